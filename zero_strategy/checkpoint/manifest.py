"""The checkpoint manifest as data: its full validation, before any other file is read,
and the digest of its layout that every shard file carries.

A manifest is read from disk, so nothing in it is trusted: every field the loader uses
is checked for type and range, and the arithmetic is checked as a whole (each unit's
``shard_numel`` is the one its ``numel`` and ``world`` give, its tensors tile
``[0, numel)`` exactly, each tensor's ``numel`` is the product of its shape), so the
slice arithmetic of loading can neither loop, divide by zero nor read past a shard.
Every problem is a :class:`CheckpointError` naming the manifest.

[Note: layout digest]
Each shard file's safetensors header records a digest (BLAKE2b, 128 bits) of the
manifest's ``world_size``, ``units`` and ``tensors``, computed by every rank from its
own engine when it writes.  Loading recomputes it from the manifest: a manifest whose
offsets, units or tensor locations were changed (two tensors' places swapped, an offset
moved by one) no longer matches the files it describes.
"""
from __future__ import annotations

import hashlib
import json
import re
import zlib
from pathlib import Path
from typing import Any, Dict

from .files import CheckpointError
from ..dtypes import dtype_from_name
from ..optim.loss_scale import LossScaler

FORMAT = "zero_strategy.checkpoint"
FORMAT_VERSION = 4
# Version 1: no checksums or identities (loaded with a warning).  Version 2: optimizer
# state per unit (one scalar state per unit).  Version 3: per parameter, with
# ``unit<i>.optim_present`` saying which parameters have state at all.  Version 4: the
# manifest carries its own checksum ([Note: manifest checksum]); earlier versions load
# with a warning.
READABLE_VERSIONS = (1, 2, 3, 4)
CHECKSUMMED_FROM = 4
CHECKSUM_KEY = "manifest_crc32"
MAX_WORLD = 1 << 24
MAX_NUMEL = 1 << 53
MAX_STRING = 1 << 16  # characters: names, keys, class names
FILE_NAME = re.compile(r"^(rank(\d{5})\.(safetensors|json)|shared\.safetensors|client_state\.pt|config\.json)$")


def layout_digest(world_size: int, units: list, tensors: list) -> str:
    blob = json.dumps({"world_size": world_size, "units": units, "tensors": tensors}, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


# [Note: manifest checksum]
# The file table checksums every other file, so the manifest is the one file whose damage
# nothing else would show: a flipped bit in a number (a step, a learning rate, an offset
# that still tiles) or in a key ("optimizer" renamed drops the optimizer state) parses
# and passes every structural check.  So the manifest records the CRC-32 of its own
# content: every field but ``manifest_crc32``, as canonical JSON (sorted keys, no
# spaces).  It detects damage, not intent: anyone who edits the manifest can recompute
# it, and the structural checks below stay the defence against edited values.
def manifest_crc32(m: dict) -> int:
    body = {k: v for k, v in m.items() if k != CHECKSUM_KEY}
    try:
        blob = json.dumps(body, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):
        return -1  # nothing a valid manifest holds: compares unequal to any checksum
    return zlib.crc32(blob.encode())


def seal(m: dict) -> dict:
    """``m`` as it will read back from JSON, with its checksum added."""
    m = json.loads(json.dumps(m))
    m[CHECKSUM_KEY] = manifest_crc32(m)
    return m


def rank_file_names(world: int) -> list:
    return [f"rank{r:05d}.{ext}" for r in range(world) for ext in ("safetensors", "json")]


class _Check:
    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, what: str):
        raise CheckpointError(f"{self.path} is not a valid checkpoint manifest: {what}")

    def dict(self, v, what: str) -> dict:
        if not isinstance(v, dict):
            self.fail(f"{what} must be an object, got {type(v).__name__}")
        return v

    def list(self, v, what: str) -> list:
        if not isinstance(v, list):
            self.fail(f"{what} must be a list, got {type(v).__name__}")
        return v

    def str(self, v, what: str) -> str:
        if not isinstance(v, str):
            self.fail(f"{what} must be a string, got {v!r:.80}")
        if len(v) > MAX_STRING:  # so that no message below copies it whole
            self.fail(f"{what} is a string of {len(v)} characters (at most {MAX_STRING})")
        return v

    def int(self, v, what: str, lo: int = 0, hi: int = MAX_NUMEL) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            self.fail(f"{what} must be an integer in [{lo}, {hi}], got {v!r:.80}")
        return v

    def key(self, d: dict, k: str, where: str) -> Any:
        if k not in d:
            self.fail(f"{where} has no {k!r}")
        return d[k]


