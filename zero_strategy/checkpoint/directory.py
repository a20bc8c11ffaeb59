"""Sharded checkpoints: atomic directories that reload at any world size and stage.

[Note: checkpoint layout]
A checkpoint is a directory::

    .zero_strategy           written first: marks the directory as ours (files.py)
    manifest.json            written by rank 0, last: describes every tensor and file
    rank00000.safetensors    one per rank: that rank's slices (values, fp32 master,
    rank00001.safetensors    per-element optimizer state) plus per-parameter scalar
                             optimizer state and which parameters have state at all
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

[Note: integrity]
The manifest (format version 2) lists every file with its size and CRC-32, computed
while the file streams out, and a random ``checkpoint_id`` of the save.  Each rank
file's safetensors header (and its JSON sidecar) records its rank, the world size,
the checkpoint id and the layout digest ([Note: layout digest] in
manifest.py).  Loading validates the manifest's structure and arithmetic
before opening anything else, then verifies every file (each by one rank, round robin)
before the engine is touched: renamed, swapped, mixed-in, truncated or flipped files
and edited layouts are CheckpointErrors naming the file, on every rank.

Atomicity: every rank writes into ``<dir>.tmp`` (after rank 0 took ``<dir>.lock``);
after every rank's files are complete rank 0 writes the manifest, then swaps the
directory into place.  A process killed during a save leaves only the ``.tmp``
directory behind; the previous checkpoint is untouched.  Each phase ends with an
agreement of all ranks ([Note: every rank fails together] in agreement.py).
"""
from __future__ import annotations

import functools
import json
import os
import pickle
import re
import secrets
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from ..offload.disk_offload import is_offload_directory
from . import files as files
from .files import CheckpointError
from .files import existing as existing_checkpoint
from .manifest import FORMAT, FORMAT_VERSION, layout_digest, rank_file_names, validate
from ..dtypes import dtype_from_name, dtype_name, precision_dtype
from .safetensors_io import StreamingSafetensorsWriter

MANIFEST = files.MANIFEST
CLIENT_STATE = "client_state.pt"
SHARED = "shared.safetensors"
CONFIG = "config.json"
_KEY = re.compile(r"^unit(\d+)\.(value|optim\.(.+)|optim_scalar\.(.+)|optim_present|whole_present|whole(\d+)\.(.+))$")

__all__ = ["CheckpointError", "CheckpointReader", "FORMAT_VERSION", "consolidate", "existing_checkpoint", "load_checkpoint",
           "load_client_state", "load_consolidated_optimizer_state", "load_consolidated_optimizer_states",
           "load_consolidated_state_dict", "save_checkpoint"]


def _agree(comm, what: str, error, **kwargs):
    # A checkpoint operation's phase ends with every rank agreeing on its success.
    return comm.agree(what, error, error_type=CheckpointError, **kwargs)


def _rank_file(d: Path, r: int, ext: str) -> Path:
    return d / f"rank{r:05d}.{ext}"


def _as_path(directory) -> Path:
    """An absolute path (not resolved through links), compared across ranks."""
    return Path(os.path.abspath(os.fspath(directory)))


# ----------------------------------------------------------------------------------------
# save
# ----------------------------------------------------------------------------------------
def _layout(engine) -> Tuple[list, list]:
    """The manifest's ``units`` and ``tensors``: where every parameter lives."""
    tensors, units = [], []
    for u in engine.units:
        units.append(
            dict(index=u.index, world=u.layout.world_size, shard_numel=u.layout.shard_numel, numel=u.layout.numel,
                 group_index=u.group_index, compute_dtype=dtype_name(u.compute_dtype))
        )
        for i, names in enumerate(u.names):
            tensors.append(
                dict(names=list(names), shape=[int(s) for s in u.shapes[i]], dtype=dtype_name(u.orig_dtypes[i]),
                     frozen=not u.trainable, unit=u.index, offset=u.layout.offsets[i], numel=u.layout.numels[i])
            )
    for name, p in engine.untouched.items():
        tied = [n for n, q in engine.module.named_parameters(remove_duplicate=False) if q is p]
        tensors.append(dict(names=tied or [name], shape=[int(s) for s in p.shape], dtype=dtype_name(engine.orig_dtype_untouched[name]),
                            frozen=True, unit=None, key=f"param.{name}"))
    return units, tensors


def _manifest(engine, units: list, tensors: list, checkpoint_id: str, table: dict) -> dict:
    from .._version import __version__

    cfg = engine.config
    saved = [_optimizer_entry(engine, k) for k in range(len(engine.inner_optimizers))]
    # One optimizer: "optimizer" (as every earlier version wrote it); several: "optimizers".
    optimizers = dict(optimizer=saved[0] if saved else None) if len(saved) <= 1 else dict(optimizer=None, optimizers=saved)
    return dict(
        format=FORMAT, format_version=FORMAT_VERSION, library_version=__version__, checkpoint_id=checkpoint_id,
        world_size=engine.comm.world_size, stage=engine.policies.stage.stage, precision=cfg.precision, config=cfg.to_dict(),
        model_class=type(engine.module).__name__, tensors=tensors, units=units,
        buffers=_persistent_buffer_names(engine.module),
        **optimizers,
        loss_scaler=engine.scaler.state_dict(), step=engine.global_step, checksum="crc32", files=table,
    )


