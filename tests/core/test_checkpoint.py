"""Sharded checkpoints: reshard on load, atomic saves, consolidation, clear errors.

References are independent runs: "resumed at the new size" must match an
uninterrupted run at that size on the same global batches."""
import json
import os
from pathlib import Path

import pytest
import torch

from dist_harness import run_distributed
from parity import build
from models import lm_batches

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks
STEPS = 4


def _train(engine, model, rank, ws, batches):
    losses = []
    for b in batches:
        ids = b.view(ws, GLOBAL_BATCH // ws, -1)[rank]
        loss = model(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone() / ws
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(t)
        losses.append(float(t))
    return losses


def _ckpt_worker(rank, ws, mode, stage, path, precision="fp32"):
    import transformers

    import zero_strategy

    transformers.logging.set_verbosity_error()
    if mode == "resume_and_uninterrupted":
        # One process group for both runs (a spawn costs more than the training here);
        # each run gets its own model and engine.
        return (_ckpt_worker(rank, ws, "resume", stage, path, precision),
                _ckpt_worker(rank, ws, "uninterrupted", stage, path, precision))
    batches = lm_batches(STEPS, GLOBAL_BATCH)
    cfg = dict(stage=stage, precision=precision, reduce_bucket_size=3000, param_persistence_threshold=64)
    model, opt = build(dict(optim="adamw", seed=0 if mode != "resume" else 7))
    engine = zero_strategy.initialize(model, opt, cfg)
    if mode == "uninterrupted":
        return _train(engine, model, rank, ws, batches)[2:]
    if mode == "save":
        _train(engine, model, rank, ws, batches[:2])
        engine.save_checkpoint(path, client_state={"epoch": 3, "note": "hello"})
        return engine.full_state_dict()
    if mode == "resume":
        client = engine.load_checkpoint(path)
        assert client == {"epoch": 3, "note": "hello"}
        assert engine.global_step == 2
        return _train(engine, model, rank, ws, batches[2:])
    raise ValueError(mode)


@pytest.mark.slow
@pytest.mark.parametrize(
    "save_ws,save_stage,load_ws,load_stage",
    [(2, 2, 1, 2), (2, 1, 3, 1), (4, 3, 2, 3), (2, 2, 2, 3), (2, 3, 2, 0)],
    ids=["ws2to1", "ws2to3", "ws4to2-stage3", "stage2to3", "stage3to0"],
)
def test_resharded_resume_matches_uninterrupted_run_at_the_new_size(tmp_path, save_ws, save_stage, load_ws, load_stage):
    path = str(tmp_path / "ckpt")
    run_distributed(_ckpt_worker, save_ws, "save", save_stage, path)
    resumed, reference = run_distributed(_ckpt_worker, load_ws, "resume_and_uninterrupted", load_stage, path)[0]
    assert max(abs(a - b) for a, b in zip(resumed, reference)) < 2e-5, (resumed, reference)


@pytest.mark.slow
def test_same_size_bf16_resume_is_exact(tmp_path):
    path = str(tmp_path / "ckpt")
    run_distributed(_ckpt_worker, 2, "save", 3, path, "bf16")
    resumed, reference = run_distributed(_ckpt_worker, 2, "resume_and_uninterrupted", 3, path, "bf16")[0]
    assert resumed == reference


# ---------------------------------------------------------------------------------------
def _crash_worker(rank, ws, path, crash):
    import transformers

    import zero_strategy
    import zero_strategy.checkpoint.save as ck

    transformers.logging.set_verbosity_error()
    model, opt = build(dict(optim="adamw"))
    engine = zero_strategy.initialize(model, opt, dict(stage=2, reduce_bucket_size=3000))
    batches = lm_batches(STEPS, GLOBAL_BATCH)
    _train(engine, model, rank, ws, batches[:1])
    if not crash:
        engine.save_checkpoint(path)
        return engine.full_state_dict()
    _train(engine, model, rank, ws, batches[1:2])
    if rank == 1:
        original = ck._write_rank_files

        def die_half_way(tmp, r, tensors, extra):
            original(tmp, r, tensors, extra)
            f = ck.rank_file(tmp, r, "safetensors")
            with open(f, "r+b") as fh:
                fh.truncate(os.path.getsize(f) // 2)
            os._exit(17)  # killed in the middle of the save

        ck._write_rank_files = die_half_way
    engine.save_checkpoint(path)
    return None


def _load_worker(rank, ws, path):
    import transformers

    import zero_strategy

    transformers.logging.set_verbosity_error()
    model, opt = build(dict(optim="adamw", seed=5))
    engine = zero_strategy.initialize(model, opt, dict(stage=2, reduce_bucket_size=3000))
    engine.load_checkpoint(path)
    return engine.full_state_dict()


@pytest.mark.slow
def test_rank_killed_during_save_leaves_previous_checkpoint_loadable(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_crash_worker, 2, path, False)[0]
    before = sorted(os.listdir(path))
    with pytest.raises(RuntimeError, match="exited with code|Connection reset|Connection closed"):
        run_distributed(_crash_worker, 2, path, True, timeout=120)
    assert sorted(os.listdir(path)) == before  # the old checkpoint is untouched
    loaded = run_distributed(_load_worker, 2, path)[0]
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k


# ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_consolidated_weights_load_with_plain_from_pretrained(tmp_path):
    from transformers import GPT2LMHeadModel

    from zero_strategy.checkpoint import consolidate, load_consolidated_state_dict
    from zero_strategy.cli import main

    path = tmp_path / "ckpt"
    full = run_distributed(_ckpt_worker, 2, "save", 3, str(path))[0]
    out = tmp_path / "hf"
    assert main(["consolidate", str(path), str(out)]) == 0
    model = GPT2LMHeadModel.from_pretrained(out)
    sd = model.state_dict()
    for k, v in full.items():
        assert torch.equal(sd[k], v), k
    # Split into several files with an index, cast to bf16.
    out2 = tmp_path / "hf_bf16"
    files = consolidate(path, out2, dtype="bf16", max_shard_bytes=20_000)
    assert len(files) > 1 and (out2 / "model.safetensors.index.json").exists()
    model16 = GPT2LMHeadModel.from_pretrained(out2, dtype=torch.bfloat16)
    for k, v in full.items():
        assert torch.equal(model16.state_dict()[k], v.to(torch.bfloat16)), k
    # The in-memory variant agrees and needs no process group.
    mem = load_consolidated_state_dict(path)
    for k, v in full.items():
        assert torch.equal(mem[k], v), k


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad") / "ckpt"
    run_distributed(_ckpt_worker, 2, "save", 2, str(path))
    return path


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _load_single(path, model_kwargs=None):
    import zero_strategy
    from models import tiny_gpt2

    model = tiny_gpt2(**(model_kwargs or {}))
    model.transformer.wpe.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    engine = zero_strategy.initialize(model, opt, dict(stage=2))
    return engine.load_checkpoint(path)


@pytest.mark.slow
def test_bad_checkpoints_give_errors_naming_the_file(saved_checkpoint, tmp_path):
    from zero_strategy.checkpoint import CheckpointError

    missing = _copy(saved_checkpoint, tmp_path / "missing")
    os.unlink(missing / "rank00001.safetensors")
    with pytest.raises(CheckpointError, match="rank00001.safetensors is missing"):
        _load_single(missing)

    truncated = _copy(saved_checkpoint, tmp_path / "truncated")
    f = truncated / "rank00000.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 100)
    with pytest.raises(CheckpointError, match="rank00000.safetensors"):
        _load_single(truncated)

    with pytest.raises(CheckpointError, match="different model.*shape"):
        _load_single(saved_checkpoint, dict(n_embd=48))

    version = _copy(saved_checkpoint, tmp_path / "version")
    m = json.loads((version / "manifest.json").read_text())
    m["format_version"] = 99
    (version / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="format version 99"):
        _load_single(version)

    with pytest.raises(CheckpointError, match="does not exist"):
        _load_single(tmp_path / "nowhere")


def _engine_state(engine) -> dict:
    """Everything a load restores, as comparable values."""
    opt = engine.full_optimizer_state_dict(rank0_only=False)
    return dict(model=engine.full_state_dict(rank0_only=False), step=engine.global_step,
                scaler=engine.scaler.state_dict(), groups=[{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]],
                state={i: dict(s) for i, s in opt["state"].items()})


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)


@pytest.mark.slow
def test_every_bit_flip_of_the_manifest_is_refused_or_changes_nothing(saved_checkpoint, tmp_path):
    """Issue #34 item 2: one bit flipped in each byte of a real manifest (bit i mod 8 of
    byte i).  A flip must either be refused with a CheckpointError, or load exactly the
    state the undamaged checkpoint loads (a flip inside JSON syntax that changes no value,
    such as 1e-08 -> 1E-08); never a silently different model, optimizer or step."""
    import warnings

    import zero_strategy
    from zero_strategy.checkpoint import CheckpointError, CheckpointReader

    model, opt = build(dict(optim="adamw", seed=5))  # the saving run's optimizer: two param groups
    engine = zero_strategy.initialize(model, opt, dict(stage=2))
    engine.load_checkpoint(saved_checkpoint)
    reference = _engine_state(engine)
    damaged = _copy(saved_checkpoint, tmp_path / "flipped")
    original = (saved_checkpoint / "manifest.json").read_bytes()
    refused, unchanged, changed = 0, 0, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a flip that leaves an older format version would warn
        for i in range(len(original)):
            data = bytearray(original)
            data[i] ^= 1 << (i % 8)
            (damaged / "manifest.json").write_bytes(bytes(data))
            try:
                # load_checkpoint's first step, on its own: what it refuses, a load refuses
                CheckpointReader(damaged).close()
                engine.load_checkpoint(damaged)
            except CheckpointError:
                refused += 1
                continue
            if _same(_engine_state(engine), reference):
                unchanged += 1
            else:
                changed.append((i, bytes(original[max(0, i - 20): i + 20]), bytes(data[max(0, i - 20): i + 20])))
                engine.load_checkpoint(saved_checkpoint)
    assert not changed, f"{len(changed)} of {len(original)} flips loaded a different state, e.g. {changed[:3]}"
    assert refused > 0.95 * len(original), (refused, unchanged)
    engine.close()
