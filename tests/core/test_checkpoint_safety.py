"""Checkpoint saving deletes only what it wrote, detects damaged files, and fails on every
rank together (issue #16 items 2, 4, 7, 9; #14).

The multi-process tests run several scenarios per spawn (real gloo processes); each
scenario records, on every rank, what was raised and how long it took."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from dist_harness import run_distributed, run_distributed_outcomes
from models import lm_batches
from parity import build

FEW_SECONDS = 15.0  # a refused save or load on 2 CPU ranks, including the agreement
TIMEOUT = 30.0  # collective_timeout in the workers: a rank left waiting would show as this


# ---------------------------------------------------------------------------------------
# helpers (run inside the workers too)
# ---------------------------------------------------------------------------------------
def _engine(stage=2, seed=0):
    import zero_strategy

    model, opt = build(dict(optim="adamw", seed=seed))
    cfg = dict(stage=stage, reduce_bucket_size=3000, param_persistence_threshold=64, collective_timeout=TIMEOUT)
    return model, zero_strategy.initialize(model, opt, cfg)


def _step(engine, model, rank, ws, which=0):
    ids = lm_batches(which + 1, 4)[which].view(ws, -1, 16)[rank]
    engine.backward(model(input_ids=ids, labels=ids).loss)
    engine.step()


def _attempt(fn):
    """(kind, message, seconds): kind is "ok", "CheckpointError" or another type."""
    from zero_strategy import CheckpointError

    t = time.monotonic()
    try:
        fn()
        return ("ok", "", time.monotonic() - t)
    except CheckpointError as e:
        return ("CheckpointError", str(e), time.monotonic() - t)
    except Exception as e:  # noqa: BLE001 - the test reports it
        return (type(e).__name__, str(e), time.monotonic() - t)


def _snapshot(root: Path) -> dict:
    """Every file under ``root`` (relative path -> sha256), and every directory."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root) + "/"] = "dir"
        for f in filenames:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
    return out


def _barrier():
    torch.distributed.barrier()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _make_own_tmp(tmp: Path, megabytes: int = 8) -> None:
    """What a save killed while writing leaves: an in-progress directory of ours."""
    from zero_strategy.checkpoint.files import KIND_CHECKPOINT, write_marker

    tmp.mkdir()
    write_marker(tmp, KIND_CHECKPOINT)
    (tmp / "rank00000.safetensors").write_bytes(b"\0" * (megabytes << 20))


def _assert_all_refused(outcomes: dict, case: str, *needles: str, ws: int = 2) -> None:
    for r in range(ws):
        kind, text, seconds = outcomes[r][case]
        assert kind == "CheckpointError", (case, r, kind, text)
        for n in needles:
            assert n in text, (case, r, n, text)
        assert seconds < FEW_SECONDS, (case, r, seconds)


def _results(result: dict, ws: int) -> dict:
    assert not result["timed_out"], result
    out = {}
    for r in range(ws):
        kind, value = result["ranks"][r]
        assert kind == "ok", (r, value)
        out[r] = value
    return out


