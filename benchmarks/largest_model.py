"""The largest model each system can train one step of on this machine, by the estimator.

For N ranks sharing one host, each rank gets ``ram / N - reserve`` bytes for model states
(``reserve``: the Python/torch runtime, activations, gathered blocks and buckets, which the
model-state formulas leave out; the 2.0B disk-offload run at width 2560 peaked at 4.08 GiB
per rank against 2.12 GiB of estimated model states, so about 2 GiB of it). For every
system this prints the largest parameter count whose model states fit in that, what
limits it (memory or, for disk offload, the free disk under ``--nvme-path`` shared by the
N ranks) and the GPT-2 shape of that size at the given width (the shape ``bench_nvme.py``
trains).

    .venv/bin/python benchmarks/largest_model.py --world-size 2
    .venv/bin/python benchmarks/largest_model.py --world-size 2 --ram 24GiB --reserve-per-rank 2GiB --disk 70e9

Bytes per rank, mixed precision (bf16) with AdamW, Ψ parameters, N ranks:

* DDP (torch DistributedDataParallel, autocast over fp32 parameters, its default
  ``gradient_as_bucket_view=False``, as benchmarks/systems.py runs it): fp32 parameters
  4Ψ, their gradients 4Ψ, DDP's gradient buckets (a second copy) 4Ψ, Adam 8Ψ = 20Ψ.
* FSDP2 (``fully_shard`` per block, bf16 compute, fp32 sharded parameters): parameter,
  gradient and Adam shards, (4 + 4 + 8)Ψ/N; the gathered bf16 blocks are in the reserve.
* DeepSpeed: only when ``import deepspeed`` works (it is not installed here).
* ours, stages 0-3: ``zero_strategy.estimate(...).held_during_step`` with the default
  buckets, as ``zero-strategy estimate`` prints it (stage 3: 14Ψ/N).
* ours with ``offload_optimizer: cpu``: on a host without an accelerator the "device" and
  the host are the same memory, so nothing is saved; the host step adds an fp32 copy of the
  gradient slice (4Ψ/N). Stage 1: 2Ψ + 2Ψ + 16Ψ/N, stage 2: 2Ψ + 16Ψ/N, stage 3: 16Ψ/N.
* ours with ``offload_optimizer: nvme`` (and ``offload_param: nvme`` at stage 3):
  ``zero_strategy.estimate.disk_offload_estimate`` (RAM and disk per rank).

``--check-plan`` builds a small GPT-2 for every "ours" row on torch's fake process group
(rank 0 of N: the real planner and buffers, no communication) and prints the engine's own
``memory_report()`` next to the formula, per parameter, so the formulas above are checked
against what the engine allocates (disk offload cannot run there: it makes files).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from zero_strategy.cli import parse_bytes  # noqa: E402
from zero_strategy.config import ZeroConfig  # noqa: E402
from zero_strategy.estimate import disk_offload_estimate, estimate, largest_fitting  # noqa: E402


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _ours(stage):
    defaults = ZeroConfig()

    def needed(psi, n):
        bucket = defaults.reduce_bucket_size
        return estimate(psi, n, stage, "bf16", "adamw", reduce_bucket_size=bucket,
                        prefetch_bucket_size=defaults.prefetch_bucket_size,
                        num_units=max(1, _ceil(psi, bucket))).held_during_step
    return needed


def _cpu_offload(stage):
    def needed(psi, n):
        shard = _ceil(psi, n)
        return {1: 4 * psi + 16 * shard, 2: 2 * psi + 16 * shard, 3: 16 * shard}[stage]
    return needed


def _disk(stage, offload_param, what):
    inflight = ZeroConfig().nvme_inflight_bytes

    def needed(psi, n):
        r = disk_offload_estimate(psi, n, stage, "bf16", "adamw", offload_param=offload_param, inflight_bytes=inflight)
        return r.ram if what == "ram" else r.disk
    return needed


def systems():
    """(name, RAM bytes per rank for (Ψ, N), disk bytes per rank or None, config for --check-plan)."""
    rows = [
        ("DDP (torch, autocast bf16)", lambda psi, n: 20 * psi, None, None),
        ("FSDP2 (fully_shard, bf16 compute)", lambda psi, n: 16 * _ceil(psi, n), None, None),
    ]
    for stage in range(4):
        rows.append((f"ours, stage {stage}", _ours(stage), None, {"stage": stage}))
    for stage in (1, 2, 3):
        rows.append((f"ours, stage {stage} + offload_optimizer: cpu", _cpu_offload(stage), None,
                     {"stage": stage, "offload_optimizer": "cpu"}))
    for stage in (1, 2, 3):
        rows.append((f"ours, stage {stage} + offload_optimizer: nvme", _disk(stage, False, "ram"),
                     _disk(stage, False, "disk"), None))
    rows.append(("ours, stage 3 + offload_optimizer + offload_param: nvme", _disk(3, True, "ram"),
                 _disk(3, True, "disk"), None))
    return rows


def gpt2_layers(psi, n_embd, vocab, seq):
    """The most GPT-2 blocks of width n_embd that fit in psi parameters (tied head)."""
    per_block = 12 * n_embd * n_embd + 13 * n_embd
    rest = vocab * n_embd + seq * n_embd + 2 * n_embd
    return max(0, (psi - rest) // per_block), per_block, rest


def deepspeed_status() -> str:
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: not available
        return f"not available (import deepspeed: {type(e).__name__}: {e})"
    return "installed, but its formulas are not in this table"


def check_plan(world_size: int) -> list:
    """memory_report() of a small GPT-2 on the fake process group, per 'ours' config."""
    import torch
    import torch.distributed as dist
    import transformers
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zero_strategy

    transformers.logging.set_verbosity_error()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    out = []
    try:
        for name, ram, _, config in systems():
            if config is None:
                continue
            torch.manual_seed(0)
            cfg = transformers.GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=4096, n_positions=64,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
            model = transformers.GPT2LMHeadModel(cfg)  # built whole: the fake group materialises nothing
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            engine = zero_strategy.initialize(model, opt, dict(precision="bf16", param_persistence_threshold=0, **config))
            ids = torch.randint(0, 4096, (1, 16))
            for _ in range(2):  # the second backward: every model state exists, as in the step
                engine.backward(model(input_ids=ids, labels=ids).loss)
                if _ == 0:
                    engine.step()
            report = engine.memory_report()
            engine.step()
            psi = sum(p.numel() for p in model.parameters())
            states = sum(report[k] for k in ("parameters", "gradients", "master_weights", "optimizer_state"))
            # The formulas without their buckets (stage 3 here: nothing of the kind is counted).
            formula = {0: 16 * psi}.get(config["stage"]) if "offload_optimizer" not in config else ram(psi, world_size)
            if formula is None:
                formula = estimate(psi, world_size, config["stage"], "bf16", "adamw").held_during_step
            out.append((name, psi, states, formula))
            engine.close()
    finally:
        dist.destroy_process_group()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--ram", type=parse_bytes, default=None, help="the host's memory (default: MemTotal)")
    p.add_argument("--reserve-per-rank", type=parse_bytes, default=parse_bytes("2GiB"),
                   help="memory per rank that is not model states (runtime, activations, gathered blocks)")
    p.add_argument("--nvme-path", default="/tmp", help="where disk offload would write (its free space is the disk)")
    p.add_argument("--disk", type=parse_bytes, default=None, help="disk for all ranks (default: free under --nvme-path)")
    p.add_argument("--n-embd", type=int, default=2560)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--check-plan", action="store_true", help="also compare the formulas with the engine's own count")
    args = p.parse_args(argv)
    n = args.world_size
    if args.ram is None:
        with open("/proc/meminfo") as f:
            args.ram = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    if args.disk is None:
        args.disk = shutil.disk_usage(args.nvme_path).free
    budget = args.ram // n - args.reserve_per_rank
    disk = args.disk // n
    gib = 2**30
    print(f"N = {n} ranks on one host: RAM {args.ram / gib:,.1f} GiB, {args.reserve_per_rank / gib:,.1f} GiB per rank "
          f"reserved -> {budget / gib:,.2f} GiB of model states per rank; disk {args.disk / 1e9:,.1f} GB "
          f"({disk / 1e9:,.1f} GB per rank); bf16 + AdamW")
    print()
    print(f"| system | largest model (parameters) | limited by | RAM / rank at that size (GiB) | disk / rank (GB) "
          f"| GPT-2 blocks at width {args.n_embd} |")
    print("|---|---|---|---|---|---|")
    for name, ram, on_disk, _ in systems():
        psi = largest_fitting(lambda x: ram(x, n), budget)
        limit = "memory"
        if on_disk is not None:
            by_disk = largest_fitting(lambda x: on_disk(x, n), disk)
            if by_disk < psi:
                psi, limit = by_disk, "disk"
        layers, _, _ = gpt2_layers(psi, args.n_embd, args.vocab, args.seq)
        d = f"{on_disk(psi, n) / 1e9:,.1f}" if on_disk is not None else "-"
        print(f"| {name} | {psi / 1e9:,.2f}B ({psi:,}) | {limit} | {ram(psi, n) / gib:,.2f} | {d} | {layers} |")
    print(f"| DeepSpeed | - | {deepspeed_status()} | - | - | - |")
    if args.check_plan:
        print()
        print(f"Formula check: a 2-block GPT-2 of width 256 on the fake process group (N = {n}), model-state bytes "
              "from memory_report() after the second backward, per parameter:")
        print()
        print("| configuration | Ψ | engine: bytes / Ψ | formula: bytes / Ψ |")
        print("|---|---|---|---|")
        for name, psi, states, formula in check_plan(n):
            print(f"| {name} | {psi:,} | {states / psi:.3f} | {formula / psi:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
