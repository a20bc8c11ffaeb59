"""The choices a ZeroConfig makes, as small objects built once per engine.

[Note: policies]
Code that behaves differently by stage, precision, offload or communication setting
asks one of these objects a question ("are gradients sharded?", "which storage holds
them?") instead of reading ``config.stage``; ``Policies.from_config`` is the only place
that turns the config's numbers into those answers (ZeroConfig itself holds only the
fields and their validation: one answer layer).  A new stage-like variation (disk
offload) becomes a new answer here, not a new ``if`` in the engine.  ZeRO++'s options
(hpZ, qwZ, qgZ) change how collectives run rather than what a stage holds: they are
turned into communicators and (bits, block) pairs in one place,
communication/multinode.py, which the builder asks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .config import ZeroConfig
from .dtypes import precision_dtype


@dataclass(frozen=True)
class StagePolicy:
    """What ZeRO partitions (the paper's P_os, P_os+g, P_os+g+p)."""

    stage: int  # for messages and manifests; behaviour reads the fields below
    partitions_optimizer_state: bool  # stages 1-3: master weights and optimizer state are 1/N
    shards_gradients: bool  # stages 2-3
    shards_parameters: bool  # stage 3

    @property
    def grad_storage(self) -> str:
        """Which :mod:`~zero_strategy.grad_storage` class keeps a unit's gradients."""
        if self.shards_gradients:
            return "sharded"
        return "owner_slice" if self.partitions_optimizer_state else "replicated"

    @property
    def gradients_are_replicated(self) -> bool:
        """Every rank holds the whole reduced gradient (a norm needs no collective)."""
        return not self.partitions_optimizer_state

    @property
    def gathers_after_step(self) -> bool:
        """Units kept whole need every rank's update all-gathered after the step."""
        return self.partitions_optimizer_state


@dataclass(frozen=True)
class GradientPolicy:
    """How long gradients live, and when a backward reduces them."""

    reduces_in_no_sync: bool  # stages 2-3 with no_sync_reduces (stages 0-1 never do)
    step_clears: bool  # step() ends with zero_grad(); else they stay readable until zero_grad()


@dataclass(frozen=True)
class PrecisionPolicy:
    storage: str  # "fp32" / "bf16" / "fp16": what parameters are stored in (the paper's formulas take it)
    compute_dtype: torch.dtype  # parameters in forward/backward (fp32 under autocast)
    reduce_dtype: torch.dtype  # gradients in collectives
    mixed: bool  # compute dtype narrower than the fp32 master
    loss_scaling: bool  # fp16: dynamic or static loss scale
    exact_frozen: bool  # units without an optimizer keep an fp32 copy of their values too
    autocast_dtype: Optional[torch.dtype] = None  # forward under torch.autocast (autocast_forward.py)


@dataclass(frozen=True)
class OffloadPolicy:
    optimizer_device: Optional[torch.device]  # ZeRO-Offload: master, gradient slice, optimizer state
    to_disk: bool = False  # ZeRO-Infinity: master and optimizer state in files (disk_offload.py)
    params_to_disk: bool = False  # ... and stage 3's 16-bit parameter shards too
    disk_path: Optional[str] = None
    inflight_bytes: int = 0  # disk offload: the read-ahead / write-behind bound

    @property
    def offloads_optimizer(self) -> bool:
        return self.optimizer_device is not None

    @property
    def grad_slice_device(self) -> Optional[torch.device]:
        """Where the reduced gradient slice is kept, when not beside the gradients: host
        offload keeps it in host memory in fp32; disk offload keeps it where (and in the
        dtype) it was reduced, freed between steps, and casts one unit at a time in step()."""
        return None if self.to_disk else self.optimizer_device


@dataclass(frozen=True)
class CommPolicy:
    overlap: bool  # reduce during backward / prefetch during forward
    reduce_bucket_size: int
    allgather_bucket_size: int
    prefetch_numel: int  # 0: no prefetch
    timeout: Optional[float]
    check_call_order: bool


@dataclass(frozen=True)
class Policies:
    stage: StagePolicy
    precision: PrecisionPolicy
    offload: OffloadPolicy
    comm: CommPolicy
    gradients: GradientPolicy

    def keeps_fp32_master(self, trainable: bool) -> bool:
        """A separate fp32 copy of the shard exists: for trainable units with mixed
        precision or offload (the copy the optimizer updates); for the others with mixed
        precision unless exact_frozen_weights is off (the values as loaded)."""
        if trainable:
            return self.precision.mixed or self.offload.offloads_optimizer
        return self.precision.mixed and self.precision.exact_frozen

    @classmethod
    def from_config(cls, config: ZeroConfig) -> "Policies":
        s = config.stage
        stage = StagePolicy(stage=s, partitions_optimizer_state=s >= 1, shards_gradients=s >= 2, shards_parameters=s == 3)
        # Under autocast the parameters stay fp32 and torch.autocast computes in the 16-bit type.
        storage = "fp32" if config.autocast else config.precision
        precision = PrecisionPolicy(
            storage=storage,
            compute_dtype=precision_dtype(storage),
            reduce_dtype=precision_dtype(config.reduce_dtype or storage),
            mixed=storage != "fp32",  # 16-bit compute copies of the parameters beside fp32 masters
            loss_scaling=config.precision == "fp16",  # bf16 has fp32's exponent range: only fp16 underflows
            exact_frozen=config.exact_frozen_weights,
            autocast_dtype=precision_dtype(config.precision) if config.autocast and config.precision != "fp32" else None,
        )
        disk = config.offload_optimizer == "nvme"
        offload = OffloadPolicy(
            torch.device("cpu") if config.offload_optimizer != "none" else None,
            to_disk=disk, params_to_disk=config.offload_param == "nvme",
            disk_path=config.nvme_path, inflight_bytes=config.nvme_inflight_bytes,
        )
        comm = CommPolicy(
            overlap=config.overlap_comm,
            reduce_bucket_size=config.reduce_bucket_size,
            allgather_bucket_size=config.allgather_bucket_size,
            prefetch_numel=config.prefetch_bucket_size if config.overlap_comm else 0,
            timeout=config.collective_timeout,
            check_call_order=config.check_call_order,
        )
        gradients = GradientPolicy(reduces_in_no_sync=stage.shards_gradients and config.no_sync_reduces,
                                   step_clears=config.step_clears_gradients)
        return cls(stage, precision, offload, comm, gradients)
