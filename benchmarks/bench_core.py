"""Core benchmark: DDP vs zero_strategy stages 0-3 on one GPT-2-style model (CPU, gloo).

Every system trains the same freshly-initialised model (same seed) on the same synthetic
token batches, one after the other inside the SAME spawned worker processes, so the step
times are measured under identical conditions (threads, allocator, store).  Per system it
reports the median step time after warm-up, model-state bytes per rank next to the paper's
formula, elements communicated per step next to 2Ψ / 3Ψ, the loss deviation from DDP and
the live tensor bytes left after the last step.

    python benchmarks/bench_core.py --world-size 2 --precision fp32 --output out.md
"""
from __future__ import annotations

import argparse
import gc
import io
import os
import queue as queue_mod
import statistics
import sys
import tempfile
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SYSTEMS = ("ddp", "zero0", "zero1", "zero2", "zero3")
MB = 1e6  # decimal, like the paper's GB = 1e9 B


# ---------------------------------------------------------------------------------------
# model and data
# ---------------------------------------------------------------------------------------
def build_model(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        n_head=args.n_head,
        vocab_size=args.vocab,
        n_positions=args.seq,
        # No dropout: every system must compute exactly the same function, otherwise
        # the loss comparison with DDP would measure RNG streams, not ZeRO.
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        # GPT-2's default token ids (50256) lie outside a small vocabulary.
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    # Same seed before every build: all systems (and all ranks) start from the same weights.
    torch.manual_seed(args.seed)
    return GPT2LMHeadModel(config)


def make_batches(args, rank):
    # Each rank gets its own data (that is what data parallelism is), but the same data
    # for every system, so the per-step losses are comparable one to one.
    g = torch.Generator().manual_seed(args.seed * 1000 + rank)
    return torch.randint(0, args.vocab, (args.steps, args.micro_batch, args.seq), generator=g)


def trainable_numel(model):
    # Count each tensor once: GPT-2 ties lm_head.weight to transformer.wte.weight.
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def make_optimizer(model, args):
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)


def tensor_bytes(t):
    return 0 if t is None else t.numel() * t.element_size()


# ---------------------------------------------------------------------------------------
# one system inside a worker
# ---------------------------------------------------------------------------------------
def run_ddp(args, rank, world_size, batches):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_strategy.accounting import live_tensor_bytes, optimizer_state_bytes

    model = build_model(args)
    psi = trainable_numel(model)
    ddp = DDP(model)
    # DDP has no comm report: count the all-reduced bucket elements through a comm hook
    # that then does exactly what DDP's default does (averaging all-reduce).
    counter = {"elements": 0}

    def counting_allreduce(state, bucket):
        counter["elements"] += bucket.buffer().numel()
        return default_hooks.allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, counting_allreduce)
    optimizer = make_optimizer(ddp, args)
    bf16 = args.precision == "bf16"

    losses, times = [], []
    for step in range(args.steps):
        x = batches[step]
        if step == args.steps - 1:
            counter["elements"] = 0
        dist.barrier()
        t0 = time.perf_counter()
        # bf16 for DDP = autocast with fp32 parameters (the usual PyTorch mixed precision).
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = ddp(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        # set_to_none=False keeps the gradient tensors allocated, like ZeRO's flat
        # gradient buffers, so the model-state bytes compare like with like.
        optimizer.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())

    params = sum(tensor_bytes(p) for p in model.parameters())
    grads = sum(tensor_bytes(p.grad) for p in model.parameters())
    state_bytes = params + grads + optimizer_state_bytes(optimizer)
    result = {
        "psi": psi,
        "times": times,
        "losses": losses,
        "model_state_bytes": state_bytes,
        # all-reduce = reduce-scatter + all-gather: counted 2x, as in comm.py and the paper.
        "comm_elements": 2 * counter["elements"],
        "live_tensor_bytes": live_tensor_bytes(),
    }
    del ddp, model, optimizer
    return result


