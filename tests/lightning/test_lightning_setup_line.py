"""#14: one line on rank 0 when a ZeRO strategy sets up, saying what runs (stage, world size,
units, model-state GiB on the rank, and the ZeRO paper's per-rank formula beside it).

Launched as users launch (``python script``: Lightning's launcher starts the second CPU
process); the output of both processes is read.  The line must appear exactly once per
engine built: once for ``trainer.fit`` followed by ``trainer.test`` (the engine is reused),
once for ``fabric.setup``, and never under ddp.  Its figures are checked against the model
(parameter count, stage, world size), not against the strategy's own report.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from test_lightning import _run

HERE = Path(__file__).resolve()
LINE = re.compile(r"ZeRO stage (\d) on (\d+) rank\(s\): (\d+) flat units.*model states ([\d.]+) GiB on this rank now"
                  r"(?: \(the ZeRO paper's formula: ([\d.]+) GiB per rank for ([\d,]+) parameters, (\w+)\))?")


@pytest.mark.slow
def test_setup_line_once_on_rank_0(tmp_path):
    proc = _run(HERE, "trainer", tmp_path)
    out = proc.stdout + proc.stderr
    lines = LINE.findall(out)
    numel = int((tmp_path / "numel.txt").read_text())
    # zero3 (fit + test: one engine), then zero1; ddp prints none.
    assert [(m[0], m[1]) for m in lines] == [("3", "2"), ("1", "2")], out[-3000:]
    for stage, world, units, held, formula, params, opt in lines:
        assert int(params.replace(",", "")) == numel and opt == "AdamW"
        # the formula of the paper for fp32 Adam (K = 8 bytes, p = g = 4): an independent figure
        psi, n, s = numel, 2, int(stage)
        shard = -(-psi // n)
        expected = 4 * (shard if s == 3 else psi) + 4 * (shard if s >= 2 else psi) + 8 * shard
        # GiB, to the printed digits (three significant ones for a small model's few MiB):
        # within half a unit of the last digit printed.
        half_unit = 0.5 * 10 ** -len(formula.split(".")[1])
        assert abs(float(formula) - expected / 2**30) <= half_unit * (1 + 1e-9), (formula, expected / 2**30)
        assert len(formula.replace(".", "").lstrip("0")) >= 3, formula  # not rounded to 0.00
        assert float(held) > 0 and int(units) >= 1

    proc = _run(HERE, "fabric", tmp_path)
    out = proc.stdout + proc.stderr
    lines = LINE.findall(out)
    assert [(m[0], m[1]) for m in lines] == [("2", "2")], out[-3000:]


def _model(pl):
    import torch

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return self(batch[0]).pow(2).mean()

        def test_step(self, batch, batch_idx):
            self.log("t", self(batch[0]).pow(2).mean(), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Net


def _data():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    return DataLoader(TensorDataset(torch.randn(16, 32)), batch_size=4)


def scenario_trainer(out):
    import lightning.pytorch as pl

    Net = _model(pl)
    for strategy in ("zero3", "zero1", "ddp"):
        model = Net()
        (Path(out) / "numel.txt").write_text(str(sum(p.numel() for p in model.parameters())))
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, _data())
        if strategy == "zero3":
            trainer.test(model, _data(), verbose=False)


def scenario_fabric(out):
    import torch
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy="zero2")
    fabric.launch()
    model = torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    fabric.backward(model(torch.randn(4, 32)).pow(2).mean())
    optimizer.step()


if __name__ == "__main__":
    globals()[f"scenario_{sys.argv[1]}"](sys.argv[2])
