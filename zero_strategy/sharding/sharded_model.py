"""ShardedModel: what partitioning made of a model, and the questions asked of it.

The engine runs a training step; everything else (state dicts, checkpoints,
materialisation, hooks, reports) needs only to know how the model was cut: its flat
units, the parameters left whole, the dtypes the parameters had, where each optimizer's
parameters now live, the communicator.  That is this object, built once by
:func:`zero_strategy.sharding.builder.build_sharded_model` and never rebound.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.nn as nn

from ..optim.optimizer import ZeroOptimizer
from .flat_unit import FlatUnit
from .param_shard import whole_values


@dataclass(eq=False)
class ShardedModel:
    module: nn.Module
    config: object  # ZeroConfig
    policies: object  # Policies
    comm: object  # Communicator
    device: Optional[torch.device]  # where deferred (meta) parameters are materialised; None: none were
    units: List[FlatUnit]
    untouched: Dict[str, nn.Parameter]  # name -> parameter left as it was (frozen at stages 0-2, non-floating)
    orig_dtype_by_id: Dict[int, torch.dtype]  # every parameter's dtype before the engine touched it
    orig_dtype_untouched: Dict[str, torch.dtype]
    unit_module_classes: List[str]  # stage 3: the classes whose instances gather their own parameters
    inner_optimizers: List[torch.optim.Optimizer] = field(default_factory=list)
    # Where each parameter the user gave an optimizer now lives, per param group of every
    # optimizer in order: (unit index, position) or None (not partitioned), for optimizer
    # state dicts in torch's format.
    optimizer_param_places: List[List[Optional[tuple]]] = field(default_factory=list)
    group_offsets: List[int] = field(default_factory=list)  # optimizer k's first param group among them all
    disk_offload: object = None  # the per-rank offload files (offload/disk_offload.py) or None
    gatherer: object = None  # stage 3: the ParameterGatherer (sharding/gather.py)
    reduction_order: List[FlatUnit] = field(default_factory=list)  # trainable units, in gradient-ready order
    trainable_units: List[FlatUnit] = field(init=False)

    def __post_init__(self) -> None:
        self.trainable_units = [u for u in self.units if u.trainable]

    def compute_device(self) -> torch.device:
        return self.units[0].device if self.units else torch.device("cpu")

    def original_dtype(self, param: torch.nn.Parameter) -> torch.dtype:
        return self.orig_dtype_by_id.get(id(param), param.dtype)

    # -- optimizers' parameters -------------------------------------------------------------
    def units_of(self, k: int) -> List[FlatUnit]:
        """The trainable units optimizer ``k`` updates."""
        return [u for u in self.trainable_units if u.optimizer_index == k]

    def param_places_of(self, k: int) -> List[List[Optional[tuple]]]:
        """:attr:`optimizer_param_places` of optimizer ``k``'s own param groups."""
        start = self.group_offsets[k]
        return self.optimizer_param_places[start : start + len(self.inner_optimizers[k].param_groups)]

    def parameters_of(self, k: int) -> List[torch.nn.Parameter]:
        """The model's parameters that optimizer ``k`` updates."""
        return [p for u in self.units_of(k) for p in u.params]

    def optimizer_index(self, optimizer) -> int:
        """The index of ``optimizer`` (a user optimizer, or the ZeroOptimizer over it)."""
        inner = optimizer.inner if isinstance(optimizer, ZeroOptimizer) else optimizer
        for k, opt in enumerate(self.inner_optimizers):
            if inner is opt:
                return k
        raise ValueError(f"this {type(optimizer).__name__} is not one of this engine's optimizers")

    def which_optimizer(self, optimizer, what: str) -> int:
        """The index ``optimizer`` names: an index, the user's optimizer, its
        ZeroOptimizer, or a wrapper holding it as ``_optimizer`` (LightningOptimizer);
        None names the only optimizer (an error when there are several)."""
        count = len(self.inner_optimizers)
        if count == 0:
            raise RuntimeError(f"{what} needs an optimizer: initialize was called with optimizer=None")
        if optimizer is None:
            if count > 1:
                raise ValueError(f"{what}: this engine has {count} optimizers: pass optimizer=k (or the optimizer itself) to say which")
            return 0
        if isinstance(optimizer, int) and not isinstance(optimizer, bool):
            if not 0 <= optimizer < count:
                raise ValueError(f"{what}: optimizer={optimizer}, but this engine has {count} optimizer(s)")
            return optimizer
        return self.optimizer_index(getattr(optimizer, "_optimizer", optimizer))

    def optimizer_of_parameters(self, parameters, what: str = "clip_grad_norm_") -> Optional[int]:
        """For clipping: None when the trainable ones among ``parameters`` are all of the
        model's trainable parameters; ``k`` when they are exactly optimizer ``k``'s;
        otherwise a RuntimeError naming ``what`` (ZeRO clips every optimizer's gradients,
        or one optimizer's, together)."""
        given = {id(p) for p in parameters if p.requires_grad}
        every = {id(p) for u in self.trainable_units for p in u.params}
        if given == every:
            return None
        for k in range(len(self.inner_optimizers)):
            if given == {id(p) for p in self.parameters_of(k)}:
                return k
        method = what.rsplit(".", 1)[-1]
        raise RuntimeError(
            f"{what} was given {len(given)} of the {len(every)} trainable parameters of a ZeroEngine's model: ZeRO "
            "clips all of a model's gradients together (they are partitioned across ranks, and their .grad is not "
            "the gradient the engine steps with), or all of one optimizer's. Pass model.parameters() (or exactly one "
            f"optimizer's parameters), or call engine.{method}(...)."
        )

    # -- whole values -------------------------------------------------------------------------
    def unshard(self) -> None:
        """Collective.  Every rank gets whole, independent parameters back in their
        original dtypes (from the fp32 master values); gradients are dropped."""
        for unit in self.units:
            full = whole_values(unit.params_store, self.comm, label=f"unsharding {unit.label}")
            for i, p in enumerate(unit.params):
                p.data = unit.param_view(full.to(unit.device), i).to(unit.orig_dtypes[i], copy=True)
                p.grad = None
        for u in self.trainable_units:
            u.set_optimizer_grads(None)
        for name, p in self.untouched.items():  # frozen parameters were cast to the compute dtype
            if p.dtype != self.orig_dtype_untouched[name]:
                p.data = p.data.to(self.orig_dtype_untouched[name])

    def all_gather_updated(self, units: List[FlatUnit]) -> None:
        """Units kept whole (stages 1-2, stage 3's persistent ones) need every rank's update."""
        if not self.policies.stage.gathers_after_step:
            return
        # Buckets of about allgather_bucket_size elements in flight; each bucket is one
        # batch of gathers into the kept buffers (comm.all_gather_kept).
        buckets, bucket, in_flight = [], [], 0
        for u in units:
            if not u.keep_full:
                continue  # stage 3: gathered on demand by the next forward
            store = u.params_store
            bucket.append((store.full.data, store.shard, f"the updated {u.label}"))
            in_flight += u.layout.padded_numel
            if in_flight > self.policies.comm.allgather_bucket_size:
                buckets.append(bucket)
                bucket, in_flight = [], 0
        if bucket:
            buckets.append(bucket)
        for bucket in buckets:
            for w in self.comm.all_gather_kept(bucket):
                w.wait()
