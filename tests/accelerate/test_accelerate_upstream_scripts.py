"""Accelerate's own test scripts, run as they ship in the installed accelerate, under
zero_config sections with the real ``accelerate launch`` on 2 CPU processes.

Each script asserts its own results and exits non-zero on the first failure, so a
launch that returns 0 within the time limit is the check (machinery of
tests/accelerate/test_accelerate.py).

* ``external_deps/test_metrics.py`` builds and resets several Accelerators and prepares
  models without an optimizer (DDP, no ZeRO engine).  It hung at exit under stages 2
  and 3 while the DDP config passed: the ZeroAccelerator held the DDP wrapper it had
  returned, so the wrapper's Reducer outlived ``end_training()``'s destruction of the
  process group, and freeing it then deadlocked in gloo's destructor.
"""
from __future__ import annotations

from pathlib import Path

import accelerate
import pytest

from test_accelerate import Launcher  # noqa: E402

SCRIPTS = Path(accelerate.__file__).parent / "test_utils" / "scripts"


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    return Launcher(tmp_path_factory.mktemp("upstream_scripts"))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_accelerates_test_metrics_runs_to_the_end(launcher, stage):
    proc = launcher.run(launcher.command(f"zero{stage}", SCRIPTS / "external_deps" / "test_metrics.py", []))
    text = proc.stdout + proc.stderr
    assert "Test that `drop_last` is taken into account" in text  # its last section ran
