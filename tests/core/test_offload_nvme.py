"""Disk offload (offload_optimizer / offload_param: nvme): the fp32 master shards and the
optimizer state live in files, and training is the in-memory run's.

References: fp32 must equal the in-memory run (offload_optimizer none, same engine
math) bit for bit; bf16 must match the single-process plain-torch reference within
test_parity's tolerances.  Residency is read from the kernel (/proc/self/smaps), disk
use from the files themselves, not from the engine's own report."""
import errno
import gc
import os
import re
from pathlib import Path

import pytest
import torch

from dist_harness import run_distributed, run_distributed_outcomes
from parity import build, reference_run, zero_run
from test_parity import LOSS_TOL, UPDATE_TOL, _relative_update_error

import zero_strategy
from zero_strategy import ZeroConfig
from zero_strategy.offload import disk_offload
from zero_strategy.offload.disk_offload import MARKER, DiskOffloadError


_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$")


def _mappings_of_files_under(directory):
    """[(start, end, resident bytes)] of this process's mappings of files under ``directory``,
    as the kernel reports them (/proc/self/smaps)."""
    found, current = [], None
    prefix = str(directory) + os.sep
    with open("/proc/self/smaps") as f:
        for line in f:
            m = _MAPPING.match(line)
            if m:
                current = [int(m.group(1), 16), int(m.group(2), 16), 0] if m.group(3).startswith(prefix) else None
                if current is not None:
                    found.append(current)
            elif current is not None and line.startswith("Rss:"):
                current[2] = int(line.split()[1]) * 1024
    return found


def _tiny(seed=0):
    from models import tiny_gpt2

    model = tiny_gpt2(seed=seed, n_embd=32)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_steps(engine, model, steps=2):
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        ids = torch.randint(0, 96, (2, 8), generator=g)
        engine.backward(model(input_ids=ids, labels=ids).loss)
        engine.step()


# -- configuration -----------------------------------------------------------------------------
@pytest.mark.parametrize("fields,message", [
    (dict(offload_optimizer="nvme"), "needs nvme_path"),
    (dict(nvme_path="/tmp/x"), "only used by disk offload"),
    (dict(offload_optimizer="cpu", nvme_path="/tmp/x"), "only used by disk offload"),
    (dict(stage=0, offload_optimizer="nvme", nvme_path="/tmp/x"), "needs stage 1, 2 or 3"),
    (dict(stage=2, offload_optimizer="nvme", offload_param="nvme", nvme_path="/tmp/x"), "offload_param='nvme' needs stage 3"),
    (dict(stage=3, offload_optimizer="cpu", offload_param="nvme", nvme_path="/tmp/x"), "offload_optimizer='nvme'"),
    (dict(stage=3, offload_param="cpu"), "parameter offload is to disk only"),
    (dict(offload_optimizer="disk"), "must be 'none', 'cpu' or 'nvme'"),
    (dict(offload_optimizer="nvme", nvme_path=""), "nvme_path must be a directory path"),
    (dict(offload_optimizer="nvme", nvme_path="/tmp/x", nvme_inflight_bytes=0), "nvme_inflight_bytes must be >= 1"),
])
def test_config_errors_say_what_is_wrong(fields, message):
    with pytest.raises(ValueError, match=message):
        ZeroConfig(**fields)


def test_path_problems_are_clear_errors(tmp_path, monkeypatch):
    afile = tmp_path / "a_file"
    afile.write_text("not a directory")
    model, opt = _tiny()
    with pytest.raises(DiskOffloadError, match="is a file, not a directory"):
        zero_strategy.initialize(model, opt, dict(stage=2, offload_optimizer="nvme", nvme_path=str(afile)))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "manifest.json").write_text("{}")
    model, opt = _tiny()
    with pytest.raises(DiskOffloadError, match="is a checkpoint directory"):
        zero_strategy.initialize(model, opt, dict(stage=2, offload_optimizer="nvme", nvme_path=str(ckpt)))
    ro = tmp_path / "read_only"
    ro.mkdir()
    if os.geteuid() == 0:  # root may write anywhere: make this directory read-only for the check
        real = os.access
        monkeypatch.setattr(disk_offload.os, "access", lambda p, m: False if Path(p) == ro else real(p, m))
    else:
        ro.chmod(0o500)
    model, opt = _tiny()
    with pytest.raises(DiskOffloadError, match=f"nvme_path '{ro}' is not writable"):
        zero_strategy.initialize(model, opt, dict(stage=2, offload_optimizer="nvme", nvme_path=str(ro)))
    ro.chmod(0o700)
    assert list(ro.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "ckpt", "read_only"]


