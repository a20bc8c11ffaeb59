"""Consolidation: a checkpoint directory's parameters, buffers and optimizer state as
whole tensors (no process group), and ``consolidate`` into ordinary safetensors files."""
from __future__ import annotations

import functools
import os
from types import SimpleNamespace
from pathlib import Path
from typing import Dict, List, Optional

import torch

from . import files
from .files import CheckpointError
from ..dtypes import dtype_from_name, dtype_name, precision_dtype
from .safetensors_io import StreamingSafetensorsWriter

from .reader import CheckpointReader, shape_numel, saved_optimizers, saved_state
from .names import CONFIG, as_path


def load_consolidated_state_dict(directory, dtype: Optional[torch.dtype] = None) -> Dict[str, torch.Tensor]:
    """Every parameter and buffer, whole, on CPU (all names, tied ones included).

    Needs no process group; memory is the whole model, see :func:`consolidate` for the
    bounded-memory file writer.  Every file is verified first."""
    reader = CheckpointReader(directory)
    try:
        reader.verify()
        out: Dict[str, torch.Tensor] = {}
        for entry in reader.manifest["tensors"]:
            t = reader.tensor(entry).view(entry["shape"]).to(dtype or dtype_from_name(entry["dtype"]))
            for n in entry["names"]:
                out[n] = t
        for n in reader.manifest.get("buffers", []):
            out[n] = reader.shared(f"buffer.{n}")
    finally:
        reader.close()
    return out


def load_consolidated_optimizer_state(directory, optimizer: Optional[int] = None) -> Optional[dict]:
    """The optimizer state of a checkpoint in torch's own format, as the optimizer held it
    without ZeRO: ``{"state": {index: {...}}, "param_groups": [{..., "params": [...]}]}``,
    indices counting the parameters in the order they were given to the optimizer,
    state whole and shaped as the optimizer keeps it, no entry for a parameter that
    had none (frozen, never stepped).  What a DDP run's ``optimizer.state_dict()`` is, so
    it loads into a plain optimizer; ``engine.load_full_optimizer_state_dict`` takes it too.
    A checkpoint of several optimizers needs ``optimizer`` (the index) to say whose.
    None when the checkpoint has no optimizer state or was saved before the parameter
    order was recorded.  Needs no process group; every file is verified first."""
    reader = CheckpointReader(directory)
    try:
        reader.verify()
        saved = saved_optimizers(reader.manifest)
        if saved is None:
            return None
        if optimizer is None:
            if len(saved) > 1:
                raise ValueError(f"{reader.directory} holds {len(saved)} optimizers' state: pass optimizer=k, or use "
                                 "load_consolidated_optimizer_states")
            optimizer = 0
        if not 0 <= optimizer < len(saved):
            raise ValueError(f"optimizer={optimizer}: {reader.directory} holds {len(saved)} optimizer(s)' state")
        return _consolidated_optimizer(reader, saved[optimizer])
    finally:
        reader.close()


def load_consolidated_optimizer_states(directory) -> Optional[List[Optional[dict]]]:
    """:func:`load_consolidated_optimizer_state` of every optimizer in the checkpoint, in
    the engine's order (None when it holds no optimizer state)."""
    reader = CheckpointReader(directory)
    try:
        reader.verify()
        saved = saved_optimizers(reader.manifest)
        return None if saved is None else [_consolidated_optimizer(reader, entry) for entry in saved]
    finally:
        reader.close()


def _consolidated_optimizer(reader, saved: dict) -> Optional[dict]:
    if "param_names" not in saved:
        return None
    by_name = {n: e for e in reader.manifest["tensors"] for n in e["names"]}
    rank_json = functools.lru_cache(maxsize=None)(reader.rank_json)
    state, groups, index = {}, [], 0
    for names, group in zip(saved["param_names"], saved["param_groups"]):
        ids = []
        for name in names:
            entry = by_name.get(name) if name is not None else None
            if entry is not None:
                like = SimpleNamespace(shape=tuple(entry["shape"]), device=torch.device("cpu"))
                st = saved_state(reader, entry, 0, shape_numel(entry["shape"]), like, rank_json)
                if st:
                    state[index] = {k: (v.to("cpu", copy=True) if isinstance(v, torch.Tensor) else v)
                                    for k, v in st.items()}
            ids.append(index)
            index += 1
        groups.append({**group, "params": ids})
    return {"state": state, "param_groups": groups}


