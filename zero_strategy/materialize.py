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
import json
import os
import types
import weakref
from pathlib import Path
from typing import Callable, Dict, Iterator, Mapping, Optional, Set

import torch
import torch.nn as nn

from .param_shard import set_parameter_data


@contextlib.contextmanager
def init_context() -> Iterator[None]:
    """Parameters created inside are placed on the meta device; pass the model to
    ``zero_strategy.initialize`` to materialise them partitioned."""
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
    try:
        yield
    finally:
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


def _locate(engine) -> Dict[int, tuple]:
    return {id(p): (u, i) for u in engine.units for i, p in enumerate(u.params)}


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
    from .planner import find_unit_module_classes

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


def initialize_deferred(engine, pending: Set[int], only: Optional[Set[int]] = None) -> None:
    """Initialise deferred parameters one granule at a time (see the note above).

    ``only`` restricts the work to those parameter ids (the ones a pretrained file did
    not provide); the rest of ``pending`` is left for the caller."""
    model, device = engine.module, engine.device
    where = _locate(engine)
    untouched = {id(p) for p in engine.untouched.values()}
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
            dtype = where[id(p)][0].orig_dtypes[where[id(p)][1]] if id(p) in where else engine.orig_dtype_by_id.get(id(p), p.dtype)
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
                p.data = p.data.to(engine.policies.precision.compute_dtype) if p.is_floating_point() else p.data
            todo.discard(id(p))
            pending.discard(id(p))


# ----------------------------------------------------------------------------------------
# loading pretrained weights straight into shards
# ----------------------------------------------------------------------------------------
def weight_files(path) -> Dict[str, Path]:
    """name -> safetensors file, for a file, or a directory with one file or an index
    (``model.safetensors.index.json``; its file names may not lead outside the folder)."""
    path = Path(path)
    if path.is_file():
        files = [path]
    else:
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {k: file_inside(path, v, index) for k, v in weight_map.items()}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors weights in {path} (looked for model.safetensors or an index)")
    from safetensors import safe_open

    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = f
    return out


def file_inside(folder: Path, name, named_in: Path) -> Path:
    """``folder / name`` for a file name read from ``named_in`` (an index), refusing
    anything that would lead outside ``folder``: absolute paths, ``..``, links out."""
    if not isinstance(name, str) or not name or os.path.isabs(name):
        raise ValueError(f"{named_in} names the weight file {name!r}: only a file inside {folder} is accepted")
    root = Path(folder).resolve()
    target = (root / name).resolve()
    if target != root and root not in target.parents:
        raise ValueError(f"{named_in} names the weight file {name!r}, which lies outside {folder}; refusing to read it")
    return target


def _read_flat_range(handle, key: str, start: int, end: int) -> torch.Tensor:
    """Elements ``[start, end)`` of a tensor's flattened view, reading only the rows
    (first-dimension slices) that cover them."""
    sl = handle.get_slice(key)
    shape = sl.get_shape()
    if len(shape) == 0:
        return handle.get_tensor(key).reshape(-1)[start:end]
    row = 1
    for d in shape[1:]:
        row *= d
    r0, r1 = start // row, -(-end // row)
    block = sl[r0:r1].reshape(-1)
    return block[start - r0 * row : end - r0 * row]


def _key_resolver(model_names, file_keys) -> Callable[[str], Optional[str]]:
    """name in the model -> key in the files.  Keys normally match; a checkpoint saved from
    the model's inner module (keys without the model's first name component, e.g. a
    causal-LM head model loading a base-model checkpoint) or from a wrapper (keys with one
    extra leading component) is matched by that one prefix."""
    def exact(n):
        return n if n in file_keys else None

    if any(n in file_keys for n in model_names):
        return exact
    for n in model_names:
        head, _, rest = n.partition(".")
        if rest and rest in file_keys:
            strip = head + "."
            return lambda n: exact(n[len(strip):]) if n.startswith(strip) else None
    for head in sorted({k.partition(".")[0] for k in file_keys if "." in k}):
        if any(f"{head}.{n}" in file_keys for n in model_names):
            return lambda n: exact(f"{head}.{n}")
    return exact