# -- files, residency, cleanup (world size 1, no process group) ---------------------------------
def test_state_lives_in_files_that_are_removed_at_close_and_at_garbage_collection(tmp_path):
    root = tmp_path / "offload" / "here"  # does not exist: created by the engine, removed after
    (tmp_path / "theirs.txt").write_text("someone else's file")
    model, opt = _tiny()
    # Several units, and an in-flight bound below one unit's state: one unit at a time.
    engine = zero_strategy.initialize(model, opt, dict(stage=2, precision="bf16", offload_optimizer="nvme",
                                                       nvme_path=str(root), reduce_bucket_size=4000,
                                                       nvme_inflight_bytes=30_000))
    (mine,) = list(root.iterdir())
    assert mine.name.startswith("zero_offload-rank0-") and (mine / MARKER).is_file()
    _train_steps(engine, model, 2)
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    files = {p.name: p.stat().st_size for p in mine.iterdir() if p.name != MARKER}
    # fp32 master + Adam's two moments, 12 bytes per parameter (padding aside), on disk.
    assert 12 * psi <= sum(files.values()) <= 12 * psi + 4096 * len(files)
    assert any(".state.exp_avg_sq." in n for n in files) and any(".master." in n for n in files)
    # The optimizer's state tensors and the master shards are memory maps of those files,
    # and none of them is resident between steps: the kernel says so.
    maps = _mappings_of_files_under(mine)
    assert len(maps) == len(files) and sum(rss for _, _, rss in maps) == 0
    tensors = [v for st in opt.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]
    tensors += [p for g in opt.param_groups for p in g["params"]]  # what the optimizer updates: the masters
    assert tensors and all(any(a <= t.data_ptr() < b for a, b, _ in maps) for t in tensors)
    report = engine.memory_report()
    assert report["host"] == 0 and report["disk"] >= 12 * psi
    io = engine.disk_offload.report()
    disk = io["disk_bytes"]
    # Every step writes every file once; from the second step on it also reads them all
    # (the first step finds no optimizer state yet).
    assert io["last_step"]["bytes_written"] == disk and io["last_step"]["bytes_read"] == disk
    # A file we did not make (here: a user's note in our directory) is not deleted.
    engine.close()
    assert not root.exists() and not (tmp_path / "offload").exists()
    assert (tmp_path / "theirs.txt").read_text() == "someone else's file"
    # The parameters still work after close (the mappings stay valid).
    ids = torch.randint(0, 96, (2, 8))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)

    model, opt = _tiny()
    engine = zero_strategy.initialize(model, opt, dict(stage=1, offload_optimizer="nvme", nvme_path=str(tmp_path)))
    _train_steps(engine, model, 1)
    (mine,) = [p for p in tmp_path.iterdir() if p.name.startswith("zero_offload-")]
    (mine / "user_note.txt").write_text("keep me")
    del engine, opt, model
    gc.collect()
    assert (mine / "user_note.txt").read_text() == "keep me"  # not ours: kept, so is its directory
    assert sorted(p.name for p in mine.iterdir()) == ["user_note.txt"]