def _refuse_overlap(requested: Path, checkpoint: Path, out: Path) -> None:
    ck = {Path(os.path.realpath(requested)), Path(os.path.realpath(checkpoint))}
    target = Path(os.path.realpath(out))
    for c in ck:
        if target == c or c in target.parents or target in c.parents:
            where = "is" if target == c else ("lies inside" if c in target.parents else "contains")
            raise CheckpointError(
                f"consolidate refused: the output directory {out} {where} the checkpoint {requested}, and writing it "
                "would replace the sharded checkpoint. Choose an output directory outside the checkpoint; nothing was changed"
            )


def consolidate(directory, output_dir, dtype: Optional[str] = None, max_shard_bytes: int = 2 * 1024**3) -> List[Path]:
    """Write ordinary safetensors weights (plus an index when split, plus config.json
    when the checkpoint has one) that ``from_pretrained`` / ``load_state_dict`` read.

    Memory stays bounded by the largest tensor: each output file's header is computed
    from the manifest first and tensors are streamed into it one at a time.  The
    output directory is replaced only when it is empty or an export this function
    wrote; it may not be, contain or lie inside the checkpoint."""
    try:
        out_dtype = None if dtype is None else precision_dtype(dtype)
    except ValueError:
        raise ValueError(f"dtype must be one of fp32, bf16, fp16 (or None to keep each tensor's original dtype), got {dtype!r}") from None
    reader = CheckpointReader(directory)
    try:
        reader.verify()
        output_dir = as_path(output_dir)
        _refuse_overlap(Path(directory), reader.directory, output_dir)
        what = f"consolidate into {output_dir}"
        try:
            lock = files.DirectoryLock.take(output_dir, what)
        except OSError as e:
            raise CheckpointError(f"{what} failed: {type(e).__name__}: {e}") from e
        done = False
        try:
            files.prepare_target(output_dir, files.KIND_CONSOLIDATED, what)
            tmp = files.new_tmp(output_dir, files.KIND_CONSOLIDATED)
            names = _write_consolidated(reader, tmp, out_dtype, max_shard_bytes)
            files.finish_and_swap(tmp, output_dir, files.KIND_CONSOLIDATED)
            done = True
        except OSError as e:
            raise CheckpointError(f"{what} failed: {type(e).__name__}: {e}") from e
        finally:
            if not done:
                files.discard_tmp(output_dir)
            lock.release()
    finally:
        reader.close()
    return [output_dir / n for n in names]


def _write_consolidated(reader: CheckpointReader, tmp: Path, out_dtype, max_shard_bytes: int) -> List[str]:
    entries = []  # (name, manifest entry or buffer name, dtype, shape)
    for entry in reader.manifest["tensors"]:
        dt = out_dtype or dtype_from_name(entry["dtype"])
        entries.append((entry["names"][0], entry, dt, tuple(entry["shape"])))  # tied names stored once
    for n in reader.manifest.get("buffers", []):
        b = reader.shared(f"buffer.{n}")
        if b.is_floating_point():
            entries.append((n, n, out_dtype or b.dtype, tuple(b.shape)))
    # Split into files of bounded size.
    groups: List[List[tuple]] = [[]]
    size = 0
    for e in entries:
        nbytes = torch.empty((), dtype=e[2]).element_size() * shape_numel(e[3])
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += nbytes
    names = ["model.safetensors"] if len(groups) == 1 else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for fname, group in zip(names, groups):
        writer = StreamingSafetensorsWriter(tmp / fname, {e[0]: (e[2], e[3]) for e in group}, metadata={"format": "pt"})
        with writer:
            for name, src, dt, shape in group:
                t = reader.tensor(src) if isinstance(src, dict) else reader.shared(f"buffer.{src}")
                writer.write(name, t.reshape(shape).to(dt))
                weight_map[name] = fname
    if len(groups) > 1:
        total = sum(torch.empty((), dtype=e[2]).element_size() * shape_numel(e[3]) for e in entries)
        files.write_json(tmp / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    config_path = reader.directory / CONFIG
    if os.path.lexists(config_path):
        record = None if reader.table is None else reader.table.get(CONFIG)
        cfg = files.read_json(config_path, files.JSON_LIMIT if record is None else record["size"])
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{config_path} must hold an object")
        if out_dtype is not None:
            cfg["torch_dtype"] = cfg["dtype"] = dtype_name(out_dtype)
        files.write_json(tmp / CONFIG, cfg)
    return names
