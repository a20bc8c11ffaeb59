"""Models larger than one device: build partitioned, initialise or load slice by slice.

[Note: deferred parameters]
Inside :func:`init_context` every parameter a module registers is moved to the meta
device (no memory); buffers are built normally (they are small, and some, like rotary
frequencies, are computed in ``__init__``).  ``initialize`` then creates each flat
unit's buffers without values and fills them here, one module (initialisation) or one
slice (loading) at a time, so no rank ever holds the whole model:

* initialisation walks ``model.modules()`` in its fixed order and, for each module
  with parameters still to fill, gives those parameters temporary storage, runs the
  module's own ``reset_parameters()`` and then the model's per-module initialiser
  (``model._init_weights(module)``, the transformers convention, duck-typed), and
  keeps only the part this rank owns.  Every rank runs the same sequence from the
  same seed, so the values do not depend on the world size.
* loading reads, from safetensors files, only the rows covering the flat range this
  rank owns of each tensor (``safe_open(...).get_slice``), so resident memory stays
  near (model / N + largest tensor).
"""
from __future__ import annotations

import contextlib
import types
from typing import Dict, Iterator, Optional, Set

import torch
import torch.nn as nn

from ..sharding.param_shard import set_parameter_data
from . import recording


@contextlib.contextmanager
def init_context(record: bool = True) -> Iterator[None]:
    """Parameters created inside are placed on the meta device; pass the model to
    ``zero_strategy.initialize`` to materialise them partitioned.

    With ``record`` (the default) how each parameter got its values while it was built
    is recorded and replayed at ``initialize`` with rank 0's random states, so the model
    gets exactly the values an eager build from the same seed gives it, and the random
    stream after the context is the eager build's too ([Note: recorded initialisation]
    in recording.py).  ``record=False`` skips that work where every value comes from a
    checkpoint (a partitioned ``from_pretrained``).  Re-entrant: inside an active
    context a nested one adds nothing, except that a nested ``record=False`` defers what
    is registered inside it unrecorded (moved to meta before the recording sees it)."""
    if recording.active() and not record:
        with _meta_registration():
            yield
        return
    if recording.active() or _deferring:
        yield
        return
    torch_register = nn.Module.register_parameter
    with _meta_registration(), (recording.recording(torch_register) if record else contextlib.nullcontext()):
        yield


def in_init_context() -> bool:
    """Whether an :func:`init_context` is active."""
    return bool(_deferring) or recording.active()


_deferring: list = []  # non-empty while parameters are being moved to meta


@contextlib.contextmanager
def _meta_registration() -> Iterator[None]:
    original = nn.Module.register_parameter

    def register_parameter(module, name, param):
        if param is not None and param.device.type != "meta":
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        if param is not None:
            # Deferred on purpose: its module's initialiser gives it values later.  A
            # parameter moved to meta by anyone else has lost its values (see bind()).
            param._zero_deferred = True
        original(module, name, param)

    nn.Module.register_parameter = register_parameter
    _deferring.append(True)
    try:
        yield
    finally:
        _deferring.pop()
        nn.Module.register_parameter = original


def _apply_keeping_meta(self: nn.Module, fn, recurse: bool = True):
    def convert(t):
        if t.device.type != "meta":
            return fn(t)
        try:
            return fn(t)  # dtype changes work on meta tensors
        except NotImplementedError:  # "cannot copy out of meta tensor": a device move
            return t

    return type(self)._apply(self, convert, recurse)


def keep_meta_on_moves(model: nn.Module) -> None:
    """Let ``model.to(device)`` / ``.cuda()`` / ``.float()`` run on a model built inside
    :func:`init_context`: parameters still on the meta device stay there (``initialize``
    places them), everything else moves as usual.  Frameworks move models to their device
    before handing them over (the transformers Trainer does); without this such a move
    fails with "Cannot copy out of meta tensor".  ``initialize`` undoes it."""
    # A bound method of a module-level function, so that copy.deepcopy rebinds it to the copy.
    model._apply = types.MethodType(_apply_keeping_meta, model)


def forget_meta_moves(model: nn.Module) -> None:
    for module in model.modules():
        bound = module.__dict__.get("_apply")
        if isinstance(bound, types.MethodType) and bound.__func__ is _apply_keeping_meta:
            del module.__dict__["_apply"]


