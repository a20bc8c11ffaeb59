"""One unit's gradient storage, one class per way a stage keeps gradients.

[Note: gradient storage by stage]
========================  ==========================  ===============================
class                     stage                       what persists until step()
========================  ==========================  ===============================
:class:`ReplicatedGrads`  0 (DDP)                     the whole gradient, all-reduced
:class:`OwnerSliceGrads`  1 (optimizer state sharded) the whole local gradient; after
                                                      reduction only this rank's slice
                                                      is kept (the rest is zeroed)
:class:`ShardedGrads`     2 and 3                     this rank's reduced slice only;
                                                      the full-size gradient waits
                                                      in ``p.grad`` and becomes a
                                                      bucket when the unit is
                                                      reduced, freed after it
========================  ==========================  ===============================

Each exposes the same small protocol to the reducer (:meth:`accept`, ``complete``,
:meth:`reduction_input`, :meth:`reduction_output`, :meth:`finish_reduction`), to the
step (:meth:`reduced`, :meth:`zero`) and to ``.grad`` reads and writes (:meth:`read`,
:meth:`write`: [Note: .grad under ZeRO] in grad_reads.py), plus ``collective`` (which
collective reduces it) and ``reduces_unsynced`` (whether it reduces inside ``no_sync``:
stages 2-3 do unless ``no_sync_reduces`` is off), so neither the reducer nor the engine
asks which stage is running.

With optimizer offload the reduced slice goes to host memory in fp32 as each bucket
finishes (:class:`OwnerSliceGrads` and :class:`ShardedGrads` take a ``slice_device``).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn

from ..communication.collectives import HEADER_ROOM
from ..optim.step_grads import apply_operations
from .layout import FlatLayout
from .param_shard import _nbytes


class _GradStorage:
    collective = "reduce_scatter"
    reduces_unsynced = False
    reduction_input_is_scratch = False  # True: reduction_input() may be overwritten by the collective
    reduction_input_is_kept = False  # True: ... but its storage lives on (never freed by it)
    reduction_input_has_room = False  # True: an all-reduce may append its header in place

    def __init__(self, params: Sequence[nn.Parameter], layout: FlatLayout, shard_index: int, *,
                 compute_dtype: torch.dtype, reduce_dtype: torch.dtype, device: torch.device) -> None:
        self.params = list(params)
        # [Note: .grad under ZeRO]: the whole reduced gradient gathered for .grad, and its
        # version when gathered (an edit through .grad moves it); positions whose .grad
        # was set to None since the gradients were reduced (the step skips them).
        self._served: Optional[torch.Tensor] = None
        self._served_version = 0
        self.dropped: set = set()
        # How many of the step's gradient operations (optim/step_grads.py) the served buffer
        # has had applied, and how many the reduced slice has (an edit made after clipping
        # writes clipped values back: the step must not clip them again).
        self._served_ops = 0
        self.ops_baked = 0
        self.shapes = [tuple(p.shape) for p in self.params]
        self.layout = layout
        self.lo, self.hi = layout.shard_range(shard_index)
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.device = device
        self.ready: set = set()  # positions of params whose gradient arrived in this backward
        self.received: set = set()  # ... since the last zero(): params that got any gradient

    def _view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        off, n = self.layout.offsets[i], self.layout.numels[i]
        return flat[off : off + n].view(self.shapes[i])

    def _new_full(self) -> torch.Tensor:
        # Room for a collective header after the gradients: on gloo the reduction then
        # runs in place instead of on a copy (collectives.reduce_scatter / all_reduce).
        room = torch.zeros(self.layout.padded_numel + HEADER_ROOM, dtype=self.compute_dtype, device=self.device)
        return room[: self.layout.padded_numel]

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.params)

    def _prescaled(self, full: torch.Tensor, world_size: int) -> torch.Tensor:
        """Averaged in advance (keeps 16-bit sums in range; the collective then yields the
        mean, as DDP does) and in the reduce dtype."""
        if world_size > 1:
            full.div_(world_size)
        return full.to(self.reduce_dtype) if full.dtype != self.reduce_dtype else full

    def before_synced_forward(self) -> None:
        """A training forward outside no_sync is about to run (see OwnerSliceGrads)."""

    def end_of_backward(self) -> None:
        self.ready.clear()

    # -- .grad reads and writes ([Note: .grad under ZeRO] in grad_reads.py) --------------------
    @property
    def holds_reduced(self) -> bool:
        """A reduction happened since zero(): the gradient is this rank's reduced slice."""
        return False

    def read(self, pos: int, gather, pending) -> Optional[torch.Tensor]:
        """What ``params[pos].grad`` shows: before any reduction, whatever autograd left in
        ``.grad`` (local gradients); after, that parameter's whole reduced gradient, with
        this step's gradient operations so far (fp16 unscale, clipping) applied, as
        they would be to ``.grad`` without ZeRO.  ``gather(full_out, own)`` all-gathers a
        unit into ``full_out``, whose chunk ``own`` holds this rank's slice
        (collective); ``pending(start)`` gives the operations from index ``start`` on
        that apply to this unit, and the index after the last."""
        if not self.holds_reduced:
            return _raw_grad(self.params[pos])
        if pos in self.dropped:
            return None
        return self._view(self._serve(gather, pending), pos)

    def write(self, pos: int, value: Optional[torch.Tensor], gather, pending) -> None:
        """``params[pos].grad = value``: replaces that parameter's gradient for the step
        (None: it gets none, and the step leaves it alone)."""
        if not self.holds_reduced:
            _set_raw_grad(self.params[pos], value)
            return
        view = self._view(self._serve(gather, pending), pos)
        if value is None:
            view.zero_()
            self.dropped.add(pos)
        else:
            view.copy_(value)
            self.dropped.discard(pos)

    def _serve(self, gather, pending) -> torch.Tensor:
        if self._served is None:
            full = torch.empty(self.layout.padded_numel, dtype=self.compute_dtype, device=self.device)
            own = full[self.lo : self.hi]
            own.copy_(self._current())
            gather(full, own)
            self._served, self._served_version, self._served_ops = full, full._version, self.ops_baked
        ops, end = pending(self._served_ops)
        if end != self._served_ops:
            apply_operations(self._served, ops)
            self._served_ops = end
            self._served_version = self._served._version  # applied here, not an edit
            if self._serves_in_place():
                self.ops_baked = end  # the slice itself has them now
        return self._served

    def _serves_in_place(self) -> bool:
        """The served buffer is the reduced slice's own storage (stage 1 without a slice)."""
        return False

    def _current(self) -> torch.Tensor:
        """This rank's reduced slice as it stands (no edits folded in)."""
        raise NotImplementedError

    def _write_current(self, values: torch.Tensor) -> None:
        raise NotImplementedError

    def _settle(self) -> None:
        """Fold edits made through ``.grad`` into the reduced slice the step reads (a
        gradient only read keeps its exact reduced values).  The edited values have the
        operations the buffer had applied: the step applies only the later ones."""
        served = self._served
        if served is not None and served._version != self._served_version:
            self._write_current(served[self.lo : self.hi])
            self._served_version = served._version
            self.ops_baked = self._served_ops

    def _forget_served(self, keep_edits: bool) -> None:
        if keep_edits:
            self._settle()
        self._served = None
        self.dropped.clear()
        self.ops_baked = 0

    def served_bytes(self) -> int:
        return _nbytes(self._served)


