"""Accelerate's own test scripts, run as they ship in the installed accelerate, under
zero_config sections with the real ``accelerate launch`` on 2 CPU processes.

Each script asserts its own results and exits non-zero on the first failure, so a
launch that returns 0 within the time limit is the check (machinery of
tests/accelerate/test_accelerate.py).

* ``test_sync.py`` checks ``param.grad`` against a one-process model around
  ``no_sync`` / ``accumulate``, and, in ``test_gradient_accumulation_with_opt_and_scheduler``,
  on a model prepared with its optimizer (a ZeRO engine): local gradients inside
  ``accumulate`` before the boundary, the reduced ones after ``optimizer.step()``.  Under
  ZeRO ``.grad`` was None there (stages 2-3) or held only this rank's slice (stage 1).
  Stage 3 runs with ``no_sync_reduces: false`` (local gradients inside ``no_sync``, as
  DDP keeps them; by default stages 2-3 reduce every micro-batch, so ``.grad`` there is
  already the synchronised partial sum, which the script's "not in sync" check refuses).
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

from test_accelerate import Launcher, _write_config  # noqa: E402

SCRIPTS = Path(accelerate.__file__).parent / "test_utils" / "scripts"


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    return Launcher(tmp_path_factory.mktemp("upstream_scripts"))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_accelerates_test_metrics_runs_to_the_end(launcher, stage):
    # A real launch: the hang was in the processes' teardown, which warm launches skip.
    proc = launcher.run(launcher.command(f"zero{stage}", SCRIPTS / "external_deps" / "test_metrics.py", []), real=True)
    text = proc.stdout + proc.stderr
    assert "Test that `drop_last` is taken into account" in text  # its last section ran


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_accelerates_test_sync_passes_unchanged(launcher, stage):
    name = f"zero{stage}_sync"
    extra = "  no_sync_reduces: false\n" if stage >= 2 else ""
    launcher.configs[name] = _write_config(launcher.root / f"{name}.yaml", stage, extra)
    proc = launcher.run(launcher.command(name, SCRIPTS / "test_sync.py", []))
    text = proc.stdout + proc.stderr
    # Its last section ran (on a model prepared with its optimizer, so on a ZeRO engine).
    assert "gradient accumulation with optimizer and scheduler" in text
    assert f"zero_strategy: ZeRO stage {stage} on 2 rank(s)" in text