def meta_parameter_ids(model: nn.Module) -> Set[int]:
    return {id(p) for p in model.parameters() if p.device.type == "meta"}


def _locate(sharded) -> Dict[int, tuple]:
    return {id(p): (u, i) for u in sharded.units for i, p in enumerate(u.params)}


def _clear_init_flags(module: nn.Module) -> None:
    # transformers skips tensors it marked as initialised; these are fresh storage.
    for obj in [module, *module.parameters(recurse=False)]:
        if getattr(obj, "_is_hf_initialized", False):
            try:
                delattr(obj, "_is_hf_initialized")
            except AttributeError:
                pass


def _initialisers(model: nn.Module) -> Dict[int, nn.Module]:
    """id(module) -> the innermost enclosing module with an ``_init_weights`` (the
    transformers convention), so a model wrapped in e.g. a LightningModule still gets
    its own initialiser."""
    owner: Dict[int, nn.Module] = {}

    def visit(m, current):
        if hasattr(m, "_init_weights"):
            current = m
        if current is not None:
            owner[id(m)] = current
        for child in m.children():
            visit(child, current)

    visit(model, None)
    return owner


def _granules(model: nn.Module, todo: Set[int]):
    """Subtrees initialised together: each repeated block (so inits a block applies to
    its children, like GPT-2's scaled projection init, are kept), and otherwise each
    module owning parameters directly.  Memory: one block at a time."""
    from ..sharding.planner import find_unit_module_classes

    classes = set(find_unit_module_classes(model, ("auto",)))
    covered: Set[int] = set()
    out = []
    # One pass in registration order, the order eager construction draws random
    # numbers in, so deferred values equal those of a model built normally.
    for m in model.modules():
        if id(m) in covered:
            continue
        if m is not model and type(m).__name__ in classes:
            out.append(m)
            covered.update(id(x) for x in m.modules())
        elif any(id(p) in todo for p in m.parameters(recurse=False)):
            out.append(m)
            covered.add(id(m))
    return out


def _post_order(module: nn.Module):
    for child in module.children():
        yield from _post_order(child)
    yield module


def initialize_deferred(sharded, pending: Set[int], only: Optional[Set[int]] = None) -> None:
    """Initialise deferred parameters one granule at a time (see the note above).

    ``only`` restricts the work to those parameter ids (the ones a pretrained file did
    not provide); the rest of ``pending`` is left for the caller."""
    model, device = sharded.module, sharded.device
    where = _locate(sharded)
    untouched = {id(p) for p in sharded.untouched.values()}
    todo = set(pending if only is None else only)
    initialiser = _initialisers(model)
    for granule in _granules(model, todo):
        if not any(id(p) in todo for p in granule.parameters()):
            continue
        # Every parameter of the granule gets scratch storage, also those already
        # filled (e.g. from a pretrained file): an initialiser may write them all, and
        # their real storage may be a released shard.  Only ``todo`` ones are kept.
        params = list(granule.parameters())
        views = {}
        for p in params:
            views[id(p)] = p.data
            dtype = where[id(p)][0].orig_dtypes[where[id(p)][1]] if id(p) in where else sharded.orig_dtype_by_id.get(id(p), p.dtype)
            set_parameter_data(p, torch.empty(p.shape, dtype=dtype, device=device))
        with torch.no_grad():
            # Children before parents, as transformers' own apply() does.
            for m in _post_order(granule):
                own = [p for p in m.parameters(recurse=False) if id(p) in todo]
                init = initialiser.get(id(m))
                if own and not hasattr(m, "reset_parameters") and init is None:
                    raise ValueError(
                        f"cannot initialise the parameters of {type(m).__name__} built inside init_context(): it has no "
                        "reset_parameters() and no enclosing _init_weights(); pass pretrained= weights or add reset_parameters()"
                    )
                _clear_init_flags(m)
                if own and hasattr(m, "reset_parameters"):
                    m.reset_parameters()
                if init is not None:
                    init._init_weights(m)
        for p in params:
            if id(p) not in todo:
                set_parameter_data(p, views[id(p)])
                continue
            if id(p) in where:
                unit, i = where[id(p)]
                unit.params_store.write(i, p.data.reshape(-1))
                p.data = views[id(p)]
            elif id(p) in untouched:
                p.data = p.data.to(sharded.policies.precision.compute_dtype) if p.is_floating_point() else p.data
            todo.discard(id(p))
            pending.discard(id(p))
