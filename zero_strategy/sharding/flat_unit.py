"""One flat unit: a group of parameters viewed as one padded 1-D space, split evenly
over the ranks.

A unit is the granule of everything ZeRO does: one reduction bucket, one partition,
one all-gather.  It is made of two owners and the unit's identity:

* :class:`~zero_strategy.param_shard.ParamShard` (``unit.params_store``): parameter
  storage and its sharded/gathering/gathered state;
* a gradient storage from :mod:`~zero_strategy.grad_storage` (``unit.grads``, None for
  frozen units), chosen by the stage policy;
* names, shapes, original dtypes, the layout, the param group and the tensors the
  optimizer updates (``optim_params``, see [Note: one optimizer tensor per parameter]).

[Note: one optimizer tensor per parameter]
The optimizer does not see the unit's flat shard as one tensor: it gets one view into
it per parameter that overlaps this rank's shard (shaped like the parameter when the
shard holds all of it, 1-D otherwise).  Communication stays flat; the update is
per parameter, as in plain torch.  That is what makes a parameter that got no
gradient in a step (an expert no token was routed to, a branch not taken) come out
exactly as under DDP: its view gets no ``.grad``, so torch's optimizers skip it
entirely, and neither weight decay nor momentum nor its own Adam step count moves.
Padding belongs to no view, so it has no optimizer state.  (An optimizer that is not
element-wise gets whole parameters instead: [Note: whole-parameter optimizers] in
whole_params.py.)

The unit itself decides nothing: the reducer and the gatherer say when to communicate,
the engine says when to step.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .grad_storage import grad_storage_for
from .layout import FlatLayout
from .param_shard import ParamShard, ShardState
from ..policy import Policies
from .whole_params import WholeParams


class FlatUnit:
    def __init__(self, index: int, params: Sequence[nn.Parameter], names: Sequence[List[str]], *,
                 group_index: Optional[int], policies: Policies, rank: int, world_size: int, whole: bool,
                 device: Optional[torch.device] = None, label: Optional[str] = None, disk=None) -> None:
        self.index = index
        self.label = label or f"unit {index}"  # what collectives on this unit are for
        self.closed = False  # its engine was closed (the guard's error message says so)
        self.params = list(params)
        self.names = [list(n) for n in names]  # every name each parameter has (tied weights)
        self.group_index = group_index  # over every optimizer's param groups, in order
        # Which optimizer updates this unit, and its param group there (the engine sets
        # these when it has several optimizers: [Note: several optimizers] in optimizer_set.py).
        self.optimizer_index = 0
        self.local_group_index = group_index
        self.trainable = group_index is not None
        self.shapes = [tuple(p.shape) for p in self.params]
        self.orig_dtypes = [p.dtype for p in self.params]
        partitioned = policies.stage.partitions_optimizer_state
        # Stage 0 replicates: the layout has one "shard" that is everything.
        self.layout = FlatLayout(tuple(p.numel() for p in self.params), world_size if partitioned else 1)
        self.shard_index = rank if partitioned else 0
        self.keep_full = whole
        self.device = torch.device(device) if device is not None else self.params[0].device
        precision, offload = policies.precision, policies.offload
        self.compute_dtype = precision.compute_dtype
        # Disk offload (``disk``, a DiskOffload): the master, and at stage 3 with
        # offload_param the 16-bit shard, are file-backed; not on the meta device (dry runs).
        on_disk = disk is not None and self.device.type != "meta"
        to_disk_params = on_disk and offload.params_to_disk and not whole
        self.params_store = ParamShard(
            self.params, self.layout, self.shard_index, whole=whole, compute_dtype=precision.compute_dtype,
            keep_master=policies.keeps_fp32_master(self.trainable), device=self.device,
            master_device=offload.optimizer_device or self.device,
            master_alloc=disk.allocator(index, "master") if on_disk else None,
            shard_alloc=disk.allocator(index, "param") if to_disk_params else None,
            after_gather=disk.dropper(index, "param") if to_disk_params else None,
            after_write=disk.writer(index) if on_disk else None,
        )
        self.grads = None
        self.whole_params: Optional[WholeParams] = None  # set by use_whole_params
        self.optim_params: List[nn.Parameter] = []
        # (position in the unit, start in the shard, length) of each optimizer tensor.
        self.optim_slices: List[Tuple[int, int, int]] = []
        if self.trainable:
            self.grads = grad_storage_for(
                policies.stage.grad_storage, self.params, self.layout, self.shard_index,
                compute_dtype=precision.compute_dtype, reduce_dtype=precision.reduce_dtype, device=self.device,
                slice_device=offload.grad_slice_device, lifetime=policies.gradients,
            )
            target = self.params_store.optimizer_target
            for i, t_start, s_start, length in self.layout.tensor_slices_in_shard(self.shard_index):
                piece = target[s_start : s_start + length]
                if length == self.layout.numels[i]:
                    piece = piece.view(self.shapes[i])
                # A Parameter made from a view shares its storage: the update lands in the shard.
                self.optim_params.append(nn.Parameter(piece, requires_grad=True))
                self.optim_slices.append((i, s_start, length))
        # The position of each optimizer tensor's parameter in the unit (both modes).
        self.optim_positions: List[int] = [i for i, _, _ in self.optim_slices]

    def use_whole_params(self, owners: Sequence[int]) -> None:
        """Hand the optimizer whole parameters instead of pieces: one tensor per parameter
        this rank owns (``owners``: the owning shard of each position), see
        [Note: whole-parameter optimizers] in whole_params.py."""
        self.whole_params = WholeParams(self.layout, self.shard_index, owners, self.shapes,
                                        self.params_store.optimizer_target, self.label)
        self.optim_params = self.whole_params.tensors
        self.optim_slices = None  # pieces only: a reader that forgets whole mode fails loudly
        self.optim_positions = self.whole_params.positions

    def set_optimizer_grads(self, grad: Optional[torch.Tensor], used: Optional[Sequence[bool]] = None) -> None:
        """Give each optimizer tensor its part of ``grad`` (this rank's flat gradient
        slice), or None where ``used[position]`` is False or ``grad`` is None.  In
        whole-parameter mode only None is given here (the step goes through
        ``whole_params.arrive``)."""
        if self.whole_params is not None:
            if grad is not None:
                raise RuntimeError("whole-parameter units get their gradients through whole_params.arrive()")
            self.whole_params.clear()
            return
        for t, (i, s_start, length) in zip(self.optim_params, self.optim_slices):
            if grad is None or (used is not None and not used[i]):
                t.grad = None
            else:
                t.grad = grad[s_start : s_start + length].view(t.shape)

    @property
    def state(self) -> ShardState:
        return self.params_store.state

    def param_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        return self.params_store.view_of(flat, i)

    def __repr__(self) -> str:
        return f"FlatUnit({self.label}, {len(self.params)} params, {self.layout.numel} elements, {self.state.value})"
