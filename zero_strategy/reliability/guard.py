"""Stage 3: reading a partitioned parameter outside forward gives a clear error.

Between uses, a stage-3 parameter is a view of a flat buffer whose storage has been
freed (``resize_(0)``): touching its values would read freed memory (on CPU torch
crashes with a segmentation fault) or, in other systems, silently see an empty tensor.
The engine changes the class of each partitioned parameter to
:class:`PartitionedParameter`, an ``nn.Parameter`` whose ``__torch_function__`` lets
metadata through (shape, dtype, device, ``.grad``, ``requires_grad``, no-op ``.to``)
and hands every other use to the gatherer (gather.py, [Note: on-demand gathers]): a
use inside the training window is gathered on demand; outside it the use raises a
:class:`PartitionedParameterError` naming the parameter and the way to read it
(``engine.gathered_parameters``, ``engine.full_state_dict``).

[Note: guard lifted while in use]
The check costs one Python call per operation that takes the parameter directly (a
Linear's matmul, not its activations): on models of many small layers, a tenth of a
step.  While a module group is in use (its forward or backward is running, or it is
pinned for backward, or held by keep_gathered()) and every unit of it is gathered,
the gatherer would allow every use without doing anything, so the guard steps aside:
:func:`set_guard` turns the group's parameters back into plain ``nn.Parameter``s
(``__class__`` only; their bookkeeping stays), and back when the group leaves that
state.  Freeing a unit's storage always puts the guard back first (the shard's
``on_free``), so no parameter is ever unguarded while its values are gone.
"""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn as nn

from ..sharding.grad_reads import GRAD_ACCESS, grad_access
from ..sharding.param_shard import ShardState


class PartitionedParameterError(RuntimeError):
    """A partitioned (stage-3) parameter's values were used while they are not gathered."""


def _getter(name):
    attr = getattr(torch.Tensor, name, None)
    return getattr(attr, "__get__", None)


def _setter(name):
    attr = getattr(torch.Tensor, name, None)
    return getattr(attr, "__set__", None)


_METADATA = {
    *(_getter(n) for n in ("shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "ndim", "is_cuda",
                           "is_meta", "layout", "grad_fn", "_version", "is_sparse", "is_quantized", "names", "itemsize",
                           "nbytes", "_base", "is_nested", "output_nr", "_cdata")),
    *(_setter(n) for n in ("data", "grad", "requires_grad")),
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.element_size,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.requires_grad_, torch.Tensor.stride,
    torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook, torch.Tensor.__hash__,
    torch.Tensor.untyped_storage, torch.Tensor.data_ptr, torch.Tensor.storage_offset, torch.Tensor.is_contiguous,
    torch.Tensor.get_device, torch.Tensor.__len__,
    # New tensors shaped like the parameter (a gradient to assign, a buffer): no values read.
    torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like,
} - {None}
_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.type}
_SET_DATA = _setter("data")


def _is_noop_move(func, args, kwargs) -> bool:
    """``p.to(its own device / dtype)`` returns ``p`` itself without reading values."""
    p = args[0]
    if func is torch.Tensor.cpu:
        return p.device.type == "cpu"
    if func is torch.Tensor.cuda:
        return p.device.type == "cuda"
    if func is torch.Tensor.to:
        try:
            device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
        except (TypeError, RuntimeError):
            return False
        same_device = device is None or torch.device(device) == p.device
        return same_device and (dtype is None or dtype == p.dtype) and not kwargs.get("copy", False)
    return False


_COLLECTING = [0]  # > 0 while model.state_dict() consolidates (module_state_dict.py)


@contextlib.contextmanager
def collecting_state_dict():
    """While active, ``Module._save_to_state_dict`` gets a meta placeholder for each
    partitioned parameter instead of an error; the caller puts the consolidated values
    in their place ([Note: model.state_dict() at stage 3] in module_state_dict.py)."""
    _COLLECTING[0] += 1
    try:
        yield
    finally:
        _COLLECTING[0] -= 1


def _placeholder_for_state_dict(func, args) -> bool:
    # Only the state-dict machinery itself, and only while a consolidation is under way:
    # any other use of a partitioned parameter still fails loudly.
    return (_COLLECTING[0] > 0 and func is torch.Tensor.detach and len(args) == 1
            and sys._getframe(2).f_code.co_name == "_save_to_state_dict")