# ---------------------------------------------------------------------------------------
# saving never deletes what it did not write; every error on every rank
# ---------------------------------------------------------------------------------------
def _save_safety_worker(rank, ws, root):
    import zero_strategy.checkpoint.save as ck
    from zero_strategy.integrations.accelerate.state import load_engine, save_engine

    root = Path(root)
    model, engine = _engine()
    _step(engine, model, rank, ws)
    out = {}

    # A user's run directory: refused, every file survives.
    user = root / "exp1"
    if rank == 0:
        (user / "tb").mkdir(parents=True)
        (user / "tb" / "events.out.tfevents.1").write_bytes(os.urandom(1000))
        (user / "hparams.yaml").write_text("lr: 0.1\n")
    _barrier()
    before = _snapshot(user)
    out["user_dir"] = _attempt(lambda: engine.save_checkpoint(user))
    out["user_dir_kept"] = _snapshot(user) == before and len(before) == 3
    _barrier()

    # An existing file.
    a_file = root / "afile"
    if rank == 0:
        a_file.write_bytes(b"precious")
    _barrier()
    out["file"] = _attempt(lambda: engine.save_checkpoint(a_file))
    out["bad_path"] = _attempt(lambda: engine.save_checkpoint(a_file / "sub" / "ck"))  # a file as a parent
    out["file_kept"] = a_file.read_bytes() == b"precious"
    _barrier()

    # Each rank names its own path.
    out["paths"] = _attempt(lambda: engine.save_checkpoint(root / f"ck_rank{rank}"))
    out["paths_created"] = [p for p in os.listdir(root) if p.startswith("ck_rank")]
    _barrier()

    # Disk full on rank 1, over a good checkpoint: refused everywhere, the old one intact.
    path = root / "ck"
    engine.save_checkpoint(path)
    good = _snapshot(path)
    original = ck._write_rank_files
    if rank == 1:
        def full(tmp, r, tensors, extra):
            raise OSError(errno.ENOSPC, "No space left on device", str(ck.rank_file(tmp, r, "safetensors")))
        ck._write_rank_files = full
    _step(engine, model, rank, ws, 1)
    out["disk_full"] = _attempt(lambda: engine.save_checkpoint(path))
    ck._write_rank_files = original
    _barrier()
    out["disk_full_kept"] = _snapshot(path) == good
    out["disk_full_listing"] = sorted(os.listdir(root))
    _barrier()  # every rank looked before rank 0 changes anything again

    # One of our checkpoints, with a file of the user's added: refused, the file survives.
    if rank == 0:
        (path / "notes.txt").write_text("mine")
    _barrier()
    out["extra_file"] = _attempt(lambda: engine.save_checkpoint(path))
    snap = _snapshot(path)
    out["extra_file_kept"] = snap.pop("notes.txt", None) is not None and snap == good
    _barrier()
    if rank == 0:
        (path / "notes.txt").unlink()
    # A foreign <dir>.tmp: refused, not deleted.
    tmp = root / "ck.tmp"
    if rank == 0:
        tmp.mkdir()
        (tmp / "data.bin").write_bytes(b"someone else's")
    _barrier()
    out["foreign_tmp"] = _attempt(lambda: engine.save_checkpoint(path))
    out["foreign_tmp_kept"] = (tmp / "data.bin").read_bytes() == b"someone else's"
    _barrier()
    if rank == 0:
        shutil.rmtree(tmp)
        _make_own_tmp(tmp)  # a killed save's leftover: the next save removes it
    _barrier()
    out["own_tmp_save"] = _attempt(lambda: engine.save_checkpoint(path))
    out["own_tmp_after_save"] = tmp.exists()
    _barrier()
    if rank == 0:
        _make_own_tmp(tmp)  # ... and so does the next load
    _barrier()
    out["own_tmp_load"] = _attempt(lambda: engine.load_checkpoint(path))
    out["own_tmp_after_load"] = tmp.exists()
    _barrier()

    # Locks: a dead holder on this host is stale; a recent holder elsewhere is not; an
    # old one nobody refreshed is.
    lock = root / "ck.lock"
    if rank == 0:
        lock.write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname(), "token": "dead"}))
    _barrier()
    out["stale_lock"] = _attempt(lambda: engine.save_checkpoint(path))
    out["stale_lock_after"] = lock.exists()
    _barrier()
    if rank == 0:
        lock.write_text(json.dumps({"pid": 4242, "host": "another-host", "token": "live", "since": "just now"}))
    _barrier()
    kept = _snapshot(path)
    out["live_lock"] = _attempt(lambda: engine.save_checkpoint(path))
    out["live_lock_kept"] = lock.exists() and _snapshot(path) == kept
    _barrier()
    if rank == 0:
        os.utime(lock, (time.time() - 3600, time.time() - 3600))
    _barrier()
    out["old_lock"] = _attempt(lambda: engine.save_checkpoint(path))
    out["old_lock_after"] = lock.exists()

    # Accelerate folders: a crash between the two renames leaves zero_checkpoint.old only.
    folder = root / "acc"
    save_engine(engine, str(folder))
    expected = engine.full_state_dict(rank0_only=False)
    _barrier()
    if rank == 0:
        os.rename(folder / "zero_checkpoint", folder / "zero_checkpoint.old")
    _barrier()
    _step(engine, model, rank, ws, 2)
    out["old_fallback"] = _attempt(lambda: load_engine(engine, str(folder)))
    got = engine.full_state_dict(rank0_only=False)
    out["old_fallback_values"] = all(torch.equal(expected[k], got[k]) for k in expected)
    _barrier()
    save_engine(engine, str(folder))
    out["old_after_save"] = sorted(os.listdir(folder))
    _barrier()

    # Loading is collective too: two valid but different paths are refused on every rank.
    out["load_paths"] = _attempt(lambda: engine.load_checkpoint(path if rank == 0 else folder / "zero_checkpoint"))
    return out


