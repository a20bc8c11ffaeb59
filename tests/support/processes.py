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