def validate(m: Any, path: Path) -> None:
    """Raise a CheckpointError naming ``path`` unless ``m`` is a well-formed manifest."""
    c = _Check(path)
    c.dict(m, "the manifest")
    if m.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a zero_strategy checkpoint manifest")
    version = m.get("format_version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise CheckpointError(
            f"{path} has format version {version!r}; this library reads versions {', '.join(map(str, READABLE_VERSIONS))}"
        )
    top = "the manifest"
    if version >= CHECKSUMMED_FROM:
        recorded = m.get(CHECKSUM_KEY)
        if recorded is None:
            c.fail(f"it has no {CHECKSUM_KEY!r} (every format-version-{version} manifest records its checksum)")
        if recorded != manifest_crc32(m):
            raise CheckpointError(
                f"{path} is damaged: its content does not match the CRC-32 it records ({CHECKSUM_KEY}), so a value in it "
                "changed after the save (a flipped bit, an edit or a bad copy); the checkpoint cannot be trusted"
            )
        c.key(m, "optimizer", top)  # written by every save (null without an optimizer): a renamed key is damage
    world = c.int(c.key(m, "world_size", top), "world_size", 1, MAX_WORLD)
    c.int(c.key(m, "stage", top), "stage", 0, 3)
    c.int(c.key(m, "step", top), "step")
    c.str(c.key(m, "precision", top), "precision")
    if "model_class" in m:
        c.str(m["model_class"], "model_class")
    try:
        LossScaler().load_state_dict(c.key(m, "loss_scaler", top))
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: bad loss_scaler entry ({e})") from None

    units: Dict[int, dict] = {}
    for i, u in enumerate(c.list(c.key(m, "units", top), "units")):
        where = f"units[{i}]"
        c.dict(u, where)
        index = c.int(c.key(u, "index", where), f"{where}.index", 0, MAX_WORLD * 64)
        if index in units:
            c.fail(f"unit index {index} appears twice")
        uw = c.int(c.key(u, "world", where), f"{where}.world", 1, MAX_WORLD)
        # Stage 0 replicates: each unit is one "shard" holding everything.
        expected_world = 1 if m["stage"] == 0 else world
        if uw != expected_world:
            c.fail(f"{where}.world is {uw} but a stage-{m['stage']} checkpoint at world_size {world} splits units over {expected_world}")
        numel = c.int(c.key(u, "numel", where), f"{where}.numel")
        shard = c.int(c.key(u, "shard_numel", where), f"{where}.shard_numel", 1)
        if shard != max(1, -(-numel // uw)):
            c.fail(f"{where}.shard_numel is {shard}, but {numel} elements over {uw} ranks give {max(1, -(-numel // uw))}")
        if "compute_dtype" in u:
            _dtype(c, u["compute_dtype"], f"{where}.compute_dtype")
        units[index] = u

    names = set()
    tiles: Dict[int, list] = {i: [] for i in units}
    for i, t in enumerate(c.list(c.key(m, "tensors", top), "tensors")):
        where = f"tensors[{i}]"
        c.dict(t, where)
        tnames = c.list(c.key(t, "names", where), f"{where}.names")
        if not tnames:
            c.fail(f"{where}.names is empty")
        for n in tnames:
            if not c.str(n, f"{where}.names[]"):
                c.fail(f"{where} has an empty name")
            if n in names:
                c.fail(f"the name {n!r} appears twice")
            names.add(n)
        shape = c.list(c.key(t, "shape", where), f"{where}.shape")
        if len(shape) > 64:
            c.fail(f"{where}.shape has {len(shape)} dimensions")
        count = 1
        for s in shape:
            count *= c.int(s, f"{where}.shape[]")
        if count > MAX_NUMEL:
            c.fail(f"{where}.shape {shape} has too many elements")
        _dtype(c, c.key(t, "dtype", where), f"{where}.dtype")
        if not isinstance(t.get("frozen", False), bool):
            c.fail(f"{where}.frozen must be true or false")
        unit = c.key(t, "unit", where)
        if unit is None:
            key = c.str(c.key(t, "key", where), f"{where}.key")
            if not key.startswith("param."):
                c.fail(f"{where}.key must start with 'param.', got {key!r:.80}")
            continue
        c.int(unit, f"{where}.unit", 0, MAX_WORLD * 64)
        if unit not in units:
            c.fail(f"{where} lives in unit {unit}, which the manifest does not describe")
        offset = c.int(c.key(t, "offset", where), f"{where}.offset")
        numel = c.int(c.key(t, "numel", where), f"{where}.numel")
        if numel != count:
            c.fail(f"{where} ({tnames[0]!r}) has numel {numel} but its shape {shape} holds {count} elements")
        if offset + numel > units[unit]["numel"]:
            c.fail(f"{where} ({tnames[0]!r}) spans [{offset}, {offset + numel}), past the end of unit {unit} ({units[unit]['numel']} elements)")
        tiles[unit].append((offset, numel, tnames[0]))
    for index, spans in tiles.items():
        pos = 0
        for offset, numel, name in sorted(spans):
            if offset != pos:
                c.fail(f"unit {index}'s tensors do not tile it: {name!r} starts at {offset}, expected {pos} (an offset was changed)")
            pos += numel
        if pos != units[index]["numel"]:
            c.fail(f"unit {index}'s tensors cover {pos} elements but the unit has {units[index]['numel']}")

    for i, b in enumerate(c.list(m.get("buffers", []), "buffers")):
        c.str(b, f"buffers[{i}]")
    opt = m.get("optimizer")
    if opt is not None:
        _check_optimizer(c, opt, "optimizer")
    several = m.get("optimizers")
    if several is not None:
        for k, opt in enumerate(c.list(several, "optimizers")):
            _check_optimizer(c, opt, f"optimizers[{k}]")

    if version >= 2:
        cid = c.str(c.key(m, "checkpoint_id", top), "checkpoint_id")
        if not re.fullmatch(r"[0-9a-f]{8,64}", cid):
            c.fail(f"checkpoint_id must be hexadecimal, got {cid!r:.80}")
        files = c.dict(c.key(m, "files", top), "files")
        for name, rec in files.items():
            match = FILE_NAME.match(name)
            if match is None:
                c.fail(f"files names {name!r:.80}, which is not a checkpoint file name")
            c.dict(rec, f"files[{name!r}]")
            c.int(c.key(rec, "size", f"files[{name!r}]"), f"files[{name!r}].size", 0, 1 << 62)
            c.int(c.key(rec, "crc32", f"files[{name!r}]"), f"files[{name!r}].crc32", 0, 0xFFFFFFFF)
            if match.group(2) is not None and int(match.group(2)) >= world:
                c.fail(f"files names {name}, but the checkpoint has {world} ranks")
        for name in rank_file_names(world) + ["shared.safetensors"]:
            if name not in files:
                c.fail(f"files has no entry for {name}")


def _check_optimizer(c: "_Check", opt, where: str) -> None:
    c.dict(opt, where)
    c.str(c.key(opt, "cls", where), f"{where}.cls")
    if "param_names" in opt:
        names = c.list(opt["param_names"], f"{where}.param_names")
        if len(names) != len(opt.get("param_groups") or []) or not all(
                isinstance(g, list) and all(n is None or isinstance(n, str) for n in g) for g in names):
            c.fail(f"{where}.param_names must hold one list of parameter names (or null) per param group")
    for i, g in enumerate(c.list(c.key(opt, "param_groups", where), f"{where}.param_groups")):
        c.dict(g, f"{where}.param_groups[{i}]")
        if "params" in g:
            c.fail(f"{where}.param_groups[{i}] must not name 'params'")


def _dtype(c: _Check, v, what: str) -> None:
    try:
        dtype_from_name(c.str(v, what))
    except ValueError as e:
        c.fail(f"{what}: {e}")
