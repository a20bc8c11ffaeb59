"""Confirm by a run what ``largest_model.py`` estimates: each system trains its largest
GPT-2 (the most blocks of the given width whose model states fit in a rank's share of
RAM, less the reserve) for two steps on N gloo processes, and every rank reports its
peak resident memory (VmHWM).

A size fits when the run completes.  Next to it the table gives every rank's peak
against its share of what the host had free before the first run (MemAvailable / N,
less than MemTotal / N by what the system and other processes hold), and the headroom
left, in blocks of the model (one block more costs the system's per-rank bytes for one
block's parameters, by the same formulas), so a reader sees whether the estimator's
reserve was too cautious (a block or more to spare) or too bold (a rank over its
share).  ``--extra-blocks K`` runs K blocks above the estimate, to find the largest
that really fits.

Each rank also watches the host: when MemAvailable falls below ``--min-available``
it stops itself and the run is reported as "out of memory" instead of leaving the
kernel to kill some other process on a shared machine (there is no swap here).

    .venv/bin/python benchmarks/confirm_largest.py --world-size 2
    .venv/bin/python benchmarks/confirm_largest.py --systems ddp,fsdp2,zero3 --extra-blocks 1

How each system builds its model is what its users do for a model this size: DDP
builds it whole on every rank (it has no other way); FSDP2 builds it on the meta
device, shards it with ``fully_shard`` and then materialises the shards
(``to_empty``); ours builds it inside ``zero_strategy.init_context()``.  bf16 and
AdamW throughout, as in ``largest_model.py``: DDP with autocast over fp32 parameters,
FSDP2 with a bf16 ``MixedPrecisionPolicy`` over fp32 shards.
"""
from __future__ import annotations

