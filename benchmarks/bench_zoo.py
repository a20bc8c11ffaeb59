"""Stage-3 step time against DDP on every architecture of the test zoo (tests/support/zoo.py).

The zoo's models are tiny (tens of thousands of parameters), which is the worst case for
stage 3: every collective costs a fixed latency, and with one gather per block the step
is mostly latency.  Per model, on N gloo processes in the same workers, the systems run
interleaved (A B C A B C ...) so machine drift hits all alike:

* ``ddp``: torch DistributedDataParallel;
* ``zero2``: this package, stage 2;
* ``zero3/module``: stage 3, every parameter partitioned (``param_persistence_threshold=0``),
  one gather per unit module (``min_gather_numel=0``, the behaviour before merging);
* ``zero3``: the same with the default ``min_gather_numel`` (small sibling blocks merged).

Reported: median (min-max) step time, its ratio to DDP, and the collectives per step
(all-gathers, reduce-scatters, all-reduces, and control reductions such as the agreement
on which parameters got gradients) counted by the engine's communicator.

    .venv/bin/python benchmarks/bench_zoo.py --repeats 5
    .venv/bin/python benchmarks/bench_zoo.py --models llama,many_linear --steps 10
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "support"))  # the zoo and the gloo harness live with the tests

import zoo  # noqa: E402
from dist_harness import run_distributed  # noqa: E402

SYSTEMS = ("ddp", "zero2", "zero3/module", "zero3")
GLOBAL_BATCH = 6


class _Called:
    """Calls go to the DDP wrapper, attribute reads to the model (the zoo's losses read
    e.g. ``model.lm.lm_head.weight`` outside the forward)."""

    def __init__(self, ddp, model):
        self._ddp, self._model = ddp, model

    def __call__(self, *args, **kwargs):
        return self._ddp(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def _build(system, name):
    import zero_strategy

    model = zoo.build_model(name)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = _Called(DistributedDataParallel(model, find_unused_parameters=name in ("moe", "mixtral")), model)

        def step(batch):
            loss = zoo.loss_of(name, wrapped, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step, None
    cfg = dict(stage=2) if system == "zero2" else dict(stage=3, param_persistence_threshold=0)
    if system == "zero3/module":
        cfg["min_gather_numel"] = 0
    engine = zero_strategy.initialize(model, opt, cfg)

    def step(batch):
        engine.backward(zoo.loss_of(name, model, batch))
        engine.step()
    return step, engine


def _worker(rank, ws, names, steps, warmup, repeats):
    import transformers

    transformers.logging.set_verbosity_error()
    out = {}
    for name in names:
        batches = [zoo.shard(b, rank, ws) for b in zoo.make_batches(name, steps + warmup, GLOBAL_BATCH)]
        for _ in range(repeats):
            for system in SYSTEMS:
                step, engine = _build(system, name)
                for b in batches[:warmup]:
                    step(b)
                if engine is not None:
                    engine.reset_comm_report()
                dist.barrier()
                t0 = time.perf_counter()
                for b in batches[warmup:]:
                    step(b)
                dist.barrier()
                per_step = (time.perf_counter() - t0) / steps
                calls = {}
                if engine is not None:
                    for kind, tally in engine.comm_report().kinds.items():
                        calls[kind] = tally.calls / steps
                    engine.close()
                out.setdefault((name, system), []).append((per_step, calls))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(n for n in zoo.NAMES), help="comma-separated zoo names")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in zoo.NAMES]
    if unknown:
        p.error(f"unknown models {unknown}; the zoo has {list(zoo.NAMES)}")
    results = run_distributed(_worker, args.world_size, names, args.steps, args.warmup, args.repeats, timeout=7200)[0]
    print("| model | system | step ms median (min-max) | vs DDP | all-gathers/step | reduce-scatters/step | all-reduces/step "
          "| control/step |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        ddp = statistics.median(t for t, _ in results[(name, "ddp")])
        for system in SYSTEMS:
            runs = results[(name, system)]
            times = [t for t, _ in runs]
            med = statistics.median(times)
            calls = runs[-1][1]

            def c(kind):
                if kind not in calls:
                    return "-" if system == "ddp" else "0"
                return f"{calls[kind]:.0f}" if calls[kind] == int(calls[kind]) else f"{calls[kind]:.2f}"
            print(f"| {name} | {system} | {med * 1e3:.1f} ({min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}) | "
                  f"{med / ddp:.2f}x | {c('all_gather')} | {c('reduce_scatter')} | {c('all_reduce')} | {c('control')} |")


if __name__ == "__main__":
    main()
