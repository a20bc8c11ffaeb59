"""Per-rank model-state bytes at world sizes this machine cannot run, from the real plan.

Llama-shaped models (7B, 70B, ~1T) are built on the meta device (no memory), and at each
world size a ZeroEngine is built for every stage on torch's *fake* process group (one
process pretends to be rank 0 of N; collectives do nothing).  The engine runs its real
planner and flat-unit layouts (units, padding to a multiple of N, persistent small
parameters), takes one (meta) optimizer step so Adam's state exists, and reports its
``memory_report()``: those bytes are what rank 0 would hold.  Next to them: the paper's
formula (``zero_strategy.estimate``), the stage-3 gather groups the planner chose (one per
``LlamaDecoderLayer``: blocks of 200M+ elements are far above ``min_gather_numel``, so
none is merged) and the time the engine took to build (planning + layout; nothing is
materialised).

    .venv/bin/python benchmarks/simulate_scale.py                     # 7B/70B/1T at N = 8..4096
    .venv/bin/python benchmarks/simulate_scale.py --models 7b --world-sizes 1024 --output sim.md
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

GB = 1e9

# Llama shapes. head_dim 128 throughout; GQA as in the released 70B.
MODELS = {
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=32000),
    # ~1.0T: 128 layers of width 25600 (200 heads of 128, 8 KV heads), SwiGLU width 83968.
    "1t": dict(hidden_size=25600, intermediate_size=83968, num_hidden_layers=128, num_attention_heads=200,
               num_key_value_heads=8, vocab_size=32000),
}
DEFAULT_WORLD_SIZES = (8, 64, 256, 1024, 4096)


def build_meta_llama(name):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**MODELS[name], tie_word_embeddings=False)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def simulate(name, world_size, stages=(0, 1, 2, 3), precision="bf16", zero_config=None):
    """Rows for one model at one world size (rank 0 of a fake process group)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zero_strategy
    from zero_strategy.estimate import disk_offload_estimate

    rows = []
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        for stage in stages:
            model = build_meta_llama(name)
            psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            config = {"stage": stage, "precision": precision}
            config.update(zero_config or {})
            t0 = time.perf_counter()
            engine = zero_strategy.initialize(model, optimizer, config)
            plan_s = time.perf_counter() - t0
            engine.step()  # meta gradients are zero; creates Adam's (meta) state
            report = engine.memory_report()
            states = sum(report[k] for k in ("parameters", "gradients", "master_weights", "optimizer_state"))
            formula = zero_strategy.estimate(psi, world_size, stage, precision=precision, optimizer="adam")
            # Disk offload (offload_optimizer: nvme; at stage 3 offload_param: nvme too) from the
            # estimator only: the fake process group cannot create its per-rank files.
            disk = (disk_offload_estimate(psi, world_size, stage, precision=precision, optimizer="adam",
                                          offload_param=stage == 3) if stage >= 1 else None)
            padding = sum(u.layout.padded_numel - u.layout.numel for u in engine.units)
            persistent = sum(u.layout.numel for u in engine.units if stage == 3 and u.keep_full)
            summary = engine.unit_summary()
            # Stage 3: which modules each gather covers (the root gathers what no block owns).
            blocks = [g for g in summary["groups"] if g["module"] != "<root>"]
            rows.append({
                "model": name, "psi": psi, "world_size": world_size, "stage": stage, "precision": precision,
                "plan_bytes": states, "formula_bytes": formula.total, "ours_bytes": formula.held_during_step,
                "parameters": report["parameters"], "gradients": report["gradients"],
                "master_weights": report["master_weights"], "optimizer_state": report["optimizer_state"],
                "communication_buffers": report["communication_buffers"],
                "units": len(engine.units), "padding_elements": padding, "persistent_elements": persistent,
                "unit_modules": summary["unit_modules"] if stage == 3 else [],
                "gathers": len(summary["groups"]),
                "block_gathers": len(blocks),
                "modules_per_block_gather": max((len(g["modules"]) for g in blocks), default=0),
                "largest_gather_elements": max((g["numel"] for g in summary["groups"]), default=0),
                "disk_offload_ram_bytes": disk.ram if disk else None,
                "disk_offload_disk_bytes": disk.disk if disk else None,
                "plan_s": plan_s,
            })
            engine.close()
            del engine, model, optimizer
            gc.collect()
    finally:
        dist.destroy_process_group()
    return rows


