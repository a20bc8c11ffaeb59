"""Where a step's time goes: forward+backward and ``step()`` medians per system, on N
gloo ranks, with the systems run one after another in fresh processes and the whole
list repeated (odd passes reversed), so drift hits all alike.

    .venv/bin/python benchmarks/phase_times.py --model 100m --systems ddp,zero0,zero1,zero2 --repeats 2

``--precision bf16`` runs DDP under autocast over fp32 parameters and ours with
``precision: bf16``, as run_all.py does.

DDP's step is ``optimizer.step()`` plus ``zero_grad``; ours is ``engine.step()``, which
at stages 1-2 includes the all-gather of the updated parameters.  ``fsdp2_zero2`` /
``fsdp2_zero3`` are FSDP2 as run_all.py builds it (``reshard_after_forward`` False /
True): its step is AdamW over the shards, and every all-gather falls in forward (and,
resharding, backward).  Reported, never
asserted (timings on a shared machine are noisy).
"""
from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for path in (REPO, HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import systems as S  # noqa: E402
from spawn import run_workers  # noqa: E402

SYSTEMS = ("ddp", "zero0", "zero1", "zero2", "zero3", "fsdp2_zero2", "fsdp2_zero3")


def _worker(rank, world_size, store_path, args, queue):
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    try:
        import transformers

        import zero_strategy

        transformers.logging.set_verbosity_error()
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
        shape = S.PRESETS[args.model]
        cfg = transformers.GPT2Config(n_layer=shape["n_layer"], n_embd=shape["n_embd"], n_head=shape["n_head"],
                                      vocab_size=shape["vocab"], n_positions=shape["seq"],
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, shape["vocab"], (shape["micro_batch"], shape["seq"]),
                            generator=torch.Generator().manual_seed(rank))
        if args.system == "ddp":
            ddp = torch.nn.parallel.DistributedDataParallel(model)

            def forward_backward():
                # bf16 for DDP = autocast over fp32 parameters, as in run_all.py.
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                    loss = ddp(input_ids=ids, labels=ids).loss
                loss.backward()

            def step():
                opt.step()
                opt.zero_grad(set_to_none=True)
        elif args.system.startswith("fsdp2"):
            S.fsdp2_shard(model, world_size, args.precision, args.system.endswith("3"))  # as run_all.py
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # over the sharded parameters

            def forward_backward():
                model(input_ids=ids, labels=ids).loss.backward()

            def step():
                opt.step()
                opt.zero_grad(set_to_none=True)
        else:
            engine = zero_strategy.initialize(model, opt, dict(stage=int(args.system[-1]), precision=args.precision))

            def forward_backward():
                engine.backward(model(input_ids=ids, labels=ids).loss)

            step = engine.step
        times = {"forward_backward": [], "step": []}
        for i in range(args.warmup + args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            forward_backward()
            t1 = time.perf_counter()
            step()
            t2 = time.perf_counter()
            if i >= args.warmup:
                times["forward_backward"].append(t1 - t0)
                times["step"].append(t2 - t1)
        buf = io.BytesIO()
        torch.save(times, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure goes to the parent
        import traceback

        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(S.PRESETS), default="100m")
    p.add_argument("--systems", default="ddp,zero0,zero1,zero2")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800.0)
    args = p.parse_args(argv)
    names = [s for s in args.systems.split(",") if s]
    bad = [s for s in names if s not in SYSTEMS]
    if bad:
        p.error(f"--systems: unknown {bad}; choose from {','.join(SYSTEMS)}")
    print(f"{'pass':>4} {'system':8s} {'fwd+bwd (s)':>12} {'step (s)':>9} {'total (s)':>10}")
    for rep in range(args.repeats):
        for name in (names if rep % 2 == 0 else names[::-1]):
            args.system = name
            times = run_workers(_worker, args, prefix="phase_times_")[0]  # rank 0's
            fb, st = statistics.median(times["forward_backward"]), statistics.median(times["step"])
            print(f"{rep:>4} {name:8s} {fb:12.3f} {st:9.3f} {fb + st:10.3f}", flush=True)


if __name__ == "__main__":
    main()
