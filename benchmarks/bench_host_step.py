"""The host optimizer step (offload_optimizer cpu / nvme) and whole-parameter optimizers.

One invocation prints three tables, each with its systems side by side:

1. **Host AdamW step throughput** over the fp32 buffers of GPT-2-shaped models (``--sizes``,
   default ~100M and ~355M elements), in GB/s of optimizer state touched per step: each
   element's parameter, gradient, ``exp_avg`` and ``exp_avg_sq`` read and the three
   updated ones written (28 bytes per element).  Systems, all on the same flat parameter
   and gradient buffers, split into one view per parameter as the engine hands them:
   * ``optimizer over views`` - ``host_optimizer_step="optimizer"``: the user's AdamW over
     the views with torch's CPU default (a for loop per tensor): the path before the
     fused host step;
   * ``foreach over views`` - the same with ``foreach=True``;
   * ``fused flat runs`` - the default ``host_optimizer_step="fused"``: zero_strategy's
     :func:`zero_strategy.optim.host_step.fused_host_step` on a unit made of those views;
   * ``DeepSpeedCPUAdam`` - DeepSpeed's vectorised CPU Adam over the flat buffer, where
     it imports and builds (``PYTHONPATH=.deepspeed``; the reason is printed otherwise).
   Medians over ``--repeats`` steps, the systems interleaved step by step.
2. **Stage 2 + offload_optimizer cpu**, GPT-2 ~100M on ``--world-size`` gloo processes:
   ``engine.step()`` time (and forward+backward) with ``host_optimizer_step="optimizer"``
   vs ``"fused"``, two engines in the same processes stepped alternately.
3. **Muon + AdamW vs AdamW**, the same model and ranks at stage 2: ``engine.step()`` time
   and elements communicated per step per rank (the paper's volume, and the extra
   whole-parameter exchange Muon needs for the matrices cut by shard boundaries), next
   to Psi.

    PYTHONPATH=.deepspeed .venv/bin/python benchmarks/bench_host_step.py
    .venv/bin/python benchmarks/bench_host_step.py --sizes 100m --repeats 3 --skip-engine   # table 1 only

Timings on a shared machine are noisy: compare the ratios within one run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

# GPT-2 shapes: ~100M (9 blocks of width 768) and gpt2-medium (~355M).
SHAPES = {
    "25m": dict(n_layer=4, n_embd=512, n_head=8),
    "100m": dict(n_layer=9, n_embd=768, n_head=12),
    "350m": dict(n_layer=24, n_embd=1024, n_head=16),
}
BYTES_PER_ELEMENT = 28  # AdamW: read p, g, m, v; write p, m, v (fp32)


def gpt2_config(size: str):
    from transformers import GPT2Config

    return GPT2Config(vocab_size=50257, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      **SHAPES[size])


def parameter_numels(size: str) -> list:
    """The parameter sizes of the GPT-2 model, built on the meta device (no memory)."""
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(gpt2_config(size))
    return [p.numel() for p in model.parameters()]


# ---------------------------------------------------------------------------------------
# 1. host step throughput
# ---------------------------------------------------------------------------------------
def deepspeed_cpu_adam():
    """DeepSpeedCPUAdam's class, or the reason it cannot run here."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        probe = torch.nn.Parameter(torch.zeros(8))
        probe.grad = torch.ones(8)
        DeepSpeedCPUAdam([probe], lr=1e-3, adamw_mode=True).step()  # builds the op on first use
        return DeepSpeedCPUAdam, ""
    except Exception as e:  # noqa: BLE001 - any failure means "not here"
        return None, f"{type(e).__name__}: {e}".splitlines()[0][:200]


def host_step_systems(numels: list, threads: int):
    """(name, step function) per system over shared flat parameter and gradient buffers."""
    from zero_strategy.optim.host_step import fused_host_step

    n = sum(numels)
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(n, generator=g) * 0.02
    grad = torch.randn(n, generator=g) * 1e-3
    offsets = [0]
    for k in numels:
        offsets.append(offsets[-1] + k)

    def views():
        out = []
        for a, k in zip(offsets, numels):
            v = flat[a : a + k]
            v.grad = grad[a : a + k]
            out.append(v)
        return out

    hyper = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    systems = []
    loop = torch.optim.AdamW(views(), foreach=False, **hyper)
    systems.append(("optimizer over views (before: host_optimizer_step=optimizer)", loop.step))
    foreach = torch.optim.AdamW(views(), foreach=True, **hyper)
    systems.append(("foreach over views", foreach.step))

    pieces = views()
    fused_opt = torch.optim.AdamW(pieces, **hyper)
    unit = SimpleNamespace(local_group_index=0, group_index=0, whole_params=None,
                           params_store=SimpleNamespace(optimizer_target=flat), optim_params=pieces,
                           optim_slices=[(i, a, k) for i, (a, k) in enumerate(zip(offsets, numels))])

    def fused_step():
        if not fused_host_step(fused_opt, unit, grad, None):
            raise RuntimeError("fused_host_step declined the unit (the benchmark would time nothing)")

    systems.append(("fused flat runs (host_step.py, the default)", fused_step))

    cls, why = deepspeed_cpu_adam()
    if cls is not None:
        whole = torch.nn.Parameter(flat, requires_grad=False)
        whole.grad = grad
        ds = cls([whole], lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, adamw_mode=True)
        systems.append(("DeepSpeedCPUAdam (flat)", ds.step))
    return systems, why


