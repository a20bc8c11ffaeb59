"""What a launch with a zero_config section says when it cannot do what was asked.

* ``mixed_precision: fp8`` (config file or ``--mixed_precision``): zero_strategy's own
  error, from the launcher, before any worker starts (the stock launcher, the reference,
  asks for an fp8 library instead);
* ``distributed_type: MULTI_GPU`` without ACCELERATE_USE_CPU on a machine without GPUs:
  each process runs alone (the stock launch, the reference, reports num_processes 1 in
  each), which the first process now says in a warning.

Real ``accelerate launch`` runs (machinery of tests/accelerate/test_accelerate.py).
"""
from __future__ import annotations

import json

import pytest
import torch

from test_accelerate import LOOP, Launcher, _write_config

from zero_strategy.integrations.accelerate import settings

OURS = "mixed_precision 'fp8' is not supported by zero_strategy"


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    return Launcher(tmp_path_factory.mktemp("launch_checks"))


def test_fp8_message_names_zero_strategy_in_process():
    from zero_strategy.integrations.accelerate.accelerator import ZeroAccelerator

    with pytest.raises(ValueError, match=OURS):
        ZeroAccelerator(mixed_precision="fp8", zero_config={"zero_stage": 2})
    assert settings.command_line_mixed_precision(["--config_file", "c.yaml", "--mixed_precision", "fp8", "t.py"]) == "fp8"
    assert settings.command_line_mixed_precision(["--mixed_precision=bf16", "t.py", "--mixed_precision", "fp8"]) == "bf16"
    assert settings.command_line_mixed_precision(["t.py", "--mixed_precision", "fp8"]) is None  # the script's own flag


@pytest.mark.slow
@pytest.mark.parametrize("where", ["command_line", "config_file"])
def test_fp8_is_refused_by_the_launcher_with_zero_strategys_message(launcher, tmp_path, where):
    if where == "config_file":
        config = _write_config(tmp_path / "fp8.yaml", 2).read_text().replace("mixed_precision: 'no'", "mixed_precision: fp8")
        (tmp_path / "fp8.yaml").write_text(config)
        launcher.configs["fp8_file"] = tmp_path / "fp8.yaml"
        cmd = [c for c in launcher.command("fp8_file", LOOP, ["--steps", "1"]) if c not in ("--mixed_precision", "no")]
    else:
        cmd = launcher.command("zero2", LOOP, ["--steps", "1"], mixed_precision="fp8")
    proc = launcher.run(cmd, expect_ok=False)
    assert proc.returncode != 0 and OURS in proc.stderr, proc.stderr[-3000:]
    assert "Transformer Engine" not in proc.stderr.replace("does not drive Transformer Engine", "")
    assert "ChildFailedError" not in proc.stderr  # refused before any worker started
    if where == "command_line":  # the reference: the stock launcher with the DDP config
        stock = launcher.run(launcher.command("ddp", LOOP, ["--steps", "1"], mixed_precision="fp8"), expect_ok=False)
        assert stock.returncode != 0 and "Transformer Engine" in stock.stderr and OURS not in stock.stderr


@pytest.mark.slow
def test_multi_gpu_without_use_cpu_on_a_cpu_machine_warns(launcher, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without GPUs")
    env = {k: v for k, v in launcher.env.items() if k != "ACCELERATE_USE_CPU"}
    env["PYTHONWARNINGS"] = "default"
    outs = {}
    for config in ("ddp", "zero2"):
        out = tmp_path / f"{config}.json"
        proc = launcher.run(launcher.command(config, LOOP, ["--steps", "1", "--accum", "1", "--out", str(out)]), env=env,
                            reference_output=out if config == "ddp" else None)
        outs[config] = (json.loads(out.read_text()), proc.stderr)
    ref, ref_err = outs["ddp"]
    got, err = outs["zero2"]
    assert ref["num_processes"] == 1 and got["num_processes"] == 1  # each process alone, also with stock DDP
    assert err.count("the launcher started 2 processes (WORLD_SIZE=2), but Accelerate runs each of them alone") == 1
    assert "set ACCELERATE_USE_CPU=true" in err
    assert "the launcher started" not in ref_err