def _sources(path) -> Dict[str, tuple]:
    """name (as the model would call it) -> (file, key in the file).  ``path`` is one
    checkpoint, or a mapping ``{submodule name: checkpoint}`` for models that hold
    pretrained submodules (``{"backbone": dir}`` loads ``dir``'s keys as ``backbone.*``)."""
    if isinstance(path, Mapping):
        out: Dict[str, tuple] = {}
        for prefix, one in path.items():
            lead = f"{prefix}." if prefix else ""
            out.update({lead + k: (f, k) for k, f in weight_files(one).items()})
        return out
    return {k: (f, k) for k, f in weight_files(path).items()}


def _write_owned_slice(unit, i, source) -> None:
    """Read this rank's flat range of parameter ``i`` of ``unit`` from ``source`` (file, key)."""
    from safetensors import safe_open

    owned = unit.params_store.owned_range(i)
    if owned is None:
        return
    a, b = owned
    # A fresh memory map per tensor: pages of a map stay resident (and count as this
    # process's memory) until it is closed, so one long-lived map per file would grow
    # to the whole file as its tensors are read.
    with safe_open(str(source[0]), framework="pt") as h:
        values = _read_flat_range(h, source[1], a, b).clone()
    if values.numel() != b - a:
        raise ValueError(f"{source[0]}: {source[1]} has {values.numel()} elements in [{a}, {b}), expected {b - a}; shape mismatch?")
    unit.params_store.write(i, values.to(torch.float32), start=a)


def _read_whole(source) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(source[0]), framework="pt") as h:
        return h.get_tensor(source[1])


def _load_bound(engine, bound: BoundWeights, pending: Optional[Set[int]]) -> Dict[str, list]:
    """``load_pretrained`` for tensors bound to parameter objects (see :func:`bind`):
    every bound tensor is read into its parameter's shard; the parameters the
    checkpoints do not hold are initialised by the model's initialisers; parameters that
    already hold values (e.g. adapters added after loading) keep them."""
    pending = pending if pending is not None else set()
    missing = []
    for unit in engine.units:
        for i, p in enumerate(unit.params):
            source = bound.params.get(id(p))
            if source is None:
                if id(p) in bound.initialise:
                    missing.append(unit.names[i][0])
                continue
            _write_owned_slice(unit, i, source)
            pending.discard(id(p))
    with torch.no_grad():
        for name, p in engine.untouched.items():
            source = bound.params.get(id(p))
            if source is None:
                if id(p) in bound.initialise:
                    missing.append(name)
                continue
            if p.device.type == "meta":
                set_parameter_data(p, torch.empty(p.shape, dtype=engine.policies.precision.compute_dtype, device=engine.device))
            p.copy_(_read_whole(source))
            pending.discard(id(p))
        for module, attr, file, key in bound.buffers:
            module._buffers[attr].copy_(_read_whole((file, key)))
    if pending:
        initialize_deferred(engine, pending)
    return {"missing": missing, "unexpected": list(bound.unexpected)}


