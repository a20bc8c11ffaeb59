"""``accelerate launch ...`` run from a warm process: accelerate's own launcher, with the
ranks forked instead of started as new interpreters.

[Note: warm launches]
A launch spends most of its CPU time importing: the launcher imports accelerate and
torch, and each rank imports torch, transformers and accelerate again (about 14
CPU-seconds on the 2-core test machine, for a tiny model that trains in one or two).
Here the launch runs in a process forked from the test harness's fork server
(dist_harness.py), which has imported those modules once:

* the launcher: accelerate's ``launch_command`` itself, as ``accelerate launch`` runs
  it (argument parsing, the config file with its ``zero_config:`` section taken out
  and exported by this package's start-up hook, the environment accelerate prepares for
  the workers), except the last call, torchrun's agent, which is replaced by
  :func:`_fork_ranks`;
* the ranks: forked from the launcher with the variables torchrun gives a worker
  (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...); accelerate was imported before
  the launch's environment existed, so each rank runs the start-up hook's hooks again
  for the modules already imported (``zero_strategy_autoload.install()``, as
  ``python -m zero_strategy.integrations.accelerate.run`` does where start-up hooks are
  off), then runs the unchanged script as ``__main__`` with its arguments.  A rank ends with the interpreter's exit handlers and
  ``os._exit`` (no module teardown: what a process does after the script has finished
  is checked by the tests that keep real launches, ``real=True`` in test_accelerate.py).

Environment variables that modules read when imported (rather than when used) take
the values the fork server started with; the launches that depend on such a variable
stay real.  Both ranks write to the launch's two log files, as torchrun's workers write
to the launcher's console.
"""
from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional


HUNG_AFTER_FINISHING = -999  # the return code of a launch ended ``grace`` s after writing ``finished``


def warm_launch(argv, *, env: dict, cwd, timeout: float, logs: Path, finished: Optional[Path] = None,
                grace: float = 10.0) -> subprocess.CompletedProcess:
    """``accelerate launch *argv`` (the arguments after ``launch``), warm; returns what
    a ``subprocess.run`` of the real command would (``args`` is the real command line).

    ``finished``: a plain DDP reference's last output file.  Stock torch can deadlock
    when a script frees its DDP model right after its last collective (the Reducer's
    gloo group joins a worker thread that waits for the interpreter lock the freeing
    thread holds; TRL's scripts do this at the end of main()); once that file exists, a
    launch still running ``grace`` seconds later is ended and returns
    HUNG_AFTER_FINISHING."""
    from dist_harness import _mp_context

    out_path, err_path = Path(str(logs) + ".out"), Path(str(logs) + ".err")
    proc = _mp_context().Process(target=_launcher_main, args=(list(argv), dict(env), str(cwd), str(out_path), str(err_path)))
    proc.start()
    deadline, seen, hung = time.monotonic() + timeout, None, False
    while proc.is_alive() and time.monotonic() < deadline:
        proc.join(0.2)
        if finished is not None and seen is None and finished.exists():
            seen = time.monotonic()
        if seen is not None and proc.is_alive() and time.monotonic() - seen > grace:
            hung = True
            break
    timed_out = proc.is_alive() and not hung
    _kill_group(proc.pid)  # what is left of it: everything after a hang or a timeout, else a rank it left behind
    proc.join(10)
    out = out_path.read_text(errors="replace") if out_path.exists() else ""
    err = err_path.read_text(errors="replace") if err_path.exists() else ""
    cmd = ["accelerate", "launch", *argv]
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, out, err)
    if hung:
        return subprocess.CompletedProcess(cmd, HUNG_AFTER_FINISHING, out,
                                           err + f"\n[warm launch] ended {grace:g} s after {finished.name} was written: hung at exit\n")
    return subprocess.CompletedProcess(cmd, proc.exitcode, out, err)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _launcher_main(argv, env, cwd, out_path, err_path) -> None:
    os.setsid()  # the launch and its ranks in one process group, ended together
    _redirect(out_path, err_path)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    import accelerate.commands.launch as launch

    launch._run_torchrun = _fork_ranks  # the one step replaced: torchrun's agent
    sys.argv = [os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", *argv]
    args = launch.launch_command_parser().parse_args(argv)
    launch.launch_command(args)


def _redirect(out_path: str, err_path: str) -> None:
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)


def _fork_ranks(args) -> None:
    """What torchrun's agent does for one machine: start the ranks with their variables,
    wait, and on the first failure end the others (exit 1, as accelerate reports it)."""
    n = int(args.nproc_per_node)
    port = int(args.master_port) if getattr(args, "master_port", None) else 29500
    if getattr(args, "standalone", False):
        port = _free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for rank in range(n):
        pid = os.fork()
        if pid == 0:
            _rank_main(rank, n, port, args)  # never returns
        pids[pid] = rank
    failed = None
    while pids:
        pid, status = os.wait()
        rank = pids.pop(pid, None)
        if rank is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and failed is None:
            failed = (rank, code)
            for other in pids:
                try:
                    os.kill(other, signal.SIGTERM)
                except ProcessLookupError:
                    pass
    if failed is not None:
        print(f"[warm launch] rank {failed[0]} exited with code {failed[1]}", file=sys.stderr, flush=True)
        sys.exit(1)


def _rank_main(rank: int, n: int, port: int, args) -> None:
    code = 1
    try:
        os.environ.update({
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
            "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(n), "ROLE_NAME": "default",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "False",
        })
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it
        if os.environ.get("PYTHONWARNINGS"):  # read by an interpreter at start-up
            import warnings

            warnings.resetwarnings()
            warnings._processoptions(os.environ["PYTHONWARNINGS"].split(","))
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        import zero_strategy_autoload

        zero_strategy_autoload.install()  # its hooks, again, for the modules imported before this environment
        _pause_in_destroy_process_group()
        code = _run_script(args)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - a failing script, reported as an interpreter would
        sys.excepthook(*sys.exc_info())  # torch.distributed's prefixes each line with [rank<r>]:
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def _pause_in_destroy_process_group() -> None:
    """Give gloo's worker threads the interpreter lock for a moment before a process
    group is destroyed, so none is left waiting for it to release its last work when a
    DDP model freed right after (stock torch's deadlock described in :func:`warm_launch`)
    joins it.  Changes nothing a script computes."""
    import torch.distributed as dist

    destroy = dist.destroy_process_group

    def destroy_process_group(*args, **kwargs):
        time.sleep(0.05)
        return destroy(*args, **kwargs)

    dist.destroy_process_group = destroy_process_group
    dist.distributed_c10d.destroy_process_group = destroy_process_group


def _run_script(args) -> int:
    import runpy

    script, script_args = args.training_script, list(args.training_script_args)
    if args.module:
        sys.argv = [script, *script_args]
        runpy.run_module(script, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [script, *script_args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


__all__ = ["warm_launch"]
