"""What moving or casting a prepared model does: ``model.to(...)``, ``.cpu()``, ``.float()``, ...

A model that ``ZeroAccelerator.prepare`` handed to a ZeroEngine holds what the engine
needs, not what an ordinary module of that class would: 16-bit compute copies of the
weights in bf16/fp16 runs (the fp32 values are the masters, partitioned across ranks),
and at stage 3 only this rank's slice of each partitioned parameter.  A conversion that
goes through ``nn.Module._apply`` (``to``, ``cpu``, ``cuda``, ``float``, ``half``,
``bfloat16``, ``double``, ``type``, ``to_empty``, ...) on that root model is defined as
acting on the model its master weights describe:

* If that model is what the module holds already (every parameter whole and in its own
  dtype: fp32 at stages 0-2, or a stage-3 model whose parameters are all below
  ``param_persistence_threshold``) and the conversion changes no tensor, it is a no-op
  and the engine keeps running (``model.to(accelerator.device)`` after ``prepare``).
* Otherwise the model leaves ZeRO first: ``engine.close(unshard=True)`` gives every rank
  the whole parameters in their original dtypes, from the fp32 masters, and then the
  conversion applies to an ordinary module.  This is collective (every process calls
  it, as end-of-training code such as ``accelerator.unwrap_model(model).cpu()`` does),
  and afterwards the optimizer prepared with the model raises if stepped.

Only the root model is covered; a submodule's own ``.to()`` at stage 3 still raises the
core's PartitionedParameterError.  The rule is Accelerate's only: the core and the
Lightning integration leave ``_apply`` alone.
"""
from __future__ import annotations

import types

import torch
import torch.nn as nn

from zero_strategy import engine_of, is_partitioned


def leave_engine_on_conversion(model: nn.Module) -> None:
    """Install the rule above on ``model`` (the root module of an engine)."""
    # A bound method of a module-level function, so that copy.deepcopy rebinds it to the
    # copy, which no engine manages (engine_of gives None there and the copy converts as usual).
    model._apply = types.MethodType(_apply_leaving_engine, model)


def _apply_leaving_engine(self: nn.Module, fn, recurse: bool = True):
    engine = engine_of(self)
    if engine is not None:
        if _unchanged_by(engine, fn):
            # Not applied: torch may still copy a tensor (``t.to("cpu:0")`` of a "cpu"
            # tensor does), and a copy would cut a parameter off the engine's flat buffer.
            return self
        engine.close(unshard=True)  # collective: every rank gets whole, original-dtype parameters
    self.__dict__.pop("_apply", None)
    return type(self)._apply(self, fn, recurse)


def _unchanged_by(engine, fn) -> bool:
    """The module already is its master model, and ``fn`` leaves every tensor as it is
    (``Tensor.to`` and friends return the tensor itself when nothing changes)."""
    module = engine.module
    for p in module.parameters():
        if is_partitioned(p):
            return False  # a 1/N slice is not the parameter
        if p.dtype != engine.original_dtype(p):
            return False  # a 16-bit compute copy of an fp32 master
    for t in list(module.parameters()) + list(module.buffers()):
        if not _same_tensor(t, fn(t)):  # stops at the first tensor that would change
            return False
    return True


def _same_tensor(t, out) -> bool:
    # Tensor.to returns its input when nothing changes; a copy with the same device type,
    # dtype, layout and values (``cpu:0`` for ``cpu``) changes nothing either.
    if out is t:
        return True
    return (
        isinstance(out, torch.Tensor) and out.device.type == t.device.type and _same_index(out.device, t.device)
        and out.dtype == t.dtype and out.shape == t.shape and out.stride() == t.stride() and torch.equal(out, t)
    )


def _same_index(a: torch.device, b: torch.device) -> bool:
    if a.type == "cpu":
        return True  # one host memory, whatever the index says
    return a.index == b.index
