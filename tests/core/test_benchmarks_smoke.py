"""Smoke tests for the benchmark harness in benchmarks/ (issue #7)."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "benchmarks")


def _import_bench(name):
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    return __import__(name)


@pytest.mark.slow
def test_quick_harness_two_processes(tmp_path):
    """run_all --quick on 2 gloo processes: DDP, zero3 and FSDP2 (stage-3 sharding)."""
    page = tmp_path / "bench.md"
    cmd = [
        sys.executable, os.path.join(BENCH, "run_all.py"), "--quick", "--no-simulate",
        "--systems", "ddp,zero3,fsdp2_zero3", "--precisions", "fp32", "--world-sizes", "2",
        "--output-dir", str(tmp_path / "out"), "--page", str(page),
        # The 0.5M-parameter smoke model has no parameter above the default
        # param_persistence_threshold (1e5 elements): shard them all, as the formula assumes.
        "--zero-config", '{"param_persistence_threshold": 0}',
        "--timeout", "240",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    text = page.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| system")]
    labels = [line.split("|")[1].strip() for line in rows]
    assert labels == ["DDP", "zero_strategy stage 3", "FSDP2 (reshard after fwd)"], labels
    assert (tmp_path / "out" / "step_time_vs_ddp.png").stat().st_size > 0
    assert (tmp_path / "out" / "memory_quick_fp32.png").stat().st_size > 0

    summary = json.loads((tmp_path / "out" / "results" / "quick_fp32_ws2.json").read_text())
    by = {r["system"]: r for r in summary["rows"]}
    for name in ("zero3", "fsdp2_zero3"):
        assert by[name]["max_dloss"] < 1e-4, (name, by[name]["max_dloss"])
    # FSDP2: exactly 3Ψ (N divides units).  Ours: this model is below min_gather_numel, so
    # one gather group, kept gathered from forward into backward (gather.py, [Note: kept
    # for backward]): one all-gather and one reduce-scatter, 2Ψ.
    assert by["fsdp2_zero3"]["comm_elements"] == by["fsdp2_zero3"]["paper_comm"]
    assert 3 * by["zero3"]["comm_elements"] == 2 * by["zero3"]["paper_comm"], by["zero3"]["comm_elements"]
    z = by["zero3"]
    assert abs(z["model_state_bytes"] - z["paper_bytes"]) <= 0.01 * z["paper_bytes"], z
    d = by["ddp"]  # + Adam's scalar step counters
    assert 0 <= d["model_state_bytes"] - d["paper_bytes"] <= 0.01 * d["paper_bytes"], d
    for r in summary["rows"]:
        assert r["median_s"] > 0 and r["peak_live_bytes"] >= r["resident_bytes"] > 0, r


def test_simulate_scale_7b_plan_matches_formula():
    """The partition plan for a meta 7B Llama at N=256 (fake process group) vs the formula."""
    simulate_scale = _import_bench("simulate_scale")
    rows = simulate_scale.simulate("7b", 256, stages=(0, 1, 2, 3), precision="bf16")
    assert [r["stage"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert 6.5e9 < r["psi"] < 7e9
        # The plan against the estimate of this implementation (the paper's formula less
        # stage 3's 16-bit parameter shard, which is not kept: 14Ψ/N at N=256).
        assert abs(r["plan_bytes"] - r["ours_bytes"]) <= 0.01 * r["ours_bytes"], r
        assert r["plan_bytes"] <= r["formula_bytes"] * 1.01
    assert rows[3]["plan_bytes"] < 0.9 * rows[3]["formula_bytes"]  # 14Ψ/N vs the paper's 16Ψ/N
    assert rows[3]["plan_bytes"] < 0.5e9
    # Stage 3 gathers one LlamaDecoderLayer at a time (Llama-7B has 32): each holds ~200M
    # elements, far above min_gather_numel, so none is merged; the root holds the rest.
    assert rows[3]["unit_modules"] == ["LlamaDecoderLayer"]
    assert rows[3]["block_gathers"] == 32 and rows[3]["modules_per_block_gather"] == 1
    assert rows[3]["gathers"] == 33
    assert rows[3]["disk_offload_disk_bytes"] == 14 * -(-r["psi"] // 256)  # 12Ψ/N master + Adam, 2Ψ/N shard
    table = simulate_scale.markdown(rows)
    assert table.count("\n| 7b |") == 4


def test_largest_model_formulas_match_the_engine(capsys):
    """benchmarks/largest_model.py: its per-system byte formulas (ours at stages 0-3, and with
    offload_optimizer: cpu, where host and device are one memory) against the engine's own
    memory_report() on the fake process group; N = 4 tells Ψ terms from Ψ/N terms."""
    largest_model = _import_bench("largest_model")
    rows = largest_model.check_plan(4)
    assert len(rows) == 7
    for name, psi, engine_bytes, formula_bytes in rows:
        # Beyond the formula only AdamW's 4-byte step counters (one per optimised tensor; the
        # 2-block GPT-2 has 28 parameter tensors).
        assert 0 <= engine_bytes - formula_bytes <= 4 * 28, (name, psi, engine_bytes / psi, formula_bytes / psi)
    # The table: DDP holds 20 bytes per parameter, so its largest model is the budget // 20.
    gib = 2**30
    assert largest_model.main(["--world-size", "2", "--ram", "24GiB", "--reserve-per-rank", "2GiB",
                               "--disk", "70e9"]) == 0
    out = capsys.readouterr().out
    ddp = next(l for l in out.splitlines() if l.startswith("| DDP"))
    assert f"({(12 * gib - 2 * gib) // 20:,})" in ddp, ddp
    assert "| DeepSpeed |" in out


def test_confirm_largest_plans_the_model_transformers_builds():
    """benchmarks/confirm_largest.py trains, per system, the GPT-2 that largest_model.py's
    shape arithmetic says has Ψ parameters: transformers, building that shape on the meta
    device, must count exactly Ψ, and Ψ must be the most whole blocks whose model states
    fit the budget (one block more does not)."""
    import argparse

    import torch
    import transformers

    confirm = _import_bench("confirm_largest")
    gib = 2**30
    args = argparse.Namespace(world_size=2, ram=gib, reserve_per_rank=gib // 4, extra_blocks=0,
                              systems=list(confirm.SYSTEMS), n_embd=256, n_head=4, vocab=4096, seq=64)
    budget = args.ram // 2 - args.reserve_per_rank
    rows = {name: ram for name, ram, _, _ in _import_bench("largest_model").systems()}
    for short, row, blocks, psi, states, per_block in confirm.plan(args):
        cfg = transformers.GPT2Config(n_layer=blocks, n_embd=256, n_head=4, vocab_size=4096, n_positions=64)
        with torch.device("meta"):
            built = sum(p.numel() for p in transformers.GPT2LMHeadModel(cfg).parameters())
        assert built == psi, (short, blocks, built, psi)
        assert states == rows[row](psi, 2) <= budget, short
        assert states + per_block > budget, short  # the next block would not fit


def test_profile_step_peak_report_finds_what_is_alive_at_the_peak():
    """benchmarks/profile_step.py --memory: on allocations of known sizes, the peak is the
    largest running total and the tensors listed are the ones alive at that moment."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    profile_step = _import_bench("profile_step")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        a = torch.empty(1_000_000, dtype=torch.uint8)
        b = torch.zeros(2_000_000, dtype=torch.uint8)
        del a
        c = torch.ones(500_000, dtype=torch.uint8)  # after a is gone: below the 3 MB peak
        del b, c
    lines = profile_step.peak_report(prof, rows=10).splitlines()
    assert lines[0].startswith("peak above the start of the step: 3.0 MB"), lines[0]
    alive = {where: float(mb) for mb, _, where in (line.split(None, 2) for line in lines[4:])}
    assert alive == {"aten::empty": 1.0, "aten::zeros > aten::empty": 2.0}, lines


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_phase_times_reports_both_phases_for_every_system(precision):
    """benchmarks/phase_times.py on the smoke model: one line per system and pass, each
    with a measured forward+backward and step time (a smoke run: timings are not judged)."""
    cmd = [sys.executable, os.path.join(BENCH, "phase_times.py"), "--model", "quick", "--systems", "ddp,zero1,fsdp2_zero2",
           "--steps", "1", "--warmup", "0", "--repeats", "1", "--timeout", "240", "--precision", precision]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines()[1:] if line.strip()]
    assert [r[1] for r in rows] == ["ddp", "zero1", "fsdp2_zero2"], proc.stdout
    for r in rows:
        fb, st = map(float, r[2:4])
        assert fb > 0 and st > 0, r


def test_host_step_benchmark_times_the_fused_path(tmp_path):
    """bench_host_step's first table on the smallest model: every system runs (the fused
    row would raise if fused_host_step declined the unit, timing nothing)."""
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "bench_host_step.py"), "--sizes", "25m", "--repeats", "1",
                           "--skip-engine"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 25m |")]
    names = [r.split("|")[4].strip() for r in rows]
    assert names[:3] == ["optimizer over views (before: host_optimizer_step=optimizer)", "foreach over views",
                         "fused flat runs (host_step.py, the default)"], names
    for r in rows:
        assert float(r.split("|")[5]) > 0 and float(r.split("|")[6]) > 0, r
