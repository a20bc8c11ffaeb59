"""Misuse that would otherwise give silent wrong numbers: detected, or made right.

[Note: silent misuse]
* ``optimizer.step()`` on the optimizer given to ``initialize``: ZeRO re-pointed it at
  this rank's fp32 shards, whose gradients exist only inside ``engine.step()``, so the
  call would do nothing (and a later error would only say "call step()").
  :func:`guard_inner_optimizer` gives that optimizer an instance-level ``step`` that
  raises naming ``engine.step()`` when called from outside the engine.  LR schedulers
  built before or after ``initialize`` keep their step tracking; once the engine is
  closed the call goes through (the optimizer is the user's again).
* ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``: a parameter's ``.grad``
  is not the gradient the engine steps with (None at stages 2-3, so torch returned 0.0
  and clipped nothing; at stages 0-1 still loss-scaled with fp16, and not what the
  step reads).  It is made right: the first ``initialize`` wraps
  ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` (module attributes) so that,
  given all the trainable parameters of one open ZeroEngine's model, they call
  ``engine.clip_grad_norm_`` / ``clip_grad_value_`` (the global norm over every shard,
  after unscaling; the same return value).  Any other tensors go to torch's own
  functions unchanged; a subset of an engine's trainable parameters, or a mix with
  other tensors, is an error naming ``engine.clip_grad_norm_`` (the engine clips all of
  a model's gradients together).  Code that bound the function before the first
  ``initialize`` (``from torch.nn.utils import clip_grad_norm_`` at import time) keeps
  torch's; call ``engine.clip_grad_norm_`` there.
* ``optimizer.zero_grad()`` on the optimizer given to ``initialize``, and
  ``model.zero_grad()``: the gradients live in the engine's buffers and slices (at
  stages 2-3 ``.grad`` is None between backward and step), so neither would clear them
  and the next backward would add to the old ones.  Both are routed to the engine's
  ``zero_grad`` (:func:`route_module_zero_grad`; the optimizer's to ``zero_grad_of(k)``), so
  a second backward before ``step()`` accumulates, as under DDP, and a cleared one
  starts afresh.
* fp16 steps skipped over and over with no way out (a static ``loss_scale`` that
  overflows, or the dynamic scale stuck at ``min_loss_scale`` with
  ``on_min_loss_scale="skip"``): :class:`SkipWatch` warns after
  :data:`SKIPPED_STEPS_WARNING` consecutive skips, once per run of skips.
"""
from __future__ import annotations

import contextlib
import functools
import math
import types
import warnings
import weakref
from typing import Iterator

import torch
import torch.nn.utils as nn_utils
from torch.nn.utils import clip_grad as _clip_grad_module
from torch.utils.weak import WeakIdKeyDictionary

SKIPPED_STEPS_WARNING = 10  # consecutive fp16 steps skipped (with no way out) before a warning

_STEPPING = "_zero_strategy_stepping"


# -- the inner optimizer's step ------------------------------------------------------------------
def guard_inner_optimizer(engine) -> None:
    for k, opt in enumerate(engine.inner_optimizers):
        _guard_one(engine, opt)
        _route_zero_grad(engine, opt, k)


def _route_zero_grad(engine, opt, k: int) -> None:
    """The user's optimizer's ``zero_grad()`` clears the engine's gradients (its own
    tensors, the shards, hold none outside ``engine.step()``), as
    ``engine.optimizers[k].zero_grad()`` does; once the engine is closed it is the
    optimizer's own again."""
    engine_ref = weakref.ref(engine)

    def zero_grad(self, *args, **kwargs):
        eng = engine_ref()
        if eng is not None and eng.phase.value != "closed":
            eng.zero_grad_of(k)
            return None
        return type(self).zero_grad(self, *args, **kwargs)

    opt.zero_grad = types.MethodType(zero_grad, opt)


