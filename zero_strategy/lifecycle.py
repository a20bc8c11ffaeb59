"""Where a ZeroEngine is in a training step, and which engine manages which module.

[Note: lifecycle]
An engine's ``phase`` is one :class:`Phase`; every misuse check is a transition that is
not allowed from the current phase:

* IDLE/ACCUMULATED --first gradient--> BACKWARD --end--> REDUCED (synchronised or
  sharded gradients) or ACCUMULATED (no_sync at stages 0-1: nothing reduced);
* REDUCED --a synchronised backward--> error (its gradients would be reduced twice);
* REDUCED --clip / overflow check--> GRADS_READY --step()--> IDLE;
* step() from IDLE (no backward) or ACCUMULATED (unreduced gradients) is an error;
* close() --> CLOSED, from which every call is an error.
"""
from __future__ import annotations

import enum
import weakref

import torch.nn as nn


class Phase(enum.Enum):
    """Where the engine is in a training step (see [Note: lifecycle])."""

    IDLE = "idle"  # no gradient since the last step() / zero_grad()
    BACKWARD = "backward"  # autograd is running backward through the model
    ACCUMULATED = "accumulated"  # backward(s) inside no_sync only: local, unreduced gradients
    REDUCED = "reduced"  # a backward reduced the gradients: step() may follow
    GRADS_READY = "grads_ready"  # step's fp32 gradients are prepared (clip / overflow checked)
    CLOSED = "closed"  # close() was called: nothing is managed any more


def check_open(phase: Phase) -> None:
    if phase is Phase.CLOSED:
        raise RuntimeError(
            "this ZeroEngine was closed: the model's parameters are no longer managed; build a new engine with "
            "zero_strategy.initialize"
        )


def check_grads_steppable(phase: Phase, what: str, *, synced: bool, stage, reduces_in_no_sync: bool,
                          dry_run: bool) -> None:
    """Raise for the transitions into GRADS_READY that are misuse (``stage``: the
    StagePolicy; ``reduces_in_no_sync``: whether a backward inside no_sync reduces;
    ``dry_run``: a planning run on the meta device, which steps once to create optimizer
    state without a backward)."""
    if phase is Phase.BACKWARD:
        raise RuntimeError(f"{what} was called while backward is still running through the model")
    if phase is Phase.IDLE and not dry_run:
        raise RuntimeError(
            f"{what} was called but no backward reached the model since the last step() or zero_grad(): "
            "there are no gradients to apply. Call engine.backward(loss) (or loss.backward()) first."
        )
    if phase is Phase.ACCUMULATED:
        raise RuntimeError(
            f"{what} was called after backward passes that all ran inside no_sync(): at stage "
            f"{stage.stage} their gradients are local to each rank and were never reduced, so "
            "the update would differ per rank. Run the last micro-batch's backward outside no_sync()."
        )
    if not synced and not reduces_in_no_sync:
        raise RuntimeError(
            f"{what} was called inside no_sync(): at stage {stage.stage} gradients are reduced "
            "only by a backward outside no_sync(); call step() after leaving the no_sync() block."
        )


# Which engine manages which module.  Weak both ways: the engine holds its module, so a
# strong value would keep every model (and its process group) alive until exit.
_ENGINES: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def register_engine(module: nn.Module, engine) -> None:
    _ENGINES[module] = weakref.ref(engine)


def engine_of(module: nn.Module):
    """The open ZeroEngine managing ``module``, or None."""
    ref = _ENGINES.get(module)
    engine = ref() if ref is not None else None
    return engine if engine is not None and engine.phase is not Phase.CLOSED else None


def weak_method(bound):
    """A callable that does not keep its object alive (stored on parameters, which
    autograd's C++ side holds); it returns False once the object is gone."""
    ref = weakref.WeakMethod(bound)

    def call(*args):
        method = ref()
        return method(*args) if method is not None else False

    return call
