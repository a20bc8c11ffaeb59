"""Sharded checkpoints: atomic directories that reload at any world size and stage.

[Note: checkpoint layout]
A checkpoint is a directory::

    manifest.json            written by rank 0, last: describes every tensor
    rank00000.safetensors    one per rank: that rank's slices (values, fp32 master,
    rank00001.safetensors    per-element optimizer state) plus scalar optimizer state
    rank00000.json           per rank: RNG states and non-tensor optimizer state
    shared.safetensors       rank 0: buffers and parameters that are not partitioned
    client_state.pt          rank 0: the caller's extra state (trainer loops, ...)
    config.json              rank 0, when the model has a transformers-style config

The manifest records, for every parameter, its qualified names (tied weights share
one entry), global shape, original dtype, frozen flag, and where it lives: the unit
index and offset inside that unit's flat space.  A unit's flat space is split into
``world`` equal shards, so "which flat range each rank holds" is ``[r*S, (r+1)*S)``
with ``S = shard_numel``.  Loading at another world size or stage therefore only needs
slice arithmetic: each rank reads, from the old shard files, exactly the ranges that
overlap its new shard (safetensors reads slices without loading whole files).

Atomicity: every rank writes into ``<dir>.tmp``; after a barrier rank 0 writes the
manifest, then swaps the directory into place.  A process killed during a save
leaves only the ``.tmp`` directory behind; the previous checkpoint is untouched.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .loss_scale import LossScaler
from .dtypes import dtype_from_name, dtype_name, precision_dtype
from .safetensors_io import StreamingSafetensorsWriter

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
CLIENT_STATE = "client_state.pt"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be used as asked; the message names the file."""


def _rank_file(d: Path, r: int, ext: str) -> Path:
    return d / f"rank{r:05d}.{ext}"


# ----------------------------------------------------------------------------------------
# save
# ----------------------------------------------------------------------------------------
def _manifest(engine) -> dict:
    from . import __version__

    cfg = engine.config
    tensors, units = [], []
    for u in engine.units:
        units.append(
            dict(index=u.index, world=u.layout.world_size, shard_numel=u.layout.shard_numel, numel=u.layout.numel,
                 group_index=u.group_index, compute_dtype=dtype_name(u.compute_dtype))
        )
        for i, names in enumerate(u.names):
            tensors.append(
                dict(names=list(names), shape=list(u.shapes[i]), dtype=dtype_name(u.orig_dtypes[i]),
                     frozen=not u.trainable, unit=u.index, offset=u.layout.offsets[i], numel=u.layout.numels[i])
            )
    for name, p in engine.untouched.items():
        tied = [n for n, q in engine.module.named_parameters(remove_duplicate=False) if q is p]
        tensors.append(dict(names=tied or [name], shape=list(p.shape), dtype=dtype_name(engine.orig_dtype_untouched[name]),
                            frozen=True, unit=None, key=f"param.{name}"))
    groups = []
    if engine.inner_optimizer is not None:
        for g in engine.inner_optimizer.param_groups:
            groups.append({k: v for k, v in g.items() if k != "params" and _jsonable(v)})
    return dict(
        format="zero_strategy.checkpoint", format_version=FORMAT_VERSION, library_version=__version__,
        world_size=engine.comm.world_size, stage=engine.policies.stage.stage, precision=cfg.precision, config=cfg.to_dict(),
        model_class=type(engine.module).__name__, tensors=tensors, units=units,
        buffers=_persistent_buffer_names(engine.module),
        optimizer=None if engine.inner_optimizer is None else dict(cls=type(engine.inner_optimizer).__name__, param_groups=groups),
        loss_scaler=engine.scaler.state_dict(), step=engine.global_step,
    )