def _optimizer_entry(engine, k: int) -> dict:
    opt = engine.inner_optimizers[k]
    return dict(
        cls=type(opt).__name__,
        param_groups=[{key: v for key, v in g.items() if key != "params" and _jsonable(v)} for g in opt.param_groups],
        # Each optimizer parameter's first name, in the order the user gave them (None:
        # not partitioned by ZeRO), so the state can be consolidated in torch's format.
        param_names=[[None if place is None else _unit_of(engine, place[0]).names[place[1]][0] for place in group]
                     for group in engine.param_places_of(k)],
    )


def saved_optimizers(manifest: dict) -> Optional[List[dict]]:
    """The manifest's optimizer entries, one per optimizer (None: saved without one)."""
    if manifest.get("optimizers") is not None:
        return manifest["optimizers"]
    return None if manifest.get("optimizer") is None else [manifest["optimizer"]]


def _unit_of(engine, index: int):
    return next(u for u in engine.units if u.index == index)


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
    """This rank's file: values, then the optimizer state of every parameter piece it
    holds ([Note: one optimizer tensor per parameter] in flat_unit.py).  Per-element state
    is laid out in the unit's flat shard space (resharding is slice arithmetic); scalar
    state (e.g. Adam's step) is one entry per parameter position in the unit, and
    ``optim_present`` says which parameters have state (one never stepped has none)."""
    tensors: Dict[str, torch.Tensor] = {}
    extra: dict = {"optimizer_scalars": {}}
    for u in engine.units:
        tensors[f"unit{u.index}.value"] = u.params_store.local_values().detach().float().cpu()
        if not u.trainable or not engine.inner_optimizers:
            continue
        opt = engine.inner_optimizers[u.optimizer_index]
        state = opt.state
        n = len(u.params)
        if u.whole_params is not None:
            _whole_payload(u, state, tensors, extra)
            continue
        present = torch.zeros(n, dtype=torch.uint8)
        elements: Dict[str, torch.Tensor] = {}
        scalars: Dict[str, torch.Tensor] = {}
        for t, (i, s_start, length) in zip(u.optim_params, u.optim_slices):
            st = state.get(t, {})
            if st:
                present[i] = 1
            for key, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) == tuple(t.shape):
                    if key not in elements:
                        elements[key] = torch.zeros(u.layout.shard_numel, dtype=v.dtype)
                    elements[key][s_start : s_start + length] = v.detach().reshape(-1).cpu()
                elif isinstance(v, torch.Tensor) and v.dim() == 0:
                    if key not in scalars:
                        scalars[key] = torch.zeros(n, dtype=v.dtype)
                    scalars[key][i] = v.detach().cpu()
                elif isinstance(v, torch.Tensor):
                    raise CheckpointError(
                        f"optimizer state {key!r} of {u.names[i][0]} has shape {tuple(v.shape)}: neither one value per "
                        f"element (shape {tuple(t.shape)}) nor a scalar, so it cannot be sharded and resharded; "
                        f"{type(opt).__name__} is not supported by sharded checkpoints"
                    )
                else:
                    extra["optimizer_scalars"][f"{u.index}.{i}.{key}"] = v
        tensors[f"unit{u.index}.optim_present"] = present
        for key, v in elements.items():
            tensors[f"unit{u.index}.optim.{key}"] = v
        for key, v in scalars.items():
            tensors[f"unit{u.index}.optim_scalar.{key}"] = v
    extra["rng_cpu"] = torch.get_rng_state().tolist()
    if torch.cuda.is_available():
        extra["rng_cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return tensors, extra


def _whole_payload(u, state, tensors: Dict[str, torch.Tensor], extra: dict) -> None:
    """A whole-parameter optimizer's state ([Note: whole-parameter optimizers] in
    whole_params.py): each owner writes its parameters' state whole, any shape, as
    ``unit<u>.whole<i>.<key>``; ``whole_present`` marks the positions it owns with state."""
    present = torch.zeros(len(u.params), dtype=torch.uint8)
    for t, i in zip(u.optim_params, u.optim_positions):
        st = state.get(t, {})
        if not st:
            continue
        present[i] = 1
        for key, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"unit{u.index}.whole{i}.{key}"] = v.detach().cpu().contiguous()
            else:
                extra["optimizer_scalars"][f"{u.index}.{i}.{key}"] = v
    tensors[f"unit{u.index}.whole_present"] = present