@pytest.mark.slow
def test_saving_replaces_only_its_own_checkpoints_and_fails_on_every_rank(tmp_path):
    result = run_distributed_outcomes(_save_safety_worker, 2, str(tmp_path), timeout=600)
    out = _results(result, 2)
    _assert_all_refused(out, "user_dir", "exp1 exists and is not a sharded zero_strategy checkpoint", "tb/", "hparams.yaml")
    _assert_all_refused(out, "file", "afile exists and is a file")
    _assert_all_refused(out, "bad_path", "afile/sub", "failed on rank")
    _assert_all_refused(out, "paths", "different paths", "ck_rank0", "ck_rank1")
    _assert_all_refused(out, "load_paths", "different paths", "/ck'", "zero_checkpoint")
    _assert_all_refused(out, "disk_full", "No space left on device", "rank00001.safetensors")
    _assert_all_refused(out, "extra_file", "notes.txt", "did not write")
    _assert_all_refused(out, "foreign_tmp", "ck.tmp exists and is not")
    _assert_all_refused(out, "live_lock", "being written by another job", "another-host", "ck.lock")
    for r in range(2):
        o = out[r]
        assert o["user_dir_kept"] and o["file_kept"] and o["paths_created"] == [], o
        assert o["disk_full_kept"], "a failed save changed the previous checkpoint"
        assert o["disk_full_listing"] == ["afile", "ck", "exp1"], o["disk_full_listing"]  # no .tmp, no .lock
        assert o["extra_file_kept"] and o["foreign_tmp_kept"] and o["live_lock_kept"], o
        for case in ("own_tmp_save", "own_tmp_load", "stale_lock", "old_lock", "old_fallback"):
            assert o[case][0] == "ok", (case, o[case])
        assert not o["own_tmp_after_save"] and not o["own_tmp_after_load"], ("a leftover .tmp of ours was kept", r, o["own_tmp_after_save"], o["own_tmp_after_load"])
        assert not o["stale_lock_after"] and not o["old_lock_after"]
        assert o["old_fallback_values"], "the .old checkpoint was not the one loaded"
        assert o["old_after_save"] == ["zero_checkpoint"], o["old_after_save"]


# ---------------------------------------------------------------------------------------
# damaged checkpoints: a CheckpointError naming the file, on every rank, in seconds
# ---------------------------------------------------------------------------------------
def _manifest_edit(fn, seal=True):
    """An edit of the manifest's values.  ``seal``: the manifest's own checksum is
    recomputed afterwards, as a deliberate editor would, so that the structural checks
    behind it are what must refuse the edit; unsealed, the checksum must."""
    from zero_strategy.checkpoint.manifest import seal as reseal

    def edit(d: Path) -> None:
        m = json.loads((d / "manifest.json").read_text())
        fn(m)
        (d / "manifest.json").write_text(json.dumps(reseal(m) if seal else m))
    return edit


def _rename_key(old: str, new: str):
    def edit(m: dict) -> None:
        m[new] = m.pop(old)
    return edit


def _group(**values):
    def edit(m: dict) -> None:
        m["optimizer"]["param_groups"][0].update(values)
    return edit


def _add_group(m: dict) -> None:
    opt = m["optimizer"]
    opt["param_groups"].append(dict(opt["param_groups"][0]))
    opt["param_names"].append([])


