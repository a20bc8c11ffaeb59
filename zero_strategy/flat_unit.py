"""One flat unit: the tensors of a group of parameters viewed as one padded 1-D space.

[Note: who holds what]
A :class:`FlatUnit` owns every buffer for its parameters and never decides *when* to
communicate (the engine's reducer and gatherer do).  Its buffers, by stage:

=================  ==============  =================  =========================
buffer             stages 0-2      stage 3 (sharded)   meaning
=================  ==============  =================  =========================
``full``           always alive    alive only while    padded flat compute-dtype
                                   gathered            parameters; every
                                                       ``param.data`` is a view
``shard``          view of full    own tensor          this rank's slice
``master``         fp32 copy of    fp32 copy of        what the optimizer updates
                   the shard (*)   the shard (*)       (*) the shard itself in fp32
``grad_full``      stage 0/1:      temporary while     padded flat gradients
                   persistent      the unit's grads
                   (param.grad     arrive in backward
                   are views)
``grad_shard``     stage 0: all of persistent           reduced, averaged gradients
                   grad_full,                           of this rank's slice, in
                   else own                             the reduce dtype
=================  ==============  =================  =========================

Freeing uses ``untyped_storage().resize_(0)`` so the parameter views (and the tensors
autograd saved for backward) stay valid objects and see the data again once the
storage is re-grown and refilled.
"""
from __future__ import annotations

import enum
from typing import List, Optional, Sequence

import torch
import torch.nn as nn

from .layout import FlatLayout


def set_parameter_data(p: nn.Parameter, data: torch.Tensor) -> None:
    """``p.data = data``, also across device types (a meta parameter materialised on a
    real device), keeping the Parameter object itself: optimizers, tied modules and
    user references still point at it."""
    if p.device.type == data.device.type:
        p.data = data
    else:
        torch.utils.swap_tensors(p, nn.Parameter(data, requires_grad=p.requires_grad))


class DataState(enum.Enum):
    SHARDED = "sharded"  # only this rank's shard exists
    GATHERING = "gathering"  # an all-gather into ``full`` is in flight
    GATHERED = "gathered"  # ``full`` holds every rank's data


