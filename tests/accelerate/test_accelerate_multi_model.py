"""Several models per Accelerator: a trained policy and frozen references, each on its own
ZeroEngine in one process group (the shape of TRL's DPOTrainer).

tests/accelerate/accelerate_multi_model_script.py prepares ``(policy, optimizer, loader)``, then a
frozen reference with ``prepare(ref)`` and a second one with
``prepare_model(ref, evaluation_mode=True)``, and trains the policy on a loss that uses
both references' outputs, with accumulation, clipping and a save_state / load_state
round trip.  Launched with the real ``accelerate launch`` on 2 CPU processes (machinery
of tests/accelerate/test_accelerate.py) at stage 2 and at stage 3 with every parameter partitioned
and ``zero3_init_flag`` (all three models are loaded unallocated by ``from_pretrained``
and filled from their files at prepare; stage 3 without the flag is covered with TRL's
reference model in tests/transformers/test_trl_dpo.py).
References: the same script under a plain DDP config (per-step losses and final policy
weights, fp32, to 1e-5), the uninterrupted run (the resumed steps), and a plain copy of
the reference model that was never prepared (its outputs and consolidated weights).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from accelerate_multi_model_script import save_models  # noqa: E402
from test_accelerate import Launcher, _write_config  # noqa: E402

SCRIPT = Path(__file__).with_name("accelerate_multi_model_script.py")


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    launcher = Launcher(tmp_path_factory.mktemp("multi_model"))
    launcher.configs["zero3_init"] = _write_config(launcher.root / "zero3_init.yaml", 3, "  zero3_init_flag: true\n")
    launcher.models = [str(launcher.root / "policy_model"), str(launcher.root / "ref_model")]
    save_models(*launcher.models)
    return launcher


def _run(launcher, config):
    folder = launcher.root / config
    out = folder / "out.json"
    if not out.exists():
        folder.mkdir(exist_ok=True)
        launcher.run(launcher.command(config, SCRIPT, [str(out), *launcher.models]),
                     reference_output=out if config == "ddp" else None)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("config", ["zero2", "zero3_init"])
def test_policy_with_frozen_references_matches_ddp(launcher, config):
    ref = _run(launcher, "ddp")
    got = _run(launcher, config)
    assert ref["accelerator_class"] == "Accelerator" and got["accelerator_class"] == "ZeroAccelerator"
    assert ref["unallocated_before_prepare"] == [False] * 3
    # each model on its own engine; the frozen reference at stage 3 by set_zero_config, in the
    # same process group as a stage-2 policy in the zero2 run
    assert got["stages"] == ([2, 3, 2] if config == "zero2" else [3, 3, 3]) and ref["stages"] is None
    # evaluated before training (an evaluation engine, then the training engine took the model over)
    assert abs(got["policy_probe_sum_before_training"] - ref["policy_probe_sum_before_training"]) <= 1e-4
    assert got["unallocated_before_prepare"] == [config == "zero3_init"] * 3
    assert len(got["losses"]) == len(ref["losses"]) == 12
    for a, b in zip(got["losses"], ref["losses"]):
        assert abs(a - b) <= 1e-5, (got["losses"], ref["losses"])
    assert got["resumed"] == got["losses"][-len(got["resumed"]):]  # load_state restored every engine exactly
    mine, stock = load_file(got["policy_weights"]), load_file(ref["policy_weights"])
    assert sorted(mine) == sorted(stock)
    for name in stock:
        assert (mine[name] - stock[name]).abs().max() <= 1e-5, name
    for run in (ref, got):
        assert run["ref_keys_equal"] and all(run["unwrap_is_model"].values())
        assert run["ref_output_gap"] == {"ref": 0.0, "ref_eval": 0.0}  # exactly the never-prepared copy
        assert run["ref_weight_gap"] == {"ref": 0.0, "ref_eval": 0.0}
