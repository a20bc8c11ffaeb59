"""Core benchmark: DDP, FSDP2, DeepSpeed and zero_strategy stages 0-3 on one GPT-2 model.

Every system trains the same freshly-initialised model (same seed) on the same synthetic
token batches, one after the other inside the SAME spawned gloo worker processes, so the
step times are measured under identical conditions (threads, allocator, store).  Per
system: median step time after warm-up (and its ratio to DDP), model-state bytes per rank
next to the paper's formula, resident and peak tensor bytes, peak RSS growth, elements
communicated per step next to 2Ψ / 3Ψ, and the loss deviation from DDP.

    python benchmarks/bench_core.py --world-size 2 --precision fp32 --model 25m --output out.md
    python benchmarks/bench_core.py --quick --systems ddp,zero3,fsdp2_zero3

See benchmarks/README.md; benchmarks/run_all.py runs a matrix of these and writes the docs.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import systems as S  # noqa: E402  (benchmarks/ is not a package)

# The profiler (memory probe) otherwise prints two kineto lines per use.
os.environ.setdefault("KINETO_LOG_LEVEL", "99")

DEFAULT_SYSTEMS = S.ALL_SYSTEMS


# ---------------------------------------------------------------------------------------
# worker
# ---------------------------------------------------------------------------------------
def make_batches(args, rank):
    # Each rank its own data, the same data for every system: losses compare one to one.
    g = torch.Generator().manual_seed(args.seed * 1000 + rank)
    return torch.randint(0, args.vocab, (args.steps, args.micro_batch, args.seq), generator=g)


def run_system(name, args, rank, world_size, batches, progress):
    from zero_strategy.accounting import live_tensor_bytes

    gc.collect()
    S.malloc_trim()
    dist.barrier()
    base_live = live_tensor_bytes()
    base_rss = S.rss_bytes()
    t0 = time.perf_counter()
    system = S.make_system(name, args, world_size)
    build_s = time.perf_counter() - t0

    def one_step(x, measure):
        loss = system.forward(x)
        system.backward(loss)
        # Model states are measured where they all exist: zero_strategy's stages 2-3 free
        # their gradient shards in step(); FSDP2 frees its gradients in zero_grad().
        early = getattr(system, "states_before_step", False)
        states = system.model_state_bytes() if measure and early else None
        system.step()
        if measure and not early:
            states = system.model_state_bytes()
        system.zero_grad()
        return loss.detach(), states

    losses, times = [], []
    states = comm = comm_kinds = live_before = peak_alloc = peak_rss = None
    for step in range(args.steps):
        x = batches[step]
        measure = step == args.steps - 1
        if measure:
            # The last step is not timed: it runs under the profiler's memory tracking.
            system.reset_comm()
            gc.collect()
            S.malloc_trim()
            live_before = live_tensor_bytes()
            S.reset_peak_rss()
        dist.barrier()
        t0 = time.perf_counter()
        if measure:
            (loss, states), peak_alloc, _ = S.profiled_step(lambda: one_step(x, True))
            peak_rss = S.peak_rss_bytes()
            comm = system.comm_elements()
            comm_kinds = system.comm_by_kind()
        else:
            loss, _ = one_step(x, False)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        del loss
        if progress is not None:
            progress()
    resident = live_tensor_bytes() - base_live
    system.close()
    del system
    gc.collect()
    return {
        "psi": None,  # filled by the caller
        "times": times,
        "losses": losses,
        "model_state_bytes": states,
        "resident_bytes": resident,
        "peak_live_bytes": live_before + peak_alloc - base_live,
        "peak_rss_growth": (peak_rss - base_rss) if peak_rss is not None and base_rss is not None else None,
        "comm_elements": comm,
        "comm_by_kind": comm_kinds,
        "build_s": build_s,
    }


def worker_main(rank, world_size, store_path, args, queue):
    from spawn import worker_session  # benchmarks/spawn.py

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    env = dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
               DS_ACCELERATOR="cpu")
    with worker_session(rank, world_size, store_path, queue, threads=cores // world_size, env=env) as send:
        batches = make_batches(args, rank)
        results, skipped = {}, {}
        psi = S.trainable_numel(S.build_model(args))
        ds_reason = None
        progress = (lambda: queue.put((rank, "progress", 1))) if rank == 0 else None
        for rep in range(args.repeats):
            # Odd repeats run the systems in reverse order, so a burst of load from other
            # processes is less likely to hit the same system every time.
            order = list(args.systems) if rep % 2 == 0 else list(reversed(args.systems))
            for name in order:
                if name in S.DS_SYSTEMS:
                    if ds_reason is None:
                        ds_reason = S.deepspeed_status()
                        import logging

                        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
                    if ds_reason:
                        skipped[name] = ds_reason
                        if progress is not None:
                            for _ in range(args.steps):
                                progress()
                        continue
                run = run_system(name, args, rank, world_size, batches, progress)
                run["psi"] = psi
                results.setdefault(name, []).append(run)
                dist.barrier()
        payload = {"results": results, "skipped": skipped, "threads": torch.get_num_threads()}
        send(payload)


def spawn(args, progress=None):
    """Run the workers; returns (per-rank results, skipped, threads)."""
    from spawn import run_workers  # benchmarks/spawn.py (benchmarks/ is on sys.path)

    results = run_workers(worker_main, args, "bench_core_", progress)
    return [r["results"] for r in results], results[0]["skipped"], results[0]["threads"]


# ---------------------------------------------------------------------------------------
# summary (json-serialisable; report.py renders it)
# ---------------------------------------------------------------------------------------
def paper_bytes(psi, world_size, system, precision):
    from zero_strategy import estimate

    return estimate(psi, world_size, S.equivalent_stage(system), precision=precision, optimizer="adam").total


def _max(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _least_over_passes(repeats, key):
    per_pass = [_max(r[key] for r in reps) for reps in repeats]
    per_pass = [v for v in per_pass if v is not None]
    return min(per_pass) if per_pass else None


def summarize(args, per_rank, skipped, threads, wall_s, load_before, load_after):
    n = args.world_size
    ran = [s for s in args.systems if s in per_rank[0]]
    psi = per_rank[0][ran[0]][0]["psi"] if ran else None
    ddp = per_rank[0].get("ddp") and [r["ddp"][0] for r in per_rank]
    timed = slice(args.warmup, args.steps - 1)
    rows = []
    ddp_median = None
    for name in ran:
        repeats = [[r[name][k] for r in per_rank] for k in range(len(per_rank[0][name]))]
        medians, all_times = [], []
        for reps in repeats:
            # A step is as slow as its slowest rank; the median ignores one-off hiccups,
            # the minimum over repeats the passes that shared the cores with other work.
            step_times = [max(r["times"][i] for r in reps) for i in range(args.steps)]
            medians.append(statistics.median(step_times[timed]))
            all_times.append(step_times)
        median = min(medians)
        ranks = repeats[0]
        if name == "ddp":
            ddp_median = median
        dloss = None
        if ddp:
            dloss = max(abs(a - b) for reps in repeats for r, d in zip(reps, ddp)
                        for a, b in zip(r["losses"], d["losses"]))
        stage = S.equivalent_stage(name)
        rows.append({
            "system": name,
            "label": S.label(name),
            "stage": stage,
            "median_s": median,
            "medians_per_repeat": medians,
            "step_times": all_times,
            "model_state_bytes": _max(r["model_state_bytes"] for r in ranks),
            "paper_bytes": paper_bytes(psi, n, name, args.precision),
            "resident_bytes": _max(r["resident_bytes"] for r in ranks),
            "peak_live_bytes": _max(r["peak_live_bytes"] for r in ranks),
            # Resident memory depends on what the allocator kept from the systems run
            # before in the same process: a system run early pays for the heap a later
            # one reuses.  The passes alternate the order, so the least over passes
            # (of the largest over ranks) gives every system the same chance.
            "peak_rss_growth": _least_over_passes(repeats, "peak_rss_growth"),
            "peak_rss_growth_per_pass": [_max(r["peak_rss_growth"] for r in reps) for reps in repeats],
            "comm_elements": _max(r["comm_elements"] for r in ranks),
            "paper_comm": (3 if stage == 3 else 2) * psi,
            "max_dloss": dloss,
            "build_s": _max(r["build_s"] for r in ranks),
            "comm_by_kind_rank0": ranks[0]["comm_by_kind"],
            "losses_rank0": ranks[0]["losses"],
        })
    for row in rows:
        row["ratio"] = row["median_s"] / ddp_median if ddp_median else None
    return {
        "config": {
            "model": args.model, "precision": args.precision, "world_size": n, "psi": psi,
            "n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head, "vocab": args.vocab,
            "seq": args.seq, "micro_batch": args.micro_batch, "steps": args.steps, "warmup": args.warmup,
            "threads_per_rank": threads, "lr": args.lr, "systems": list(args.systems),
            "repeats": args.repeats,
            "zero_config": args.zero_config,
        },
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "cores": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "wall_s": wall_s,
        "skipped": skipped,
        "rows": rows,
    }


def run(args, progress=None):
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    per_rank, skipped, threads = spawn(args, progress)
    return summarize(args, per_rank, skipped, threads, time.perf_counter() - t0, load_before, os.getloadavg())


# ---------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------
def add_model_args(p):
    p.add_argument("--model", choices=sorted(S.PRESETS), default="25m",
                   help="GPT-2 preset; --n-layer etc. override single fields")
    p.add_argument("--quick", action="store_true", help="tiny model, 4 steps: a smoke run")
    for name in ("n-layer", "n-embd", "n-head", "vocab", "seq", "micro-batch"):
        p.add_argument(f"--{name}", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="steps per system (default 12; --quick 4)")
    p.add_argument("--warmup", type=int, default=None,
                   help="leading steps excluded from the timing (default 3; --quick 1); the last step "
                        "(memory probe) is excluded too")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the system list this many times (odd passes reversed); step time = the "
                        "minimum over passes of the median, against load from other processes")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the workers are given up on")
    p.add_argument("--zero-config", type=json.loads, default=None,
                   help='extra zero_strategy config fields as json, e.g. \'{"param_persistence_threshold": 0}\'')


def finish_model_args(p, args):
    if args.quick:
        args.model = "quick"
    for key, value in S.PRESETS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps is None:
        args.steps = 4 if args.quick else 12
    if args.warmup is None:
        args.warmup = 1 if args.quick else 3
    if not 0 <= args.warmup < args.steps - 1:
        p.error("need 0 <= --warmup < --steps - 1 (at least one timed step before the memory-probe step)")
    if args.n_embd % args.n_head:
        p.error("--n-embd must be divisible by --n-head")


def parse_systems(p, text):
    systems = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in systems if s not in S.ALL_SYSTEMS]
    if bad or not systems:
        p.error(f"--systems: unknown {bad}; choose from {','.join(S.ALL_SYSTEMS)}")
    return systems


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="gloo processes to spawn")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help="comma-separated subset of " + ",".join(S.ALL_SYSTEMS))
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    add_model_args(p)
    p.add_argument("--output", help="also write the markdown table to this file")
    p.add_argument("--json", help="also write the raw summary to this json file")
    args = p.parse_args(argv)
    args.systems = parse_systems(p, args.systems)
    if args.world_size < 1:
        p.error("--world-size must be >= 1")
    finish_model_args(p, args)
    return args


def main(argv=None):
    import report

    args = parse_args(argv)
    total = len(args.systems) * args.steps * args.repeats
    bar = report.Progress(total, f"{args.model} {args.precision} N={args.world_size}")
    try:
        summary = run(args, progress=bar.update)
    finally:
        bar.close()
    report.write_outputs(report.markdown_run(summary), summary, args.output, args.json)


if __name__ == "__main__":
    main()
