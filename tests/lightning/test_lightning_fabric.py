"""Lightning Fabric: ``Fabric(strategy="zero3")`` against ``Fabric(strategy="ddp")``.

Run as a script (``python tests/lightning/test_lightning_fabric.py OUT``) so that Fabric's own
launcher starts the second CPU process; the script imports nothing from this project.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from test_lightning import _assert_close_seq, _assert_state_close, _run

HERE = Path(__file__).resolve()
WIDTH = 320


@pytest.mark.slow
def test_fabric_zero_matches_ddp_with_accumulation_clipping_and_checkpoint(tmp_path):
    """A hand-written Fabric loop (no_backward_sync accumulation, clip_gradients by norm,
    two param groups) gives ddp's losses and weights for zero2 and zero3;
    fabric.save / fabric.load of the sharded state resumes exactly; a model built
    under fabric.init_module() with zero3 is materialised partitioned."""
    import torch

    _run(HERE, tmp_path)
    ref = [json.loads((tmp_path / f"ddp.rank{r}.json").read_text()) for r in (0, 1)]
    ref_w = torch.load(tmp_path / "ddp.pt", weights_only=True)
    for s in ("zero2", "zero3"):
        for r in (0, 1):
            got = json.loads((tmp_path / f"{s}.rank{r}.json").read_text())
            assert got["precision"] == "fp32" and got["stage"] == int(s[-1])
            _assert_close_seq(got["losses"], ref[r]["losses"], 1e-5, 1e-7, f"fabric {s} rank {r} losses")
            assert len(got["seen"]) == 32 and set(got["seen"]).isdisjoint(ref[1 - r]["seen"])  # DistributedSampler
            resumed = json.loads((tmp_path / f"{s}-resumed.rank{r}.json").read_text())
            assert resumed["step"] == 4
            _assert_close_seq(resumed["losses"], got["losses"][8:], 1e-6, 1e-8, f"fabric {s} rank {r} resumed losses")
        _assert_state_close(torch.load(tmp_path / f"{s}.pt", weights_only=True), ref_w, 1e-5, 1e-6, f"fabric {s} weights")
    for r in (0, 1):  # fabric.init_module(): nothing allocated while building, same training as ddp
        got = json.loads((tmp_path / f"zero3-init.rank{r}.json").read_text())
        assert got["built_bytes"] == 0 and 0 < got["param_bytes"] < 0.6 * got["full_bytes"], got
        _assert_close_seq(got["losses"], ref[r]["losses"][:8], 1e-5, 1e-7, f"fabric init_module zero3 rank {r}")


# ======================================================================================
# the workload
# ======================================================================================
def _loop(fabric, model, optimizer, loader, losses, seen, max_steps, accumulate=2):
    import torch.nn.functional as F

    steps = 0
    for epoch in range(4):
        for i, (idx, x, y) in enumerate(loader):
            boundary = i % accumulate == accumulate - 1
            with fabric.no_backward_sync(model, enabled=not boundary):
                loss = F.mse_loss(model(x).float(), y.float())
                fabric.backward(loss / accumulate)
            losses.append(float(loss.detach()))
            seen.extend(int(j) for j in idx)
            if boundary:
                fabric.clip_gradients(model, optimizer, max_norm=0.5)
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
                if steps == max_steps:
                    return steps
    return steps


def _main(out):
    import torch
    from lightning.fabric import Fabric
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from models import ResidualBlock as Block

    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, WIDTH), Block(WIDTH), Block(WIDTH), nn.Linear(WIDTH, 1))
        groups = [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
                  {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0, "lr": 5e-4}]
        return model, torch.optim.AdamW(groups, lr=1e-3)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 1, generator=g))
    data = TensorDataset(torch.arange(64), x, y)

    out = Path(out)
    for s in ("ddp", "zero2", "zero3"):
        fabric = Fabric(accelerator="cpu", devices=2, strategy=s)
        fabric.launch()
        loader = fabric.setup_dataloaders(DataLoader(data, batch_size=4, shuffle=False))
        model, optimizer = fabric.setup(*build(0))
        losses, seen = [], []
        _loop(fabric, model, optimizer, loader, losses, seen, max_steps=4)  # 8 micro-batches = 1 epoch
        if s != "ddp":
            fabric.save(out / f"{s}-ckpt", {"model": model, "optimizer": optimizer, "step": 4})
        _loop(fabric, model, optimizer, loader, losses, [], max_steps=4)
        engine = getattr(fabric.strategy, "engine", None)
        sd = engine.full_state_dict(rank0_only=True) if engine is not None else {k: v.detach().clone() for k, v in model.state_dict().items()}
        if fabric.global_rank == 0:
            torch.save(sd, out / f"{s}.pt")
        info = {"losses": losses, "seen": seen}
        if engine is not None:
            info.update(stage=engine.config.stage, precision=engine.config.precision)
        (out / f"{s}.rank{fabric.global_rank}.json").write_text(json.dumps(info))
        if s == "ddp":
            continue
        # Resume into a differently initialised model from the sharded checkpoint.
        fabric = Fabric(accelerator="cpu", devices=2, strategy=s)
        fabric.launch()
        loader = fabric.setup_dataloaders(DataLoader(data, batch_size=4, shuffle=False))
        model, optimizer = fabric.setup(*build(1))
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(out / f"{s}-ckpt", state)
        losses = []
        _loop(fabric, model, optimizer, loader, losses, [], max_steps=4)
        (out / f"{s}-resumed.rank{fabric.global_rank}.json").write_text(json.dumps({"losses": losses, "step": state["step"]}))
    # fabric.init_module() under zero3: parameters deferred, materialised partitioned by setup.
    fabric = Fabric(accelerator="cpu", devices=2, strategy="zero3")
    fabric.launch()
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=4, shuffle=False))
    with fabric.init_module():
        model, optimizer = build(0)
    built_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")
    model, optimizer = fabric.setup(model, optimizer)
    losses = []
    _loop(fabric, model, optimizer, loader, losses, [], max_steps=4)
    (out / f"zero3-init.rank{fabric.global_rank}.json").write_text(json.dumps(
        {"losses": losses, "built_bytes": built_bytes, "param_bytes": fabric.strategy.engine.memory_report()["parameters"],
         "full_bytes": sum(p.numel() * 4 for p in model.parameters())}))

    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1])
