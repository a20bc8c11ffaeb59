"""Profile a few training steps of chosen systems (torch.profiler, CPU) on 2 gloo ranks.

    .venv/bin/python benchmarks/profile_step.py --systems ddp,zero3 --precision bf16 [--model 25m]

Prints, per system, rank 0's top operators by self CPU time over the profiled steps, and
the wall time per step; use it to find where a system loses against DDP.

With ``--memory`` it profiles one step's allocations instead and prints, per system,
the peak tensor bytes above the start of the step (the benchmarks' "peak tensors" less
the resident bytes), the operator running at the peak, and the tensors alive at the
peak grouped by the operators that allocated them; use it to find what one system
holds at its peak that another does not:

    .venv/bin/python benchmarks/profile_step.py --systems zero3,fsdp2_zero3 --precision fp32 --model 100m --memory
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("KINETO_LOG_LEVEL", "99")

import bench_core  # noqa: E402
import systems as S  # noqa: E402


def worker(rank, world_size, store_path, args, out_dir):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), DS_ACCELERATOR="cpu")
    from torch.profiler import ProfilerActivity, profile
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    batches = bench_core.make_batches(args, rank)
    for name in args.systems:
        system = S.make_system(name, args, world_size)

        def step(x):
            loss = system.forward(x)
            system.backward(loss)
            system.step()
            system.zero_grad()

        for i in range(args.warmup):
            step(batches[i])
        dist.barrier()
        if args.memory:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                step(batches[args.warmup])
            if rank == 0:
                _report(out_dir, f"{name}_memory.txt", f"## {name}: allocations of one step\n{peak_report(prof, args.rows)}")
        else:
            t0 = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for i in range(args.warmup, args.steps):
                    step(batches[i])
            wall = (time.perf_counter() - t0) / (args.steps - args.warmup)
            if rank == 0:
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
                _report(out_dir, f"{name}.txt", f"## {name}: {wall:.3f} s/step (profiled)\n{table}")
        system.close()
        dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _report(out_dir: str, filename: str, text: str) -> None:
    with open(os.path.join(out_dir, filename), "w") as f:
        f.write(text + "\n")
    print(text + "\n", flush=True)


def _where(event) -> str:
    """The operator that made an allocation, under the outermost operator it ran in."""
    inner = event.parent
    outer = inner
    while outer is not None and outer.parent is not None:
        outer = outer.parent
    if inner is None:
        return "(outside any operator)"
    return inner.name if outer is inner else f"{outer.name} > {inner.name}"


def peak_report(prof, rows: int) -> str:
    """The step's peak above its start, and what is alive at that peak, by allocating operator."""
    from torch._C._profiler import _EventType

    allocations, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.typed[0] == _EventType.Allocation:
            allocations.append((e.start_time_ns, e.typed[1].ptr, e.typed[1].alloc_size, e))
        stack.extend(e.children)
    allocations.sort(key=lambda a: a[0])
    running = peak = 0
    peak_index = -1
    for i, (_, _, size, _) in enumerate(allocations):
        running += size
        if running > peak:
            peak, peak_index = running, i
    live = {}  # ptr -> (bytes, where), for what the step allocated and still holds at the peak
    for _, ptr, size, e in allocations[:peak_index + 1]:
        if size > 0:
            live[ptr] = (size, _where(e))
        else:
            live.pop(ptr, None)
    by_where = {}
    for size, where in live.values():
        count, total = by_where.get(where, (0, 0))
        by_where[where] = (count + 1, total + size)
    lines = [f"peak above the start of the step: {peak / 1e6:,.1f} MB, reached in "
             f"{_where(allocations[peak_index][3]) if peak_index >= 0 else '-'}",
             f"alive at the peak, allocated in this step: {sum(s for s, _ in live.values()) / 1e6:,.1f} MB "
             "(the rest of the peak: tensors from before the step freed by then count negative)", "",
             f"{'MB':>10} {'tensors':>8}  allocated in"]
    for where, (count, total) in sorted(by_where.items(), key=lambda kv: -kv[1][1])[:rows]:
        lines.append(f"{total / 1e6:10,.1f} {count:8d}  {where}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--systems", default="ddp,zero3")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--memory", action="store_true",
                   help="profile one step's allocations: the peak and what is alive at it, by operator")
    p.add_argument("--out-dir", default=None, help="write <system>.txt here (default: a temp dir)")
    bench_core.add_model_args(p)
    args = p.parse_args(argv)
    args.systems = bench_core.parse_systems(p, args.systems)
    if args.steps is None:
        args.steps = 6
    if args.warmup is None:
        args.warmup = 2
    bench_core.finish_model_args(p, args)
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="zero_profile_")
    os.makedirs(out_dir, exist_ok=True)
    store = os.path.join(tempfile.mkdtemp(prefix="zero_profile_store_"), "store")
    mp.start_processes(worker, args=(args.world_size, store, args, out_dir), nprocs=args.world_size,
                       start_method="spawn")
    print(f"profiles in {out_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
