"""Deferred parameters (stage 3) that get exactly the values an eager build gives them.

[Note: recorded initialisation]
Inside ``zero_strategy.init_context()`` (which Lightning's ``configure_model`` /
``init_module`` run in at stage 3) every parameter is moved to the meta device as it is
registered.  Initialising it later by running its module's ``reset_parameters()`` and
the enclosing ``_init_weights`` is not what an eager build (``strategy="ddp"``, or the
same code without the context) does:

* whatever else wrote the parameter while it was being built is lost -- PEFT's LoRA
  initialisation (``zeros_(lora_B)``, ``kaiming_uniform_(lora_A)``), any
  ``nn.init.*`` call in ``configure_model`` -- and ``_init_weights`` overwrites it
  (``lora_B`` comes out non-zero);
* the random stream is consumed in another order (a transformers model draws every
  ``reset_parameters`` during construction, then every ``_init_weights`` in
  ``post_init``; the replay interleaves them per module), and at set-up rather than in
  ``configure_model``, so even the untouched values differ.

So init_context records instead of guessing.  While the context is active, a torch
function mode sees every operation: each parameter deferred to meta gets a recipe --
how it was created (uninitialised, or filled with a constant) and every in-place
operation later applied to it or to a view of it (``torch.nn.init``'s functions as whole
calls, tensor methods such as ``zero_``, ``mul_``, ``__setitem__``), each with the state
of the random generator before it.  Each operation is also run for real on a scratch
tensor (the parameter's shape, dtype and would-be device; freed at once), so the random
stream advances exactly as in an eager build and everything drawn afterwards (the next
module, PEFT's ``lora_A``, dropout) is the same too.  At set-up every rank replays with
rank 0's random states (ddp broadcasts rank 0's values).  At set-up each recipe is replayed into the parameter's
scratch storage (the core calls ``reset_parameters``, which is the replay for these
modules; ``_init_weights`` is skipped for them), restoring the random state around
every replayed draw: set-up draws nothing, as under ddp.

What cannot be replayed is never guessed:

* a parameter registered with values that are not a recorded constant
  (``nn.Parameter(torch.randn(n) * 0.02)``) keeps those values: it is not deferred
  (on the build device, as under ddp; it is partitioned at set-up);
* an operation that writes a deferred parameter from another tensor that is not a small
  real one (``p.copy_(other_param)``, ``p.data = t``, an initialiser building its values
  from a meta tensor such as ``orthogonal_``) makes that parameter unreplayable, and
  set-up raises, naming it and the operation, before the engine exists.

Parameters deferred outside this recording (a partitioned ``from_pretrained``, whose
tensors come from the checkpoint; modules built on the meta device by the user) are
left to the core as before.
"""
from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Dict, List, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

RECIPE_ATTR = "_zero_strategy_recipe"

_RANDOM = {"uniform_", "normal_", "bernoulli_", "random_", "exponential_", "geometric_", "cauchy_", "log_normal_"}
# In-place by name but not touching values.
_METADATA_ONLY = {"requires_grad_", "retain_grad", "share_memory_", "record_stream", "__set_requires_grad__"}
_INPLACE_DUNDER = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                   "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"}
# Factories whose values a recipe can state: uninitialised (None) or a constant fill.
_FACTORIES = {
    "empty": None, "empty_like": None, "new_empty": None, "empty_strided": None, "new_empty_strided": None,
    "zeros": 0, "zeros_like": 0, "new_zeros": 0, "ones": 1, "ones_like": 1, "new_ones": 1,
}
_FULL = {"full": 1, "full_like": 1, "new_full": 1}  # position of the fill value
_SMALL = 1 << 20  # a real tensor argument up to this many elements is kept (copied) in the recipe
_DATA = torch._C.TensorBase.__dict__["data"]


class Recipe:
    """How one deferred parameter got its values while it was built."""

    __slots__ = ("shape", "dtype", "device", "fill", "ops", "problem")

    def __init__(self, shape, dtype, device, fill) -> None:
        self.shape, self.dtype, self.device, self.fill = tuple(shape), dtype, device, fill
        self.ops: List[tuple] = []  # (view chain, func, args, kwargs, rng state or None)
        self.problem: Optional[str] = None


def _name(func) -> str:
    return getattr(func, "__name__", "") or ""


def _is_data_setter(func) -> bool:
    return _name(func) == "__set__" and getattr(func, "__self__", None) is _DATA


def _storage(t) -> Optional[int]:
    try:
        return t.untyped_storage()._cdata
    except Exception:  # noqa: BLE001 - sparse, nested, ... tensors have no plain storage
        return None


