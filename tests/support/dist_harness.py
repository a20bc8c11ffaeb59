"""Run a function on N real gloo processes (torch.multiprocessing + FileStore).

Each worker's return value (picklable) comes back to the test; an exception in any
worker is re-raised in the test with that worker's traceback.  Kept tiny on purpose:
MultiProcessTestCase needs the dev-only expecttest package.

On Linux the workers are forked from a multiprocessing fork server that has imported
torch and transformers once, and nothing else: a spawned worker spent several seconds
importing them (most of a small test's time, on two busy cores), once per rank per
test.  Each worker is still a new process that has run no test code, gets the test
process's current environment, working directory and sys.path (as a spawned one does),
and initialises torch's thread pools and process group itself.
"""
from __future__ import annotations

import io
import multiprocessing.forkserver
import os
import queue as queue_mod
import sys
import time
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# Imported once in the fork server: every worker needs them, none has state to share.
_PRELOAD = ["torch", "torch.distributed", "transformers.modeling_utils", "transformers.models.gpt2.modeling_gpt2",
            "transformers.models.llama.modeling_llama", "safetensors.torch",
            # warm launches (warm_launch.py): accelerate's launcher and what the launched scripts import
            "accelerate", "accelerate.commands.launch", "transformers.trainer"]
_context = None


def _mp_context():
    global _context
    if _context is None:
        if sys.platform.startswith("linux"):
            _context = mp.get_context("forkserver")
            _context.set_forkserver_preload(_PRELOAD)
            # The server loads torch's OpenMP runtime, which reads OMP_NUM_THREADS once;
            # and it imports accelerate, whose start-up hook acts on a zero_config section
            # in the environment: the server starts without one.
            saved = dict(os.environ)
            os.environ.setdefault("OMP_NUM_THREADS", "1")
            for name in [k for k in os.environ if k.startswith("ZERO_STRATEGY_")]:
                del os.environ[name]
            try:
                multiprocessing.forkserver.ensure_running()
            finally:
                os.environ.clear()
                os.environ.update(saved)
        else:  # fork is unsafe on macOS
            _context = mp.get_context("spawn")
    return _context


def _worker(rank, world_size, store_path, fn, args, queue, backend="gloo", environ=None):
    if environ is not None:  # the fork server's environment is the one it started with
        os.environ.clear()
        os.environ.update(environ)
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


def _spawn_and_collect(fn, world_size, args, timeout, backend, stop_at_first_error):
    """Start the workers; return ({rank: ("ok", result) | ("error", traceback)},
    {rank: exit code of ranks that died without reporting}, timed_out)."""
    ctx = _mp_context()
    queue = ctx.Queue()
    fd, store_path = tempfile.mkstemp(prefix="zs_store_")
    os.close(fd)
    os.unlink(store_path)
    procs = [ctx.Process(target=_worker, args=(r, world_size, store_path, fn, args, queue, backend, dict(os.environ))) for r in range(world_size)]
    for p in procs:
        p.start()
    outcomes, dead, timed_out = {}, {}, False
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) + len(dead) < world_size:
            if stop_at_first_error and (dead or any(k == "error" for k, _ in outcomes.values())):
                break
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except queue_mod.Empty:
                for r, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and r not in outcomes:
                        dead[r] = p.exitcode
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                continue
            if status == "ok":
                outcomes[rank] = ("ok", torch.load(io.BytesIO(payload), weights_only=False))
            else:
                outcomes[rank] = ("error", payload)
    finally:
        for p in procs:
            p.join(timeout=5 if (dead or timed_out or len(outcomes) < world_size) else 60)
            if p.is_alive():
                p.kill()
        if os.path.exists(store_path):
            os.unlink(store_path)
    return outcomes, dead, timed_out


def run_distributed(fn, world_size: int, *args, timeout: float = 600.0, backend: str = "gloo"):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank."""
    outcomes, dead, timed_out = _spawn_and_collect(fn, world_size, args, timeout, backend, stop_at_first_error=True)
    errors = [f"--- rank {r} ---\n{v}" for r, (k, v) in sorted(outcomes.items()) if k == "error"]
    if dead:
        errors.append(f"rank(s) {sorted(dead)} exited with code(s) {[dead[r] for r in sorted(dead)]} without a result")
    if timed_out and not errors:
        errors.append(f"timed out after {timeout:.0f}s waiting for ranks {sorted(set(range(world_size)) - set(outcomes))}")
    if errors:
        raise RuntimeError("distributed worker failed:\n" + "\n".join(errors))
    return [outcomes[r][1] for r in range(world_size)]


def run_distributed_outcomes(fn, world_size: int, *args, timeout: float = 120.0, backend: str = "gloo"):
    """Like run_distributed, but waits for every rank and reports each one's fate:
    ``{"ranks": {rank: ("ok", result) | ("error", traceback) | ("dead", exit code)},
    "seconds": wall time, "timed_out": whether some rank was still running at the end}``."""
    start = time.monotonic()
    outcomes, dead, timed_out = _spawn_and_collect(fn, world_size, args, timeout, backend, stop_at_first_error=False)
    ranks = dict(outcomes)
    for r, code in dead.items():
        ranks.setdefault(r, ("dead", code))
    return {"ranks": ranks, "seconds": time.monotonic() - start, "timed_out": timed_out}