def run_zero(args, rank, world_size, batches, stage):
    import zero_strategy
    from zero_strategy.accounting import live_tensor_bytes

    model = build_model(args)
    psi = trainable_numel(model)  # before initialize: stage 3 shards the parameters in place
    optimizer = make_optimizer(model, args)
    engine = zero_strategy.initialize(model, optimizer, {"stage": stage, "precision": args.precision})

    losses, times = [], []
    comm = None
    for step in range(args.steps):
        x = batches[step]
        last = step == args.steps - 1
        if last:
            engine.reset_comm_report()
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        if last:
            comm = engine.comm_report().paper_volume
        losses.append(loss.item())

    report = engine.memory_report()
    state_bytes = sum(report[k] for k in ("parameters", "gradients", "master_weights", "optimizer_state"))
    result = {
        "psi": psi,
        "times": times,
        "losses": losses,
        "model_state_bytes": state_bytes,
        "comm_elements": comm,
        "live_tensor_bytes": live_tensor_bytes(),
    }
    engine.close()
    del engine, model, optimizer
    return result


def worker_main(rank, world_size, store_path, args, queue):
    # Threads split evenly so the N processes do not oversubscribe the cores.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // world_size))
    # Keep the table readable: transformers' config chatter and the FutureWarning that
    # live_tensor_bytes' gc walk triggers by touching the deprecated dist.reduce_op.
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        batches = make_batches(args, rank)
        results = {}
        for name in args.systems:
            if name == "ddp":
                results[name] = run_ddp(args, rank, world_size, batches)
            else:
                results[name] = run_zero(args, rank, world_size, batches, int(name[-1]))
            # Free the previous system before the next one is built, so neither its
            # memory nor its garbage collection leaks into the next measurement.
            gc.collect()
            dist.barrier()
        results["_threads"] = torch.get_num_threads()
        buf = io.BytesIO()
        torch.save(results, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - the parent prints it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="bench_core_")
    store_path = os.path.join(store_dir, "store")  # must not exist yet
    procs = [ctx.Process(target=worker_main, args=(r, args.world_size, store_path, args, queue))
             for r in range(args.world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    deadline = time.monotonic() + args.timeout
    try:
        while len(results) < args.world_size and not errors:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    errors.append(f"rank(s) {dead} died without a result (exit codes {[procs[r].exitcode for r in dead]})")
                elif time.monotonic() > deadline:
                    errors.append(f"timed out after {args.timeout:.0f}s")
                continue
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()  # only the processes this script started
        if os.path.exists(store_path):
            os.unlink(store_path)
        os.rmdir(store_dir)
    if errors:
        sys.stderr.write("benchmark worker failed:\n" + "\n".join(errors) + "\n")
        sys.exit(1)
    return [results[r] for r in range(args.world_size)]


# ---------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------
def paper_bytes(psi, world_size, system, precision):
    from zero_strategy import estimate

    stage = 0 if system == "ddp" else int(system[-1])
    return estimate(psi, world_size, stage, precision=precision, optimizer="adam").total


def summarize(args, per_rank):
    n = args.world_size
    psi = per_rank[0][args.systems[0]]["psi"]
    rows = {}
    for name in args.systems:
        ranks = [r[name] for r in per_rank]
        # A step is as slow as its slowest rank; the median ignores one-off hiccups.
        step_times = [max(r["times"][i] for r in ranks) for i in range(args.steps)]
        rows[name] = {
            "median": statistics.median(step_times[args.warmup:]),
            "state": max(r["model_state_bytes"] for r in ranks),
            "comm": max(r["comm_elements"] for r in ranks),
            "live": max(r["live_tensor_bytes"] for r in ranks),
            "losses": [[r["losses"][i] for i in range(args.steps)] for r in ranks],
        }
    ddp = rows.get("ddp")

    lines = [
        f"# bench_core: GPT-2 {args.n_layer}L/{args.n_embd}d/{args.n_head}h, vocab {args.vocab}, "
        f"seq {args.seq}, micro-batch {args.micro_batch}/rank",
        "",
        f"- Ψ = {psi:,} trainable parameters (tied lm_head counted once); world size N = {n} (gloo, CPU), "
        f"{per_rank[0]['_threads']} torch thread(s) per rank; precision {args.precision}; AdamW lr {args.lr}",
        f"- {args.steps} steps, first {args.warmup} excluded from timing; step time = slowest rank per step, median; "
        "all systems ran sequentially in the same processes",
        f"- model states = parameters + gradients + master weights + optimizer state per rank after the last step "
        f"(max over ranks); paper = zero_strategy.estimate(Ψ, N, stage, precision={args.precision}, optimizer=adam).total",
        "- comm = elements per rank in the last step, counted as the paper does (all-reduce = 2x); "
        "paper = 2Ψ (DDP, stages 0-2) or 3Ψ (stage 3)",
        "- max |Δloss| = max over ranks and steps of |loss − DDP loss| (same data, same init, no dropout)",
        "- live tensor bytes = zero_strategy.accounting.live_tensor_bytes() after the last step (max over ranks; "
        "includes activations still referenced, comm buffers and the data)",
    ]
    if args.precision == "bf16":
        lines.append("- DDP in bf16 = torch.autocast('cpu', bfloat16) with fp32 parameters, gradients and Adam state "
                     "(so its model states are 16Ψ as fp32); ZeRO bf16 = bf16 params/grads + fp32 master and Adam state")
    lines.append("- DDP model states: counted here as fp32 params + grads + Adam state (its bucket buffers not included)")
    lines += [
        "",
        "| system | median step (s) | vs DDP | model states / rank (MB) | paper (MB) | measured / paper "
        "| comm / step (elements) | paper | measured / paper | max abs Δloss vs DDP | live tensor bytes (MB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in args.systems:
        r = rows[name]
        paper_state = paper_bytes(psi, n, name, args.precision)
        paper_comm = (3 if name == "zero3" else 2) * psi
        if ddp is None:
            ratio, dloss = "n/a", "n/a"
        else:
            ratio = f"{r['median'] / ddp['median']:.2f}x"
            dloss = max(abs(a - b) for ra, rb in zip(r["losses"], ddp["losses"]) for a, b in zip(ra, rb))
            dloss = f"{dloss:.2e}"
        label = "DDP" if name == "ddp" else f"ZeRO stage {name[-1]}"
        lines.append(
            f"| {label} | {r['median']:.3f} | {ratio} | {r['state'] / MB:.1f} | {paper_state / MB:.1f} "
            f"| {r['state'] / paper_state:.3f} | {r['comm']:,} | {paper_comm:,} | {r['comm'] / paper_comm:.3f} "
            f"| {dloss} | {r['live'] / MB:.1f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="gloo processes to spawn")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS))
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3, help="leading steps excluded from the timing")
    p.add_argument("--seq", type=int, default=128, help="sequence length (also n_positions)")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    # Defaults give ~25.3M parameters (6 x 3.15M blocks + 6.3M tied embedding).
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--vocab", type=int, default=12288)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before the workers are given up on")
    p.add_argument("--output", help="also write the markdown table to this file")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in args.systems if s not in SYSTEMS]
    if bad or not args.systems:
        p.error(f"--systems: unknown {bad}; choose from {','.join(SYSTEMS)}")
    if args.world_size < 1:
        p.error("--world-size must be >= 1")
    if not 0 <= args.warmup < args.steps:
        p.error("need 0 <= --warmup < --steps (at least one timed step)")
    if args.n_embd % args.n_head:
        p.error("--n-embd must be divisible by --n-head")
    return args


def main(argv=None):
    args = parse_args(argv)
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    per_rank = spawn(args)
    table = summarize(args, per_rank)
    # The load average tells a reader whether other processes shared the cores (and so
    # how far to trust the step times); this run itself adds about world_size.
    table += (f"\n_total wall time {time.perf_counter() - t0:.0f}s; 1-min load average "
              f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after ({os.cpu_count()} cores)_\n")
    sys.stdout.write(table)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(table)


if __name__ == "__main__":
    main()