class PartitionedParameter(nn.Parameter):
    """An ``nn.Parameter`` managed by a stage-3 ZeroEngine (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in GRAD_ACCESS:  # .grad: served like any trainable parameter's (grad_reads.py)
            return grad_access(func, args, depth=2)
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            # Traced by torch.compile: the unit's pre-forward hook (run eagerly) has
            # gathered what the compiled region uses; the graph sees a plain tensor.
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func not in _METADATA:
            for p in _partitioned(args, kwargs):
                if func in _MOVES and args and args[0] is p and _is_noop_move(func, args, kwargs):
                    continue
                access = p.__dict__.get("_zero_access")
                usable = access(p._zero_unit) if access is not None and not p._zero_unit.closed else not _released(p)
                if not usable:
                    if _placeholder_for_state_dict(func, args):
                        return torch.empty(p.shape, dtype=p.dtype, device="meta")
                    raise PartitionedParameterError(_message(p, func))
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if func == _SET_DATA and args and type(args[0]) is cls:
            unit = args[0].__dict__.get("_zero_unit")
            if unit is not None and unit.closed:
                # New whole values given to a parameter its (closed) engine left sharded:
                # it is an ordinary parameter again.
                _unguard(args[0])
        return result


def _unguard(p) -> None:
    p.__class__ = nn.Parameter
    p.__dict__.pop("_zero_unit", None)
    p.__dict__.pop("_zero_name", None)
    p.__dict__.pop("_zero_access", None)


def _released(t) -> bool:
    unit = t.__dict__.get("_zero_unit")
    return unit is not None and unit.state is not ShardState.GATHERED


def _partitioned(args, kwargs):
    """The PartitionedParameters among an operation's arguments (one level of lists)."""
    for a in (*args, *kwargs.values()):
        if type(a) is PartitionedParameter:
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if type(b) is PartitionedParameter:
                    yield b


def _message(p, func) -> str:
    name = p.__dict__.get("_zero_name", "a parameter")
    what = getattr(func, "__name__", str(func))
    if p.__dict__.get("_zero_unit") is not None and p._zero_unit.closed:
        return (
            f"{name} was partitioned by a ZeroEngine (stage 3) that has been closed: this rank holds only its "
            f"shard, so the parameter has no values to {what!r}. Close with engine.close(unshard=True) to get "
            "whole parameters back, or build a new engine."
        )
    return (
        f"{name} is partitioned by ZeRO stage 3: outside forward and backward only a 1/N shard exists on "
        f"this rank, so {what!r} cannot read its values. To read or change parameters, use "
        "`with engine.gathered_parameters(module, modifier_rank=0): ...` (collective); for weights to save, "
        "engine.full_state_dict()."
    )


def guard_parameters(units, on_access=None) -> None:
    """Make every parameter of the (not kept-whole) stage-3 units a PartitionedParameter.

    ``on_access(unit) -> bool`` is asked on every use of such a parameter's values: it
    may gather the unit (and return True) or refuse (False: the use raises)."""
    for unit in units:
        if unit.keep_full:
            continue
        for p, names in zip(unit.params, unit.names):
            p.__class__ = PartitionedParameter
            p._zero_unit = unit
            p._zero_name = names[0]
            if on_access is not None:
                p._zero_access = on_access
        unit.params_store.on_free = lambda u=unit: set_guard(u, True)


def unguard_parameters(units) -> None:
    for unit in units:
        unit.params_store.on_free = None
        for p in unit.params:
            if type(p) is PartitionedParameter or "_zero_unit" in p.__dict__:
                _unguard(p)


def set_guard(unit, on: bool) -> None:
    """Guard (``on``) or lift the guard of a guarded unit's parameters ([Note: guard
    lifted while in use]); lifting needs the unit gathered."""
    if unit.closed or not unit.params or "_zero_unit" not in unit.params[0].__dict__:
        return  # never guarded (kept whole) or handed back by close()
    if not on and unit.state is not ShardState.GATHERED:
        on = True
    cls = PartitionedParameter if on else nn.Parameter
    for p in unit.params:
        p.__class__ = cls


def is_partitioned(p) -> bool:
    """``p`` is a stage-3 parameter of an open engine (whether or not its guard is lifted now)."""
    unit = p.__dict__.get("_zero_unit")
    return unit is not None and not unit.closed


def lift_guard(units) -> list:
    """While every partitioned parameter is gathered and held (keep_gathered.py), lift
    the guard of each gathered unit; returns the units lifted, for :func:`restore_guard`."""
    lifted = []
    for unit in units:
        if unit.state is ShardState.GATHERED and unit.params and type(unit.params[0]) is PartitionedParameter:
            set_guard(unit, False)
            lifted.append(unit)
    return lifted


def restore_guard(units) -> None:
    for unit in units:
        set_guard(unit, True)
