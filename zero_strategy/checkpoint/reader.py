"""CheckpointReader: a checkpoint directory's manifest and files, validated, and
slices of its tensors read whatever world size wrote them ([Note: checkpoint layout]
in checkpoint/names.py)."""
from __future__ import annotations

import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Dict, List, Optional

import torch

from ..offload.disk_offload import is_offload_directory
from . import files
from .files import CheckpointError
from .manifest import layout_digest, rank_file_names, validate

from .names import CLIENT_STATE, CONFIG, MANIFEST, SHARED, TENSOR_KEY, rank_file


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
        if not os.path.lexists(path):
            if is_offload_directory(found):
                raise CheckpointError(f"{found} is a disk-offload directory of a running (or killed) engine "
                                      "(nvme_path), not a checkpoint: pass the directory given to save_checkpoint")
            raise CheckpointError(f"{path} is missing: not a zero_strategy checkpoint, or its save did not finish")
        self.manifest = files.read_json(path)  # [Note: only regular files are read]
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
        if self.version == 2 or self.version == 3:
            warnings.warn(
                f"{path} is a format-version-{self.version} checkpoint: its manifest records no checksum of itself, so a "
                "damaged manifest cannot be detected. Load it and save it again to upgrade it",
                stacklevel=3,
            )
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
            match = TENSOR_KEY.match(key)
            if match is None or int(match.group(1)) not in self.units:
                raise CheckpointError(f"{path} holds {key!r:.80}, which the manifest's units do not explain")
            index = int(match.group(1))
            shape = _shape(f, key, path)
            per_param = (key.endswith(".optim_present") or key.endswith(".whole_present")
                         or (match.group(4) is not None and self.version >= 3))
            if match.group(5) is not None:  # whole state: any shape, of a parameter the unit holds
                if int(match.group(5)) >= self.params_in_unit.get(index, 0):
                    raise CheckpointError(f"{path} holds {key!r:.80}, but unit {index} has {self.params_in_unit.get(index, 0)} parameters")
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
                    raise CheckpointError(f"{path} has no {entry['key']!r:.80}, which the manifest places there")
                n = 1
                for s in _shape(f, entry["key"], path):
                    n *= s
                if list(entry["shape"]) and n != shape_numel(entry["shape"]):
                    raise CheckpointError(f"{path}: {entry['key']} holds {n} elements, the manifest says shape {entry['shape']}")
        for b in self.manifest.get("buffers", []):
            if f"buffer.{b}" not in keys:
                raise CheckpointError(f"{path} has no buffer {b!r:.80}, which the manifest lists")

    # -- files ---------------------------------------------------------------------------
    def _open(self, path: Path):
        key = str(path)
        if key not in self._handles:
            from safetensors import safe_open

            if not os.path.lexists(path):
                raise CheckpointError(f"{path} is missing from the checkpoint (world size {self.world} needs one file per rank)")
            files.require_regular(path)  # a FIFO would block inside safetensors' native open
            try:
                self._handles[key] = safe_open(str(path), framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors raises several types
                raise CheckpointError(f"{path} is unreadable or truncated ({str(e)[:200]})") from None
        return self._handles[key]

    def _rank_tensor_slice(self, rank: int, key: str, lo: int, hi: int) -> torch.Tensor:
        path = rank_file(self.directory, rank, "safetensors")
        f = self._open(path)
        try:
            return f.get_slice(key)[lo:hi]
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{path}: cannot read {key}[{lo}:{hi}] ({e})") from None

    def rank_tensor(self, rank: int, key: str) -> torch.Tensor:
        """One whole tensor of rank ``rank``'s file."""
        path = rank_file(self.directory, rank, "safetensors")
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
            self._key_sets[rank] = frozenset(self._open(rank_file(self.directory, rank, "safetensors")).keys())
        return self._key_sets[rank]

    def keys_with_prefix(self, rank: int, prefix: str) -> List[str]:
        """The suffixes of rank ``rank``'s tensor keys that start with ``prefix``, sorted."""
        return sorted(k[len(prefix):] for k in self._keys(rank) if k.startswith(prefix))

    def rank_json(self, rank: int) -> dict:
        path = rank_file(self.directory, rank, "json")
        if not os.path.lexists(path):
            raise CheckpointError(f"{path} is missing from the checkpoint")
        record = None if self.table is None else self.table.get(path.name)
        rj = files.read_json(path, files.JSON_LIMIT if record is None else record["size"])
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
                if restricted and os.path.isfile(path) and not os.path.islink(path):
                    load_client_state(path, weights_only=True)  # refuses foreign objects as such; runs nothing
                raise CheckpointError(
                    f"{path} is not part of this checkpoint (its manifest lists no client state): it was added after "
                    "the save; remove it"
                )
            return None
        if not os.path.lexists(path):
            if record is not None:
                raise CheckpointError(f"{path} is missing from the checkpoint")
            return None
        size = files.require_regular(path).st_size
        if record is not None and size != record["size"] and size > files.JSON_LIMIT:
            files.verify_file(path, record)  # too large to be read only to explain what else it holds
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


def shape_numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def saved_optimizers(manifest: dict) -> Optional[List[dict]]:
    """The manifest's optimizer entries, one per optimizer (None: saved without one)."""
    if manifest.get("optimizers") is not None:
        return manifest["optimizers"]
    return None if manifest.get("optimizer") is None else [manifest["optimizer"]]


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


def saved_state(reader, entry: dict, t_start: int, length: int, like, rank_json) -> dict:
    """The saved optimizer state of elements ``[t_start, t_start+length)`` of one
    parameter, shaped like ``like``, from either form it was saved in: per-element
    pieces in the flat shard space, or whole on the parameter's owner
    ([Note: whole-parameter optimizers] in whole_params.py).  A whole form is taken
    as it is when the whole parameter is wanted, else sliced (per-element state only)."""
    old_unit = entry["unit"]
    if old_unit is None or not reader.stored_whole(old_unit):
        return saved_param_state(reader, entry, t_start, length, like, rank_json)
    st = saved_whole_state(reader, entry, rank_json)
    numel = shape_numel(entry["shape"])
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


def saved_whole_state(reader, entry: dict, rank_json) -> dict:
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


def saved_param_state(reader, entry: dict, t_start: int, length: int, like: torch.Tensor, rank_json) -> dict:
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