import argparse
import io
import os
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
for path in (REPO, HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import largest_model  # noqa: E402
from spawn import run_workers  # noqa: E402
from systems import peak_rss_bytes  # noqa: E402
from zero_strategy.cli import parse_bytes  # noqa: E402
from zero_strategy.estimate import largest_fitting  # noqa: E402

# Short name -> (row of largest_model.systems(), how to build and train it).
SYSTEMS = {
    "ddp": ("DDP (torch, autocast bf16)", {"kind": "ddp"}),
    "fsdp2": ("FSDP2 (fully_shard, bf16 compute)", {"kind": "fsdp2"}),
    "zero0": ("ours, stage 0", {"kind": "zero", "stage": 0}),
    "zero1": ("ours, stage 1", {"kind": "zero", "stage": 1}),
    "zero2": ("ours, stage 2", {"kind": "zero", "stage": 2}),
    "zero3": ("ours, stage 3", {"kind": "zero", "stage": 3}),
    "zero1_cpu": ("ours, stage 1 + offload_optimizer: cpu", {"kind": "zero", "stage": 1, "offload_optimizer": "cpu"}),
    "zero2_cpu": ("ours, stage 2 + offload_optimizer: cpu", {"kind": "zero", "stage": 2, "offload_optimizer": "cpu"}),
    "zero3_cpu": ("ours, stage 3 + offload_optimizer: cpu", {"kind": "zero", "stage": 3, "offload_optimizer": "cpu"}),
}


def _meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


_PHASE = ["starting"]  # what the rank is doing, for the host-memory watch's message


def _phase(name: str, progress: bool) -> None:
    if progress:
        print(f"[{time.strftime('%H:%M:%S')}] {_PHASE[0]} done, peak RSS {peak_rss_bytes() / 2**30:,.2f} GiB; "
              f"now {name}", file=sys.stderr, flush=True)
    _PHASE[0] = name


def _watch_host(rank, queue, min_available: int) -> None:
    """Stop this rank (exit 137) before the host runs out of memory."""
    def watch():
        while True:
            available = _meminfo("MemAvailable")
            if available < min_available:
                queue.put((rank, "error", f"out of memory in {_PHASE[0]}: MemAvailable fell to "
                                          f"{available / 2**20:,.0f} MiB (peak RSS of this rank "
                                          f"{peak_rss_bytes() / 2**30:,.2f} GiB); stopped"))
                time.sleep(0.5)  # let the queue's feeder thread send it
                os._exit(137)
            time.sleep(0.2)
    threading.Thread(target=watch, daemon=True, name="host-memory-watch").start()


def _wait_for_memory(idle: int, slack: int = 256 * 2**20, timeout: float = 120.0) -> None:
    """Wait until the host has (nearly) as much free as before the first run: processes
    of a run that was stopped may still be exiting, and the next run must not pay for
    them."""
    deadline = time.monotonic() + timeout
    while _meminfo("MemAvailable") < idle - slack and time.monotonic() < deadline:
        time.sleep(1.0)


def _settled_available(timeout: float = 60.0) -> int:
    """MemAvailable once it has stopped rising (an earlier invocation's stopped processes
    may still be handing their memory back)."""
    deadline = time.monotonic() + timeout
    last = _meminfo("MemAvailable")
    while time.monotonic() < deadline:
        time.sleep(2.0)
        now = _meminfo("MemAvailable")
        if now - last < 64 * 2**20:
            return max(now, last)
        last = now
    return last


def _config(args):
    from transformers import GPT2Config

    return GPT2Config(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, vocab_size=args.vocab,
                      n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)


def _fill_like_gpt2(named_tensors) -> None:
    """GPT-2's initialisation, for parameters materialised without values."""
    with torch.no_grad():
        for name, t in named_tensors:
            if t.dim() >= 2:
                t.normal_(0.0, 0.02)
            elif name.endswith("weight"):
                t.fill_(1.0)
            else:
                t.zero_()


def _build(args, spec, world_size):
    """(model, forward(ids) -> loss, backward(loss), step()) for one system, built its way."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    kind = spec["kind"]
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = transformers.GPT2LMHeadModel(_config(args))
        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)

        def forward(ids):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return ddp(input_ids=ids, labels=ids).loss

        def step():
            opt.step()
            opt.zero_grad(set_to_none=False)
        return model, forward, lambda loss: loss.backward(), step
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        with torch.device("meta"):
            model = transformers.GPT2LMHeadModel(_config(args))
        mesh = init_device_mesh("cpu", (world_size,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        model.to_empty(device="cpu")
        _fill_like_gpt2((n, p.to_local()) for n, p in model.named_parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            opt.step()
            opt.zero_grad()
        return model, lambda ids: model(input_ids=ids, labels=ids).loss, lambda loss: loss.backward(), step
    import zero_strategy

    with zero_strategy.init_context():
        model = transformers.GPT2LMHeadModel(_config(args))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    config = {k: v for k, v in spec.items() if k != "kind"}
    engine = zero_strategy.initialize(model, opt, dict(precision="bf16", **config))
    return model, lambda ids: model(input_ids=ids, labels=ids).loss, engine.backward, engine.step


def _worker(rank, world_size, store_path, args, queue):
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // world_size))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    _watch_host(rank, queue, args.min_available)
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
        progress = args.progress and rank == 0
        _phase("build", progress)
        t0 = time.perf_counter()
        model, forward, backward, step = _build(args, SYSTEMS[args.system][1], world_size)
        psi = sum(p.numel() for p in model.parameters())
        out = {"params": psi, "build_s": time.perf_counter() - t0, "peak_after_build": peak_rss_bytes(),
               "losses": [], "step_s": [], "peak_after_step": []}
        ids = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(rank))
        for i in range(args.steps):
            t0 = time.perf_counter()
            _phase(f"step {i + 1} forward", progress)
            loss = forward(ids)
            _phase(f"step {i + 1} backward", progress)
            backward(loss)
            _phase(f"step {i + 1} optimizer step", progress)
            step()
            _phase(f"after step {i + 1}", progress)
            out["losses"].append(loss.item())
            out["step_s"].append(time.perf_counter() - t0)
            out["peak_after_step"].append(peak_rss_bytes())
        buf = io.BytesIO()
        torch.save(out, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure goes to the parent
        import traceback

        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def plan(args):
    """Per system: (short name, row name, blocks, Ψ, model states per rank, bytes per rank of one more block)."""
    n = args.world_size
    budget = args.ram // n - args.reserve_per_rank
    rows = {name: ram for name, ram, _, _ in largest_model.systems()}
    out = []
    for short in args.systems:
        row, _ = SYSTEMS[short]
        ram = rows[row]
        psi = largest_fitting(lambda x: ram(x, n), budget)
        blocks, per_block, rest = largest_model.gpt2_layers(psi, args.n_embd, args.vocab, args.seq)
        blocks += args.extra_blocks
        psi = rest + blocks * per_block
        out.append((short, row, blocks, psi, ram(psi, n), ram(psi + per_block, n) - ram(psi, n)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    p.add_argument("--ram", type=parse_bytes, default=None, help="the host's memory (default: MemTotal)")
    p.add_argument("--reserve-per-rank", type=parse_bytes, default=parse_bytes("2GiB"),
                   help="as in largest_model.py: memory per rank that is not model states")
    p.add_argument("--extra-blocks", type=int, default=0, help="train this many blocks more than the estimate")
    p.add_argument("--min-available", type=parse_bytes, default=parse_bytes("768MiB"),
                   help="a rank stops itself when the host's MemAvailable falls below this")
    p.add_argument("--n-embd", type=int, default=2560)
    p.add_argument("--n-head", type=int, default=20)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=2, help="training steps (the second runs with every state allocated)")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--progress", action="store_true", help="rank 0 prints its peak RSS after each phase to stderr")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in args.systems:
        if s not in SYSTEMS:
            p.error(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    if args.ram is None:
        args.ram = _meminfo("MemTotal")
    n = args.world_size
    gib = 2**30
    print(f"N = {n} ranks: RAM {args.ram / gib:,.2f} GiB (MemTotal / N {args.ram / n / gib:,.2f} GiB), reserve "
          f"{args.reserve_per_rank / gib:,.2f} GiB; GPT-2 width {args.n_embd}, vocab {args.vocab}, 1x{args.seq} tokens "
          f"per rank, {args.steps} steps, bf16 + AdamW" + (f"; {args.extra_blocks} block(s) over the estimate"
                                                            if args.extra_blocks else ""))
    print()
    print("| system | blocks | parameters | model states / rank, formula (GiB) | fits | peak RSS / rank, max over ranks "
          "(GiB) | share: MemAvailable before the first run / N (GiB) | headroom (blocks) | s / step | loss, step 1 -> last |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    idle = min(_settled_available(), args.ram)  # --ram may stand for a smaller machine
    share = idle // n
    for short, row, blocks, psi, states, per_block in plan(args):
        args.system, args.n_layer = short, blocks
        _wait_for_memory(idle)
        sys.stdout.flush()
        try:
            results = run_workers(_worker, args, prefix="confirm_largest_")
        except RuntimeError as e:
            reason = "out of memory" if "out of memory" in str(e) else "failed"
            print(f"| {row} | {blocks} | {psi / 1e9:,.3f}B | {states / gib:,.2f} | NO: {reason} | - | "
                  f"{share / gib:,.2f} | - | - | - |", flush=True)
            print(str(e), file=sys.stderr, flush=True)
            continue
        measured = results[0]["params"]
        if measured != psi:
            raise SystemExit(f"{short}: built {measured:,} parameters, the plan said {psi:,}")
        peak = max(r["peak_after_step"][-1] for r in results)
        headroom = (share - peak) / per_block
        step_s = max(r["step_s"][-1] for r in results)
        losses = results[0]["losses"]
        print(f"| {row} | {blocks} | {psi / 1e9:,.3f}B | {states / gib:,.2f} | yes | {peak / gib:,.2f} | "
              f"{share / gib:,.2f} | {headroom:+.1f} | {step_s:,.0f} | "
              f"{losses[0]:.3f} -> {losses[-1]:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
