"""Two optimizers prepared together under Accelerate: ``accelerator.prepare(model, muon,
adamw, ...)`` with a ``zero_config`` section against the same script under a plain DDP
config (tests/accelerate/accelerate_two_optimizers_script.py, launched with the real
``accelerate launch`` on 2 CPU processes, machinery of tests/accelerate/test_accelerate.py).
fp32: per-step losses, final weights and each optimizer's torch-format state within
1e-5; the steps after ``load_state`` repeat the uninterrupted ones.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_accelerate import Launcher  # noqa: E402

SCRIPT = Path(__file__).with_name("accelerate_two_optimizers_script.py")


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    return Launcher(tmp_path_factory.mktemp("two_optimizers"))


def _run(launcher, config):
    folder = launcher.root / config
    out = folder / "out.json"
    if not out.exists():
        folder.mkdir(exist_ok=True)
        launcher.run(launcher.command(config, SCRIPT, [str(folder)]), reference_output=out if config == "ddp" else None)
    return json.loads(out.read_text()), folder


def _close(a, b, what):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, what
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"{what}: max |diff| {(a - b).abs().max().item():.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_muon_and_adamw_prepared_together_match_ddp(launcher, config):
    (ref, ref_dir), (got, got_dir) = _run(launcher, "ddp"), _run(launcher, config)
    assert ref["accelerator_class"] == "Accelerator" and got["accelerator_class"] == "ZeroAccelerator"
    assert got["optimizer_classes"] == ref["optimizer_classes"] == ["Muon", "AdamW"]
    assert len(ref["losses"]) == 8
    _close(got["losses"], ref["losses"], f"{config} losses")
    _close(got["lrs"], ref["lrs"], f"{config} learning rates")
    assert got["resumed"] == pytest.approx(got["losses"][4:], rel=1e-6, abs=1e-7), "load_state did not restore the run"
    mine, stock = (torch.load(d / "weights.pt", weights_only=True) for d in (got_dir, ref_dir))
    assert sorted(mine) == sorted(stock)
    for name in stock:
        _close(mine[name], stock[name], f"{config} weight {name}")
    mine, stock = (torch.load(d / "optimizers.pt", weights_only=True) for d in (got_dir, ref_dir))
    assert len(mine) == len(stock) == 2
    for k, (m, s) in enumerate(zip(mine, stock)):
        assert [g["params"] for g in m["param_groups"]] == [g["params"] for g in s["param_groups"]]
        assert sorted(m["state"]) == sorted(s["state"]) and s["state"], f"optimizer {k}: state indices"
        for i, entry in s["state"].items():
            for key, v in entry.items():
                _close(m["state"][i][key], v, f"{config} optimizer {k} param {i} {key}")