def test_offload_directory_is_never_taken_for_a_checkpoint(tmp_path):
    model, opt = _tiny()
    engine = zero_strategy.initialize(model, opt, dict(stage=2, offload_optimizer="nvme", nvme_path=str(tmp_path)))
    _train_steps(engine, model, 1)
    (mine,) = list(tmp_path.iterdir())
    before = sorted(p.name for p in mine.iterdir())
    with pytest.raises(zero_strategy.CheckpointError, match="is a disk-offload directory"):
        engine.load_checkpoint(mine)
    with pytest.raises(zero_strategy.CheckpointError, match="is not a sharded zero_strategy checkpoint"):
        engine.save_checkpoint(mine)  # nor replaced by one
    assert sorted(p.name for p in mine.iterdir()) == before
    engine.close()


def test_disk_full_names_the_directory(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    model, opt = _tiny()
    monkeypatch.setattr(disk_offload.os, "posix_fallocate", full)
    with pytest.raises(DiskOffloadError, match=r"could not create its files in .*zero_offload-rank0-.*No space left on "
                                               r"device.*disk is full"):
        zero_strategy.initialize(model, opt, dict(stage=2, offload_optimizer="nvme", nvme_path=str(tmp_path)))
    gc.collect()
    assert list(tmp_path.iterdir()) == []  # what the failed engine made is gone
    monkeypatch.undo()
    # Full at the first step, when the optimizer state is moved to disk.
    model, opt = _tiny()
    engine = zero_strategy.initialize(model, opt, dict(stage=3, param_persistence_threshold=0, offload_optimizer="nvme",
                                                       nvme_path=str(tmp_path)))
    monkeypatch.setattr(disk_offload.os, "posix_fallocate", full)
    with pytest.raises(DiskOffloadError, match=rf"rank\(s\) \[0\].*{re.escape(str(tmp_path))}.*No space left"):
        _train_steps(engine, model, 1)
    engine.close()


# -- parity, checkpoints, a failure on one rank (real gloo processes) ----------------------------
def _jobs(ws, root):
    """fp32 with disk offload beside the same run in memory (bit-equal), bf16 with disk
    offload (against the reference); stage 3 with every parameter partitioned, with the
    16-bit shards on disk too.  World size 1 runs a subset (same code, no collectives)."""
    # The optimizer's own step over per-piece views, as in memory: bit-equality is about the
    # files; the fused host kernel (the default, rounding differently) is tests/core/test_host_step.py's.
    disk = dict(offload_optimizer="nvme", nvme_path=root, nvme_inflight_bytes=20_000,  # below one unit: one at a time
                host_optimizer_step="optimizer")
    params = dict(disk, offload_param="nvme", nvme_inflight_bytes=256 * 2**20)
    jobs = []
    for stage in ((1, 2, 3) if ws > 1 else (2, 3)):
        base = dict(stage=stage, world_size=ws, accum=2, steps=2, optim="adamw", persist=0 if stage == 3 else 64)
        jobs += [dict(base, precision="fp32", config=disk), dict(base, precision="fp32")]
        if ws > 1 or stage == 3:
            jobs.append(dict(base, precision="bf16", config=params if stage == 3 else disk))
        if stage == 3:
            jobs.append(dict(base, precision="fp32", config=params))
    return [dict(j, with_report=True) for j in jobs]


def _ckpt_run(rank, ws, mode, path, root, stage):
    from models import lm_batches
    from test_checkpoint import GLOBAL_BATCH, STEPS, _train

    batches = lm_batches(STEPS, GLOBAL_BATCH)
    cfg = dict(stage=stage, precision="fp32", reduce_bucket_size=3000, param_persistence_threshold=0)
    if root is not None:
        cfg.update(offload_optimizer="nvme", nvme_path=root)
    model, opt = build(dict(optim="adamw", seed=0 if mode != "resume" else 7))
    engine = zero_strategy.initialize(model, opt, cfg)
    try:
        if mode == "uninterrupted":
            return _train(engine, model, rank, ws, batches)[2:]
        if mode == "save":
            _train(engine, model, rank, ws, batches[:2])
            engine.save_checkpoint(path)
            return None
        engine.load_checkpoint(path)
        return _train(engine, model, rank, ws, batches[2:])
    finally:
        engine.close()


def _worker(rank, ws, root, ckpt, plan):
    import transformers

    transformers.logging.set_verbosity_error()
    out = {"parity": [zero_run(rank, ws, j) for j in _jobs(ws, root)]}
    gc.collect()  # zero_run does not close its engines: collection removes their files
    out["left_behind"] = sorted(n for n in os.listdir(root) if n.startswith(f"zero_offload-rank{rank}-"))
    for what, args in plan:
        out[what] = _ckpt_run(rank, ws, *args)
    if ws == 2:
        # Disk full on rank 1 only, at the first step: both ranks raise, naming rank 1's directory.
        model, opt = _tiny()
        engine = zero_strategy.initialize(model, opt, dict(stage=2, offload_optimizer="nvme", nvme_path=root))
        if rank == 1:
            def full(fd, offset, length):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            disk_offload.os.posix_fallocate = full
        try:
            _train_steps(engine, model, 1)
            out["full"] = None
        except DiskOffloadError as e:
            out["full"] = (str(e), str(engine.disk_offload.directory))
        engine.close()
    return out


def _check_parity(ws, results):
    jobs = _jobs(ws, "x")
    failures, memory = [], {}
    for job, result in zip(jobs, results):
        losses, sd = result[:2]
        if "config" not in job:
            memory[job["stage"]] = (losses, sd, result[2])
    for job, result in zip(jobs, results):
        if "config" not in job:
            continue
        losses, sd, report = result
        # The master and optimizer state were in the files (fp32 Adam: 4 + 8 bytes/param over N).
        psi = sum(t.numel() for n, t in sd.items() if n != "transformer.wpe.weight" and n != "lm_head.weight")
        if report["host"] != 0 or report["disk"] < 12 * psi // ws:
            failures.append(f"{job}: not on disk: {report}")
        if job["precision"] == "fp32":
            ref_losses, ref_sd, _ = memory[job["stage"]]
            if losses != ref_losses or any(not torch.equal(sd[k], ref_sd[k]) for k in ref_sd):
                failures.append(f"{job}: fp32 differs from the in-memory run")
            continue
        ref_losses, ref_params = reference_run(job)
        loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses))
        upd_err = _relative_update_error(job, sd, ref_params)
        if loss_err > LOSS_TOL["bf16"] or upd_err > UPDATE_TOL["bf16", job["optim"]]:
            failures.append(f"{job}: loss err {loss_err:.2e}, update err {upd_err:.2e}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_disk_offload_matches_in_memory_training_saves_reshards_and_fails_together(tmp_path):
    root2, root1 = str(tmp_path / "off2"), str(tmp_path / "off1")
    os.makedirs(root2), os.makedirs(root1)
    ckpt = str(tmp_path / "ckpt")
    # World size 2: parity, then a stage-2 checkpoint saved from disk offload, then disk full on rank 1.
    r2 = run_distributed(_worker, 2, root2, ckpt, [("save", ("save", ckpt, root2, 2))])
    _check_parity(2, r2[0]["parity"])
    assert r2[0]["left_behind"] == [] and r2[1]["left_behind"] == []
    (msg0, _), (msg1, dir1) = r2[0]["full"], r2[1]["full"]
    for msg in (msg0, msg1):
        assert "failed on rank(s) [1]" in msg and dir1 in msg and "No space left on device" in msg
    assert os.listdir(root2) == []
    # World size 1: parity, and the checkpoint resumed at stage 3 with and without disk
    # offload matches the uninterrupted in-memory run at that size.
    plan = [("resumed_disk", ("resume", ckpt, root1, 3)), ("resumed_memory", ("resume", ckpt, None, 3)),
            ("uninterrupted", ("uninterrupted", ckpt, None, 3))]
    (r1,) = run_distributed(_worker, 1, root1, ckpt, plan)
    _check_parity(1, r1["parity"])
    assert r1["resumed_disk"] == r1["resumed_memory"]  # fp32: bit-equal
    assert max(abs(a - b) for a, b in zip(r1["resumed_disk"], r1["uninterrupted"])) < 2e-5
    assert os.listdir(root1) == []


def test_lightning_names_take_the_path_from_the_environment(tmp_path, monkeypatch):
    L = pytest.importorskip("lightning.pytorch")
    monkeypatch.delenv("ZERO_STRATEGY_NVME_PATH", raising=False)
    with pytest.raises(ValueError, match="needs a directory for its files: set nvme_path .* ZERO_STRATEGY_NVME_PATH"):
        L.Trainer(strategy="zero3_offload_nvme", accelerator="cpu", devices=1, logger=False)
    monkeypatch.setenv("ZERO_STRATEGY_NVME_PATH", str(tmp_path))
    for name, param in (("zero2_offload_nvme", "none"), ("zero3_offload_nvme", "nvme")):
        cfg = L.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False).strategy.config
        assert (cfg.offload_optimizer, cfg.offload_param, cfg.nvme_path) == ("nvme", param, str(tmp_path))


