"""Stage 3: keep every parameter gathered for an inference region, such as generate().

[Note: keep gathered]
Autoregressive decoding runs the model's forward once per new token.  At stage 3 each
forward gathers every unit module and releases it again, so generating T tokens moves
the whole model over the network T times, each time for one token's worth of compute.
``engine.keep_gathered()`` gathers every partitioned unit once when the region starts
and releases it when the region ends: inside, the forward hooks find everything
gathered and communicate nothing.  The guard (guard.py) is lifted for the region:
nothing is sharded for it to catch, and its Python call per operation is, for a small
model, a large part of each decoding step.  (DeepSpeed-Chat's hybrid engine gathers the model for
generation in the same way; FSDP2 leaves it to the user, with ``unshard()`` and
``reshard_after_forward=False``.)

* Memory: the region holds the whole model in the compute dtype.  When that is more
  than ``ZeroConfig.keep_gathered_max_bytes``, the region holds nothing (the model is
  gathered layer by layer as usual) and a warning says so, once per engine.  The size
  is the same number on every rank, so every rank decides the same way.
* Collective: every rank enters and leaves the region together, as stage 3 already
  needs for generate().  Regions nest; only the outermost one gathers and releases.
* No stale copy: step() inside a region, and loading weights, gather the held units
  again.  At the end only what the region gathered is released, so parameters that a
  surrounding ``gathered_parameters()`` or an on-demand use (pinned for a backward
  still to come) hold stay gathered for their owner; and if a forward with gradients
  ran inside and its backward has not, everything stays gathered until that backward
  ends (autograd may have saved any parameter).
* Methods: at initialize every method named in ``keep_gathered_methods`` (default
  ``generate``) is wrapped, on the model and on every submodule that has it, so
  ``model.generate(...)`` runs inside the region with no change to the caller.  The
  core knows only the names; close() takes the wrappers off again.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import warnings
import weakref
from typing import Callable, Iterator, List, Tuple

from ..reliability.guard import lift_guard, restore_guard


class KeepGathered:
    """One engine's inference region: whether it holds the model, and how deep it is nested."""

    def __init__(self, gatherer, units, *, max_bytes: int, bucket_numel: int, rank: int) -> None:
        self.gatherer = gatherer  # None below stage 3: the parameters are always whole
        self.max_bytes = max_bytes
        self.bucket_numel = bucket_numel
        self.rank = rank
        self.partitioned = [u for u in units if not u.keep_full]
        self.gathered_bytes = sum(u.layout.padded_numel * u.params_store.full.element_size() for u in self.partitioned)
        self.holding = False
        self._depth = 0
        self._gathered_here: list = []
        self._lifted: list = []  # parameters whose guard the region lifted
        self._warned = False

    @property
    def fits(self) -> bool:
        return self.gathered_bytes <= self.max_bytes

    @contextlib.contextmanager
    def region(self) -> Iterator[bool]:
        """Yields whether the parameters are whole inside (always, below stage 3)."""
        if self.gatherer is None:
            yield True
            return
        self._depth += 1
        outermost = self._depth == 1
        try:
            if outermost and self.fits and self.max_bytes > 0:
                self.holding = True
                self.gatherer.hold_all(self._gathered_here, self.bucket_numel)
                self._lifted = lift_guard(self.partitioned)
            elif outermost and self.max_bytes > 0:
                self._warn_once()
            yield self.holding
        finally:
            self._depth -= 1
            if outermost and self.holding:
                self.holding = False
                restore_guard(self._lifted)
                self._lifted = []
                gathered, self._gathered_here = self._gathered_here, []
                self.gatherer.end_hold(gathered)

    def refresh(self, units) -> None:
        """``units``' shards changed: what the region holds of them is gathered again (collective)."""
        if self.holding:
            self.gatherer.refresh_held(units, self.bucket_numel)

    def _warn_once(self) -> None:
        if self._warned or self.rank != 0:
            return
        self._warned = True
        warnings.warn(
            f"zero_strategy: keep_gathered() would hold {self.gathered_bytes / 2**20:.1f} MiB of gathered parameters, "
            f"more than keep_gathered_max_bytes={self.max_bytes} ({self.max_bytes / 2**20:.1f} MiB): the model is "
            "gathered layer by layer for every forward instead, which makes generate() much slower. Raise "
            "keep_gathered_max_bytes if the devices have that much memory free, or set it to 0 to silence this.",
            RuntimeWarning,
            stacklevel=4,
        )


