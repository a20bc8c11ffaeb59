"""Start one benchmark worker process per rank and collect what each one reports.

A worker is called as ``worker_main(rank, world_size, store_path, args, queue)`` and
puts ``(rank, "ok", torch-serialised bytes)``, ``(rank, "error", traceback text)`` or,
optionally, ``(rank, "progress", payload)`` on the queue.  A rank that dies, an error
or ``args.timeout`` seconds without every result stop the run with RuntimeError; only
the processes started here are killed, and the FileStore's files are removed.
"""
from __future__ import annotations

import io
import os
import queue as queue_mod
import tempfile
import time

import torch
import torch.multiprocessing as mp


def run_workers(worker_main, args, prefix: str, progress=None) -> list:
    """Each rank's result (rank order), from ``args.world_size`` spawned workers."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix=prefix)
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
            if status == "progress":
                if progress is not None:
                    progress(payload)
            elif status == "ok":
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
        raise RuntimeError("benchmark worker failed:\n" + "\n".join(errors))
    return [results[r] for r in range(args.world_size)]