def _header_identity(kind: str, identity: dict) -> Dict[str, str]:
    meta = {"format": "pt", "zero_strategy.file": kind, "zero_strategy.checkpoint_id": identity["checkpoint_id"],
            "zero_strategy.world_size": str(identity["world_size"]), "zero_strategy.layout": identity["layout"]}
    if kind == "rank":
        meta["zero_strategy.rank"] = str(identity["rank"])
    return meta


def _write_safetensors(path: Path, tensors: Dict[str, torch.Tensor], metadata: Dict[str, str]) -> dict:
    writer = StreamingSafetensorsWriter(path, {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()},
                                        metadata=metadata, checksum=True)
    with writer:
        for k, v in tensors.items():
            writer.write(k, v)
    return {"size": writer.size, "crc32": writer.crc32}


def _write_rank_files(tmp: Path, rank: int, tensors: Dict[str, torch.Tensor], extra: dict) -> Dict[str, dict]:
    """This rank's two files; ``extra["identity"]`` says whose they are.  Returns their
    ``{name: {"size", "crc32", "rank"}}`` records for the manifest."""
    identity = extra["identity"]
    st = _rank_file(tmp, rank, "safetensors")
    records = {st.name: _write_safetensors(st, tensors, _header_identity("rank", identity))}
    js = _rank_file(tmp, rank, "json")
    records[js.name] = files.write_json(js, extra)
    for r in records.values():
        r["rank"] = rank
    return records