class _InRegion:
    """What ``module.<name>`` is while an engine manages the module: the original method,
    run inside ``engine.keep_gathered()``."""

    def __init__(self, engine, original: Callable) -> None:
        self._engine = weakref.ref(engine)  # the module (and so this object) must not keep the engine alive
        self.original = original
        functools.update_wrapper(self, original)  # name, docstring and signature (via __wrapped__)

    def __call__(self, *args, **kwargs):
        engine = self._engine()
        if engine is None:
            return self.original(*args, **kwargs)
        with engine.keep_gathered() as holding:
            if self._takes_synced_gpus and "synced_gpus" not in kwargs and engine.comm.world_size > 1:
                kwargs["synced_gpus"] = not holding  # [Note: synced_gpus]
            return self.original(*args, **kwargs)

    @functools.cached_property
    def _takes_synced_gpus(self) -> bool:
        try:
            return "synced_gpus" in inspect.signature(self.original).parameters
        except (TypeError, ValueError):
            return False

    # Like a bound method's, for code that rebinds one (peft.helpers.update_generate_signature).
    @property
    def __func__(self):
        return self.original.__func__

    @property
    def __self__(self):
        return self.original.__self__

    def __deepcopy__(self, memo):
        # A deep copy of the model is not this engine's: it gets the method itself,
        # bound to the copy (copy.deepcopy rebinds a bound method to the copied object).
        return copy.deepcopy(self.original, memo)


# [Note: synced_gpus]
# A decoding loop that takes ``synced_gpus`` (transformers' generate()) keeps every rank
# running forwards until all ranks are done only when asked to, at the price of one
# all-reduce per new token.  Stage 3 needs that lockstep while each forward gathers
# layer by layer (a rank that stopped early would leave the others waiting in an
# all-gather); inside a region that holds the model (and below stage 3) the forwards
# communicate nothing, so each rank may stop when its own sequences end.  So the
# wrapper passes ``synced_gpus = not holding`` on more than one rank, unless the caller
# gave it.  (transformers turns the lockstep on for a model marked as FSDP-managed, as
# the Accelerate integration marks stage-3 models: that per-token all-reduce was most
# of a held generate()'s time; and without the mark, under Lightning or a plain loop,
# a generate() too large to hold ran without the lockstep it needs.)


def methods_to_wrap(model, names) -> List[Tuple[object, str, object]]:
    """``(module, name, instance attribute or None)`` for each method in ``names`` found on
    ``model`` or a submodule; raises if a name is something other than a method."""
    found = []
    for module in model.modules():
        for name in names:
            own = module.__dict__.get(name)  # an instance attribute (another wrapper) shadows the class's
            defined = own if own is not None else getattr(type(module), name, None)
            if defined is None:
                continue
            if not callable(defined):
                raise ValueError(
                    f"ZeroConfig.keep_gathered_methods names {name!r}, but {type(module).__name__}.{name} is not a "
                    f"method ({type(defined).__name__}); list only methods, e.g. ['generate']"
                )
            found.append((module, name, own))
    return found


def wrap_methods(engine, targets) -> List[Callable[[], None]]:
    """Run each of ``targets`` (from :func:`methods_to_wrap`) inside the engine's region;
    returns the functions that put the originals back."""
    undo = []
    for module, name, own in targets:
        wrapper = _InRegion(engine, own if own is not None else getattr(module, name))
        module.__dict__[name] = wrapper
        undo.append(functools.partial(_unwrap, module, name, wrapper, own))
    return undo


def _unwrap(module, name: str, wrapper, own) -> None:
    if module.__dict__.get(name) is not wrapper:
        return  # replaced since by someone else: theirs stays
    if own is not None:
        module.__dict__[name] = own
    else:
        del module.__dict__[name]


__all__ = ["KeepGathered", "methods_to_wrap", "wrap_methods"]