def route_module_zero_grad(engine):
    """``model.zero_grad()`` clears the engine's gradients too: at stages 2-3 ``.grad``
    is None between backward and step (the reduced slices hold the gradients), so
    without this the call would clear nothing and the next backward would add to the
    old gradients.  Returns the function that puts the module's own method back."""
    module, engine_ref = engine.module, weakref.ref(engine)
    own = module.__dict__.get("zero_grad")

    def zero_grad(*args, **kwargs):
        result = (own or type(module).zero_grad.__get__(module))(*args, **kwargs)
        eng = engine_ref()
        if eng is not None and eng.phase.value != "closed":
            eng.zero_grad()
        return result

    module.__dict__["zero_grad"] = zero_grad

    def undo() -> None:
        if module.__dict__.get("zero_grad") is not zero_grad:
            return  # replaced since by someone else: theirs stays
        if own is not None:
            module.__dict__["zero_grad"] = own
        else:
            del module.__dict__["zero_grad"]

    return undo


def _guard_one(engine, opt) -> None:
    engine_ref = weakref.ref(engine)
    previous = opt.__dict__.get("step")  # an LR scheduler's step tracking, set on the instance

    def step(self, *args, **kwargs):
        eng = engine_ref()
        live = eng is not None and eng.phase.value != "closed"
        if live and not getattr(self, _STEPPING, False):
            raise RuntimeError(
                f"optimizer.step() was called on the {type(self).__name__} given to zero_strategy.initialize: the "
                "ZeroEngine now drives it over this rank's shards, whose gradients exist only inside "
                "engine.step(), so this call would silently do nothing. Call engine.step() instead (or "
                "engine.optimizers[k].step(), the ZeroOptimizer that frameworks call), then engine.zero_grad()."
            )
        if previous is not None:
            return previous(*args, **kwargs)
        return type(self).step(self, *args, **kwargs)

    if previous is not None and hasattr(previous, "_wrapped_by_lr_sched"):
        step._wrapped_by_lr_sched = True  # a scheduler made later must not wrap it twice
    opt.step = types.MethodType(step, opt)


@contextlib.contextmanager
def engine_steps(optimizer) -> Iterator[None]:
    """Inside, the guarded optimizer's step runs (the engine's own calls)."""
    if optimizer is None:
        yield
        return
    setattr(optimizer, _STEPPING, True)
    try:
        yield
    finally:
        setattr(optimizer, _STEPPING, False)


# -- torch.nn.utils.clip_grad_norm_ / clip_grad_value_ ----------------------------------------------
_ENGINE_OF_PARAM = WeakIdKeyDictionary()  # parameter -> weakref to its engine (by identity)
_TORCH_CLIP_NORM = _clip_grad_module.clip_grad_norm_
_TORCH_CLIP_VALUE = _clip_grad_module.clip_grad_value_


def _open_engine(p):
    ref = _ENGINE_OF_PARAM.get(p)
    eng = ref() if ref is not None else None
    return eng if eng is not None and eng.phase.value != "closed" else None