class FlatUnit:
    """A flat, evenly partitioned group of parameters sharing dtype, param group and trainability."""

    def __init__(
        self,
        index: int,
        params: Sequence[nn.Parameter],
        names: Sequence[List[str]],
        *,
        group_index: Optional[int],
        rank: int,
        world_size: int,
        partition: bool,
        keep_full: bool,
        compute_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        keep_master: bool,
        shards_gradients: bool,
        device: Optional[torch.device] = None,
        offload_device: Optional[torch.device] = None,
    ) -> None:
        self.index = index
        self.label = f"unit {index}"  # what collectives on this unit are for (set by the engine)
        self.closed = False  # its engine was closed (the guard's error message says so)
        self.params = list(params)
        self.names = [list(n) for n in names]  # every name each parameter has (tied weights)
        self.group_index = group_index
        self.trainable = group_index is not None
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.keep_full = keep_full
        self.shards_gradients = shards_gradients
        self.shapes = [tuple(p.shape) for p in self.params]
        self.orig_dtypes = [p.dtype for p in self.params]
        # Stage 0 replicates: the layout has one "shard" that is everything.
        self.layout = FlatLayout(tuple(p.numel() for p in self.params), world_size if partition else 1)
        self.shard_index = rank if partition else 0
        self.device = torch.device(device) if device is not None else self.params[0].device
        # ZeRO-Offload: the master shard, its gradient and the optimizer state live here.
        self.offload_device = offload_device
        master_device = offload_device or self.device
        pin = offload_device is not None and self.device.type == "cuda"
        lo, hi = self.layout.shard_range(self.shard_index)
        self._lo, self._hi = lo, hi
        self.master: Optional[torch.Tensor] = None
        self._gather_work = None
        # Parameters built on the meta device (see materialize.py) get their buffers
        # here without values; ``write_param_values`` fills them one tensor at a time,
        # so the whole unit never exists at once.
        deferred = self.params[0].device.type == "meta" and self.device.type != "meta"
        if deferred:
            if keep_full:
                self.full = torch.zeros(self.layout.padded_numel, dtype=compute_dtype, device=self.device)
                self.shard = self.full[lo:hi]
            else:
                self.full = torch.empty(self.layout.padded_numel, dtype=compute_dtype, device=self.device)
                self.shard = torch.zeros(self.layout.shard_numel, dtype=compute_dtype, device=self.device)
            if self.trainable and keep_master:
                self.master = torch.zeros(self.layout.shard_numel, dtype=torch.float32, device=master_device, pin_memory=pin)
            self._point_params_at_full()
            self.state = DataState.GATHERED
            if not keep_full:
                self.full.untyped_storage().resize_(0)
                self.state = DataState.SHARDED
        else:
            # Build the padded flat parameter from the current values (which may be fp32
            # originals: the master copy is taken from them before casting down).
            full_hp = torch.zeros(self.layout.padded_numel, dtype=self.params[0].dtype, device=self.device)
            for p, off in zip(self.params, self.layout.offsets):
                if p.device.type != "meta":
                    full_hp[off : off + p.numel()].copy_(p.detach().reshape(-1))
            if self.trainable and keep_master:
                self.master = torch.empty(self.layout.shard_numel, dtype=torch.float32, device=master_device, pin_memory=pin)
                self.master.copy_(full_hp[lo:hi])
            self.full = full_hp.to(compute_dtype) if full_hp.dtype != compute_dtype else full_hp
            del full_hp
            self.shard = self.full[lo:hi] if keep_full else self.full[lo:hi].clone()
            self._point_params_at_full()
            self.state = DataState.GATHERED
            if not keep_full:
                self.release()

        # The tensor the optimizer updates: the fp32 master, or the shard itself in fp32.
        self.optim_param: Optional[nn.Parameter] = None
        if self.trainable:
            target = self.master if self.master is not None else self.shard
            self.optim_param = nn.Parameter(target, requires_grad=True)

        self.grad_full: Optional[torch.Tensor] = None
        self.grad_shard: Optional[torch.Tensor] = None
        if self.trainable:
            if offload_device is not None:
                # Reduced gradients go straight to host memory, in fp32, as each bucket
                # finishes; the device keeps only the bucket (stage 2/3) or grad_full (1).
                self.grad_shard = torch.zeros(self.layout.shard_numel, dtype=torch.float32, device=offload_device, pin_memory=pin)
                if not shards_gradients:
                    self.grad_full = torch.zeros(self.layout.padded_numel, dtype=compute_dtype, device=self.device)
                    self._attach_grad_views()
            elif shards_gradients:
                self.grad_shard = torch.zeros(self.layout.shard_numel, dtype=reduce_dtype, device=self.device)
            else:
                self.grad_full = torch.zeros(self.layout.padded_numel, dtype=compute_dtype, device=self.device)
                self._attach_grad_views()
                if reduce_dtype != compute_dtype:
                    # Keep the reduced slice in the (wider) reduce dtype rather than
                    # rounding it back into the compute-dtype buffer.
                    self.grad_shard = torch.zeros(self.layout.shard_numel, dtype=reduce_dtype, device=self.device)
        self.grad_shard_is_fresh = True  # nothing accumulated into grad_shard since zero_grad
        # Stages 2-3 on the device: the gradient shard's storage is freed by zero_grad and
        # re-grown by the next reduction, so it does not sit beside the activations of the
        # next forward (its bytes count only from backward to step, as in FSDP2).
        # (Not on the meta device: planning dry runs report the model states of a step.)
        self.frees_grad_between_steps = (
            self.grad_shard is not None and shards_gradients and offload_device is None and self.grad_shard.device.type != "meta"
        )
        self.slice_holds_reduced = False  # stage 1: grad_full[own slice] is already reduced
        self.slice_prescaled = False  # stage 1: ...and multiplied by N for another reduction
        self.ready: set = set()  # ids of params whose gradient arrived in this backward

    # -- parameter views -------------------------------------------------------------
    def _point_params_at_full(self) -> None:
        for p, off, shape in zip(self.params, self.layout.offsets, self.shapes):
            n = p.numel()
            set_parameter_data(p, self.full[off : off + n].view(shape))

    def write_param_values(self, i: int, values: torch.Tensor, start: int = 0) -> None:
        """Store elements ``[start, start + len(values))`` of parameter ``i`` (flattened)
        wherever this rank keeps them: the full buffer (if kept), its shard, its master."""
        off = self.layout.offsets[i] + start
        end = off + values.numel()
        values = values.reshape(-1)
        if self.keep_full:
            self.full[off:end].copy_(values)
        a, b = max(self._lo, off), min(self._hi, end)
        if a >= b:
            return
        piece = values[a - off : b - off]
        if not self.keep_full:
            self.shard[a - self._lo : b - self._lo].copy_(piece)
        if self.master is not None:
            self.master[a - self._lo : b - self._lo].copy_(piece)

    def owned_range_of_param(self, i: int):
        """``(start, end)`` within parameter ``i`` (flattened) that this rank must hold,
        or None: the whole tensor for kept-full units, else the overlap with the shard."""
        off, n = self.layout.offsets[i], self.layout.numels[i]
        if self.keep_full:
            return (0, n)
        a, b = max(self._lo, off), min(self._hi, off + n)
        return (a - off, b - off) if a < b else None

    def param_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        off, n = self.layout.offsets[i], self.layout.numels[i]
        return flat[off : off + n].view(self.shapes[i])

    def _attach_grad_views(self) -> None:
        """Stages 0/1: ``param.grad`` is a view of ``grad_full`` so autograd accumulates in place."""
        for i, p in enumerate(self.params):
            p.grad = self.param_view(self.grad_full, i)

    # -- gather / release (stage 3) --------------------------------------------------------
    def start_gather(self, comm) -> None:
        if self.state is not DataState.SHARDED:
            return
        storage = self.full.untyped_storage()
        storage.resize_(self.layout.padded_numel * self.full.element_size())
        # Write through ``.data`` so the all-gather does not bump autograd version counters.
        self._gather_work = comm.all_gather(self.full.data, self.shard, async_op=True, label=self.label)
        self.state = DataState.GATHERING

    def finish_gather(self) -> None:
        if self.state is DataState.GATHERING:
            self._gather_work.wait()
            self._gather_work = None
            self.state = DataState.GATHERED

    def release(self) -> None:
        if self.keep_full or self.state is DataState.SHARDED:
            return
        self.finish_gather()
        self.full.untyped_storage().resize_(0)
        self.state = DataState.SHARDED

    def adopt_full_values(self) -> None:
        """The gathered ``full`` buffer was changed (and agreed on by every rank): make this
        rank's shard and master copy match it."""
        own = self.full[self._lo : self._hi]
        if not self.keep_full:
            self.shard.copy_(own)
        if self.master is not None:
            self.master.copy_(own.to(self.master.device, torch.float32))

    # -- gradients -------------------------------------------------------------------------
    def accept_grad(self, param_pos: int) -> None:
        """Called from the post-accumulate-grad hook of parameter ``param_pos``."""
        p = self.params[param_pos]
        g = p.grad
        if self.shards_gradients:
            if g is not None:
                if self.grad_full is None:
                    self.grad_full = torch.zeros(self.layout.padded_numel, dtype=self.compute_dtype, device=self.device)
                self.param_view(self.grad_full, param_pos).add_(g)
                p.grad = None
        else:
            view = self.param_view(self.grad_full, param_pos)
            if g is not None and g.data_ptr() != view.data_ptr():
                # The grad was re-created (e.g. model.zero_grad(set_to_none=True)): fold it in.
                view.add_(g)
                p.grad = view
        self.ready.add(param_pos)

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.params)

    def grad_for_reduction(self, world_size: int) -> torch.Tensor:
        """The padded full gradient, averaged in advance and in the reduce dtype.

        Pre-dividing by N keeps 16-bit sums in range (the all-reduce/reduce-scatter
        then yields the mean, as DDP does)."""
        if self.grad_full is None:
            self.grad_full = torch.zeros(self.layout.padded_numel, dtype=self.compute_dtype, device=self.device)
        if world_size > 1:
            self.grad_full.div_(world_size)
        if self.grad_full.dtype != self.reduce_dtype:
            return self.grad_full.to(self.reduce_dtype)
        return self.grad_full

    def reduction_output(self) -> torch.Tensor:
        """Where the reduce-scatter writes: grad_shard directly when nothing is accumulated
        there yet, otherwise a temporary to be added (see :meth:`finish_reduction`)."""
        g = self.grad_shard
        if g is not None and self.grad_shard_is_fresh and g.dtype == self.reduce_dtype and g.device == self.device:
            self._regrow_grad_shard()  # no need to zero: the collective overwrites it
            return g
        return torch.empty(self.layout.shard_numel, dtype=self.reduce_dtype, device=self.device)

    def _regrow_grad_shard(self) -> bool:
        """Give a freed gradient shard its storage back; True if it had none."""
        storage = self.grad_shard.untyped_storage()
        if storage.nbytes() == 0 and self.grad_shard.numel() > 0:
            storage.resize_(self.grad_shard.numel() * self.grad_shard.element_size())
            return True
        return False

    def finish_reduction(self, reduced: torch.Tensor, replicated: bool) -> None:
        """Fold a completed collective's result into this rank's gradient slice.

        ``replicated`` is True for stage 0, where ``reduced`` is the whole all-reduced
        (mean) gradient; otherwise it is this rank's reduce-scattered slice."""
        if replicated:
            if reduced.data_ptr() != self.grad_full.data_ptr():
                self.grad_full.copy_(reduced)
        elif self.grad_shard is not None:
            self._regrow_grad_shard()
            if reduced.data_ptr() != self.grad_shard.data_ptr():
                if self.grad_shard_is_fresh:
                    self.grad_shard.copy_(reduced)
                else:
                    self.grad_shard.add_(reduced)
            if self.shards_gradients:
                self.grad_full = None  # the bucket is no longer needed
            else:
                self.grad_full.zero_()  # stage 1: local grads are now folded into grad_shard
        else:
            # Stage 1 in the compute dtype: keep the reduced slice inside grad_full and
            # drop the rest, so the stage keeps the paper's 2Ψ gradient bytes.
            reduced_copy = reduced if reduced.data_ptr() != self.grad_full.data_ptr() else reduced.clone()
            self.grad_full.zero_()
            self.grad_full[self._lo : self._hi].copy_(reduced_copy)
            self.slice_holds_reduced = True
        self.slice_prescaled = False
        self.grad_shard_is_fresh = False
        self.ready.clear()

    def prepare_for_another_synced_backward(self) -> None:
        """Stage 1 only, rare: a second synchronised backward before ``step``.

        The next reduction pre-divides grad_full by N and sums over ranks; only the owner
        holds the already-reduced slice, so scale it by N first to keep it intact."""
        if self.slice_holds_reduced and self.layout.world_size > 1:
            self.grad_full[self._lo : self._hi].mul_(self.layout.world_size)
            self.slice_prescaled = True
        self.slice_holds_reduced = False

    # -- optimizer side ----------------------------------------------------------------------
    def reduced_grad(self) -> torch.Tensor:
        """This rank's averaged gradient slice (stage 0: the whole replicated gradient)."""
        if self.grad_shard is not None:
            if self._regrow_grad_shard():
                self.grad_shard.zero_()  # no reduction since zero_grad: the gradient is zero
            return self.grad_shard
        if self.slice_prescaled:  # a forward ran but no synchronised backward followed
            self.grad_full[self._lo : self._hi].div_(self.layout.world_size)
            self.slice_prescaled = False
        return self.grad_full[self._lo : self._hi]

    def write_back_master(self) -> None:
        """Copy the updated fp32 master into the compute-dtype shard."""
        if self.master is not None:
            self.shard.copy_(self.master)

    def zero_grad(self) -> None:
        if not self.trainable:
            return
        if self.frees_grad_between_steps:
            self.grad_shard.untyped_storage().resize_(0)
        elif self.grad_shard is not None:
            self.grad_shard.zero_()
        if self.shards_gradients:
            self.grad_full = None
        else:
            self.grad_full.zero_()
            self._attach_grad_views()
        self.grad_shard_is_fresh = True
        self.slice_holds_reduced = False
        self.slice_prescaled = False
        self.ready.clear()

    # -- accounting ----------------------------------------------------------------------
    def bytes_by_category(self) -> dict:
        """Bytes this unit holds now, by category (see ``ZeroEngine.memory_report``)."""
        params = self.full.untyped_storage().nbytes()
        if not self.keep_full:
            params += _nbytes(self.shard)
        grads = _nbytes(self.grad_shard)
        comm = 0
        if self.shards_gradients:
            comm += _nbytes(self.grad_full)  # a transient bucket, bounded by the unit size
        else:
            grads += _nbytes(self.grad_full)
        out = {"parameters": params, "gradients": grads, "master_weights": _nbytes(self.master), "communication_buffers": comm}
        out["offloaded"] = (_nbytes(self.master) + _nbytes(self.grad_shard)) if self.offload_device is not None else 0
        return out


def _nbytes(t: Optional[torch.Tensor]) -> int:
    # Storage bytes, so that freed (resized-to-0) buffers count as what they hold: nothing.
    return 0 if t is None else min(t.numel() * t.element_size(), t.untyped_storage().nbytes())