def _write_rank0_files(engine, tmp: Path, client_state: Optional[dict], identity: dict) -> Dict[str, dict]:
    shared = {f"param.{n}": p.detach().cpu() for n, p in engine.untouched.items()}
    persistent = set(_persistent_buffer_names(engine.module))
    shared.update({f"buffer.{n}": b.detach().cpu() for n, b in engine.module.named_buffers() if n in persistent})
    records = {SHARED: _write_safetensors(tmp / SHARED, shared, _header_identity("shared", identity))}
    if client_state is not None:
        with files.ChecksumFile(tmp / CLIENT_STATE) as f:
            torch.save(client_state, f)
        records[CLIENT_STATE] = f.record()
    config = getattr(engine.module, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        try:
            blob = json.dumps(config.to_dict()).encode()
        except (TypeError, ValueError):
            blob = None  # a config that is not JSON-serialisable is simply not copied
        if blob is not None:
            records[CONFIG] = files.write_bytes(tmp / CONFIG, blob)
    return records


def save_checkpoint(engine, directory, client_state: Optional[dict] = None) -> Path:
    """Write ``directory`` atomically. Collective: every rank calls it with the same path.

    Replaces ``directory`` only when it is a checkpoint this library wrote (or empty);
    any error, on any rank, is raised on every rank (CheckpointError)."""
    comm = engine.comm
    rank, ws = comm.rank, comm.world_size
    error, path, digest, units, tensors = None, None, "", [], []
    try:
        path = _as_path(directory)
        units, tensors = _layout(engine)
        digest = layout_digest(ws, units, tensors)
    except Exception as e:  # noqa: BLE001 - agreed below, raised on every rank
        error = e
    _agree(comm, "save_checkpoint", error, same={"path": str(path), "model layout": digest})
    what = f"save_checkpoint({path})"

    lock, done = None, False
    try:
        # 1. rank 0: the lock, the target checked, a fresh .tmp; it proposes the id.
        error, proposed = None, [0, 0]
        if rank == 0:
            try:
                lock = files.DirectoryLock.take(path, what)
                files.prepare_target(path, files.KIND_CHECKPOINT, what)
                files.new_tmp(path, files.KIND_CHECKPOINT)
                proposed = [secrets.randbits(62), secrets.randbits(62)]
            except Exception as e:  # noqa: BLE001
                error = e
        hi, lo = _agree(comm, what, error, proposed=proposed)
        identity = dict(rank=rank, world_size=ws, checkpoint_id=f"{hi:016x}{lo:016x}", layout=digest)
        tmp = files.sibling(path, ".tmp")

        # 2. every rank: its files.
        error, records = None, {}
        try:
            payload, extra = _rank_payload(engine)
            extra["identity"] = identity
            records = dict(_write_rank_files(tmp, rank, payload, extra) or {})
            if rank == 0:
                records.update(_write_rank0_files(engine, tmp, client_state, identity))
        except Exception as e:  # noqa: BLE001
            error = e
        _agree(comm, what, error)
        everyone = comm.all_gather_object(records, label=f"{what}: file checksums")

        # 3. rank 0: the manifest, then the swap; the lock is released before the
        # ranks agree, so it is gone wherever save_checkpoint has returned.
        error = None
        if rank == 0:
            try:
                table = {}
                for r in everyone:
                    table.update(r)
                files.write_json(tmp / MANIFEST, _manifest(engine, units, tensors, identity["checkpoint_id"], table))
                files.finish_and_swap(tmp, path, files.KIND_CHECKPOINT)
                done = True
            except Exception as e:  # noqa: BLE001
                error = e
            finally:
                if not done:
                    files.discard_tmp(path)
                lock.release()
                lock = None
        _agree(comm, what, error)
    finally:
        if lock is not None:
            if not done:
                files.discard_tmp(path)
            lock.release()
    return Path(directory)


# ----------------------------------------------------------------------------------------
# read
# ----------------------------------------------------------------------------------------
class CheckpointReader:
    """Reads slices of a checkpoint directory, whatever world size wrote it.

    The manifest is validated on construction; :meth:`verify` checks the files."""

    def __init__(self, directory) -> None:
        requested = Path(directory)
        found = files.existing(requested)
        if found is None:
            raise CheckpointError(f"checkpoint directory {requested} does not exist")
        self.directory = found  # ``<dir>.old`` when a save was interrupted between its two renames
        path = found / MANIFEST
        self.manifest_path = path
        if not path.is_file():
            if is_offload_directory(found):
                raise CheckpointError(f"{found} is a disk-offload directory of a running (or killed) engine "
                                      "(nvme_path), not a checkpoint: pass the directory given to save_checkpoint")
            raise CheckpointError(f"{path} is missing: not a zero_strategy checkpoint, or its save did not finish")
        try:
            self.manifest = json.loads(path.read_bytes())
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} is not valid JSON ({e})") from None
        except OSError as e:
            raise CheckpointError(f"{path} cannot be read ({e})") from None
        validate(self.manifest, path)
        m = self.manifest
        self.version = m["format_version"]
        self.world = m["world_size"]
        self.units = {u["index"]: u for u in m["units"]}
        # Each partitioned tensor's position inside its unit (the manifest lists them in order).
        self.params_in_unit: Dict[int, int] = {}
        self.position: Dict[int, int] = {}  # id(entry) -> position
        for entry in m["tensors"]:
            if entry["unit"] is not None:
                self.position[id(entry)] = self.params_in_unit.get(entry["unit"], 0)
                self.params_in_unit[entry["unit"]] = self.position[id(entry)] + 1
        self.digest = layout_digest(self.world, m["units"], m["tensors"])
        self.table: Optional[dict] = m.get("files") if self.version >= 2 else None
        self._handles: Dict[str, object] = {}
        self._key_sets: Dict[int, frozenset] = {}
        if self.version < 2:
            warnings.warn(
                f"{path} is a format-version-{self.version} checkpoint: it has no checksums or file identities, so a "
                "damaged or swapped file cannot be detected. Load it and save it again to upgrade it",
                stacklevel=3,
            )

    # -- verification ------------------------------------------------------------------------
    def data_files(self) -> List[str]:
        """The files :meth:`verify` checks (client_state.pt is checked when it is read)."""
        if self.table is not None:
            return sorted(n for n in self.table if n != CLIENT_STATE)
        return sorted(rank_file_names(self.world) + [SHARED])

    def verify(self, rank: int = 0, world: int = 1) -> None:
        """Check this reader's share of the files (size, identity, CRC-32, structure):
        old rank ``k``'s files by rank ``k % world`` (at the same world size every rank
        checks the files it reads most), the others from the last rank down."""
        others = 0
        for name in self.data_files():
            match = re.match(r"rank(\d{5})\.", name)
            if match is not None:
                owner = int(match.group(1)) % world
            else:
                owner = (world - 1 - others) % world
                others += 1
            if owner == rank:
                self.verify_file(name)

    def verify_file(self, name: str) -> None:
        path = self.directory / name
        checks = {SHARED: self._check_shared, CONFIG: lambda p: None}
        match = re.fullmatch(r"rank(\d{5})\.(safetensors|json)", name)
        if match is not None:
            r = int(match.group(1))
            check = (lambda p: self._check_rank_tensors(p, r)) if match.group(2) == "safetensors" else (lambda p: self._check_rank_json(p, r))
        else:
            check = checks[name]
        if self.table is not None:
            files.verify_file(path, self.table[name], identity=lambda: check(path))
        else:
            if not path.exists():
                raise CheckpointError(f"{path} is missing from the checkpoint (world size {self.world} needs one file per rank)")
            check(path)

    def _identity(self, path: Path, meta: Dict[str, str], kind: str, rank: Optional[int] = None) -> None:
        if self.table is None:
            return
        cid = self.manifest["checkpoint_id"]
        if meta.get("zero_strategy.file") != kind:
            raise CheckpointError(f"{path} is not a zero_strategy {kind} file (its header has no matching identity)")
        if meta.get("zero_strategy.checkpoint_id") != cid:
            raise CheckpointError(
                f"{path} belongs to another save (checkpoint id {meta.get('zero_strategy.checkpoint_id')}, the manifest's "
                f"is {cid}): files of different checkpoints were mixed"
            )
        if rank is not None and meta.get("zero_strategy.rank") != str(rank):
            raise CheckpointError(
                f"{path} holds rank {meta.get('zero_strategy.rank')}'s shard, not rank {rank}'s: rank files were renamed or swapped"
            )
        if meta.get("zero_strategy.world_size") != str(self.world):
            raise CheckpointError(f"{path} was written at world size {meta.get('zero_strategy.world_size')}, the manifest says {self.world}")
        if meta.get("zero_strategy.layout") != self.digest:
            raise CheckpointError(
                f"{self.manifest_path} does not describe {path.name}: the tensor layout in the manifest (units, offsets, shapes, "
                "tensor locations) differs from the one the file was written with, so the manifest was edited or damaged"
            )

    def _check_rank_tensors(self, path: Path, rank: int) -> None:
        f = self._open(path)
        self._identity(path, _metadata(f), "rank", rank)
        seen = set()
        for key in f.keys():
            match = _KEY.match(key)
            if match is None or int(match.group(1)) not in self.units:
                raise CheckpointError(f"{path} holds {key!r}, which the manifest's units do not explain")
            index = int(match.group(1))
            shape = _shape(f, key, path)
            per_param = (key.endswith(".optim_present") or key.endswith(".whole_present")
                         or (match.group(4) is not None and self.version >= 3))
            if match.group(5) is not None:  # whole state: any shape, of a parameter the unit holds
                if int(match.group(5)) >= self.params_in_unit.get(index, 0):
                    raise CheckpointError(f"{path} holds {key!r}, but unit {index} has {self.params_in_unit.get(index, 0)} parameters")
            elif per_param:
                if shape != [self.params_in_unit.get(index, 0)]:
                    raise CheckpointError(
                        f"{path}: {key} has shape {shape} but unit {index} holds {self.params_in_unit.get(index, 0)} parameters"
                    )
            elif match.group(4) is None and shape != [self.units[index]["shard_numel"]]:
                raise CheckpointError(
                    f"{path}: {key} has shape {shape} but unit {index}'s shards hold {self.units[index]['shard_numel']} elements"
                )
            if match.group(2) == "value":
                seen.add(index)
        missing = sorted(set(self.units) - seen)
        if missing:
            raise CheckpointError(f"{path} has no values for unit(s) {missing[:5]}")

    def _check_rank_json(self, path: Path, rank: int) -> None:
        rj = self.rank_json(rank)
        if self.table is not None:
            ident = rj.get("identity")
            if not isinstance(ident, dict):
                raise CheckpointError(f"{path} has no identity: not a file of this checkpoint")
            meta = {"zero_strategy.file": "rank", **{f"zero_strategy.{k}": str(v) for k, v in ident.items()}}
            self._identity(path, meta, "rank", rank)

    def _check_shared(self, path: Path) -> None:
        f = self._open(path)
        self._identity(path, _metadata(f), "shared")
        keys = set(f.keys())
        for entry in self.manifest["tensors"]:
            if entry["unit"] is None:
                if entry["key"] not in keys:
                    raise CheckpointError(f"{path} has no {entry['key']!r}, which the manifest places there")
                n = 1
                for s in _shape(f, entry["key"], path):
                    n *= s
                if list(entry["shape"]) and n != _numel(entry["shape"]):
                    raise CheckpointError(f"{path}: {entry['key']} holds {n} elements, the manifest says shape {entry['shape']}")
        for b in self.manifest.get("buffers", []):
            if f"buffer.{b}" not in keys:
                raise CheckpointError(f"{path} has no buffer {b!r}, which the manifest lists")

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

    def rank_tensor(self, rank: int, key: str) -> torch.Tensor:
        """One whole tensor of rank ``rank``'s file."""
        path = _rank_file(self.directory, rank, "safetensors")
        try:
            return self._open(path).get_tensor(key)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{path}: cannot read {key} ({e})") from None

    def whole_owner(self, unit: int, pos: int) -> Optional[int]:
        """The rank whose file holds the whole optimizer state of position ``pos`` of
        ``unit`` (saved by a whole-parameter optimizer), or None (no state)."""
        for r in range(self.world):
            key = f"unit{unit}.whole_present"
            if not self.has_key(r, key):
                continue
            cache = self.__dict__.setdefault("_present", {})
            if (r, unit) not in cache:
                cache[(r, unit)] = self.rank_tensor(r, key).tolist()
            flags = cache[(r, unit)]
            if pos < len(flags) and flags[pos]:
                return r
        return None

    def stored_whole(self, unit: int) -> bool:
        """Whether ``unit``'s optimizer state was saved whole per parameter."""
        return self.has_key(0, f"unit{unit}.whole_present")

    def has_key(self, rank: int, key: str) -> bool:
        return key in self._keys(rank)

    def _keys(self, rank: int) -> frozenset:
        if rank not in self._key_sets:
            self._key_sets[rank] = frozenset(self._open(_rank_file(self.directory, rank, "safetensors")).keys())
        return self._key_sets[rank]

    def keys_with_prefix(self, rank: int, prefix: str) -> List[str]:
        """The suffixes of rank ``rank``'s tensor keys that start with ``prefix``, sorted."""
        return sorted(k[len(prefix):] for k in self._keys(rank) if k.startswith(prefix))

    def rank_json(self, rank: int) -> dict:
        path = _rank_file(self.directory, rank, "json")
        try:
            rj = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing from the checkpoint") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} is not valid JSON ({e})") from None
        except OSError as e:
            raise CheckpointError(f"{path} cannot be read ({e})") from None
        if not isinstance(rj, dict):
            raise CheckpointError(f"{path} must hold an object, got {type(rj).__name__}")
        rng = rj.get("rng_cpu", [])
        if not isinstance(rng, list) or not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 256 for b in rng):
            raise CheckpointError(f"{path}: rng_cpu must be a list of bytes")
        cuda = rj.get("rng_cuda", [])
        if not isinstance(cuda, list) or not all(isinstance(s, list) and all(isinstance(b, int) and 0 <= b < 256 for b in s) for s in cuda):
            raise CheckpointError(f"{path}: rng_cuda must be lists of bytes")
        scalars = rj.get("optimizer_scalars", {})
        pattern = r"\d+\.\d+\..+" if self.version >= 3 else r"\d+\..+"
        if not isinstance(scalars, dict) or not all(re.fullmatch(pattern, k) for k in scalars):
            shown = "'<unit>.<position>.<key>'" if self.version >= 3 else "'<unit>.<key>'"
            raise CheckpointError(f"{path}: optimizer_scalars must map {shown} to values")
        return rj

    def shared(self, key: str) -> torch.Tensor:
        path = self.directory / SHARED
        f = self._open(path)
        try:
            return f.get_tensor(key)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{path}: cannot read {key} ({e})") from None

    # -- flat ranges -------------------------------------------------------------------------
    def read_unit_range(self, unit_index: int, suffix: str, start: int, length: int) -> torch.Tensor:
        """Elements ``[start, start+length)`` of an old unit's flat space, gathered from
        whichever old rank files hold them (the manifest was validated: every unit has
        ``shard_numel >= 1`` and ``world`` shards, so this loop ends)."""
        u = self.units[unit_index]
        s = u["shard_numel"]
        if start < 0 or start + length > s * u["world"]:
            raise CheckpointError(f"{self.manifest_path}: unit {unit_index} has no elements [{start}, {start + length})")
        pieces, pos, end = [], start, start + length
        while pos < end:
            r = pos // s
            lo = pos - r * s
            take = min(end - pos, s - lo)
            pieces.append(self._rank_tensor_slice(r, f"unit{unit_index}.{suffix}", lo, lo + take))
            pos += take
        if not pieces:
            return torch.empty(0, dtype=torch.float32)
        return torch.cat(pieces) if len(pieces) != 1 else pieces[0]

    def tensor(self, entry: dict, suffix: str = "value") -> torch.Tensor:
        """One whole parameter (flat, float32 for values) from the checkpoint."""
        if entry["unit"] is None:
            return self.shared(entry["key"]).reshape(-1)
        return self.read_unit_range(entry["unit"], suffix, entry["offset"], entry["numel"])

    def client_state(self, *, weights_only: Optional[bool] = True):
        """The saved client state (None if there is none), verified against the manifest.

        With restricted unpickling (the default), which runs no code whatever the file
        holds, the file is read first so that a file holding other objects is refused as
        such; otherwise its checksum is verified before it is unpickled."""
        path = self.directory / CLIENT_STATE
        record = None if self.table is None else self.table.get(CLIENT_STATE)
        restricted = weights_only is None or bool(weights_only)
        if self.table is not None and record is None:
            if os.path.lexists(path):
                if restricted:
                    load_client_state(path, weights_only=True)  # refuses foreign objects as such; runs nothing
                raise CheckpointError(
                    f"{path} is not part of this checkpoint (its manifest lists no client state): it was added after "
                    "the save; remove it"
                )
            return None
        if not path.exists():
            if record is not None:
                raise CheckpointError(f"{path} is missing from the checkpoint")
            return None
        if restricted:
            client = load_client_state(path, weights_only=True)
            if record is not None:
                files.verify_file(path, record)
            return client
        if record is not None:
            files.verify_file(path, record)
        return load_client_state(path, weights_only=False)

    def close(self) -> None:
        self._handles.clear()
        self._key_sets.clear()


