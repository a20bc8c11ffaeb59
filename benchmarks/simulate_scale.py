"""Per-rank model-state bytes at world sizes this machine cannot run, from the real plan.

Llama-shaped models (7B, 70B, ~1T) are built on the meta device (no memory), and at each
world size a ZeroEngine is built for every stage on torch's *fake* process group (one
process pretends to be rank 0 of N; collectives do nothing).  The engine runs its real
planner and flat-unit layouts (units, padding to a multiple of N, persistent small
parameters), takes one (meta) optimizer step so Adam's state exists, and reports its
``memory_report()``: those bytes are what rank 0 would hold.  Next to them: the paper's
formula (``zero_strategy.estimate``) and the time the engine took to build (planning +
layout; nothing is materialised).

    .venv/bin/python benchmarks/simulate_scale.py                     # 7B/70B/1T at N = 8..1024
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
DEFAULT_WORLD_SIZES = (8, 64, 256, 1024)


def build_meta_llama(name):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**MODELS[name], tie_word_embeddings=False)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def simulate(name, world_size, stages=(0, 1, 2, 3), precision="bf16", zero_config=None):
    """Rows for one model at one world size (rank 0 of a fake process group)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zero_strategy

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
            padding = sum(u.layout.padded_numel - u.layout.numel for u in engine.units)
            persistent = sum(u.layout.numel for u in engine.units if stage == 3 and u.keep_full)
            rows.append({
                "model": name, "psi": psi, "world_size": world_size, "stage": stage, "precision": precision,
                "plan_bytes": states, "formula_bytes": formula.total, "ours_bytes": formula.held_during_step,
                "parameters": report["parameters"], "gradients": report["gradients"],
                "master_weights": report["master_weights"], "optimizer_state": report["optimizer_state"],
                "communication_buffers": report["communication_buffers"],
                "units": len(engine.units), "padding_elements": padding, "persistent_elements": persistent,
                "plan_s": plan_s,
            })
            engine.close()
            del engine, model, optimizer
            gc.collect()
    finally:
        dist.destroy_process_group()
    return rows


def markdown(rows):
    lines = [
        "| model | Ψ | N | stage | plan: bytes / rank (GB) | paper's formula (GB) | estimate for this implementation (GB) "
        "| plan / formula | units | padding (elements) | persistent (elements) | engine build (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['psi'] / 1e9:.2f}B | {r['world_size']} | {r['stage']} | {r['plan_bytes'] / GB:.3f} "
            f"| {r['formula_bytes'] / GB:.3f} | {r.get('ours_bytes', r['formula_bytes']) / GB:.3f} "
            f"| {r['plan_bytes'] / r['formula_bytes']:.4f} | {r['units']} "
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
