"""Run a command whose processes start processes of their own (Lightning's launcher
re-runs the script for the other ranks), and never wait on one of them for ever.

``subprocess.run(..., capture_output=True)`` returns only when every process holding
the output pipes has closed them.  When a launch fails on one rank (say, rank 0 cannot
open its store), the rank it started can be left waiting for a peer that is gone,
orphaned, holding the pipes: the test then waits until that rank's own timeout (half an
hour for a process group).  Here the command runs in a session of its own; once the
first process has exited, the others get ``grace`` seconds, and then the whole session
is ended."""
from __future__ import annotations

import os
import signal
import subprocess
import time


def run_session(cmd, *, cwd, env, timeout: float, grace: float = 20.0) -> subprocess.CompletedProcess:
    start = time.monotonic()
    exited_at = None
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as p:
        while True:
            try:
                out, err = p.communicate(timeout=1)
                return subprocess.CompletedProcess(cmd, p.returncode, out, err)
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if exited_at is None and p.poll() is not None:
                    exited_at = now
                if now - start > timeout or (exited_at is not None and now - exited_at > grace):
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    out, err = p.communicate()
                    note = (f"\n[test harness] ended the session {grace:g} s after its first process exited"
                            if exited_at is not None else f"\n[test harness] timed out after {timeout:g} s")
                    code = p.returncode if exited_at is not None and p.returncode else -9
                    return subprocess.CompletedProcess(cmd, code, out, err + note)


def process_tree(root: int) -> list:
    """``root`` and every process descended from it (Linux /proc): torchrun starts each
    worker in a session of its own, so ending a launch's session leaves them running."""
    from pathlib import Path

    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def run_together(cmds, *, cwd, envs, timeout: float, grace: float = 30.0) -> list:
    """Start every command of ``cmds`` at once (``envs``: one environment each), as the
    per-node launchers of one multi-node job, and wait for all of them.  When one fails,
    the others get ``grace`` seconds (a launcher whose peer is gone waits in its
    rendezvous for many minutes); on a failure or ``timeout``, whatever is left of every
    launch -- their workers included, whatever session they are in -- is ended.
    Returns a ``CompletedProcess`` per command, in order (returncode -9 for one ended here)."""
    import tempfile

    logs, procs = [], []
    try:
        for cmd, env in zip(cmds, envs):
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            logs.append((out, err))
            procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, text=True,
                                          start_new_session=True))
        start, failed_at, ended = time.monotonic(), None, False
        while any(p.poll() is None for p in procs):
            time.sleep(0.5)
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now
            if now - start > timeout or (failed_at is not None and now - failed_at > grace):
                ended = True
                break
        if ended or failed_at is not None:
            for p in procs:
                for pid in process_tree(p.pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        results = []
        for cmd, p, (out, err) in zip(cmds, procs, logs):
            p.wait(timeout=60)
            out.seek(0)
            err.seek(0)
            note = f"\n[test harness] ended after {time.monotonic() - start:.0f} s" if ended and p.returncode < 0 else ""
            results.append(subprocess.CompletedProcess(cmd, p.returncode, out.read(), err.read() + note))
        return results
    finally:
        for out, err in logs:
            out.close()
            err.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