def _metadata(f) -> Dict[str, str]:
    try:
        return dict(f.metadata() or {})
    except Exception:  # noqa: BLE001
        return {}


def _shape(f, key: str, path: Path) -> list:
    try:
        return list(f.get_slice(key).get_shape())
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path}: cannot read the header of {key} ({e})") from None


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


_prod = _numel


# ----------------------------------------------------------------------------------------
# load into an engine
# ----------------------------------------------------------------------------------------
@dataclass
class _Plan:
    reader: CheckpointReader
    client: Optional[dict]
    by_name: Dict[str, dict]
    restore_optimizer: bool
    rank_json: object  # rank -> that rank's JSON sidecar, read once


def load_checkpoint(engine, directory, *, allow_reshard: bool = True, weights_only: Optional[bool] = True) -> Optional[dict]:
    """Restore ``engine`` from ``directory``; returns the saved ``client_state``.

    Works across world sizes and stages (resharding on the fly) unless
    ``allow_reshard`` is False, in which case a different world size is an error.
    ``client_state.pt`` is read with ``torch.load(weights_only=True)`` (tensors and
    plain containers only, no code runs) unless the caller passes
    ``weights_only=False`` for a file it trusts; ``None`` means True.

    Everything is validated and verified before the engine is changed; an error on any
    rank is raised on every rank."""
    comm = engine.comm
    error, path, plan = None, None, None
    try:
        path = _as_path(directory)
        if comm.rank == 0:
            files.clean_leftover_tmp(path)
        plan = _plan_load(engine, path, allow_reshard, weights_only)
    except Exception as e:  # noqa: BLE001 - agreed below, raised on every rank
        error = e
    _agree(comm, "load_checkpoint", error, same={"path": str(path)})
    error = None
    try:
        _apply(engine, plan)
    except Exception as e:  # noqa: BLE001
        error = e
    finally:
        plan.reader.close()
    _agree(comm, f"load_checkpoint({path})", error)
    return plan.client