class _PersistentFull(_GradStorage):
    """Stages 0 and 1: a full-size gradient buffer with ``param.grad`` views into it, so
    autograd accumulates in place across micro-batches."""

    reduction_input_has_room = True  # _new_full

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.full = self._new_full()
        self._attach_views()

    def _attach_views(self) -> None:
        for i, p in enumerate(self.params):
            p.grad = self._view(self.full, i)

    def accept(self, pos: int) -> None:
        p = self.params[pos]
        view = self._view(self.full, pos)
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            # ``.grad`` is a new tensor: autograd made it out of place (create_graph=True:
            # the old view's values are in it) or the user set ``.grad = None`` (the old
            # values are discarded, as without ZeRO).  Either way it is the whole gradient.
            view.copy_(p.grad)
            p.grad = view
        self.ready.add(pos)
        self.received.add(pos)


class ReplicatedGrads(_PersistentFull):
    """Stage 0: all-reduce the whole gradient; every rank keeps all of it."""

    collective = "all_reduce"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._reduced: Optional[torch.Tensor] = None  # in the reduce dtype when it differs
        self._full_version = 0  # full's version when reduced: an edit through .grad moves it
        self._reduced_since_zero = False

    def reduction_input(self, world_size: int) -> torch.Tensor:
        return self._prescaled(self.full, world_size)

    def reduction_output(self) -> None:
        return None  # all-reduce works in place on the input

    def finish_reduction(self, reduced: torch.Tensor) -> None:
        if reduced.data_ptr() != self.full.data_ptr():
            self.full.copy_(reduced)  # what param.grad shows
            # The step reads the wider reduced copy, not its compute-dtype rounding.
            self._reduced = reduced
        self._full_version = self.full._version
        self._reduced_since_zero = True
        self.ops_baked = 0
        self.dropped.clear()
        self.ready.clear()

    def read(self, pos: int, gather, pending) -> Optional[torch.Tensor]:
        # Whole on every rank: .grad is the gradient itself, once the step's operations so
        # far (clipping) are carried into it, as clipping does to .grad without ZeRO.
        if not self._reduced_since_zero and pos not in self.received:
            return None  # .grad is a view of the zeroed buffer: no gradient since zero_grad()
        if self._reduced_since_zero:
            ops, end = pending(self.ops_baked)
            if end != self.ops_baked:
                apply_operations(self.full, ops)
                self._reduced, self.ops_baked, self._full_version = None, end, self.full._version
            if pos in self.dropped:
                return None
        return _raw_grad(self.params[pos])

    def write(self, pos: int, value: Optional[torch.Tensor], gather, pending) -> None:
        if not self._reduced_since_zero:
            _set_raw_grad(self.params[pos], value)  # local: the next backward's gradient replaces it
            return
        self.read(pos, gather, pending)  # an edit comes after the operations so far
        view = self._view(self.full, pos)
        if value is None:
            view.zero_()
            self.dropped.add(pos)
        else:
            view.copy_(value)
            self.dropped.discard(pos)

    def reduced(self) -> torch.Tensor:
        if self._reduced is not None and self.full._version != self._full_version:
            self._reduced = None  # edited through .grad: the step takes the edit
        return self._reduced if self._reduced is not None else self.full

    def zero(self) -> None:
        self.full.zero_()
        self._reduced = None
        self._reduced_since_zero = False
        self.ops_baked = 0
        self.dropped.clear()
        self._attach_views()
        self.ready.clear()
        self.received.clear()

    def bytes(self) -> dict:
        return {"gradients": _nbytes(self.full) + _nbytes(self._reduced), "communication_buffers": 0, "offloaded": 0}


