"""The optimizer step over this rank's shards, one unit at a time where that is exact.

[Note: stepping unit by unit]
Each unit's fp32 gradient is made (cast from the reduced 16-bit slice, unscaled and
clipped) just before the optimizer updates that unit, and freed right after, together
with the reduced slice it came from.  So at most one unit's fp32 gradient, and one
unit's worth of the optimizer's temporaries (a foreach Adam allocates several
shard-sized ones), exist at a time, instead of all of them at once.

That needs an optimizer whose update of one tensor depends on nothing but that
tensor, its gradient and its own state, so that N calls of ``step()`` that each see one
gradient (parameters without a gradient are skipped by every torch optimizer) equal
one call that sees them all.  torch's per-element optimizers and the known
per-parameter whole-tensor ones are (optimizer_kinds.py); for any other class, and whenever step hooks are registered on
the optimizer (they would run once per unit), every gradient is made first and
``step()`` is called once.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch.optim import optimizer as _optimizer_module

from .optimizer_kinds import PER_PARAMETER, steps_per_parameter  # noqa: F401 - PER_PARAMETER re-exported

def steps_unit_by_unit(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` may be stepped one unit at a time (see the module note)."""
    if not steps_per_parameter(optimizer):
        return False
    hooks = (optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks)
    global_hooks = (_optimizer_module._global_optimizer_pre_hooks, _optimizer_module._global_optimizer_post_hooks)
    return not any(hooks) and not any(global_hooks)


class _NoIO:
    """Stands in for disk offload's read-ahead / write-behind when there is none."""

    def before(self, unit) -> None:
        pass

    def after(self, unit) -> None:
        pass

    def finish(self) -> None:
        pass


def step_units(optimizer: torch.optim.Optimizer, units: Sequence, grad_of: Callable,
               used_of: Optional[Callable] = None, disk=None, comm=None, host_fused: bool = False) -> None:
    """Run ``optimizer`` over ``units`` (trainable FlatUnits it updates) with
    ``grad_of(unit)`` as each one's flat gradient slice, then refresh each unit's
    compute-dtype copy.

    ``used_of(unit)`` says, per parameter position, whether the parameter got a gradient
    on any rank; the others get no ``.grad`` and are skipped by the optimizer
    ([Note: one optimizer tensor per parameter] in flat_unit.py).

    Units in whole-parameter mode exchange their cut parameters with their owners
    through ``comm`` around the update ([Note: whole-parameter optimizers] in
    whole_params.py): collective, in the same unit order on every rank.

    ``disk`` (a DiskOffload) brings each unit's files in before its update (reading the
    next ones ahead) and writes them back after it; collective at the end (every rank
    learns of a disk failure on any rank).

    ``host_fused``: step each unit with torch's fused CPU kernel over its flat buffers
    where that is the optimizer's own update ([Note: fused host step] in host_step.py)."""
    used_of = used_of or (lambda u: None)
    io = disk.stepping(units, optimizer) if disk is not None else _NoIO()
    if steps_unit_by_unit(optimizer):
        groups = optimizer.param_groups
        saved = [g["params"] for g in groups]
        try:
            for u in units:
                io.before(u)
                # Only this unit's tensors in the groups: one step() costs O(unit), not O(model).
                for gi, g in enumerate(groups):
                    g["params"] = u.optim_params if gi == u.local_group_index else []
                grad = grad_of(u)
                if host_fused and _fused_host_step(optimizer, u, grad, used_of(u)):
                    grad = None
                    _release_reduced(u)  # after the step: the kernel read the slice (no .grad views it)
                else:
                    _give_grads(u, grad, used_of(u), comm)
                    grad = None
                    _release_reduced(u)
                    optimizer.step()
                _take_back(u, comm)
                u.params_store.refresh_compute_copy()
                io.after(u)
        finally:
            for g, params in zip(groups, saved):
                g["params"] = params
    else:
        # One step() over everything: with disk offload every unit is in memory at once,
        # and every owned cut parameter of a whole-parameter optimizer is whole at once.
        for u in units:
            io.before(u)
            _give_grads(u, grad_of(u), used_of(u), comm)
            _release_reduced(u)
        optimizer.step()
        for u in units:
            _take_back(u, comm)
            u.params_store.refresh_compute_copy()
            io.after(u)
    io.finish()


def _give_grads(unit, grad: torch.Tensor, used, comm) -> None:
    if unit.whole_params is not None:
        unit.whole_params.arrive(grad, used, comm, unit.device)
    else:
        unit.set_optimizer_grads(grad, used)


def _take_back(unit, comm) -> None:
    if unit.whole_params is not None:
        unit.whole_params.depart(comm, unit.device)
    else:
        unit.set_optimizer_grads(None)


def _fused_host_step(optimizer, unit, grad, used) -> bool:
    from .host_step import fused_host_step  # at call time: tests may wrap it

    return fused_host_step(optimizer, unit, grad, used)


def _release_reduced(unit) -> None:
    """The reduced slice has been turned into the optimizer's gradients: free it now
    unless the gradients *are* views of the slice (fp32 with nothing to unscale or clip)."""
    free = getattr(unit.grads, "free", None)
    if free is None:
        return
    slice_ptr = unit.grads.slice.untyped_storage().data_ptr()
    if not any(t.grad is not None and t.grad.untyped_storage().data_ptr() == slice_ptr for t in unit.optim_params):
        free()
