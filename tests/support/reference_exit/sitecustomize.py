"""Loaded at start-up (as ``sitecustomize``) by plain DDP reference launches only: the
launch helpers in tests/accelerate/test_accelerate.py and tests/transformers/test_trl_dpo.py
put this folder first on their PYTHONPATH.

Before the interpreter finalises, it sleeps a moment so torch's gloo worker threads can
drop the last work they ran.  A worker that finishes a collective releases its work, and
with it Python tensors, which needs the interpreter lock; when the main thread runs on to
the end of the script without giving the lock up, and at shutdown frees the last
reference to the process group (DDP's Reducer holds one), the group's destructor joins
that worker while holding the lock: a deadlock (seen with TRL's sft.py; the harness then
ended the launch 30 s after its output was written).  Sleeping releases the lock.  What a
reference computes is untouched: this runs after the script has finished.
"""
import atexit
import time

atexit.register(time.sleep, 0.2)
