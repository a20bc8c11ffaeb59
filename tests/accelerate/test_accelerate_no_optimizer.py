"""A model prepared without an optimizer is prepared as Accelerate does without zero_config.

Accelerate's own no_sync tests (test_sync.py, run unchanged from the installed accelerate
by tests/accelerate/accelerate_no_optimizer.py) train such a model and check that its gradients are
synchronised across processes exactly when DDP's are; the join tests need prepare to
return a Joinable.  Reference: the same script under a plain DDP config.  Launched with
the real ``accelerate launch`` on 2 CPU processes (machinery of tests/accelerate/test_accelerate.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_accelerate import Launcher  # noqa: E402

SCRIPT = Path(__file__).with_name("accelerate_no_optimizer.py")


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    return Launcher(tmp_path_factory.mktemp("no_optimizer"))


def _run(launcher, config):
    out = launcher.root / f"{config}.json"
    if not out.exists():
        launcher.run(launcher.command(config, SCRIPT, [str(out)]), reference_output=out if config == "ddp" else None)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_accelerates_own_no_sync_tests_pass_on_a_model_without_optimizer(launcher, stage):
    ref = _run(launcher, "ddp")
    got = _run(launcher, f"zero{stage}")
    assert got["accelerator_class"] == "ZeroAccelerator" and ref["accelerator_class"] == "Accelerator"
    assert got["num_processes"] == ref["num_processes"] == 2
    assert len(ref["ran"]) == 3 and got["ran"] == ref["ran"]  # every assertion of those tests held
    assert got["prepared_class"] == ref["prepared_class"] == "DistributedDataParallel" and got["joinable"]