def test_memory_report_counts_the_16_bit_shards_on_disk(tmp_path):
    """offload_param: the 16-bit shards are file-backed: the report moves them to ``disk``
    (against the files' own sizes)."""
    reports = {}
    for param in ("none", "nvme"):
        model, opt = _tiny()
        engine = zero_strategy.initialize(model, opt, dict(stage=3, precision="bf16", param_persistence_threshold=0,
                                                           offload_optimizer="nvme", offload_param=param,
                                                           nvme_path=str(tmp_path)))
        _train_steps(engine, model, 1)
        (mine,) = list(tmp_path.iterdir())
        shard_files = sum(p.stat().st_size for p in mine.iterdir() if ".param." in p.name)
        reports[param] = (engine.memory_report(), shard_files)
        engine.close()
    (plain, none_files), (on_disk, shard_files) = reports["none"], reports["nvme"]
    assert none_files == 0 and shard_files > 0
    assert on_disk["disk"] - plain["disk"] == shard_files
    assert plain["device"] - on_disk["device"] == shard_files and on_disk["total"] == plain["total"]


def test_a_killed_runs_directory_is_reported_not_deleted(tmp_path):
    import json
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / "zero_offload-rank0-1-deadbeef"
    stale.mkdir()
    import socket

    (stale / MARKER).write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))
    (stale / "unit0.master.float32").write_bytes(b"\0" * 4096)
    model, opt = _tiny()
    with pytest.warns(UserWarning, match=f"{re.escape(str(stale))} holds the disk-offload files of a process that no "
                                         "longer runs"):
        engine = zero_strategy.initialize(model, opt, dict(stage=1, offload_optimizer="nvme", nvme_path=str(tmp_path)))
    engine.close()
    assert sorted(p.name for p in stale.iterdir()) == [MARKER, "unit0.master.float32"]
    assert [p.name for p in tmp_path.iterdir()] == [stale.name]


def test_pretrained_weights_load_into_disk_offload_exactly(tmp_path):
    """Loading into shards whose masters are files, written back every few KB (a tiny
    nvme_inflight_bytes), gives back exactly the saved weights; nothing stays resident."""
    from transformers import GPT2LMHeadModel

    source, _ = _tiny(seed=3)
    source.save_pretrained(tmp_path / "hf")
    expected = {k: v.clone() for k, v in source.state_dict().items()}
    with zero_strategy.init_context():
        model = GPT2LMHeadModel(source.config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    root = tmp_path / "off"
    engine = zero_strategy.initialize(
        model, opt, dict(stage=3, param_persistence_threshold=0, offload_optimizer="nvme", offload_param="nvme",
                         nvme_path=str(root), nvme_inflight_bytes=8192), pretrained=str(tmp_path / "hf"))
    (mine,) = list(root.iterdir())
    assert sum(rss for _, _, rss in _mappings_of_files_under(mine)) == 0
    got = engine.full_state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected if k in got) and "lm_head.weight" in got
    engine.close()
