"""Measured model-state bytes per rank next to the paper's formula, for each stage with
and without optimizer offload (GPT-2 style model, 2 gloo processes, bf16 + AdamW).

    .venv/bin/python benchmarks/memory_table.py [--world-size 2] [--n-layer 6 --n-embd 512]

Prints a markdown table (used in docs/bigger-models.md)."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, ws, args, store_path, queue):
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    import zero_strategy

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, ws), rank=rank, world_size=ws)
    rows = []
    for stage in (0, 1, 2, 3):
        for offload in ("none", "cpu"):
            if offload == "cpu" and stage == 0:
                continue
            torch.manual_seed(0)
            cfg = GPT2Config(n_layer=args.n_layer, n_embd=args.n_embd, n_head=8, vocab_size=args.vocab, n_positions=128)
            with zero_strategy.init_context():
                model = GPT2LMHeadModel(cfg)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            engine = zero_strategy.initialize(model, opt, dict(stage=stage, precision="bf16", offload_optimizer=offload,
                                                               param_persistence_threshold=0))
            ids = torch.randint(0, args.vocab, (2, 64))
            engine.backward(model(input_ids=ids, labels=ids).loss)
            engine.step()  # creates the optimizer state
            engine.backward(model(input_ids=ids, labels=ids).loss)
            r = engine.memory_report()  # before the step: every model state exists
            engine.step()
            psi = sum(p.numel() for p in model.parameters())
            est = zero_strategy.estimate(psi, ws, stage, precision="bf16", optimizer="adam")
            rows.append((stage, offload, psi, r["device"], r["host"], r["total"], est.total))
            engine.close()
            del engine, model, opt
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--vocab", type=int, default=12288)
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = tempfile.mktemp(prefix="zs_mem_")
    procs = [ctx.Process(target=_worker, args=(r, args.world_size, args, store, queue)) for r in range(args.world_size)]
    for pr in procs:
        pr.start()
    rows = queue.get()
    for pr in procs:
        pr.join()
    mb = lambda b: f"{b / 2**20:,.1f}"
    print(f"Ψ = {rows[0][2]:,} parameters, N = {args.world_size}, bf16 + AdamW (MiB per rank)\n")
    print("| stage | optimizer offload | on device | in host memory | total | paper formula (total) |")
    print("|---|---|---|---|---|---|")
    for stage, offload, psi, dev, host, total, est in rows:
        print(f"| {stage} | {offload} | {mb(dev)} | {mb(host)} | {mb(total)} | {mb(est)} |")


if __name__ == "__main__":
    sys.exit(main())
