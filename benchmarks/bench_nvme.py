"""Disk offload (offload_optimizer: nvme) next to the in-memory run: a GPT-2-shaped
model trained a few steps on N gloo processes, one fresh set of processes per
configuration (peak resident memory only grows within a process).

Per configuration and rank it reports tokens/s (after the warm-up steps), peak resident
memory (VmHWM) and resident memory between steps (VmRSS), the model states the engine
holds in memory and on disk, and per step the bytes disk offload read and wrote (its
own count) next to what the kernel counted for the process (/proc/self/io
read_bytes / write_bytes: block I/O actually issued).

    .venv/bin/python benchmarks/bench_nvme.py --world-size 2 --stage 3 --steps 4
    .venv/bin/python benchmarks/bench_nvme.py --n-layer 4 --n-embd 256 --configs none,nvme --stage 2

The defaults (about 52M parameters, 2 ranks) stay well under 4 GB of resident memory in
all. A model whose model states (16 bytes/parameter) exceed a 24 GiB machine's RAM, built
partitioned (``init_context``: no rank ever holds it whole), about 13 minutes on 2 cores:

    .venv/bin/python benchmarks/bench_nvme.py --n-layer 25 --n-embd 2560 --n-head 20 --vocab 16384 \
        --seq 128 --batch 1 --configs nvme+param --steps 3 --progress

Every rank trains on one fixed batch of its own, so the loss should fall from step to step.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONFIGS = {
    "none": {},
    "cpu": {"offload_optimizer": "cpu"},
    "nvme": {"offload_optimizer": "nvme"},
    "nvme+param": {"offload_optimizer": "nvme", "offload_param": "nvme"},
}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _disk_used(directory) -> int:
    """Bytes of disk the files under ``directory`` occupy (allocated blocks, not sizes)."""
    total = 0
    for root, _, files in os.walk(directory):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def _io() -> dict:
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


def _worker(rank, ws, args, name, store_path, queue):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // ws)))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, ws), rank=rank, world_size=ws)
        queue.put((rank, "ok", _run(rank, ws, args, name)))
    except BaseException as e:  # noqa: BLE001 - report to the parent
        import traceback

        queue.put((rank, "error", f"{e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(rank, ws, args, name):
    import transformers

    import zero_strategy

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, vocab_size=args.vocab,
                                  n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    t_build = time.perf_counter()
    with zero_strategy.init_context():  # every rank builds nothing whole
        model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    zcfg = dict(stage=args.stage, precision=args.precision, **CONFIGS[name])
    if "nvme" in name:
        zcfg.update(nvme_path=args.nvme_path, nvme_inflight_bytes=args.inflight_bytes)
    engine = zero_strategy.initialize(model, opt, zcfg)
    psi = sum(p.numel() for p in model.parameters())
    steps, times, per_step = [], [], []
    built = {"build_s": time.perf_counter() - t_build, "peak_rss_after_build": _status("VmHWM"),
             "rss_after_build": _status("VmRSS")}
    _progress(args, rank, f"{name}: built {psi / 1e6:,.1f}M parameters in {built['build_s']:.0f} s, "
                          f"peak RSS {_mib(built['peak_rss_after_build'])} MiB")
    # The same fixed batch every step: the loss must fall as the model fits it (a sanity
    # check that the offloaded update is applied), independent of the data.
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(rank))
    times, per_step, losses = [], [], []
    for i in range(args.warmup + args.steps):
        before = _io()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        dt = time.perf_counter() - t0
        after = _io()
        losses.append(loss.item())
        disk = engine.disk_offload.report()["last_step"] if engine.disk_offload is not None else {}
        step = {"step": i, "loss": losses[-1], "seconds": dt, "read": disk.get("bytes_read", 0),
                "written": disk.get("bytes_written", 0),
                "kernel_read": after["read_bytes"] - before["read_bytes"],
                "kernel_written": after["write_bytes"] - before["write_bytes"],
                "wait_s": disk.get("wait_seconds", 0.0), "rss": _status("VmRSS"), "rss_anon": _status("RssAnon"),
                "rss_file": _status("RssFile"), "peak_rss": _status("VmHWM")}
        _progress(args, rank, f"{name}: step {i} loss {step['loss']:.4f} {dt:.1f} s, read {_mib(step['read'])} MiB "
                              f"(kernel {_mib(step['kernel_read'])}), written {_mib(step['written'])} MiB (kernel "
                              f"{_mib(step['kernel_written'])}), RSS {_mib(step['rss'])} MiB (anon "
                              f"{_mib(step['rss_anon'])}, file {_mib(step['rss_file'])}), peak {_mib(step['peak_rss'])} MiB")
        if i >= args.warmup:
            times.append(dt)
            per_step.append(step)
    report = engine.memory_report()
    directory = engine.disk_offload.directory if engine.disk_offload is not None else None
    result = {
        "params": psi,
        "tokens_per_s": args.batch * args.seq * len(times) / sum(times),
        "step_s": sorted(times),
        "peak_rss": _status("VmHWM"),
        "rss_between_steps": _status("VmRSS"),
        "rss_anon_between_steps": _status("RssAnon"),
        "rss_file_between_steps": _status("RssFile"),
        "in_memory": report["total"] - report.get("disk", 0),
        "on_disk": report.get("disk", 0),
        "disk_used": _disk_used(directory) if directory is not None else 0,
        "losses": losses,
        "per_step": per_step,
        **built,
    }
    engine.close()
    result["offload_directory_removed"] = directory is None or not os.path.exists(directory)
    return result


def _progress(args, rank, line) -> None:
    if args.progress:
        print(f"[{time.strftime('%H:%M:%S')} rank {rank}] {line}", file=sys.stderr, flush=True)


def _spawn(args, name):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    fd, store = tempfile.mkstemp(prefix="bench_nvme_store_")
    os.close(fd)
    os.unlink(store)
    procs = [ctx.Process(target=_worker, args=(r, args.world_size, args, name, store, queue)) for r in range(args.world_size)]
    for p in procs:
        p.start()
    results = {}
    try:
        while len(results) < args.world_size:
            rank, status, payload = queue.get(timeout=args.timeout)
            if status == "error":
                raise RuntimeError(f"{name}, rank {rank}: {payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if os.path.exists(store):
            os.unlink(store)
    return [results[r] for r in range(args.world_size)]


def _mib(b) -> str:
    return f"{b / 2**20:,.0f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--configs", default="none,nvme,nvme+param",
                   help=f"comma-separated, of {', '.join(CONFIGS)} (nvme+param: stage 3 only)")
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=640)
    p.add_argument("--n-head", type=int, default=10)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--nvme-path", default=None, help="directory for the offload files (default: a new temporary one)")
    p.add_argument("--inflight-bytes", type=int, default=256 * 2**20, help="nvme_inflight_bytes")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", default=None, help="also write the raw results here")
    p.add_argument("--progress", action="store_true", help="print one line per rank per step to stderr")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    for n in names:
        if n not in CONFIGS:
            p.error(f"unknown configuration {n!r}; choose from {', '.join(CONFIGS)}")
        if n == "nvme+param" and args.stage != 3:
            p.error("nvme+param needs --stage 3")
    made = args.nvme_path is None
    if made:
        args.nvme_path = tempfile.mkdtemp(prefix="bench_nvme_")
    raw = {}
    try:
        for n in names:
            raw[n] = _spawn(args, n)
    finally:
        if made:
            os.rmdir(args.nvme_path)  # empty: every engine removed its own directory at close
    psi = raw[names[0]][0]["params"]
    print(f"GPT-2 shape: {args.n_layer} layers, width {args.n_embd}, vocab {args.vocab}: {psi / 1e6:.1f}M parameters; "
          f"stage {args.stage}, {args.precision}, N = {args.world_size}, {args.batch}x{args.seq} tokens per rank per "
          f"step, {args.steps} timed steps after {args.warmup}")
    print()
    print("| config | rank | tokens/s (all ranks) | s / step (min-max) | peak RSS MiB | RSS between steps MiB (anon + file) "
          "| model states in memory MiB | on disk MiB (allocated) | read / step MiB (kernel) | written / step MiB (kernel) "
          "| step waited for I/O s | loss, first -> last step | offload dir removed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in names:
        for r, res in enumerate(raw[n]):
            steps = res["per_step"]
            avg = lambda k: sum(s[k] for s in steps) / len(steps)  # noqa: E731
            tps = res["tokens_per_s"] * args.world_size
            print(f"| {n} | {r} | {tps:,.1f} | {min(res['step_s']):.1f}-{max(res['step_s']):.1f} | {_mib(res['peak_rss'])} | "
                  f"{_mib(res['rss_between_steps'])} ({_mib(res['rss_anon_between_steps'])} + "
                  f"{_mib(res['rss_file_between_steps'])}) | {_mib(res['in_memory'])} | {_mib(res['on_disk'])} "
                  f"({_mib(res['disk_used'])}) | {_mib(avg('read'))} ({_mib(avg('kernel_read'))}) | "
                  f"{_mib(avg('written'))} ({_mib(avg('kernel_written'))}) | {avg('wait_s'):.2f} | "
                  f"{res['losses'][0]:.4f} -> {res['losses'][-1]:.4f} | {'yes' if res['offload_directory_removed'] else 'NO'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": raw}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