def _persistent_buffer_names(module) -> List[str]:
    """Buffers that belong in a state dict (non-persistent ones are rebuilt at init)."""
    keys = set(module.state_dict(keep_vars=True).keys())  # no parameter data is read
    return [n for n, _ in module.named_buffers() if n in keys]


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def _rank_payload(engine) -> Tuple[Dict[str, torch.Tensor], dict]:
    tensors: Dict[str, torch.Tensor] = {}
    extra: dict = {"optimizer_scalars": {}}
    state = engine.inner_optimizer.state if engine.inner_optimizer is not None else {}
    for u in engine.units:
        tensors[f"unit{u.index}.value"] = u.params_store.local_values().detach().float().cpu()
        if not u.trainable:
            continue
        for key, v in state.get(u.optim_param, {}).items():
            if isinstance(v, torch.Tensor) and v.numel() == u.layout.shard_numel and v.dim() == 1:
                tensors[f"unit{u.index}.optim.{key}"] = v.detach().cpu()
            elif isinstance(v, torch.Tensor):
                tensors[f"unit{u.index}.optim_scalar.{key}"] = v.detach().cpu().reshape(-1).clone()
            else:
                extra["optimizer_scalars"][f"{u.index}.{key}"] = v
    extra["rng_cpu"] = torch.get_rng_state().tolist()
    if torch.cuda.is_available():
        extra["rng_cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return tensors, extra


def _write_rank_files(tmp: Path, rank: int, tensors: Dict[str, torch.Tensor], extra: dict) -> None:
    writer = StreamingSafetensorsWriter(_rank_file(tmp, rank, "safetensors"), {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()})
    with writer:
        for k, v in tensors.items():
            writer.write(k, v)
    _write_json(_rank_file(tmp, rank, "json"), extra)


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _barrier(engine) -> None:
    engine.comm.barrier()


def save_checkpoint(engine, directory, client_state: Optional[dict] = None) -> Path:
    """Write ``directory`` atomically. Collective: every rank calls it with the same path."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    rank = engine.comm.rank
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a save that was killed
        tmp.mkdir(parents=True)
    _barrier(engine)
    tensors, extra = _rank_payload(engine)
    _write_rank_files(tmp, rank, tensors, extra)
    if rank == 0:
        shared = {f"param.{n}": p.detach().cpu() for n, p in engine.untouched.items()}
        persistent = set(_persistent_buffer_names(engine.module))
        shared.update({f"buffer.{n}": b.detach().cpu() for n, b in engine.module.named_buffers() if n in persistent})
        writer = StreamingSafetensorsWriter(tmp / "shared.safetensors", {k: (v.dtype, tuple(v.shape)) for k, v in shared.items()})
        with writer:
            for k, v in shared.items():
                writer.write(k, v)
        if client_state is not None:
            with open(tmp / CLIENT_STATE, "wb") as f:
                torch.save(client_state, f)
                f.flush()
                os.fsync(f.fileno())
        config = getattr(engine.module, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            try:
                _write_json(tmp / "config.json", config.to_dict())
            except (TypeError, ValueError):
                pass  # a config that is not JSON-serialisable is simply not copied
    _barrier(engine)  # every rank's files are complete
    if rank == 0:
        _write_json(tmp / MANIFEST, _manifest(engine))
        _swap_into_place(tmp, directory)
    _barrier(engine)
    return directory


def _swap_into_place(tmp: Path, directory: Path) -> None:
    old = directory.with_name(directory.name + ".old")
    if directory.exists():
        if old.exists():
            shutil.rmtree(old)
        os.rename(directory, old)
    os.rename(tmp, directory)
    _fsync_dir(directory.parent)
    if old.exists():
        shutil.rmtree(old)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------
# read
# ----------------------------------------------------------------------------------------
class CheckpointReader:
    """Reads slices of a checkpoint directory, whatever world size wrote it."""

    def __init__(self, directory) -> None:
        directory = Path(directory)
        if not directory.exists():
            old = directory.with_name(directory.name + ".old")
            if old.exists() and (old / MANIFEST).exists():
                directory = old  # a save was interrupted between its two renames
            else:
                raise CheckpointError(f"checkpoint directory {directory} does not exist")
        self.directory = directory
        path = directory / MANIFEST
        if not path.exists():
            raise CheckpointError(f"{path} is missing: not a zero_strategy checkpoint, or its save did not finish")
        try:
            self.manifest = json.loads(path.read_text())
        except ValueError as e:
            raise CheckpointError(f"{path} is not valid JSON ({e})") from None
        m = self.manifest
        if m.get("format") != "zero_strategy.checkpoint":
            raise CheckpointError(f"{path} is not a zero_strategy checkpoint manifest")
        if m.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"{path} has format version {m.get('format_version')!r}; this library reads version {FORMAT_VERSION}")
        self.world = m["world_size"]
        self.units = {u["index"]: u for u in m["units"]}
        self._handles: Dict[str, object] = {}

    # -- files ---------------------------------------------------------------------------
    def _open(self, path: Path):
        key = str(path)
        if key not in self._handles:
            from safetensors import safe_open

            if not path.exists():
                raise CheckpointError(f"{path} is missing from the checkpoint (world size {self.world} needs one file per rank)")
            try:
                self._handles[key] = safe_open(str(path), framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors raises several types
                raise CheckpointError(f"{path} is unreadable or truncated ({e})") from None
        return self._handles[key]

    def _rank_tensor_slice(self, rank: int, key: str, lo: int, hi: int) -> torch.Tensor:
        path = _rank_file(self.directory, rank, "safetensors")
        f = self._open(path)
        try:
            return f.get_slice(key)[lo:hi]
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{path}: cannot read {key}[{lo}:{hi}] ({e})") from None

    def has_key(self, rank: int, key: str) -> bool:
        return key in self._open(_rank_file(self.directory, rank, "safetensors")).keys()

    def rank_json(self, rank: int) -> dict:
        path = _rank_file(self.directory, rank, "json")
        if not path.exists():
            raise CheckpointError(f"{path} is missing from the checkpoint")
        return json.loads(path.read_text())

    def shared(self, key: str) -> torch.Tensor:
        return self._open(self.directory / "shared.safetensors").get_tensor(key)

    # -- flat ranges -------------------------------------------------------------------------
    def read_unit_range(self, unit_index: int, suffix: str, start: int, length: int) -> torch.Tensor:
        """Elements ``[start, start+length)`` of an old unit's flat space, gathered from
        whichever old rank files hold them."""
        u = self.units[unit_index]
        s = u["shard_numel"]
        pieces, pos, end = [], start, start + length
        while pos < end:
            r = pos // s if u["world"] > 1 else 0
            lo = pos - r * s
            take = min(end - pos, s - lo)
            pieces.append(self._rank_tensor_slice(r, f"unit{unit_index}.{suffix}", lo, lo + take))
            pos += take
        return torch.cat(pieces) if len(pieces) != 1 else pieces[0]

    def tensor(self, entry: dict, suffix: str = "value") -> torch.Tensor:
        """One whole parameter (flat, float32 for values) from the checkpoint."""
        if entry["unit"] is None:
            return self.shared(entry["key"]).reshape(-1)
        return self.read_unit_range(entry["unit"], suffix, entry["offset"], entry["numel"])

    def close(self) -> None:
        self._handles.clear()


# ----------------------------------------------------------------------------------------
# load into an engine
# ----------------------------------------------------------------------------------------
def load_checkpoint(engine, directory, *, allow_reshard: bool = True, weights_only: Optional[bool] = True) -> Optional[dict]:
    """Restore ``engine`` from ``directory``; returns the saved ``client_state``.

    Works across world sizes and stages (resharding on the fly) unless
    ``allow_reshard`` is False, in which case a different world size is an error.
    ``client_state.pt`` is read with ``torch.load(weights_only=True)`` (tensors and
    plain containers only, no code runs) unless the caller passes
    ``weights_only=False`` for a file it trusts; ``None`` means True."""
    reader = CheckpointReader(directory)
    client_path = reader.directory / CLIENT_STATE
    # Read (and refuse) the caller's state before touching the engine, so a refused
    # file leaves the model as it was.
    client = load_client_state(client_path, weights_only=weights_only) if client_path.exists() else None
    m = reader.manifest
    try:
        LossScaler().load_state_dict(m["loss_scaler"])
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{reader.directory / MANIFEST}: bad loss_scaler entry ({e})") from None
    ws = engine.comm.world_size
    if not allow_reshard and (m["world_size"] != ws or m["stage"] != engine.policies.stage.stage):
        raise CheckpointError(
            f"{reader.directory} was saved at world size {m['world_size']} / stage {m['stage']} but this run has "
            f"world size {ws} / stage {engine.policies.stage.stage}; pass allow_reshard=True to reshard it on load"
        )
    by_name: Dict[str, dict] = {}
    for entry in m["tensors"]:
        for n in entry["names"]:
            by_name[n] = entry
    _check_model_matches(engine, reader, by_name)

    opt = engine.inner_optimizer
    old_optimizer = m.get("optimizer")
    restore_optimizer = opt is not None and old_optimizer is not None
    if restore_optimizer and old_optimizer["cls"] != type(opt).__name__:
        raise CheckpointError(f"{reader.directory} holds {old_optimizer['cls']} state but the optimizer is {type(opt).__name__}")
    old_rank_scalars = reader.rank_json(0).get("optimizer_scalars", {}) if restore_optimizer else {}

    for u in engine.units:
        store = u.params_store
        for i, names in enumerate(u.names):  # values: whatever part of each tensor this rank keeps
            owned = store.owned_range(i)
            if owned is not None:
                store.write(i, _read_tensor_range(reader, by_name[names[0]], *owned).to(u.device), start=owned[0])
        state_keys = _old_state_keys(reader, u, by_name) if (restore_optimizer and u.trainable) else []
        states = {k: torch.zeros(u.layout.shard_numel, dtype=torch.float32) for k in state_keys}
        scalar_src = None
        for i, t_start, s_start, length in u.layout.tensor_slices_in_shard(u.shard_index):
            entry = by_name[u.names[i][0]]
            for k in state_keys:
                if entry["unit"] is not None and reader.has_key(0, f"unit{entry['unit']}.optim.{k}"):
                    states[k][s_start : s_start + length] = reader.read_unit_range(entry["unit"], f"optim.{k}", entry["offset"] + t_start, length)
            if scalar_src is None and entry["unit"] is not None:
                scalar_src = entry["unit"]
        if restore_optimizer and u.trainable:
            st = {k: v.to(u.optim_param.device) for k, v in states.items()}
            if scalar_src is not None:
                for key in _old_scalar_keys(reader, scalar_src):
                    st[key] = reader._rank_tensor_slice(0, f"unit{scalar_src}.optim_scalar.{key}", 0, 1).reshape(()).clone()
                for k, v in old_rank_scalars.items():
                    idx, key = k.split(".", 1)
                    if int(idx) == scalar_src:
                        st[key] = v
            if st:
                opt.state[u.optim_param] = st
    with torch.no_grad():
        for name, p in engine.untouched.items():
            p.copy_(reader.tensor(by_name[name]).view(p.shape))
        buffers = dict(engine.module.named_buffers())
        for n in m.get("buffers", []):
            if n in buffers:
                buffers[n].copy_(reader.shared(f"buffer.{n}"))
    if restore_optimizer:
        for group, saved in zip(opt.param_groups, old_optimizer["param_groups"]):
            group.update(saved)
    engine.scaler.load_state_dict(m["loss_scaler"])  # validated above
    engine.global_step = m["step"]
    engine.zero_grad()
    if m["world_size"] == ws:
        rj = reader.rank_json(engine.comm.rank)
        torch.set_rng_state(torch.tensor(rj["rng_cpu"], dtype=torch.uint8))
        if "rng_cuda" in rj and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in rj["rng_cuda"]])
    reader.close()
    engine.comm.barrier()
    return client


def load_client_state(path, *, weights_only: Optional[bool] = True):
    """The caller's extra state saved beside the shards.

    Unpickling runs code named in the file, so by default only tensors, numbers,
    strings and plain containers are accepted (``torch.load(weights_only=True)``);
    a file holding anything else is refused with a CheckpointError naming it.
    ``weights_only=False`` is for files the caller trusts (its own, from a trusted run)."""
    path = Path(path)
    restricted = weights_only is None or bool(weights_only)
    try:
        return torch.load(path, map_location="cpu", weights_only=restricted)
    except pickle.UnpicklingError as e:
        if not restricted:
            raise CheckpointError(f"{path} cannot be unpickled ({e})") from None
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path} holds objects other than tensors and plain containers, so it was not unpickled "
            f"(unpickling can run code from the file: {first}). If you trust this checkpoint, load it with "
            "weights_only=False; otherwise keep only tensors, numbers, strings, lists and dicts in the state you save"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{path} is unreadable or truncated ({e})") from None


def _read_tensor_range(reader, entry: dict, start: int, end: int) -> torch.Tensor:
    """Elements ``[start, end)`` of one saved tensor (flattened), as float32."""
    if entry["unit"] is None:
        return reader.shared(entry["key"]).reshape(-1)[start:end].float()
    return reader.read_unit_range(entry["unit"], "value", entry["offset"] + start, end - start)


def _check_model_matches(engine, reader, by_name: Dict[str, dict]) -> None:
    problems = []
    for u in engine.units:
        for i, names in enumerate(u.names):
            entry = by_name.get(names[0])
            if entry is None:
                problems.append(f"{names[0]!r} is not in the checkpoint")
            elif list(entry["shape"]) != list(u.shapes[i]):
                problems.append(f"{names[0]!r} has shape {tuple(entry['shape'])} in the checkpoint, {u.shapes[i]} in the model")
    for name, p in engine.untouched.items():
        entry = by_name.get(name)
        if entry is None:
            problems.append(f"{name!r} is not in the checkpoint")
        elif list(entry["shape"]) != list(p.shape):
            problems.append(f"{name!r} has shape {tuple(entry['shape'])} in the checkpoint, {tuple(p.shape)} in the model")
    if problems:
        raise CheckpointError(
            f"{reader.directory / MANIFEST} describes a different model ({reader.manifest.get('model_class')}): "
            + "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
        )


def _old_state_keys(reader, unit, by_name) -> List[str]:
    for names in unit.names:
        entry = by_name[names[0]]
        if entry["unit"] is not None:
            prefix = f"unit{entry['unit']}.optim."
            f = reader._open(_rank_file(reader.directory, 0, "safetensors"))
            return sorted(k[len(prefix):] for k in f.keys() if k.startswith(prefix))
    return []


def _old_scalar_keys(reader, old_unit: int) -> List[str]:
    prefix = f"unit{old_unit}.optim_scalar."
    f = reader._open(_rank_file(reader.directory, 0, "safetensors"))
    return sorted(k[len(prefix):] for k in f.keys() if k.startswith(prefix))


# ----------------------------------------------------------------------------------------
# consolidation
# ----------------------------------------------------------------------------------------
def load_consolidated_state_dict(directory, dtype: Optional[torch.dtype] = None) -> Dict[str, torch.Tensor]:
    """Every parameter and buffer, whole, on CPU (all names, tied ones included).

    Needs no process group; memory is the whole model, see :func:`consolidate` for the
    bounded-memory file writer."""
    reader = CheckpointReader(directory)
    out: Dict[str, torch.Tensor] = {}
    for entry in reader.manifest["tensors"]:
        t = reader.tensor(entry).view(entry["shape"]).to(dtype or dtype_from_name(entry["dtype"]))
        for n in entry["names"]:
            out[n] = t
    for n in reader.manifest.get("buffers", []):
        out[n] = reader.shared(f"buffer.{n}")
    reader.close()
    return out


def consolidate(directory, output_dir, dtype: Optional[str] = None, max_shard_bytes: int = 2 * 1024**3) -> List[Path]:
    """Write ordinary safetensors weights (plus an index when split, plus config.json
    when the checkpoint has one) that ``from_pretrained`` / ``load_state_dict`` read.

    Memory stays bounded by the largest tensor: each output file's header is computed
    from the manifest first and tensors are streamed into it one at a time."""
    reader = CheckpointReader(directory)
    output_dir = Path(output_dir)
    try:
        out_dtype = None if dtype is None else precision_dtype(dtype)
    except ValueError:
        raise ValueError(f"dtype must be one of fp32, bf16, fp16 (or None to keep each tensor's original dtype), got {dtype!r}") from None
    entries = []  # (name, manifest entry or buffer name, dtype, shape)
    for entry in reader.manifest["tensors"]:
        dt = out_dtype or dtype_from_name(entry["dtype"])
        entries.append((entry["names"][0], entry, dt, tuple(entry["shape"])))  # tied names stored once
    for n in reader.manifest.get("buffers", []):
        b = reader.shared(f"buffer.{n}")
        if b.is_floating_point():
            entries.append((n, n, out_dtype or b.dtype, tuple(b.shape)))
    # Split into files of bounded size.
    files: List[List[tuple]] = [[]]
    size = 0
    for e in entries:
        nbytes = torch.empty((), dtype=e[2]).element_size() * _prod(e[3])
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(e)
        size += nbytes
    tmp = output_dir.with_name(output_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    names = ["model.safetensors"] if len(files) == 1 else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    weight_map = {}
    for fname, group in zip(names, files):
        writer = StreamingSafetensorsWriter(tmp / fname, {e[0]: (e[2], e[3]) for e in group}, metadata={"format": "pt"})
        with writer:
            for name, src, dt, shape in group:
                t = reader.tensor(src) if isinstance(src, dict) else reader.shared(f"buffer.{src}")
                writer.write(name, t.reshape(shape).to(dt))
                weight_map[name] = fname
    if len(files) > 1:
        total = sum(torch.empty((), dtype=e[2]).element_size() * _prod(e[3]) for e in entries)
        _write_json(tmp / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    if (reader.directory / "config.json").exists():
        cfg = json.loads((reader.directory / "config.json").read_text())
        if out_dtype is not None:
            cfg["torch_dtype"] = cfg["dtype"] = dtype_name(out_dtype)
        _write_json(tmp / "config.json", cfg)
    reader.close()
    _swap_into_place(tmp, output_dir)
    return [output_dir / n for n in names]


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