# The paragraph docs/benchmarks.md prints above the table (run_all.py renders the page).
DESCRIPTION = (
    "`benchmarks/simulate_scale.py`: Llama-shaped models built on the meta device; for each world size "
    "a `ZeroEngine` is built on torch's fake process group as rank 0 of N (its real planner, flat-unit "
    "layouts, padding and persistent small parameters), takes one meta optimizer step, and reports "
    "`memory_report()` (*plan*). *paper's formula* = `zero_strategy.estimate(...).total` (bf16 parameters "
    "and gradients, Adam with an fp32 master copy: K = 12); *estimate for this implementation* = its "
    "`held_during_step`, the formula less the 16-bit parameter shard that stage 3 does not keep (the "
    "compute copy is cast from the fp32 master for each all-gather), so stage 3 holds 14Ψ/N, not 16Ψ/N. "
    "Stage 3 sits slightly above that estimate because parameters under `param_persistence_threshold` "
    "(the RMSNorm weights) stay whole on every rank. *stage-3 gathers*: the gather groups the planner "
    "chose: one per `LlamaDecoderLayer` (the class the model declares in `_no_split_modules`), plus the "
    "root for the embedding and the head (the norms, under the threshold, stay whole); every layer holds far more than `min_gather_numel` "
    "(1M elements), so none is merged. *disk offload* = `zero_strategy.estimate.disk_offload_estimate` "
    "(`offload_optimizer: nvme`, and at stage 3 `offload_param: nvme` too; the default 256 MiB "
    "`nvme_inflight_bytes`): RAM per rank between backward and step, and bytes in the per-rank files. It "
    "comes from the estimator only: the fake process group cannot create the offload files. *engine build* "
    "is the time to plan and lay out the units (nothing is materialised)."
)
REGENERATE = ".venv/bin/python benchmarks/simulate_scale.py --models 7b,70b,1t --world-sizes 8,64,256,1024,4096"


def markdown(rows):
    lines = [
        "| model | Ψ | N | stage | plan: bytes / rank (GB) | paper's formula (GB) | estimate for this implementation (GB) "
        "| plan / formula | disk offload, estimate: RAM / disk per rank (GB) "
        "| units | stage-3 gathers | padding (elements) | persistent (elements) | engine build (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gathers = "-"
        if r.get("unit_modules"):
            # e.g. "32 x LlamaDecoderLayer + root": one gather per block unless min_gather_numel merged some.
            per = r["modules_per_block_gather"]
            blocks = f"{r['block_gathers']} x {'/'.join(r['unit_modules'])}" + (f" (up to {per} per gather)" if per > 1 else "")
            gathers = blocks + (" + root" if r["gathers"] > r["block_gathers"] else "")
        disk = "-"
        if r.get("disk_offload_ram_bytes") is not None:
            disk = f"{r['disk_offload_ram_bytes'] / GB:.3f} / {r['disk_offload_disk_bytes'] / GB:.3f}"
        lines.append(
            f"| {r['model']} | {r['psi'] / 1e9:.2f}B | {r['world_size']} | {r['stage']} | {r['plan_bytes'] / GB:.3f} "
            f"| {r['formula_bytes'] / GB:.3f} | {r.get('ours_bytes', r['formula_bytes']) / GB:.3f} "
            f"| {r['plan_bytes'] / r['formula_bytes']:.4f} | {disk} | {r['units']} | {gathers} "
            f"| {r['padding_elements']:,} | {r['persistent_elements']:,} | {r['plan_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="7b,70b,1t", help="comma-separated subset of " + ",".join(MODELS))
    p.add_argument("--world-sizes", default=",".join(map(str, DEFAULT_WORLD_SIZES)))
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--precision", choices=("bf16", "fp32", "fp16"), default="bf16")
    p.add_argument("--output", help="write the markdown table here")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in MODELS]
    if bad:
        p.error(f"unknown model(s) {bad}; choose from {','.join(MODELS)}")
    args.world_sizes = [int(n) for n in args.world_sizes.split(",")]
    args.stages = [int(s) for s in args.stages.split(",")]
    return args


def run(args, progress=None):
    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    rows = []
    for name in args.models:
        for n in args.world_sizes:
            rows += simulate(name, n, args.stages, args.precision)
            if progress is not None:
                progress()
    return rows


def main(argv=None):
    args = parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import report

    bar = report.Progress(len(args.models) * len(args.world_sizes), "simulate")
    t0 = time.perf_counter()
    try:
        rows = run(args, bar.update)
    finally:
        bar.close()
    table = markdown(rows) + f"\n_{len(rows)} engines built in {time.perf_counter() - t0:.0f} s_\n"
    report.write_outputs(table, rows, args.output, args.json)


if __name__ == "__main__":
    main()