def load_pretrained(engine, path, pending: Optional[Set[int]] = None) -> Dict[str, list]:
    """Fill the engine's parameters from safetensors weights, each rank reading only
    what it keeps; parameters missing from the files are initialised reproducibly
    (deferred ones) or left as they are.  ``path``: a file, a directory, or a mapping
    ``{submodule name: file or directory}``, or :class:`BoundWeights` (from :func:`bind`).  Returns ``{"missing": [...], "unexpected": [...]}``."""
    if isinstance(path, BoundWeights):
        return _load_bound(engine, path, pending)
    files = _sources(path)
    buffer_names = [n for n, _ in engine.module.named_buffers()]
    model_names = [n for u in engine.units for names in u.names for n in names] + list(engine.untouched) + buffer_names
    key_of = _key_resolver(model_names, files)
    used, missing = set(), []
    not_provided: Set[int] = set()
    for unit in engine.units:
        for i, names in enumerate(unit.names):
            key = next((key_of(n) for n in names if key_of(n) is not None), None)
            if key is None:
                missing.append(names[0])
                not_provided.add(id(unit.params[i]))
                continue
            used.add(key)
            _write_owned_slice(unit, i, files[key])
    with torch.no_grad():
        for name, p in engine.untouched.items():
            key = key_of(name)
            if key is not None:
                if p.device.type == "meta":
                    set_parameter_data(p, torch.empty(p.shape, dtype=engine.policies.precision.compute_dtype, device=engine.device))
                    (pending or set()).discard(id(p))
                p.copy_(_read_whole(files[key]))
                used.add(key)
            else:
                missing.append(name)
                not_provided.add(id(p))
        for name, b in engine.module.named_buffers():
            key = key_of(name)
            if key is not None:
                b.copy_(_read_whole(files[key]))
                used.add(key)
    if pending:
        provided = pending - not_provided
        pending -= provided
        if pending:
            initialize_deferred(engine, pending)
    unexpected = sorted(set(files) - used)
    return {"missing": missing, "unexpected": unexpected}