class OwnerSliceGrads(_PersistentFull):
    """Stage 1: reduce-scatter the local gradient; keep only this rank's reduced slice.

    Without offload and with the reduce dtype equal to the compute dtype, the reduced
    slice is written back into ``full`` (the rest zeroed), so the stage holds the paper's
    2 bytes/parameter of gradients; otherwise it lives in ``slice`` (reduce dtype, or
    fp32 on the host with offload).

    The reduction may overwrite ``full`` (on gloo it is summed there in place): once
    reduced, everything but this rank's slice is zeroed anyway."""

    reduction_input_is_scratch = True
    reduction_input_is_kept = True  # param.grad views it

    def __init__(self, *args, slice_device: Optional[torch.device] = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        n = self.layout.shard_numel
        self.offloaded = slice_device is not None
        pin = self.offloaded and self.device.type == "cuda"
        if self.offloaded:
            self.slice: Optional[torch.Tensor] = torch.zeros(n, dtype=torch.float32, device=slice_device, pin_memory=pin)
        elif self.reduce_dtype != self.compute_dtype:
            self.slice = torch.zeros(n, dtype=self.reduce_dtype, device=self.device)
        else:
            self.slice = None
        self._slice_fresh = True  # nothing reduced into ``slice`` since zero()
        self._holds_reduced = False  # full[own slice] is already the reduced mean
        self._prescaled_slice = False  # ... and was multiplied by N for another reduction

    def reduction_input(self, world_size: int) -> torch.Tensor:
        return self._prescaled(self.full, world_size)

    @property
    def holds_reduced(self) -> bool:
        return not self._slice_fresh

    def read(self, pos: int, gather, pending) -> Optional[torch.Tensor]:
        if not self.holds_reduced and pos not in self.received:
            return None  # .grad is a view of the zeroed buffer: no gradient since zero_grad()
        return super().read(pos, gather, pending)

    def _serve(self, gather, pending) -> torch.Tensor:
        # When ``full`` holds the reduced slice itself, the other ranks' slices are gathered
        # into the rest of it: no second buffer, and .grad is the view autograd fills.
        if self._served is None and self.slice is None and not self._prescaled_slice:
            gather(self.full, self.full[self.lo : self.hi])
            self._served, self._served_version, self._served_ops = self.full, self.full._version, self.ops_baked
        return super()._serve(gather, pending)

    def _serves_in_place(self) -> bool:
        return self._served is self.full

    def _forget_served(self, keep_edits: bool) -> None:
        if self._served is self.full:  # back to "this rank's slice, zeros elsewhere"
            self.full[: self.lo].zero_()
            self.full[self.hi :].zero_()
        super()._forget_served(keep_edits)

    def served_bytes(self) -> int:
        return 0 if self._served is self.full else super().served_bytes()

    def _current(self) -> torch.Tensor:
        if self.slice is not None:
            return self.slice
        own = self.full[self.lo : self.hi]
        return own / self.layout.world_size if self._prescaled_slice else own

    def _write_current(self, values: torch.Tensor) -> None:
        if self.slice is not None:
            self.slice.copy_(values)
        else:
            own = self.full[self.lo : self.hi]
            own.copy_(values)
            if self._prescaled_slice:
                own.mul_(self.layout.world_size)

    def reduction_output(self) -> torch.Tensor:
        if self.slice is not None and self._slice_fresh and self.slice.dtype == self.reduce_dtype and self.slice.device == self.device:
            return self.slice  # the collective overwrites it
        return torch.empty(self.layout.shard_numel, dtype=self.reduce_dtype, device=self.device)

    def finish_reduction(self, reduced: torch.Tensor) -> None:
        self._forget_served(keep_edits=False)  # folded in before this backward (before_synced_forward)
        if self.slice is not None:
            if reduced.data_ptr() != self.slice.data_ptr():
                if self._slice_fresh:
                    self.slice.copy_(reduced)
                else:
                    self.slice.add_(reduced)
            self.full.zero_()  # local grads are now folded into the slice
        else:
            # Keep the reduced slice inside ``full`` and drop the rest.
            own = reduced if reduced.data_ptr() != self.full.data_ptr() else reduced.clone()
            self.full.zero_()
            self.full[self.lo : self.hi].copy_(own)
            self._holds_reduced = True
        self._prescaled_slice = False
        self._slice_fresh = False
        self.ready.clear()

    def before_synced_forward(self) -> None:
        """Rare: a second synchronised backward before ``step``.  The next reduction
        pre-divides ``full`` by N and sums over ranks; only this rank holds its reduced
        slice, so scale it by N first to keep it intact."""
        self._forget_served(keep_edits=True)
        if self._holds_reduced and self.layout.world_size > 1:
            self.full[self.lo : self.hi].mul_(self.layout.world_size)
            self._prescaled_slice = True
        self._holds_reduced = False

    def reduced(self) -> torch.Tensor:
        self._settle()
        if self.slice is not None:
            return self.slice
        if self._prescaled_slice:  # a forward ran but no synchronised backward followed
            self.full[self.lo : self.hi].div_(self.layout.world_size)
            self._prescaled_slice = False
        return self.full[self.lo : self.hi]

    def zero(self) -> None:
        self._forget_served(keep_edits=False)
        self.full.zero_()
        self._attach_views()
        if self.slice is not None:
            self.slice.zero_()
        self._slice_fresh = True
        self._holds_reduced = self._prescaled_slice = False
        self.ready.clear()
        self.received.clear()

    def bytes(self) -> dict:
        slice_bytes = _nbytes(self.slice)
        return {"gradients": _nbytes(self.full) + slice_bytes + self.served_bytes(), "communication_buffers": 0,
                "offloaded": slice_bytes if self.offloaded else 0}


class ShardedGrads(_GradStorage):
    """Stages 2 and 3: gradients are reduce-scattered every backward (inside no_sync too,
    unless ``reduces_in_no_sync`` is off: then they wait whole in ``p.grad`` until a
    synchronised backward) and only this rank's reduced slice is kept.

    On the compute device the slice's storage is freed by the step (unless the step
    leaves the gradients for zero_grad(): ``frees_after_step``) and by :meth:`zero`, and
    re-grown by the next reduction, so it does not sit beside the next forward's
    activations (its bytes count from backward to step, as in FSDP2)."""

    reduction_input_is_scratch = True  # the full-size bucket is dropped once reduced

    def __init__(self, *args, slice_device: Optional[torch.device] = None, reduces_in_no_sync: bool = True,
                 frees_after_step: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reduces_unsynced = reduces_in_no_sync
        self._frees_after_step = frees_after_step
        n = self.layout.shard_numel
        self.offloaded = slice_device is not None
        pin = self.offloaded and self.device.type == "cuda"
        dtype = torch.float32 if self.offloaded else self.reduce_dtype
        where = slice_device or self.device
        # (Not on the meta device: planning dry runs report the model states of a step.)
        self._frees_between_steps = not self.offloaded and torch.device(where).type != "meta"
        if self._frees_between_steps:
            # Born as zero() leaves it: no storage until the first reduction grows it.
            self.slice = torch.empty(n, dtype=dtype, device=where)
            self.slice.untyped_storage().resize_(0)
        else:
            self.slice = torch.zeros(n, dtype=dtype, device=where, pin_memory=pin)
        self.bucket: Optional[torch.Tensor] = None  # the full-size gradient, from launch to the end of its reduction
        # Positions whose gradient waits in ``p.grad`` until the unit is reduced
        # ([Note: deferred bucket]).
        self._deferred: set = set()
        self._slice_fresh = True

    # [Note: deferred bucket]
    # A unit's gradients wait in ``p.grad``, where autograd put them (no copy, and never
    # more memory than the bucket), until the reducer launches the unit; only then is
    # the unit-sized bucket made and filled.  Made at the unit's first large gradient,
    # the bucket would sit whole beside the activations its own backward has not freed
    # yet, at the start of the block's backward, where stage 3's peak is (with the block
    # in use and the one being prefetched).  Made at launch it costs, for a moment, the
    # bucket beside the gradients it takes in, when the block's activations are gone.
    # Measured on GPT-2, 2 gloo ranks, the step's peak tensor bytes above its start:
    # 100M fp32 779 -> 757 MB, a 4-block 2560-wide model in bf16 1202 -> 1135 MB
    # (benchmarks/profile_step.py --memory).  It also keeps the root unit's bucket
    # (the final norm's gradient comes first in backward, the embedding's last) from
    # living through the whole backward.

    def accept(self, pos: int) -> None:
        p = self.params[pos]
        if p.grad is not None:
            self.received.add(pos)
            if self.bucket is None:
                self._deferred.add(pos)
            else:
                self._take(pos)
        self.ready.add(pos)

    def _take(self, pos: int) -> None:
        p = self.params[pos]
        self._view(self.bucket, pos).add_(p.grad)
        p.grad = None

    def _make_bucket(self) -> None:
        self.bucket = self._new_full()
        for pos in sorted(self._deferred):
            if self.params[pos].grad is not None:
                self._take(pos)
        self._deferred.clear()

    def reduction_input(self, world_size: int) -> torch.Tensor:
        if self.bucket is None:
            self._make_bucket()
        return self._prescaled(self.bucket, world_size)

    def _regrow(self) -> bool:
        """Give a freed slice its storage back; True if it had none."""
        storage = self.slice.untyped_storage()
        if storage.nbytes() == 0 and self.slice.numel() > 0:
            storage.resize_(self.slice.numel() * self.slice.element_size())
            return True
        return False

    def reduction_output(self) -> torch.Tensor:
        if self._slice_fresh and self.slice.dtype == self.reduce_dtype and self.slice.device == self.device:
            self._regrow()  # no need to zero: the collective overwrites it
            return self.slice
        return torch.empty(self.layout.shard_numel, dtype=self.reduce_dtype, device=self.device)

    @property
    def holds_reduced(self) -> bool:
        return not self._slice_fresh

    def _current(self) -> torch.Tensor:
        if self._regrow():
            self.slice.zero_()
        return self.slice

    def _write_current(self, values: torch.Tensor) -> None:
        self._regrow()
        self.slice.copy_(values)

    def finish_reduction(self, reduced: torch.Tensor) -> None:
        self._forget_served(keep_edits=True)  # what was edited through .grad, then this backward's sum
        self._regrow()
        if reduced.data_ptr() != self.slice.data_ptr():
            if self._slice_fresh:
                self.slice.copy_(reduced)
            else:
                self.slice.add_(reduced)
        if self.bucket is not None:
            # The collective is done with it, but the communicator keeps its last few
            # work handles (and through them this buffer) alive for a while ([Note:
            # keeping recent work handles] in comm.py): give the memory back now.
            self.bucket.untyped_storage().resize_(0)
        self.bucket = None
        self._slice_fresh = False
        self.ready.clear()

    def reduced(self) -> torch.Tensor:
        if self._regrow():
            self.slice.zero_()  # no reduction since zero(): the gradient is zero
        self._settle()
        return self.slice

    def free(self) -> None:
        """The step has consumed the slice: give its memory back now (see the class doc)."""
        if self._frees_between_steps and self._frees_after_step:
            self.slice.untyped_storage().resize_(0)

    def zero(self) -> None:
        self._forget_served(keep_edits=False)
        if self._frees_between_steps:
            self.slice.untyped_storage().resize_(0)
        else:
            self.slice.zero_()
        self.bucket = None
        for pos in self._deferred:  # a backward that never reached this unit's reduction
            self.params[pos].grad = None
        self._deferred.clear()
        self._slice_fresh = True
        self.ready.clear()
        self.received.clear()

    def bytes(self) -> dict:
        slice_bytes = _nbytes(self.slice)
        # Full-size gradients waiting for the unit's reduction are the bucket's, not yet made.
        deferred = sum(_nbytes(_raw_grad(self.params[pos])) for pos in self._deferred)
        return {"gradients": slice_bytes + self.served_bytes(), "communication_buffers": _nbytes(self.bucket) + deferred,
                "offloaded": slice_bytes if self.offloaded else 0}


def grad_storage_for(kind: str, params, layout, shard_index, *, compute_dtype, reduce_dtype, device, slice_device=None,
                     lifetime=None):
    """Build the storage ``kind`` names (see :class:`~zero_strategy.policy.StagePolicy`);
    ``lifetime`` is the :class:`~zero_strategy.policy.GradientPolicy` (default: reduce
    inside no_sync at stages 2-3, step() clears)."""
    common = dict(compute_dtype=compute_dtype, reduce_dtype=reduce_dtype, device=device)
    if kind == "replicated":
        return ReplicatedGrads(params, layout, shard_index, **common)
    if kind == "owner_slice":
        return OwnerSliceGrads(params, layout, shard_index, slice_device=slice_device, **common)
    if kind == "sharded":
        return ShardedGrads(params, layout, shard_index, slice_device=slice_device,
                            reduces_in_no_sync=lifetime.reduces_in_no_sync if lifetime else True,
                            frees_after_step=lifetime.step_clears if lifetime else True, **common)
    raise ValueError(f"unknown gradient storage {kind!r}")


def _raw_grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    """``p.grad`` as autograd keeps it, past any ``.grad`` handling of p's class."""
    with torch._C.DisableTorchFunctionSubclass():
        return p.grad


def _set_raw_grad(p: torch.Tensor, value: Optional[torch.Tensor]) -> None:
    with torch._C.DisableTorchFunctionSubclass():
        p.grad = value
