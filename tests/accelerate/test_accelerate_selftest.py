"""``accelerate test`` under zero_config sections, launched for real on 2 CPU processes.

``accelerate test --config_file <yaml>`` runs accelerate's own test_script.py.  Its
bf16 and fp16 sections of ``training_check`` train under
``Accelerator(mixed_precision=...)`` and compare the weights with fp32 training at
atol = rtol = 1e-6, which holds under stock Accelerate because autocast computes this
model's ``x * a + b`` in fp32 (its comment: "the operation inside the model is not
converted").  So:

* With the section's ``autocast: true`` (fp32 parameters, the forward under
  torch.autocast, as stock Accelerate does) the unchanged CLI passes, every check, at
  stages 1, 2 and 3 (stage 3 with every parameter partitioned).
* With the default mixed precision (16-bit compute copies of the parameters, ZeRO's
  memory model) those two comparisons cannot hold to 1e-6: the weights differ by about
  the compute dtype's rounding, and fp16 loss scaling skips the first steps while it
  searches for a scale (its gradients are fp16).  Accelerate itself returns before
  ``training_check`` under DeepSpeed for the same reason.
  tests/accelerate/accelerate_selftest_driver.py therefore runs ``test_script.main()`` unchanged
  with those two sections replaced by the same training checked with the compute
  dtype's tolerance against a single-process fp32 run (skipping the steps the loss
  scaler skipped), plus what ZeRO promises there: the live model holds 16-bit compute
  copies, and ``unwrap_model(model).cpu()`` gives back the same object as an ordinary
  fp32 module holding the master weights.  The DDP config is the reference (it must
  pass the same driver with stock's 1e-6).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from test_accelerate import ACCELERATE, TIMEOUT, Launcher  # noqa: E402

DRIVER = Path(__file__).with_name("accelerate_selftest_driver.py")


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    return Launcher(tmp_path_factory.mktemp("selftest"))


def _run(launcher, config):
    out = launcher.root / f"{config}.json"
    if not out.exists():
        launcher.run(launcher.command(config, DRIVER, [str(out)]), reference_output=out if config == "ddp" else None)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_accelerates_own_test_script_passes(launcher, stage):
    ref = _run(launcher, "ddp")
    got = _run(launcher, f"zero{stage}")
    assert ref["accelerator_class"] == "Accelerator" and got["accelerator_class"] == "ZeroAccelerator"
    assert ref["main"] == got["main"] == "passed"  # every other check of test_script.main() held
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        stock, zero = ref["sixteen_bit"][name], got["sixteen_bit"][name]
        # Stock keeps fp32 parameters and autocast leaves this model in fp32: upstream's 1e-6 holds.
        assert stock["live_dtype"] == "torch.float32" and not any(stock["skipped"])
        for p in ("a", "b"):
            assert abs(stock[p] - stock[f"reference_{p}"]) <= 1e-6 + 1e-6 * abs(stock[f"reference_{p}"])
        # ZeRO computes with 16-bit copies (the memory model) ...
        assert zero["live_dtype"] == str(dtype)
        assert not all(zero["skipped"]), "every step skipped: nothing was compared"
        # ... and unwrap_model(model).cpu() gave fp32 master weights within the compute
        # dtype's rounding of the fp32 run (checked in the driver; repeated here).
        eps = torch.finfo(dtype).eps
        for p in ("a", "b"):
            assert abs(zero[p] - zero[f"reference_{p}"]) <= eps + eps * abs(zero[f"reference_{p}"])
        assert "has left ZeRO" in zero["step_after_release"]
    assert ref["fp32_move"] == {"same_object": True, "engine_open": None, "step": "ok"}
    move = got["fp32_move"]
    assert move["same_object"]
    if stage < 3:  # whole fp32 parameters: model.to(its device) changes nothing, training goes on
        assert move["engine_open"] and move["step"] == "ok"
    else:  # partitioned: the move hands the model back whole, and its optimizer says so
        assert not move["engine_open"] and "has left ZeRO" in move["step"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unchanged_accelerate_test_cli_passes_with_autocast(launcher, stage):
    # `accelerate test --config_file <yaml>` exactly as a user types it, with the section's
    # `autocast: true`: fp32 parameters and the forward under torch.autocast, as stock
    # Accelerate does, so its 1e-6 comparisons of the 16-bit sections hold too.
    from test_accelerate import _write_config

    config = _write_config(launcher.root / f"zero{stage}_autocast.yaml", stage, "  autocast: true\n")
    env = dict(launcher.env, PATH=os.pathsep.join([str(Path(ACCELERATE).parent), launcher.env.get("PATH", "")]))
    proc = subprocess.run([ACCELERATE, "test", "--config_file", str(config)], env=env,
                          cwd=launcher.root, capture_output=True, text=True, timeout=TIMEOUT)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "Test is a success! You are ready for your distributed training!" in text
    # It ran on ZeRO, in both 16-bit sections, with the autocast kind of mixed precision.
    for dtype in ("bf16", "fp16"):
        assert f"{dtype.upper()} training check." in text
        assert f"zero_strategy: ZeRO stage {stage} on 2 rank(s)" in text
        assert f"{dtype} autocast over fp32 parameters" in text, text[-4000:]
