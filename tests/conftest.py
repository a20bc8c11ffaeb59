import os
import sys
import warnings

# The tests live in one folder per target (core/, lightning/, accelerate/, transformers/)
# and share helpers in support/; tests import each other's launchers and helpers by
# module name, and many run themselves (or a script beside them) in a subprocess, so
# these folders go on sys.path here and on PYTHONPATH for every process started from
# a test.
_HERE = os.path.dirname(os.path.abspath(__file__))
TEST_PATHS = [os.path.join(_HERE, d) for d in ("support", "core", "lightning", "accelerate", "transformers")]
for _p in reversed(TEST_PATHS):
    if _p not in sys.path:
        sys.path.insert(0, _p)
os.environ["PYTHONPATH"] = os.pathsep.join(TEST_PATHS + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Nothing is ever downloaded; huggingface_hub reads this when imported (by the fork
# server of dist_harness.py too, whose warm launches never import it again).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore", message=".*Converting a tensor with requires_grad=True to a scalar.*")


def pytest_xdist_auto_num_workers(config):
    """Workers for ``-n auto`` (pyproject's addopts): as many as cores, at most 4.  Most
    test files start 2-4 processes of their own, so more workers than cores only make
    them contend (and timeouts tighter); on 2 cores two workers fill the time one
    leaves idle (process start-up, teardown, ranks waiting for each other)."""
    return max(1, min(os.cpu_count() or 1, 4))