def _fifo(name: str):
    def edit(d: Path) -> None:
        (d / name).unlink()
        os.mkfifo(d / name)
    return edit


def _link(name: str, target):
    """``name`` replaced by a symbolic link to ``target`` (a path, or a callable giving
    one from the directory)."""
    def edit(d: Path) -> None:
        to = target(d) if callable(target) else target
        (d / name).unlink()
        os.symlink(to, d / name)
    return edit


def _copy_outside(name: str):
    def where(d: Path) -> str:
        out = d.parent / f"{d.name}-outside-{name}"
        shutil.copy(d / name, out)
        return str(out)
    return where


def _deep_manifest(d: Path) -> None:
    (d / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)


def _huge_name(m: dict) -> None:
    m["tensors"][0]["names"].append("x" * (8 << 20))


def _flip(name: str, at: int = -10):
    def edit(d: Path) -> None:
        f = d / name
        data = bytearray(f.read_bytes())
        data[at] ^= 0x40
        f.write_bytes(bytes(data))
    return edit


_flip_byte = _flip("rank00001.safetensors")  # inside the tensor data (the header is at the start)


def _swap_ranks(d: Path) -> None:
    a, b = d / "rank00000.safetensors", d / "rank00001.safetensors"
    os.rename(a, d / "x")
    os.rename(b, a)
    os.rename(d / "x", b)


def _offset_plus_one(m: dict) -> None:
    entry = next(t for t in m["tensors"] if t["unit"] is not None and t["offset"] > 0)
    entry["offset"] += 1


def _swap_locations(m: dict) -> None:
    entries = [t for t in m["tensors"] if t["unit"] is not None]
    for i, a in enumerate(entries):
        for b in entries[i + 1:]:
            if a["numel"] == b["numel"] and (a["unit"], a["offset"]) != (b["unit"], b["offset"]):
                a["unit"], a["offset"], b["unit"], b["offset"] = b["unit"], b["offset"], a["unit"], a["offset"]
                return
    raise AssertionError("no two tensors of one size")


def _truncate_manifest(d: Path) -> None:
    f = d / "manifest.json"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _garbage(name: str, same_size: bool = True):
    def edit(d: Path) -> None:
        f = d / name
        n = f.stat().st_size if same_size else 100
        f.write_bytes(os.urandom(n) if name.endswith(".safetensors") else b"{not json" + b" " * max(0, n - 9))
    return edit


def _truncate(name: str):
    def edit(d: Path) -> None:
        with open(d / name, "r+b") as fh:
            fh.truncate((d / name).stat().st_size - 100)
    return edit


def _edit_rng(d: Path) -> None:
    """Still valid JSON of the same size: only the checksum can tell."""
    f = d / "rank00000.json"
    text = f.read_text()
    i = text.index('"rng_cpu": [') + len('"rng_cpu": [')
    f.write_text(text[:i] + ("1" if text[i] != "1" else "2") + text[i + 1:])


def _mixed(d: Path) -> None:
    shutil.copy(d.parent / "other" / "rank00001.safetensors", d / "rank00001.safetensors")


def _to_v1(m: dict) -> None:
    m["format_version"] = 1
    for k in ("files", "checkpoint_id", "checksum"):
        m.pop(k, None)


def _v1(*more):
    def edit(d: Path) -> None:
        _manifest_edit(_to_v1)(d)
        for f in more:
            f(d)
    return edit