def engine_for_parameters(parameters, what: str = "clip_grad_norm_"):
    """``(engine, which)`` for clipping ``parameters``: the open engine whose trainable
    parameters, or one of whose optimizers' parameters, are exactly the trainable ones
    among them (``which``: None for all of them, else the optimizer's index); ``(None,
    the tensors)`` when none of them is managed by an open engine (or all are frozen).
    Anything else is a RuntimeError naming ``what``: ZeRO clips all of a model's
    gradients together, or all of one optimizer's (ShardedModel.optimizer_of_parameters).
    Public as zero_strategy.engine_for_parameters."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owners = [_open_engine(p) for p in params]
    engines = {id(e): e for e in owners if e is not None}
    if not engines:
        return None, params
    if len(engines) > 1 or any(e is None for e in owners):
        raise RuntimeError(
            f"{what} was given parameters of a ZeroEngine's model together with other tensors (or another "
            "engine's): under ZeRO their .grad is not the gradient the engine steps with (None at stages 2-3, "
            f"loss-scaled with fp16). Clip each engine's model in a call of its own ({what}(model.parameters(), ...) "
            f"or engine.{what.rsplit('.', 1)[-1]}(...)), and the other tensors in another."
        )
    eng = next(iter(engines.values()))
    if not any(p.requires_grad for p in params):
        return None, params  # frozen parameters only: no gradient to clip, as with torch
    return eng, eng.sharded.optimizer_of_parameters(params, what)


@functools.wraps(_TORCH_CLIP_NORM)
def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    eng, which = engine_for_parameters(parameters, "torch.nn.utils.clip_grad_norm_")
    if eng is None:
        return _TORCH_CLIP_NORM(which, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)
    total = eng.clip_grad_norm_(float(max_norm), norm_type=float(norm_type), optimizer=which)
    if error_if_nonfinite and not math.isfinite(float(total)):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it cannot "
            "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    return total


@functools.wraps(_TORCH_CLIP_VALUE)
def clip_grad_value_(parameters, clip_value, foreach=None):
    eng, which = engine_for_parameters(parameters, "torch.nn.utils.clip_grad_value_")
    if eng is None:
        return _TORCH_CLIP_VALUE(which, clip_value, foreach=foreach)
    eng.clip_grad_value_(float(clip_value), optimizer=which)
    return None


_ROUTED = ("\n\n(zero_strategy: given all the trainable parameters of a ZeroEngine's model, this calls "
           "engine.{0}; see [Note: silent misuse] in zero_strategy/misuse.py.)")
clip_grad_norm_.__doc__ = (clip_grad_norm_.__doc__ or "") + _ROUTED.format("clip_grad_norm_")
clip_grad_value_.__doc__ = (clip_grad_value_.__doc__ or "") + _ROUTED.format("clip_grad_value_")


def install_clip_routing(engine) -> None:
    """Register ``engine``'s parameters and route torch's clipping functions (once)."""
    ref = weakref.ref(engine)
    for p in engine.module.parameters():
        _ENGINE_OF_PARAM[p] = ref
    for module in (nn_utils, _clip_grad_module):
        if getattr(module, "clip_grad_norm_", None) is _TORCH_CLIP_NORM:
            module.clip_grad_norm_ = clip_grad_norm_
        if getattr(module, "clip_grad_value_", None) is _TORCH_CLIP_VALUE:
            module.clip_grad_value_ = clip_grad_value_


def guard_misuse(engine) -> None:
    """What ZeroEngine.__init__ installs (see [Note: silent misuse])."""
    guard_inner_optimizer(engine)
    install_clip_routing(engine)


# -- repeated fp16 skips ------------------------------------------------------------------------------
class SkipWatch:
    """Warns once per run of SKIPPED_STEPS_WARNING consecutive skipped fp16 steps that no
    scale change can end (a static scale, or the dynamic one at its minimum)."""

    def __init__(self) -> None:
        self.streak = 0

    def stepped(self) -> None:
        self.streak = 0

    def skipped(self, scaler, step: int) -> None:
        if scaler.dynamic and scaler.scale > scaler.min_scale:
            self.streak = 0  # the dynamic scale is still coming down: skips are expected
            return
        self.streak += 1
        if self.streak != SKIPPED_STEPS_WARNING:
            return
        if scaler.dynamic:
            why = (f"the dynamic loss scale is at min_loss_scale={scaler.min_scale:g} and the gradients still "
                   "overflow")
            fix = "Lower the learning rate, look for inf/NaN in the model (on_min_loss_scale='raise' names the parameters), or use bf16."
        else:
            why = f"the static loss_scale={scaler.scale:g} makes the fp16 gradients overflow every step"
            fix = ("Set loss_scale=0 (dynamic scaling, which lowers the scale after an overflow) or a smaller static "
                   "loss_scale, or use bf16.")
        warnings.warn(
            f"fp16: the last {SKIPPED_STEPS_WARNING} optimizer steps were all skipped (engine.global_step stays at {step}): {why}, so "
            f"the weights do not change while training loops, schedulers and loggers still count the steps. {fix}",
            RuntimeWarning,
            stacklevel=3,
        )