def _rng_state(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    if device.type == "cpu":
        return torch.get_rng_state()
    return None  # another accelerator: random ops there are not replayed (see _freeze)


def _set_rng_state(device: torch.device, state) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class _Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        # storage -> how the real tensor owning it was made (None: computed, unknown values)
        self.created: Dict[int, Optional[tuple]] = {}
        # storage of a deferred (meta) parameter -> (its recipe, weak parameter)
        self.tracked: Dict[int, tuple] = {}
        # id of a meta tensor aliasing a tracked parameter -> (storage, view chain or None, weak alias)
        self.aliases: Dict[int, tuple] = {}
        # id of a meta tensor computed from deferred parameters -> (weak tensor, would-be device):
        # real in an eager build, so random draws on it advance the stream there
        self.derived: Dict[int, tuple] = {}
        self.depth = 0

    # -- what a meta tensor is -----------------------------------------------------------
    def _alias(self, t):
        """(recipe, view chain) when ``t`` is a tracked parameter or a view of one."""
        if not isinstance(t, torch.Tensor) or not t.is_meta:
            return None
        s = _storage(t)
        if s not in self.tracked:
            return None
        recipe, ref = self.tracked[s]
        if ref() is t:
            return recipe, ()
        entry = self.aliases.get(id(t))
        if entry is not None and entry[0] == s and entry[2]() is t:
            return recipe, entry[1]
        return recipe, None  # shares the storage in a way not seen here

    def _freeze(self, value, recipe: Recipe, what: str):
        """An argument as kept in a recipe; marks the recipe unreplayable when it cannot be."""
        if value is _SLOT:
            return value
        if isinstance(value, torch.Tensor):
            if value.is_meta:
                recipe.problem = recipe.problem or f"{what} reads a tensor on the meta device (its values do not exist)"
                return None
            if value.numel() > _SMALL:
                recipe.problem = recipe.problem or f"{what} reads a tensor of {value.numel()} elements"
                return None
            return value.detach().clone()
        if isinstance(value, (list, tuple)):
            return type(value)(self._freeze(v, recipe, what) for v in value)
        if isinstance(value, dict):
            return {k: self._freeze(v, recipe, what) for k, v in value.items()}
        if isinstance(value, torch.Generator):
            recipe.problem = recipe.problem or f"{what} draws from its own torch.Generator"
            return None
        return value

    # -- the mode ------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.depth:  # inside an operation being recorded (the body of nn.init.kaiming_uniform_, ...)
            return func(*args, **kwargs)
        name = _name(func)
        where, target = self._target(args, kwargs)
        if target is not None and _is_data_setter(func) and len(args) > 1 and _storage(args[1]) == _storage(args[0]):
            pass  # ``param.data = param`` (Module._apply for a move to where it already is): nothing changes
        elif target is not None and (_is_data_setter(func) or name in ("set_", "resize_", "resize_as_")):
            target[0].problem = target[0].problem or f"Tensor.{'data =' if name == '__set__' else name} replaced its values"
        elif target is not None and name not in _METADATA_ONLY and (
                (name.endswith("_") and not name.startswith("__")) or name in _INPLACE_DUNDER):
            return self._record(target, where, func, name, args, kwargs)
        elif name in _RANDOM and where is not None and where[0] == "arg":
            self._advance_for_derived(func, args, kwargs)
        result = func(*args, **kwargs)
        self._note_result(func, name, args, kwargs, result)
        return result

    def _derived_device(self, t):
        if not isinstance(t, torch.Tensor) or not t.is_meta:
            return None
        entry = self.derived.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        found = self._alias(t)
        return found[0].device if found is not None else None

    def _advance_for_derived(self, func, args, kwargs) -> None:
        """A random draw on a meta tensor computed from deferred parameters (``orthogonal_``
        draws into ``param.new_empty(...)``): drawn for real, as the eager build does."""
        device = self._derived_device(args[0])
        if device is None or any(isinstance(v, torch.Tensor) for v in (*args[1:], *kwargs.values())):
            return
        self.depth += 1
        try:
            with torch.no_grad():
                func(torch.empty(args[0].shape, dtype=args[0].dtype, device=device), *args[1:], **kwargs)
        finally:
            self.depth -= 1

    def _target(self, args, kwargs):
        """Where the (first) tensor argument is, and what it is when it is a tracked parameter or view."""
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                return ("arg", i), self._alias(a)
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                return ("kw", k), self._alias(v)
        return None, None

    def _record(self, target, where, func, name, args, kwargs):
        """Run an in-place operation on a deferred parameter (on meta: no values) and keep
        it in the parameter's recipe, with the random state before it.  It is also run on
        a scratch tensor, so the random stream advances as in an eager build."""
        recipe, chain = target
        what = f"{getattr(func, '__module__', None) or 'Tensor'}.{name}".replace("torch.nn.init", "nn.init")
        self.depth += 1
        try:
            result = func(*args, **kwargs)  # on meta: no values, no random numbers drawn
            if chain is None:
                recipe.problem = recipe.problem or f"{what} wrote it through a view this recording could not follow"
                return result
            rest = list(args)
            kw = dict(kwargs)
            if where[0] == "arg":
                rest[where[1]] = _SLOT
            else:
                kw[where[1]] = _SLOT
            rest = self._freeze(tuple(rest), recipe, what)
            kw = self._freeze(kw, recipe, what)
            if recipe.problem is not None:
                return result
            state = _rng_state(recipe.device)
            if state is None:
                recipe.problem = f"{what} may draw random numbers on {recipe.device}"
                return result
            with torch.no_grad():
                scratch = torch.empty(recipe.shape, dtype=recipe.dtype, device=recipe.device)
                _apply(scratch, chain, func, rest, kw)
                del scratch
            recipe.ops.append((chain, func, rest, kw, state))
            return result
        finally:
            self.depth -= 1

    def _note_result(self, func, name, args, kwargs, result) -> None:
        results = result if isinstance(result, (tuple, list)) else (result,)
        arg_storages = None
        for i, r in enumerate(results):
            if not isinstance(r, torch.Tensor):
                continue
            s = _storage(r)
            if s is None:
                continue
            if args and r is args[0]:
                continue  # an in-place operation returning its target
            if r.is_meta:
                if s not in self.tracked:
                    device = next((d for d in map(self._derived_device, (*args, *kwargs.values())) if d is not None), None)
                    if device is not None:
                        self.derived[id(r)] = (weakref.ref(r), device)
                    continue
                if args:
                    parent = self._alias(args[0])
                    if parent is not None and parent[1] is not None and self.tracked[s][1]() is not r:
                        rest = tuple(args[1:])
                        ok = not any(isinstance(a, torch.Tensor) for a in rest) and not any(
                            isinstance(v, torch.Tensor) for v in kwargs.values())
                        step = (func, rest, dict(kwargs)) if len(results) == 1 else (_Pick(func, i), rest, dict(kwargs))
                        chain = parent[1] + (step,) if ok else None
                        self.aliases[id(r)] = (s, chain, weakref.ref(r))
                continue
            if arg_storages is None:
                arg_storages = {_storage(a) for a in args if isinstance(a, torch.Tensor)}
            if s in arg_storages:
                continue  # a view of an argument: the storage keeps its origin
            if name in _FACTORIES:
                self.created[s] = (_FACTORIES[name],)
            elif name in _FULL and len(args) > _FULL[name] and isinstance(args[_FULL[name]], (int, float, bool)):
                self.created[s] = (args[_FULL[name]],)
            elif name == "full" and isinstance(kwargs.get("fill_value"), (int, float, bool)):
                self.created[s] = (kwargs["fill_value"],)
            else:
                self.created[s] = None  # computed: values this recording cannot state

    # -- registration (wraps the core's init_context) ----------------------------------
    def creation(self, param) -> Optional[tuple]:
        return self.created.get(_storage(param))

    def track(self, param, recipe: Recipe) -> None:
        setattr(param, RECIPE_ATTR, recipe)
        self.tracked[_storage(param)] = (recipe, weakref.ref(param))


class _Slot:
    """Where the parameter (or its view) goes in a recorded call."""

    def __repr__(self) -> str:
        return "<parameter>"


_SLOT = _Slot()


def _apply(value, chain, func, args, kwargs) -> None:
    view = value
    for f, a, k in chain:
        view = f(view, *a, **k)
    func(*[view if a is _SLOT else a for a in args], **{k: view if v is _SLOT else v for k, v in kwargs.items()})


class _Pick:
    """One element of a function returning several views (``split``, ``chunk``, ``unbind``)."""

    def __init__(self, func, index: int) -> None:
        self.func, self.index = func, index
        self.__name__ = f"{_name(func)}[{index}]"

    def __call__(self, *args, **kwargs):
        return self.func(*args, **kwargs)[self.index]


_active: Optional[_Recorder] = None


def active() -> bool:
    return _active is not None


@contextlib.contextmanager
def recording(torch_register):
    """Inside ``zero_strategy.init_context()``: record every deferred parameter's recipe.
    ``torch_register``: ``nn.Module.register_parameter`` as it was before the core
    patched it (used for parameters whose values are kept).  Re-entrant: an inner use
    (Lightning enters ``tensor_init_context`` and ``model_sharded_context``) adds nothing."""
    global _active
    if _active is not None:
        yield
        return
    recorder = _Recorder()
    core_register = nn.Module.register_parameter

    def register_parameter(module, name, param):
        if param is None or param.device.type == "meta" or getattr(param, RECIPE_ATTR, None) is not None:
            return core_register(module, name, param)
        made = recorder.creation(param)
        if made is None:
            # Values we could not reproduce later: keep them, exactly what an eager build has.
            return torch_register(module, name, param)
        recipe = Recipe(param.shape, param.dtype, param.device, made[0])
        core_register(module, name, param)
        recorder.track(module._parameters[name], recipe)

    patched = _patch_initialisers(recorder)
    nn.Module.register_parameter = register_parameter
    _active = recorder
    try:
        with recorder:
            yield
    finally:
        _active = None
        nn.Module.register_parameter = core_register
        # Its weak references to the parameters go now, not whenever a reference cycle is
        # collected: torch.utils.swap_tensors (materialising a meta parameter) refuses a
        # tensor that still has a weak reference.
        for table in (recorder.created, recorder.tracked, recorder.aliases, recorder.derived):
            table.clear()
        for table, key, original in reversed(patched):
            table[key] = original


def _patch_initialisers(recorder: _Recorder) -> list:
    """Record ``torch.nn.init``'s in-place initialisers as whole calls.  Some cannot be
    followed op by op: ``trunc_normal_`` returns at once on a meta tensor (and draws a
    data-dependent number of samples), ``orthogonal_`` computes its values on the side.
    Replayed whole, from the same random state, they give the eager values.
    transformers keeps its own references to them (``TORCH_INIT_FUNCTIONS``): patched too."""
    import torch.nn.init as init

    def wrap(name, original):
        def initialiser(*args, **kwargs):
            if recorder.depth == 0:
                where, target = recorder._target(args, kwargs)
                if target is not None:
                    return recorder._record(target, where, original, name, args, kwargs)
            return original(*args, **kwargs)

        initialiser._zero_strategy_original = original
        return initialiser

    patched = []
    tables = [vars(init)]
    hf = sys.modules.get("transformers.initialization")
    if hf is not None and isinstance(getattr(hf, "TORCH_INIT_FUNCTIONS", None), dict):
        tables.append(hf.TORCH_INIT_FUNCTIONS)
    for table in tables:
        for key, fn in list(table.items()):
            if (key.endswith("_") and not key.startswith("_") and callable(fn)
                    and getattr(fn, "__module__", None) == "torch.nn.init"):
                patched.append((table, key, fn))
                table[key] = wrap(key, fn)
    return patched


# ----------------------------------------------------------------------------------------
# set-up: replay
# ----------------------------------------------------------------------------------------
def _replay_into(p: nn.Parameter, recipe: Recipe) -> None:
    with torch.no_grad():
        value = torch.empty(recipe.shape, dtype=recipe.dtype, device=recipe.device)
        if recipe.fill is not None:
            value.fill_(recipe.fill)
        saved = _rng_state(recipe.device)
        try:
            for chain, func, args, kwargs, state in recipe.ops:
                _set_rng_state(recipe.device, state)
                _apply(value, chain, func, args, kwargs)
        finally:
            _set_rng_state(recipe.device, saved)
        p.data.copy_(value.reshape(p.shape))


def check_replayable(module: nn.Module) -> None:
    """Raise, naming them, when deferred parameters were written in a way that cannot be replayed."""
    bad = []
    for name, p in module.named_parameters():
        recipe = getattr(p, RECIPE_ATTR, None)
        if recipe is not None and recipe.problem is not None and p.is_meta:
            bad.append(f"{name} ({recipe.problem})")
    if bad:
        raise ValueError(
            f"ZeRO stage 3: {len(bad)} parameter(s) created deferred (inside zero_strategy.init_context, or Lightning's configure_model / init_module) were written "
            "while being built in a way their values cannot be reproduced at set-up: " + "; ".join(bad[:10])
            + (" ..." if len(bad) > 10 else "") + ". Initialise them with in-place operations on the parameter itself "
            "(nn.init.*, fill_, mul_, ...), or build this module outside that context (it is then "
            "partitioned at set-up with its values), or use a stage below 3"
        )


def _use_rank0_random_states(module: nn.Module, comm) -> None:
    """Every rank replays with rank 0's random states (collective).  ddp broadcasts rank
    0's values; so a run whose ranks were seeded differently still gets rank 0's model
    (each rank keeps its own slice of one model, never slices of different ones)."""
    if comm.world_size < 2:
        return
    mine = [(name, getattr(p, RECIPE_ATTR)) for name, p in module.named_parameters()
            if p.is_meta and getattr(p, RECIPE_ATTR, None) is not None]
    shape = [(name, [_name(op[1]) for op in r.ops]) for name, r in mine]
    theirs, states = comm.broadcast_object((shape, [[op[4] for op in r.ops] for _, r in mine]) if comm.rank == 0 else None,
                                           label="rank 0's random states for deferred initialisation")
    error = None
    if theirs != shape:
        diff = next((f"{a} vs rank 0's {b}" for a, b in zip(shape, theirs) if a != b), f"{len(shape)} vs {len(theirs)} parameters")
        error = ValueError(f"ZeRO stage 3: init_context (configure_model / init_module) built different parameters on rank {comm.rank} "
                           f"than on rank 0 ({diff}); every rank must build the same model")
    comm.agree("deferred initialisation", error, error_type=ValueError, own="always")
    for (_, recipe), ranks0 in zip(mine, states):
        recipe.ops = [(*op[:4], state) for op, state in zip(recipe.ops, ranks0)]


def plan_replay(module: nn.Module, comm):
    """Collective, before the engine allocates anything: refuse (on every rank) what
    cannot be replayed, take rank 0's random states, and note which deferred parameters
    have recipes; the plan is what :func:`replaying` installs."""
    error = None
    try:
        check_replayable(module)
    except ValueError as exc:  # agreed: every rank stops, none waits in the next collective
        error = exc
    comm.agree("deferred initialisation", error, error_type=ValueError, own="always")
    _use_rank0_random_states(module, comm)
    recipes = {id(p): (p, getattr(p, RECIPE_ATTR)) for p in module.parameters()
               if p.is_meta and getattr(p, RECIPE_ATTR, None) is not None}
    unrecorded = {id(p) for p in module.parameters() if p.is_meta and id(p) not in recipes}
    return module, recipes, unrecorded


@contextlib.contextmanager
def replaying(plan):
    """While the engine materialises the planned module: each module's
    ``reset_parameters`` (what the core runs for its deferred parameters) replays the
    recipes of its recorded parameters (after the module's own initialiser when it also
    has unrecorded ones), and ``_init_weights`` is skipped where everything it could
    write is recorded, else run and followed by the replay of what it overwrote."""
    module, recipes, unrecorded = plan
    installed = []  # (object, attribute)
    if not recipes:
        yield
        return

    def replay(params) -> None:
        for p in params:
            if id(p) in recipes:
                _replay_into(p, recipes[id(p)][1])

    for m in module.modules():
        own = [p for p in m._parameters.values() if p is not None and id(p) in recipes]
        if not own:
            continue
        original = getattr(m, "reset_parameters", None)
        mixed = any(p is not None and id(p) in unrecorded for p in m._parameters.values()) and callable(original)

        def reset_parameters(_own=own, _original=original if mixed else None):
            if _original is not None:  # parameters without a recipe: the module's own initialiser, as before
                _original()
            replay(_own)

        m.__dict__["reset_parameters"] = reset_parameters
        installed.append((m, "reset_parameters"))
    for m in module.modules():
        original = getattr(m, "_init_weights", None)
        if original is None or not callable(original):
            continue

        # The core calls it for every module of a granule (its subtree has scratch storage
        # then); it may write parameters of submodules (GPT-2's scaled c_proj init).
        def _init_weights(target, _original=original):
            params = list(target.parameters())
            if not any(id(p) in unrecorded for p in params):
                return None  # everything it could write is replayed
            result = _original(target)
            replay(params)  # what it overwrote of the recorded ones
            return result

        m.__dict__["_init_weights"] = _init_weights
        installed.append((m, "_init_weights"))
    cpu_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        # Set-up draws nothing, as ddp's: what the core's initialisers drew for parameters
        # without a recipe (or for scratch copies of loaded ones) is given back.
        torch.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        for obj, attr in installed:
            obj.__dict__.pop(attr, None)
        for p, _ in recipes.values():
            if getattr(p, RECIPE_ATTR, None) is not None:
                try:
                    delattr(p, RECIPE_ATTR)
                except AttributeError:
                    pass