# case -> (edit of a copy of a good 2-rank checkpoint, texts the error must contain)
CORRUPTIONS = {
    "flipped_data_byte": (_flip_byte, ["rank00001.safetensors is corrupted", "CRC-32"]),
    "swapped_rank_files": (_swap_ranks, ["rank00000.safetensors holds rank 1's shard", "renamed or swapped"]),
    "offset_plus_one": (_manifest_edit(_offset_plus_one), ["manifest.json", "do not tile"]),
    "swapped_locations": (_manifest_edit(_swap_locations), ["manifest.json does not describe", "edited or damaged"]),
    "unit_world_1": (_manifest_edit(lambda m: m["units"][0].update(world=1)), ["manifest.json", "units[0].world is 1"]),
    "shard_numel_0": (_manifest_edit(lambda m: m["units"][0].update(shard_numel=0)), ["manifest.json", "units[0].shard_numel"]),
    "numel_not_shape": (_manifest_edit(lambda m: m["tensors"][0].update(shape=[3, 5])), ["manifest.json", "has numel"]),
    "truncated_manifest": (_truncate_manifest, ["manifest.json is not valid JSON"]),
    "manifest_not_object": (lambda d: (d / "manifest.json").write_text("[1, 2]"), ["manifest.json", "must be an object"]),
    "garbage_rank_json": (_garbage("rank00001.json"), ["rank00001.json is not valid JSON"]),
    "edited_rank_json": (_edit_rng, ["rank00000.json is corrupted"]),
    "garbage_safetensors": (_garbage("rank00000.safetensors"), ["rank00000.safetensors is unreadable"]),
    # a size that differs from the manifest's record is refused before any byte is read
    "short_garbage_safetensors": (_garbage("shared.safetensors", same_size=False),
                                  ["shared.safetensors has 100 bytes but the manifest records", "truncated or was replaced"]),
    "truncated_shard": (_truncate("rank00001.safetensors"), ["rank00001.safetensors has", "truncated or was replaced"]),
    "mixed_saves": (_mixed, ["rank00001.safetensors belongs to another save"]),
    "flipped_client_state": (_flip("client_state.pt"), ["client_state.pt"]),
    "unlisted_client_state": (_manifest_edit(lambda m: m["files"].pop("client_state.pt")), ["client_state.pt is not part of this checkpoint"]),
    "v1_garbage_rank_json": (_v1(_garbage("rank00000.json")), ["rank00000.json is not valid JSON"]),
    "v1_garbage_safetensors": (_v1(_garbage("rank00001.safetensors")), ["rank00001.safetensors is unreadable"]),
    "v1_unit_world_1": (_v1(_manifest_edit(lambda m: m["units"][0].update(world=1))), ["units[0].world is 1"]),
    # The manifest checks itself (issue #34 item 2): a changed value or a renamed key parses
    # and may pass every structural check, so only its own checksum can tell ...
    "manifest_step_unsealed": (_manifest_edit(lambda m: m.update(step=m["step"] + 1), seal=False),
                               ["manifest.json is damaged", "CRC-32"]),
    "manifest_optimizer_renamed_unsealed": (_manifest_edit(_rename_key("optimizer", "optimizes"), seal=False),
                                            ["manifest.json is damaged"]),
    # ... and behind it the values the loader applies are checked against the live optimizer.
    "manifest_optimizer_renamed": (_manifest_edit(_rename_key("optimizer", "optimizes")), ["manifest.json", "has no 'optimizer'"]),
    "manifest_optimizer_dropped": (_manifest_edit(lambda m: m.update(optimizer=None)),
                                   ["has no optimizer section, but its rank files hold optimizer state"]),
    "group_lr_nan": (_manifest_edit(_group(lr=float("nan"))), ["param_groups[0]['lr']", "not finite"]),
    "group_lr_text": (_manifest_edit(_group(lr="abc")), ["param_groups[0]['lr'] is 'abc'", "expected a number"]),
    "group_betas_short": (_manifest_edit(_group(betas=[0.9])), ["param_groups[0]['betas']", "expected 2 values"]),
    "group_unknown_key": (_manifest_edit(_group(momentum_typo=0.5)), ["'momentum_typo'", "does not have"]),
    "group_added": (_manifest_edit(_add_group),
                    ["saved param group(s) but the live optimizer has"]),
    "deep_manifest": (_deep_manifest, ["manifest.json is not a valid checkpoint file", "nests too deeply"]),
    "huge_name": (_manifest_edit(_huge_name), ["manifest.json", "a string of 8388608 characters"]),
    # Special files, as tarballs carry them (issue #34 item 1): refused before a read can
    # block (a FIFO) or run without end (a link to /dev/zero), on every rank.
    "fifo_rank_json": (_fifo("rank00000.json"), ["rank00000.json is a FIFO (named pipe), not a regular file"]),
    "fifo_safetensors": (_fifo("rank00000.safetensors"), ["rank00000.safetensors is a FIFO"]),
    "fifo_client_state": (_fifo("client_state.pt"), ["client_state.pt is a FIFO"]),
    "fifo_shared": (_fifo("shared.safetensors"), ["shared.safetensors is a FIFO"]),
    "fifo_manifest": (_fifo("manifest.json"), ["manifest.json is a FIFO"]),
    "fifo_config": (_fifo("config.json"), ["config.json is a FIFO"]),
    "dev_zero_rank_json": (_link("rank00001.json", "/dev/zero"), ["rank00001.json is a symbolic link, not a regular file"]),
    "dev_zero_manifest": (_link("manifest.json", "/dev/zero"), ["manifest.json is a symbolic link"]),
    "dev_zero_client_state": (_link("client_state.pt", "/dev/zero"), ["client_state.pt is a symbolic link"]),
    "link_to_good_copy": (_link("rank00001.safetensors", _copy_outside("rank00001.safetensors")),
                          ["rank00001.safetensors is a symbolic link"]),
}


