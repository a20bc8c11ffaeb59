"""Run a function on N real gloo processes (torch.multiprocessing + FileStore).

Each worker's return value (picklable) comes back to the test; an exception in any
worker is re-raised in the test with that worker's traceback.  Kept tiny on purpose:
MultiProcessTestCase needs the dev-only expecttest package.
"""
from __future__ import annotations

import io
import os
import queue as queue_mod
import time
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world_size, store_path, fn, args, queue, backend="gloo"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Serialise to bytes: tensors sent through a torch queue share memory with a
        # process that is about to exit.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 600.0, backend: str = "gloo"):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    fd, store_path = tempfile.mkstemp(prefix="zs_store_")
    os.close(fd)
    os.unlink(store_path)
    procs = [ctx.Process(target=_worker, args=(r, world_size, store_path, fn, args, queue, backend)) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and not errors:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    errors.append(f"rank(s) {dead} exited with code(s) {[procs[r].exitcode for r in dead]} without a result")
                elif time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout:.0f}s waiting for ranks {sorted(set(range(world_size)) - set(results))}")
                continue
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
        if os.path.exists(store_path):
            os.unlink(store_path)
    if errors:
        raise RuntimeError("distributed worker failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
