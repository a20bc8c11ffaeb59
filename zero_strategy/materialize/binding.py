"""Binding a checkpoint's tensors to a model's parameter objects (partitioned
from_pretrained): decided by name when the model is built, kept by object, resolved
against the model as it is when the engine is built."""
from __future__ import annotations

import weakref
from typing import Dict

import torch
import torch.nn as nn

from .deferred import init_context, keep_meta_on_moves
from .weight_files import _key_resolver, file_inside, weight_files


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
