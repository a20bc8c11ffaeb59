"""Loading pretrained safetensors weights straight into shards: each rank reads only the
rows covering the flat range it owns of each tensor (``safe_open(...).get_slice``), so
resident memory stays near (model / N + largest tensor)."""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Set

import torch

from ..sharding.param_shard import set_parameter_data
from .binding import BoundWeights
from .deferred import initialize_deferred
from .weight_files import _key_resolver, weight_files


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


def _load_bound(sharded, bound: BoundWeights, pending: Optional[Set[int]]) -> Dict[str, list]:
    """``load_pretrained`` for tensors bound to parameter objects (see :func:`bind`):
    every bound tensor is read into its parameter's shard; the parameters the
    checkpoints do not hold are initialised by the model's initialisers; parameters that
    already hold values (e.g. adapters added after loading) keep them."""
    pending = pending if pending is not None else set()
    missing = []
    for unit in sharded.units:
        for i, p in enumerate(unit.params):
            source = bound.params.get(id(p))
            if source is None:
                if id(p) in bound.initialise:
                    missing.append(unit.names[i][0])
                continue
            _write_owned_slice(unit, i, source)
            pending.discard(id(p))
    with torch.no_grad():
        for name, p in sharded.untouched.items():
            source = bound.params.get(id(p))
            if source is None:
                if id(p) in bound.initialise:
                    missing.append(name)
                continue
            if p.device.type == "meta":
                set_parameter_data(p, torch.empty(p.shape, dtype=sharded.policies.precision.compute_dtype, device=sharded.device))
            p.copy_(_read_whole(source))
            pending.discard(id(p))
        for module, attr, file, key in bound.buffers:
            module._buffers[attr].copy_(_read_whole((file, key)))
    if pending:
        initialize_deferred(sharded, pending)
    return {"missing": missing, "unexpected": list(bound.unexpected)}


def load_pretrained(sharded, path, pending: Optional[Set[int]] = None) -> Dict[str, list]:
    """Fill the sharded model's parameters from safetensors weights, each rank reading only
    what it keeps; parameters missing from the files are initialised reproducibly
    (deferred ones) or left as they are.  ``path``: a file, a directory, or a mapping
    ``{submodule name: file or directory}``, or :class:`BoundWeights` (from :func:`bind`).  Returns ``{"missing": [...], "unexpected": [...]}``."""
    if isinstance(path, BoundWeights):
        return _load_bound(sharded, path, pending)
    files = _sources(path)
    buffer_names = [n for n, _ in sharded.module.named_buffers()]
    model_names = [n for u in sharded.units for names in u.names for n in names] + list(sharded.untouched) + buffer_names
    key_of = _key_resolver(model_names, files)
    used, missing = set(), []
    not_provided: Set[int] = set()
    for unit in sharded.units:
        for i, names in enumerate(unit.names):
            key = next((key_of(n) for n in names if key_of(n) is not None), None)
            if key is None:
                missing.append(names[0])
                not_provided.add(id(unit.params[i]))
                continue
            used.add(key)
            _write_owned_slice(unit, i, files[key])
    with torch.no_grad():
        for name, p in sharded.untouched.items():
            key = key_of(name)
            if key is not None:
                if p.device.type == "meta":
                    set_parameter_data(p, torch.empty(p.shape, dtype=sharded.policies.precision.compute_dtype, device=sharded.device))
                    (pending or set()).discard(id(p))
                p.copy_(_read_whole(files[key]))
                used.add(key)
            else:
                missing.append(name)
                not_provided.add(id(p))
        for name, b in sharded.module.named_buffers():
            key = key_of(name)
            if key is not None:
                b.copy_(_read_whole(files[key]))
                used.add(key)
    if pending:
        provided = pending - not_provided
        pending -= provided
        if pending:
            initialize_deferred(sharded, pending)
    unexpected = sorted(set(files) - used)
    return {"missing": missing, "unexpected": unexpected}
