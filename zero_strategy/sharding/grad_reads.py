"""``.grad`` of a parameter the engine manages reads (and writes) what DDP would show.

[Note: .grad under ZeRO]
From stage 1 on, the gradient the step applies is not in ``p.grad``: after a
synchronised backward each rank holds only its 1/N slice of the reduced gradient
(stage 1 keeps it inside a whole-size buffer whose other slices are zero, stages 2-3
keep the slice alone and leave ``p.grad`` None).  Code written for DDP reads ``p.grad``
anyway: gradient-norm logging (``torch.nn.utils.get_total_norm``, Lightning's
``grad_norm``), ``clip_grads_with_norm_``, gradient surgery (zeroing the rows of
embeddings that must not change), Accelerate's own ``test_sync.py``.  So between the
end of a backward and the next forward, every trainable parameter of the engine has a
class whose ``__torch_function__`` sees ``.grad`` reads and writes
(:class:`GradReadingParameter`; stage 3's :class:`PartitionedParameter` does the same),
and its unit's gradient storage answers them (grad_storage.py, ``read`` / ``write``):

* before any reduction since the gradients were cleared (backward passes inside
  ``no_sync`` at stages 0-1, or at stages 2-3 with ``no_sync_reduces=False``):
  ``.grad`` is what autograd left there, this rank's local gradient, as under DDP;
* after one: the parameter's whole reduced gradient.  The first read of a unit's
  parameter all-gathers the unit's slices into a buffer of the compute dtype (a
  **collective**: every rank must read the same units' gradients, in the same order,
  as every rank calls ``clip_grad_norm_``); later reads are views of that buffer;
* what the step will do to a gradient so far shows: after ``clip_grad_norm_`` (which
  only records a factor: optim/step_grads.py) ``.grad`` reads clipped values, and under
  fp16 unscaled ones once clipping or the step has unscaled them, as ``.grad`` is
  after torch's ``GradScaler.unscale_()`` and clipping;
* an edit made through ``.grad`` (in place, or by assigning a tensor) is folded into
  the reduced slice before the step (or clipping) reads it, so the step applies it
  (and only the operations recorded after the edit);
  ``p.grad = None`` gives the parameter no gradient for the step (the optimizer skips
  it, as torch's do).  A gradient that was only read keeps its exact reduced values
  (the buffer is in the compute dtype; the slice may be wider);
* the buffers live until the gradients are cleared (``zero_grad()``, or the step when
  ``step_clears_gradients``) or the next reduction adds to them.

Under fp16, before clipping or the step, the values are loss-scaled, as ``p.grad`` is
under torch's GradScaler before ``unscale_()`` (``engine.loss_scale`` is the factor).

During forward and backward the parameters are plain ``nn.Parameter`` s again
(:func:`set_grad_reads`), so the hot path pays nothing; the engine's own code always
sees the raw ``.grad`` (:func:`_from_core`).
"""
from __future__ import annotations

import sys

import torch
import torch.nn as nn

_GRAD_GET = torch.Tensor.grad.__get__
_GRAD_SET = torch.Tensor.grad.__set__
GRAD_ACCESS = {_GRAD_GET, _GRAD_SET}


class GradReadingParameter(nn.Parameter):
    """A trainable parameter of an open engine, between a backward and the next forward."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in GRAD_ACCESS:
            return grad_access(func, args, depth=2)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def grad_access(func, args, depth: int):
    """A read (``func`` is the getter) or write of ``args[0].grad``, made by the frame
    ``depth`` levels up: served by the parameter's unit, or raw."""
    p = args[0]
    source = p.__dict__.get("_zero_grads")
    if source is not None and not source.unit.closed and not _from_core(depth + 1):
        pending = source.pending_for_unit
        if func == _GRAD_GET:
            return source.unit.grads.read(source.pos, source.gather, pending)
        source.unit.grads.write(source.pos, args[1], source.gather, pending)
        return None
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args)


def _from_core(depth: int) -> bool:
    """The access is the engine's own (it manages ``.grad`` itself): any module of the
    core, not the integrations, which read ``.grad`` as users do."""
    name = sys._getframe(depth).f_globals.get("__name__", "")
    return name.startswith("zero_strategy.") and not name.startswith("zero_strategy.integrations")


class _Source:
    """Where a parameter's ``.grad`` comes from: its unit, its position there, the unit's
    all-gather for reads after a reduction, and the step's gradient operations."""

    __slots__ = ("unit", "pos", "gather", "step_grads")

    def __init__(self, unit, pos: int, gather, step_grads) -> None:
        self.unit, self.pos, self.gather, self.step_grads = unit, pos, gather, step_grads

    def pending_for_unit(self, start: int):
        return self.step_grads.pending(self.unit, start)


def install_grad_reads(units, comm, step_grads) -> None:
    """Give every parameter of the trainable ``units`` its source (see the module note);
    ``step_grads`` is the engine's StepGradients (optim/step_grads.py)."""
    for unit in units:
        label = f"the gradients of {unit.label}, read through .grad"

        def gather(full, own, label=label):
            # Announced (collectives.py): a rank whose next collective is something else
            # fails on the announcement's header, before sizes can differ.
            for work in comm.all_gather_kept([(full, own, label)], tally="grad_read"):
                work.wait()

        for pos, p in enumerate(unit.params):
            p.__dict__["_zero_grads"] = _Source(unit, pos, gather, step_grads)


def uninstall_grad_reads(units) -> None:
    set_grad_reads(units, False)
    for unit in units:
        for p in unit.params:
            p.__dict__.pop("_zero_grads", None)


def set_grad_reads(units, on: bool) -> None:
    """Between backward and forward (``on``) ``.grad`` is served; during forward and
    backward the parameters are plain.  Stage 3's partitioned parameters keep their
    own class (guard.py), which serves ``.grad`` whenever it is on."""
    old, new = (nn.Parameter, GradReadingParameter) if on else (GradReadingParameter, nn.Parameter)
    for unit in units:
        for p in unit.params:
            if type(p) is old:
                p.__class__ = new


__all__ = ["GradReadingParameter", "GRAD_ACCESS", "grad_access", "install_grad_reads", "uninstall_grad_reads",
           "set_grad_reads"]