def _make_corrupted_copies(root: Path, cases) -> None:
    for case in cases:
        shutil.copytree(root / "good", root / case)
        CORRUPTIONS[case][0](root / case) if case in CORRUPTIONS else _v1()(root / case)


def _bound_memory(extra_bytes: int = 6 << 30) -> None:
    """A read without end (a link to /dev/zero) fails with MemoryError in this process
    instead of exhausting the machine, should the check against it regress."""
    import resource

    vm = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
              if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + extra_bytes, resource.getrlimit(resource.RLIMIT_AS)[1]))


def _corruption_worker(rank, ws, root, cases):
    root = Path(root)
    _bound_memory()
    model, engine = _engine()
    _step(engine, model, rank, ws)
    engine.save_checkpoint(root / "good", client_state={"epoch": 1})
    _step(engine, model, rank, ws, 1)
    engine.save_checkpoint(root / "other")
    _barrier()
    if rank == 0:
        _make_corrupted_copies(root, cases + ["v1"])
    _barrier()
    before = engine.full_state_dict(rank0_only=False)
    out = {}
    for case in cases:
        out[case] = _attempt(lambda: engine.load_checkpoint(root / case))
        after = engine.full_state_dict(rank0_only=False)
        out[case + "/unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["v1"] = _attempt(lambda: engine.load_checkpoint(root / "v1"))
    out["v1/warnings"] = [str(w.message) for w in caught]
    return out


@pytest.mark.slow
def test_each_corruption_is_a_checkpoint_error_naming_the_file_on_every_rank(tmp_path):
    cases = sorted(CORRUPTIONS)
    result = run_distributed_outcomes(_corruption_worker, 2, str(tmp_path), cases, timeout=600)
    out = _results(result, 2)
    for case in cases:
        _assert_all_refused(out, case, *CORRUPTIONS[case][1])
        assert all(len(out[r][case][1]) < 2000 for r in range(2)), (case, "the message copies the file's content")
        for r in range(2):
            assert out[r][case + "/unchanged"], f"{case}: a refused checkpoint changed the model on rank {r}"
    # A version-1 checkpoint (no checksums) still loads, with a warning.
    for r in range(2):
        assert out[r]["v1"][0] == "ok", out[r]["v1"]
        assert any("format-version-1" in w and "no checksums" in w for w in out[r]["v1/warnings"]), out[r]["v1/warnings"]
    # Consolidation reads the same files and refuses them the same way (one process).
    from zero_strategy.checkpoint import CheckpointError, consolidate, load_consolidated_state_dict
    from zero_strategy.cli import main

    for case in ("flipped_data_byte", "swapped_locations", "unit_world_1", "mixed_saves", "manifest_step_unsealed",
                 "deep_manifest", "fifo_config", "fifo_safetensors", "dev_zero_manifest"):
        needle = CORRUPTIONS[case][1][0]
        with pytest.raises(CheckpointError, match=needle.replace(".", r"\.").replace("'", ".")):
            load_consolidated_state_dict(tmp_path / case)
        with pytest.raises(CheckpointError, match=needle.replace(".", r"\.").replace("'", ".")):
            consolidate(tmp_path / case, tmp_path / f"{case}-hf")
        assert not (tmp_path / f"{case}-hf").exists()
        assert main(["consolidate", str(tmp_path / case), str(tmp_path / f"{case}-hf")]) == 1


# ---------------------------------------------------------------------------------------
# two jobs saving into one directory
# ---------------------------------------------------------------------------------------
def _concurrent_worker(rank, ws, root, role):
    import zero_strategy.checkpoint.save as ck

    root = Path(root)
    model, engine = _engine(seed=0 if role == "holder" else 1)
    _step(engine, model, rank, ws)
    holding, release = root / "holding", root / "release"
    if role == "holder":
        if rank == 0:
            original = ck._write_rank0_files

            def slow(*args, **kwargs):  # inside the save, holding the lock
                holding.write_text("1")
                deadline = time.monotonic() + 120
                while not release.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                return original(*args, **kwargs)

            ck._write_rank0_files = slow
        result = _attempt(lambda: engine.save_checkpoint(root / "shared_ck"))
        return result + (engine.full_state_dict(rank0_only=False),)
    deadline = time.monotonic() + 120
    while not holding.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    result = _attempt(lambda: engine.save_checkpoint(root / "shared_ck"))
    _barrier()
    if rank == 0:
        release.write_text("1")
    return result + (None,)


def _load_full(rank, ws, path):
    model, engine = _engine(seed=3)
    engine.load_checkpoint(path)
    return engine.full_state_dict(rank0_only=False)


@pytest.mark.slow
def test_two_jobs_saving_into_one_directory_one_wins_the_other_fails_clearly(tmp_path):
    results = {}

    def job(role):
        results[role] = run_distributed_outcomes(_concurrent_worker, 2, str(tmp_path), role, timeout=400)

    threads = [threading.Thread(target=job, args=(role,)) for role in ("holder", "loser")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    holder = _results(results["holder"], 2)
    loser = _results(results["loser"], 2)
    for r in range(2):
        assert holder[r][0] == "ok", holder[r][:2]
        kind, text, seconds = loser[r][:3]
        assert kind == "CheckpointError" and "being written by another job" in text and "shared_ck.lock" in text, (kind, text)
        assert "pid" in text and socket.gethostname() in text, text
        assert seconds < FEW_SECONDS, seconds
    assert sorted(os.listdir(tmp_path)) == ["holding", "release", "shared_ck"]
    loaded = run_distributed(_load_full, 2, str(tmp_path / "shared_ck"))[0]
    assert all(torch.equal(loaded[k], holder[0][3][k]) for k in loaded), "the winner's checkpoint is not the one on disk"


# ---------------------------------------------------------------------------------------
# consolidation (one process, no process group)
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def single_checkpoint(tmp_path_factory):
    model, engine = _engine()
    _step(engine, model, 0, 1)
    path = tmp_path_factory.mktemp("single") / "ck"
    engine.save_checkpoint(path)
    return path


def test_consolidate_refuses_foreign_directories_and_the_checkpoint_itself(single_checkpoint, tmp_path):
    from zero_strategy.checkpoint import CheckpointError, consolidate
    from zero_strategy.cli import main

    ck = single_checkpoint
    ck_before = _snapshot(ck)
    precious = tmp_path / "precious"
    (precious / "other_model").mkdir(parents=True)
    (precious / "notes.txt").write_text("keep me")
    (precious / "other_model" / "model.safetensors").write_bytes(b"weights")
    before = _snapshot(precious)
    with pytest.raises(CheckpointError, match="precious exists and is not a consolidated zero_strategy export"):
        consolidate(ck, precious)
    assert main(["consolidate", str(ck), str(precious)]) == 1
    assert _snapshot(precious) == before
    for target in (ck, ck / "inner", ck.parent):
        with pytest.raises(CheckpointError, match="would replace the sharded checkpoint"):
            consolidate(ck, target)
        assert main(["consolidate", str(ck), str(target)]) == 1
    # A sharded checkpoint is not an export either.
    other = tmp_path / "ck2"
    shutil.copytree(ck, other)
    with pytest.raises(CheckpointError, match="is a sharded zero_strategy checkpoint, not a consolidated"):
        consolidate(ck, other)
    assert _snapshot(ck) == ck_before
    # Its own export is replaced; once a user adds a file, it is not.
    out = tmp_path / "hf"
    consolidate(ck, out)
    first = _snapshot(out)
    consolidate(ck, out, dtype="bf16")
    assert _snapshot(out) != first and sorted(os.listdir(out)) == [".zero_strategy", "config.json", "model.safetensors"]
    (out / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        consolidate(ck, out)
    assert (out / "tokenizer.json").exists()
    # An empty directory holds nothing and may be used.
    empty = tmp_path / "empty"
    empty.mkdir()
    consolidate(ck, empty)
    assert (empty / "model.safetensors").exists()
    assert not any(p.name.endswith((".tmp", ".lock", ".old")) for p in tmp_path.iterdir())


def test_single_process_corruptions_are_refused_before_anything_is_read(single_checkpoint, tmp_path):
    """The manifest checks need no process group: crafted manifests that used to loop,
    divide by zero or raise KeyError are CheckpointErrors naming the manifest."""
    from zero_strategy.checkpoint import CheckpointError, load_consolidated_state_dict

    edits = {
        "unit_world_2": lambda m: m["units"][0].update(world=2),  # saved at world size 1
        "shard_numel_0": lambda m: m["units"][0].update(shard_numel=0),
        "no_units": lambda m: m.pop("units"),
        "tensor_not_object": lambda m: m["tensors"].__setitem__(0, "x"),
        "bad_unit_ref": lambda m: m["tensors"][0].update(unit=999),
        "past_the_unit": lambda m: m["tensors"][0].update(offset=10**9),
        "bool_world": lambda m: m.update(world_size=True),
        "bad_dtype": lambda m: m["tensors"][0].update(dtype="complex-ish"),
        "bad_file_name": lambda m: m["files"].update({"../x": {"size": 1, "crc32": 1}}),
        "missing_file_entry": lambda m: m["files"].pop("shared.safetensors"),
        "duplicate_name": lambda m: m["tensors"][1].update(names=m["tensors"][0]["names"]),
    }
    for case, fn in edits.items():
        d = tmp_path / case
        shutil.copytree(single_checkpoint, d)
        _manifest_edit(fn)(d)
        t = time.monotonic()
        with pytest.raises(CheckpointError, match="manifest.json"):
            load_consolidated_state_dict(d)
            pytest.fail(f"{case}: no error")
        assert time.monotonic() - t < 5, case


# ---------------------------------------------------------------------------------------
# the lock alone
# ---------------------------------------------------------------------------------------
def test_lock_is_exclusive_between_threads_and_breaks_only_stale_holders(tmp_path):
    from zero_strategy.checkpoint.files import CheckpointError, DirectoryLock

    d = tmp_path / "ck"
    got, barrier = [], threading.Barrier(8)

    def take():
        barrier.wait()
        got.append(DirectoryLock.try_take(d))

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    held = [g for g in got if g is not None]
    assert len(held) == 1
    with pytest.raises(CheckpointError, match=f"pid {os.getpid()} on host {socket.gethostname()}"):
        DirectoryLock.take(d, "save_checkpoint(ck)")  # a live holder (this process)
    held[0].release()
    assert not (tmp_path / "ck.lock").exists()
    # A holder with this pid but another start time is a reused pid: stale.
    (tmp_path / "ck.lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "start": "1", "token": "t"}))
    DirectoryLock.take(d, "x").release()
    # Another release does not remove a lock it no longer holds.
    lock = DirectoryLock.take(d, "x")
    (tmp_path / "ck.lock").write_text(json.dumps({"pid": 1, "host": "elsewhere", "token": "theirs"}))
    lock.release()
    assert (tmp_path / "ck.lock").exists()