def _plan_load(engine, path: Path, allow_reshard: bool, weights_only) -> _Plan:
    """Everything that can refuse the checkpoint, before the engine is touched."""
    comm = engine.comm
    reader = CheckpointReader(path)
    try:
        reader.verify(comm.rank, comm.world_size)
        # Read (and refuse) the caller's state before touching the engine, so a refused
        # file leaves the model as it was.
        client = reader.client_state(weights_only=weights_only)
        m = reader.manifest
        ws = comm.world_size
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
        opts = engine.inner_optimizers
        old = saved_optimizers(m)
        restore_optimizer = bool(opts) and old is not None
        if restore_optimizer:
            saved_classes, classes = [o["cls"] for o in old], [type(o).__name__ for o in opts]
            if saved_classes != classes:
                raise CheckpointError(f"{reader.directory} holds the state of {' + '.join(saved_classes)} but the engine's "
                                      f"optimizers are {' + '.join(classes)}")
        rank_json = functools.lru_cache(maxsize=None)(reader.rank_json)
        if restore_optimizer:
            rank_json(0)  # validated now, before the engine is touched
        if m["world_size"] == ws:
            reader.rank_json(comm.rank)  # validated now, applied later
    except BaseException:
        reader.close()
        raise
    return _Plan(reader, client, by_name, restore_optimizer, rank_json)


