"""Profile a few training steps of chosen systems (torch.profiler, CPU) on 2 gloo ranks.

    .venv/bin/python benchmarks/profile_step.py --systems ddp,zero3 --precision bf16 [--model 25m]

Prints, per system, rank 0's top operators by self CPU time over the profiled steps, and
the wall time per step; use it to find where a system loses against DDP.
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
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(args.warmup, args.steps):
                step(batches[i])
        wall = (time.perf_counter() - t0) / (args.steps - args.warmup)
        if rank == 0:
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
            text = f"## {name}: {wall:.3f} s/step (profiled)\n{table}\n"
            with open(os.path.join(out_dir, f"{name}.txt"), "w") as f:
                f.write(text)
            print(text, flush=True)
        system.close()
        dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--systems", default="ddp,zero3")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--rows", type=int, default=25)
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
