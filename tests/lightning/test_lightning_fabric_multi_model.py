"""Several engines in one Lightning Fabric: ``fabric.setup(student, optimizer)`` and
``fabric.setup(teacher)`` (frozen, no optimizer) under ZeRO stage 3 with every parameter
partitioned, the student trained on a loss that uses the teacher's outputs
(distillation).  References: ``Fabric(strategy="ddp")`` running the same loop with the
teacher left unprepared (DDP refuses a module without trainable parameters), for the
student's per-step losses, and a plain copy of the teacher that was never set up, for
the teacher's outputs (exact).

Run as a script (``python tests/lightning/test_lightning_fabric_multi_model.py OUT``) so that
Fabric's own launcher starts the second CPU process; one run (~30 s) serves the test.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from test_lightning import _assert_close_seq, _run

HERE = Path(__file__).resolve()
WIDTH = 64


@pytest.mark.slow
def test_fabric_student_with_frozen_teacher_on_two_engines_matches_ddp(tmp_path):
    _run(HERE, tmp_path)
    for r in (0, 1):
        ref = json.loads((tmp_path / f"ddp.rank{r}.json").read_text())
        got = json.loads((tmp_path / f"zero3.rank{r}.json").read_text())
        assert got["engines"] == 2 and got["teacher_partitioned"] and got["student_partitioned"]
        assert ref["teacher_gap"] == got["teacher_gap"] == 0.0  # the teacher computes exactly what the plain copy does
        _assert_close_seq(got["losses"], ref["losses"], 1e-5, 1e-7, f"student losses rank {r}")
        assert len(set(ref["losses"])) == len(ref["losses"])


def _main(out):
    import copy

    import torch
    import torch.nn.functional as F
    from lightning.fabric import Fabric
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from models import ResidualBlock as Block
    from zero_strategy.reliability.guard import PartitionedParameter
    from zero_strategy.integrations.lightning.fabric import ZeroFabricStrategy

    def build(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(8, WIDTH), Block(WIDTH), Block(WIDTH), nn.Linear(WIDTH, 1))

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 1, generator=g))
    out = Path(out)
    for name in ("ddp", "zero3"):
        strategy = "ddp" if name == "ddp" else ZeroFabricStrategy(stage=3, param_persistence_threshold=0)
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
        fabric.launch()
        loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False))
        student = build(0)
        optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3)
        teacher = build(1).requires_grad_(False)
        plain = copy.deepcopy(teacher)
        student, optimizer = fabric.setup(student, optimizer)
        if name != "ddp":
            teacher = fabric.setup(teacher)  # an engine of its own, without an optimizer
        losses, gap = [], 0.0
        for xb, yb in loader:
            with torch.no_grad():
                target = teacher(xb)
                gap = max(gap, float((target - plain(xb)).abs().max()))
            pred = student(xb)
            loss = F.mse_loss(pred, yb) + 0.5 * F.mse_loss(pred, target)
            fabric.backward(loss, model=student)
            fabric.clip_gradients(student, optimizer, max_norm=0.5)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))

        def partitioned(module):
            return all(isinstance(p, PartitionedParameter) for p in module.parameters())

        info = {"losses": losses, "teacher_gap": gap, "engines": len(getattr(fabric.strategy, "_engines", []))}
        if name != "ddp":
            info.update(teacher_partitioned=partitioned(teacher), student_partitioned=partitioned(student))
        (out / f"{name}.rank{fabric.global_rank}.json").write_text(json.dumps(info))

    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1])
