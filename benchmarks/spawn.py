"""Start one benchmark worker process per rank and collect what each one reports.

A worker is called as ``worker_main(rank, world_size, store_path, args, queue)`` and
puts ``(rank, "ok", torch-serialised bytes)``, ``(rank, "error", traceback text)`` or,
optionally, ``(rank, "progress", payload)`` on the queue; :func:`worker_session` does
that part for it (the process group, the result or the error, the exit).  A rank that dies, an error
or ``args.timeout`` seconds without every result stop the run with RuntimeError; only
the processes started here are killed, and the FileStore's files are removed.
"""
from __future__ import annotations

import contextlib
import io
import os
import queue as queue_mod
import sys
import tempfile
import time
import traceback
import warnings

import torch
import torch.multiprocessing as mp


@contextlib.contextmanager
def worker_session(rank: int, world_size: int, store_path: str, queue, *, threads: int, env=None):
    """The life of one benchmark worker around its work: threads, quiet warnings and
    transformers logging, ``env`` exported, a gloo process group on the FileStore.
    Yields ``send(payload)``, which puts the rank's torch-serialised result on the
    queue; an exception puts its traceback there instead.  Either way the process
    group is destroyed and the process leaves with ``os._exit`` (some libraries leave
    threads that abort in the interpreter's teardown; the result is already sent)."""
    import torch.distributed as dist

    torch.set_num_threads(max(1, threads))
    warnings.filterwarnings("ignore")
    os.environ.update(env or {})
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    sent = []

    def send(payload) -> None:
        buf = io.BytesIO()
        torch.save(payload, buf)
        queue.put((rank, "ok", buf.getvalue()))
        sent.append(True)

    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
        yield send
    except BaseException:  # noqa: BLE001 - the parent prints it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            queue.close()
            queue.join_thread()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0 if sent else 1)


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