def _apply(engine, plan: _Plan) -> None:
    reader, by_name, m = plan.reader, plan.by_name, plan.reader.manifest
    restore_optimizer = plan.restore_optimizer
    for u in engine.units:
        store = u.params_store
        for i, names in enumerate(u.names):  # values: whatever part of each tensor this rank keeps
            owned = store.owned_range(i)
            if owned is not None:
                store.write(i, _read_tensor_range(reader, by_name[names[0]], *owned).to(u.device), start=owned[0])
        if restore_optimizer and u.trainable:
            opt = engine.inner_optimizers[u.optimizer_index]
            lo = u.layout.shard_range(u.shard_index)[0]
            if u.whole_params is not None:
                wanted = [(t, i, 0, u.layout.numels[i]) for t, i in zip(u.optim_params, u.optim_positions)]
            else:
                wanted = [(t, i, lo + s_start - u.layout.offsets[i], length)
                          for t, (i, s_start, length) in zip(u.optim_params, u.optim_slices)]
            for t, i, t_start, length in wanted:
                st = _saved_state(reader, by_name[u.names[i][0]], t_start, length, t, plan.rank_json)
                if st:
                    opt.state[t] = st
                else:  # never stepped when saved: no state, as torch would have
                    opt.state.pop(t, None)
    with torch.no_grad():
        for name, p in engine.untouched.items():
            p.copy_(reader.tensor(by_name[name]).view(p.shape))
        buffers = dict(engine.module.named_buffers())
        for n in m.get("buffers", []):
            if n in buffers:
                buffers[n].copy_(reader.shared(f"buffer.{n}"))
    if restore_optimizer:
        for opt, entry in zip(engine.inner_optimizers, saved_optimizers(m)):
            for group, saved in zip(opt.param_groups, entry["param_groups"]):
                # JSON has no tuples: give a tuple-valued hyperparameter (Adam's betas) its type back.
                group.update({k: tuple(v) if isinstance(group.get(k), tuple) and isinstance(v, list) else v
                              for k, v in saved.items()})
    engine.scaler.load_state_dict(m["loss_scaler"])  # validated with the manifest
    engine.global_step = m["step"]
    engine.zero_grad()
    if m["world_size"] == engine.comm.world_size:
        rj = reader.rank_json(engine.comm.rank)
        torch.set_rng_state(torch.tensor(rj["rng_cpu"], dtype=torch.uint8))
        if "rng_cuda" in rj and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in rj["rng_cuda"]])


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