# ----------------------------------------------------------------------------------------
# binding checkpoint tensors to parameter objects (partitioned from_pretrained)
# ----------------------------------------------------------------------------------------
class CheckpointBinding:
    """Which tensor of a checkpoint fills which parameter or buffer of a model.

    Decided by name when the model is built, before anything wraps it, and kept by
    object (module and attribute): a wrapper that renames modules afterwards (PEFT's
    ``q_proj`` -> ``q_proj.base_layer``, a LightningModule holding the model) does not
    change which tensor goes where.  :func:`bind` then checks, at engine time, that
    every bound tensor still has its parameter and that no parameter lost its values."""

    def __init__(self, model: nn.Module, folder, ignore_mismatched_sizes: bool = False,
                 ignore_unexpected=(), ignore_missing=()) -> None:
        import re

        from safetensors import safe_open

        self.folder = str(folder)
        self.files = weight_files(folder)
        shapes = {}
        for f in sorted(set(self.files.values())):  # headers only: no tensor data is read
            with safe_open(str(f), framework="pt") as h:
                for key in h.keys():
                    if self.files.get(key) == f:
                        shapes[key] = tuple(h.get_slice(key).get_shape())
        owners: Dict[int, list] = {}  # id(tensor) -> [(module, attribute, full name)], aliases of tied tensors
        tensors: Dict[int, torch.Tensor] = {}
        for prefix, module in model.named_modules(remove_duplicate=False):
            lead = f"{prefix}." if prefix else ""
            persistent = [(n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set]
            for attr, t in [*module._parameters.items(), *persistent]:
                if t is not None:
                    owners.setdefault(id(t), []).append((module, attr, lead + attr))
                    tensors[id(t)] = t
        key_of = _key_resolver([n for aliases in owners.values() for _, _, n in aliases], self.files)
        self.entries = []  # (module ref, attribute, key, name)
        self.missing: list = []  # names the checkpoint does not hold (initialised by the model, as from_pretrained does)
        self.mismatched: list = []  # (name, checkpoint shape, model shape)
        self._missing_refs = []
        used = set()
        for tid, aliases in owners.items():
            found = next(((m, a, n, key_of(n)) for m, a, n in aliases if key_of(n) is not None), None)
            shape = tuple(tensors[tid].shape)
            if found is not None and shapes[found[3]] != shape:
                module, attr, name, key = found
                used.add(key)
                if not ignore_mismatched_sizes:
                    raise ValueError(
                        f"{self.folder}: {key} has shape {list(shapes[key])} but {name} of {type(model).__name__} has "
                        f"shape {list(shape)}; pass ignore_mismatched_sizes=True to from_pretrained to initialise it instead"
                    )
                self.mismatched.append((name, torch.Size(shapes[key]), torch.Size(shape)))
                found = None
            if found is None:
                module, attr, name = aliases[0]
                if isinstance(tensors[tid], nn.Parameter):
                    self._missing_refs.append((weakref.ref(module), attr))
                if not any(re.search(p, name) for p in ignore_missing) and not any(name == m[0] for m in self.mismatched):
                    self.missing.append(name)
                continue
            module, attr, name, key = found
            used.add(key)
            self.entries.append((weakref.ref(module), attr, key, name))
        self.unexpected = sorted(k for k in set(self.files) - used if not any(re.search(p, k) for p in ignore_unexpected))

    def loading_info(self) -> dict:
        """What ``from_pretrained(..., output_loading_info=True)`` returns next to the model."""
        return {"missing_keys": set(self.missing), "unexpected_keys": set(self.unexpected),
                "mismatched_keys": set(self.mismatched), "error_msgs": []}


class BoundWeights:
    """The bindings of the pretrained models inside one model, resolved to its current
    parameter objects; what ``initialize(pretrained=...)`` receives from the integrations."""

    def __init__(self, params, buffers, initialise, unexpected, folders) -> None:
        self.params = params  # id(parameter) -> (file, key, name)
        self.buffers = buffers  # [(module, attribute, file, key)]
        self.initialise = initialise  # ids of parameters the checkpoints do not hold
        self.unexpected = unexpected
        self.folders = folders


def bind(root: nn.Module, bindings) -> BoundWeights:
    """Resolve ``bindings`` (CheckpointBinding objects of models inside ``root``) against
    ``root`` as it is now.  Raises, naming them, if a bound checkpoint tensor no longer
    has a parameter or buffer inside ``root`` (a wrapper replaced it), or if a parameter
    of ``root`` is on the meta device with no known values: not bound, not missing from
    a checkpoint, and not created inside :func:`init_context` (it was copied or moved to
    the meta device afterwards, so no values exist for it).  Nothing is ever left silently random."""
    live_params = {id(p) for p in root.parameters()}
    live = live_params | {id(b) for b in root.buffers()}
    params, buffers, initialise, unexpected, lost = {}, [], set(), [], []
    for binding in bindings:
        for ref, attr, key, name in binding.entries:
            module = ref()
            tensor = None if module is None else (module._parameters.get(attr) if attr in module._parameters else module._buffers.get(attr))
            if tensor is None or id(tensor) not in live:
                lost.append(f"{key} (was {name})")
            elif attr in module._parameters:
                params[id(tensor)] = (binding.files[key], key, name)
            else:
                buffers.append((module, attr, binding.files[key], key))
        for ref, attr in binding._missing_refs:
            module = ref()
            p = None if module is None else module._parameters.get(attr)
            if p is not None and id(p) in live_params:
                initialise.add(id(p))
        unexpected += binding.unexpected
    names = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    unknown = [names[id(p)] for p in root.parameters()
               if p.device.type == "meta" and id(p) not in params and id(p) not in initialise
               and not getattr(p, "_zero_deferred", False)]
    if lost or unknown:
        folders = ", ".join(sorted({b.folder for b in bindings}))
        parts = []
        if lost:
            parts.append(f"{len(lost)} checkpoint tensor(s) in {folders} no longer have their parameter in "
                         f"{type(root).__name__} (a wrapper replaced the module or parameter after from_pretrained): "
                         + ", ".join(lost[:20]) + (" ..." if len(lost) > 20 else ""))
        if unknown:
            parts.append(f"{len(unknown)} parameter(s) of {type(root).__name__} are on the meta device with no values to "
                         "load or initialise (created on, copied on or moved to the meta device after from_pretrained, "
                         "e.g. a deepcopy of a meta module: no values exist for them): " + ", ".join(unknown[:20]) + (" ..." if len(unknown) > 20 else ""))
        raise ValueError("partitioned loading refused, nothing would be loaded exactly: " + "; ".join(parts)
                         + ". Build the model's wrappers so that they keep the parameters from_pretrained created, "
                         "or load without zero3_init_flag")
    return BoundWeights(params, buffers, initialise, unexpected, sorted({b.folder for b in bindings}))


# The public names (adapters use only these; docs/architecture.md, "The public surface").
__all__ = ["BoundWeights", "CheckpointBinding", "bind", "file_inside", "init_context", "keep_meta_on_moves", "weight_files"]