def bench_host_step(sizes, repeats: int) -> str:
    lines = ["| model | elements | views | system | median step (s) | GB/s of state | vs before |",
             "|---|---|---|---|---|---|---|"]
    notes = []
    for size in sizes:
        numels = parameter_numels(size)
        systems, why = host_step_systems(numels, torch.get_num_threads())
        if why and why not in notes:
            notes.append(f"DeepSpeedCPUAdam not run: {why}")
        for _, step in systems:  # first steps create state (and build kernels)
            step()
        times = {name: [] for name, _ in systems}
        for _ in range(repeats):
            for name, step in systems:  # interleaved
                t = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t)
        n = sum(numels)
        base = statistics.median(times[systems[0][0]])
        for name, _ in systems:
            med = statistics.median(times[name])
            lines.append(f"| {size} | {n / 1e6:.0f}M | {len(numels)} | {name} | {med:.3f} | "
                         f"{BYTES_PER_ELEMENT * n / med / 1e9:.2f} | {base / med:.1f}x |")
        del systems
    return "\n".join(lines + [""] + notes)


# ---------------------------------------------------------------------------------------
# 2 and 3. engines on gloo processes
# ---------------------------------------------------------------------------------------
def _engine_worker(rank, world_size, store_path, args, queue):
    import io
    import traceback

    try:
        torch.set_num_threads(max(1, args.threads))
        import torch.distributed as dist
        from transformers import GPT2LMHeadModel
        from transformers.utils import logging as hf_logging

        import zero_strategy

        hf_logging.set_verbosity_error()
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)

        def model():
            torch.manual_seed(0)
            return GPT2LMHeadModel(gpt2_config(args.engine_size))

        def muon_adamw(m):
            hidden = [p for n, p in m.named_parameters() if p.ndim == 2 and "wte" not in n and "wpe" not in n]
            rest = [p for n, p in m.named_parameters() if not (p.ndim == 2 and "wte" not in n and "wpe" not in n)]
            return [torch.optim.Muon(hidden, lr=2e-2), torch.optim.AdamW(rest, lr=1e-4)]

        jobs = {
            "offload, host_optimizer_step=optimizer": (dict(stage=2, offload_optimizer="cpu",
                                                           host_optimizer_step="optimizer"), "adamw"),
            "offload, host_optimizer_step=fused": (dict(stage=2, offload_optimizer="cpu"), "adamw"),
            "AdamW": (dict(stage=2), "adamw"),
            "Muon + AdamW": (dict(stage=2), "muon"),
        }
        engines = {}
        for name, (cfg, optim) in jobs.items():
            m = model()
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4) if optim == "adamw" else muon_adamw(m)
            engines[name] = (m, zero_strategy.initialize(m, opt, cfg))
        g = torch.Generator().manual_seed(1 + rank)
        ids = torch.randint(0, 50257, (args.micro_batch, args.seq), generator=g)
        out = {name: {"fwd_bwd": [], "step": [], "comm": []} for name in jobs}
        psi = sum(p.numel() for p in engines["AdamW"][0].parameters())
        for i in range(args.engine_steps + 1):
            for name, (m, engine) in engines.items():  # interleaved
                engine.reset_comm_report()
                t0 = time.perf_counter()
                engine.backward(m(input_ids=ids, labels=ids).loss)
                t1 = time.perf_counter()
                engine.step()
                t2 = time.perf_counter()
                if i:  # the first step creates state
                    report = engine.comm_report()
                    out[name]["fwd_bwd"].append(t1 - t0)
                    out[name]["step"].append(t2 - t1)
                    out[name]["comm"].append((report.paper_volume, report["whole_param_exchange"].elements))
        buf = io.BytesIO()
        torch.save({"rows": out, "psi": psi}, buf)
        queue.put((rank, "ok", buf.getvalue()))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        queue.put((rank, "error", traceback.format_exc()))


def bench_engines(args) -> str:
    from spawn import run_workers

    results = run_workers(_engine_worker, args, prefix="bench_host_step_")
    psi = results[0]["psi"]
    rows = {name: {k: [v for r in results for v in r["rows"][name][k]] for k in ("fwd_bwd", "step")}
            for name in results[0]["rows"]}
    med = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in rows.items()}
    lines = [f"GPT-2 {args.engine_size} (Psi = {psi / 1e6:.1f}M), stage 2, N = {args.world_size}, micro-batch "
             f"{args.micro_batch}x{args.seq}, medians over {args.engine_steps} steps x {args.world_size} ranks", "",
             "| run | forward+backward (s) | step() (s) | step vs host_optimizer_step=optimizer |", "|---|---|---|---|"]
    base = med["offload, host_optimizer_step=optimizer"]["step"]
    for name in ("offload, host_optimizer_step=optimizer", "offload, host_optimizer_step=fused"):
        lines.append(f"| {name} | {med[name]['fwd_bwd']:.3f} | {med[name]['step']:.3f} | {base / med[name]['step']:.1f}x |")
    lines += ["", "| optimizers | step() (s) | paper volume per step (elements, rank 0) | whole-parameter exchange "
              "(elements, rank 0) | exchange / Psi |", "|---|---|---|---|---|"]
    for name in ("AdamW", "Muon + AdamW"):
        volume, exchange = results[0]["rows"][name]["comm"][-1]
        lines.append(f"| {name} | {med[name]['step']:.3f} | {volume:,} | {exchange:,} | {exchange / psi:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100m,350m", help="table 1's models: " + ", ".join(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-engine", action="store_true", help="table 1 only")
    parser.add_argument("--engine-size", default="100m", choices=sorted(SHAPES))
    parser.add_argument("--engine-steps", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank in tables 2 and 3")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs\n", flush=True)
    print("## 1. Host AdamW step throughput\n", flush=True)
    print(bench_host_step([s.strip() for s in args.sizes.split(",") if s.strip()], args.repeats), flush=True)
    if not args.skip_engine:
        print("\n## 2-3. Engine steps: offloaded host step; Muon + AdamW vs AdamW\n", flush=True)
        print(bench_engines(args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