def _saved_state(reader, entry: dict, t_start: int, length: int, like, rank_json) -> dict:
    """The saved optimizer state of elements ``[t_start, t_start+length)`` of one
    parameter, shaped like ``like``, from either form it was saved in: per-element
    pieces in the flat shard space, or whole on the parameter's owner
    ([Note: whole-parameter optimizers] in whole_params.py).  A whole form is taken
    as it is when the whole parameter is wanted, else sliced (per-element state only)."""
    old_unit = entry["unit"]
    if old_unit is None or not reader.stored_whole(old_unit):
        return _saved_param_state(reader, entry, t_start, length, like, rank_json)
    st = _saved_whole_state(reader, entry, rank_json)
    numel = _numel(entry["shape"])
    if not st or (t_start == 0 and length == numel):
        return {k: (v.to(like.device) if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
    out = {}
    for key, v in st.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            if list(v.shape) != list(entry["shape"]):
                raise CheckpointError(
                    f"{reader.directory}: the optimizer state {key!r} of {entry['names'][0]} was saved whole (shape "
                    f"{list(v.shape)}) by a whole-parameter optimizer and cannot be split into this run's per-element "
                    "pieces; load it with the same ZeroConfig.elementwise_optimizers as when it was saved"
                )
            v = v.reshape(-1)[t_start : t_start + length].view(like.shape).to(like.device)
        out[key] = v
    return out


def _saved_whole_state(reader, entry: dict, rank_json) -> dict:
    """A parameter's whole optimizer state from the rank file of its owner ({}: none)."""
    old_unit, pos = entry["unit"], reader.position[id(entry)]
    rank = reader.whole_owner(old_unit, pos)
    if rank is None:
        return {}
    st = {}
    for key in reader.keys_with_prefix(rank, f"unit{old_unit}.whole{pos}."):
        st[key] = reader.rank_tensor(rank, f"unit{old_unit}.whole{pos}.{key}").clone()
    prefix = f"{old_unit}.{pos}."
    for k, v in rank_json(rank).get("optimizer_scalars", {}).items():
        if k.startswith(prefix):
            st[k[len(prefix):]] = v
    return st


def _saved_param_state(reader, entry: dict, t_start: int, length: int, like: torch.Tensor, rank_json) -> dict:
    """The saved optimizer state of elements ``[t_start, t_start+length)`` of one
    parameter, shaped like ``like`` (the optimizer tensor it is for); {} when the
    checkpoint holds none (the parameter was frozen or had never been stepped)."""
    old_unit = entry["unit"]
    if old_unit is None:
        return {}
    first = entry["offset"] + t_start  # in the old unit's flat space
    rank = first // reader.units[old_unit]["shard_numel"]  # the old rank holding our first element
    pos = reader.position[id(entry)]
    per_param = reader.version >= 3
    if per_param:
        present_key = f"unit{old_unit}.optim_present"
        if not reader.has_key(rank, present_key) or int(reader._rank_tensor_slice(rank, present_key, pos, pos + 1)[0]) == 0:
            return {}
    st = {}
    for key in reader.keys_with_prefix(rank, f"unit{old_unit}.optim."):
        st[key] = reader.read_unit_range(old_unit, f"optim.{key}", first, length).view(like.shape).to(like.device)
    at = pos if per_param else 0  # version 2 kept one scalar per unit
    for key in reader.keys_with_prefix(rank, f"unit{old_unit}.optim_scalar."):
        st[key] = reader._rank_tensor_slice(rank, f"unit{old_unit}.optim_scalar.{key}", at, at + 1).reshape(()).clone()
    prefix = f"{old_unit}.{pos}." if per_param else f"{old_unit}."
    for k, v in rank_json(rank if per_param else 0).get("optimizer_scalars", {}).items():
        if k.startswith(prefix):
            st[k[len(prefix):]] = v
    return st


# ----------------------------------------------------------------------------------------
# consolidation
# ----------------------------------------------------------------------------------------
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
                st = _saved_state(reader, entry, 0, _numel(entry["shape"]), like, rank_json)
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
        output_dir = _as_path(output_dir)
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
        nbytes = torch.empty((), dtype=e[2]).element_size() * _prod(e[3])
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
        total = sum(torch.empty((), dtype=e[2]).element_size() * _prod(e[3]) for e in entries)
        files.write_json(tmp / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    config_path = reader.directory / CONFIG
    if config_path.exists():
        try:
            cfg = json.loads(config_path.read_bytes())
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{config_path} is not valid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{config_path} must hold an object")
        if out_dtype is not None:
            cfg["torch_dtype"] = cfg["dtype"] = dtype_name(out_dtype)
        files.write_json(tmp / CONFIG, cfg)
    return names
