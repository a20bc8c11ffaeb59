"""Fabric under ZeRO with ordinary single-file checkpoints, and ``init_module(empty_init=True)``
(#14 item 7), against ``Fabric(strategy="ddp")``.

Run as a script (``python tests/lightning/test_lightning_fabric_files.py OUT``) so that Fabric's own
launcher starts the second CPU process.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from test_lightning import _assert_state_close, _run

HERE = Path(__file__).resolve()
WIDTH = 320
ZERO = ("zero1", "zero2", "zero3", "zero3-t0")


@pytest.mark.slow
def test_fabric_loads_single_files_and_skips_init_when_asked(tmp_path):
    """ddp's ``fabric.save`` file, a raw ``model.state_dict()`` file and a file consolidated
    from a ZeRO directory all load into a set-up ZeRO model with ddp's weights (``load`` and
    ``load_raw``); the optimizer state of a single file (ddp's, a raw ``optimizer.state_dict()``
    file, a consolidated one) comes back as ddp's optimizer holds it, exactly, without a warning;
    ``load_raw(path, optimizer)`` of a file that is no optimizer state dict says so.
    ``init_module(empty_init=True)`` skips weight initialisation at stages 1-2 as it does
    under ddp, and initialises when empty_init is False.  ``fabric.save`` to a per-rank
    name writes one directory, at rank 0's path."""
    import torch

    _run(HERE, tmp_path)
    ddp = torch.load(tmp_path / "ddp.pt", weights_only=True)
    ddp_optimizer = torch.load(tmp_path / "ddp.ckpt", weights_only=True)["optimizer"]
    assert ddp_optimizer["state"], "ddp stepped: its Adam state is not empty"
    for s in ZERO:
        for tag in ("load", "load_raw", "consolidated"):
            _assert_state_close(torch.load(tmp_path / f"{s}-{tag}.pt", weights_only=True), ddp, 0, 0, f"{s} {tag}")
        for r in (0, 1):
            got = json.loads((tmp_path / f"{s}.rank{r}.json").read_text())
            assert got["step"] == 3 and got["consolidated_step"] == 3, got
            assert got["per_rank_dirs"] == [f"{s}-rank0-dir"], got["per_rank_dirs"]
            assert "not a torch optimizer state dict" in got["raw_optimizer_error"], got
            assert got["optimizer_warnings"] == [], got
        for tag in ("load", "load_raw", "consolidated"):
            osd = torch.load(tmp_path / f"{s}-{tag}-optimizer.pt", weights_only=True)
            torch.testing.assert_close(osd["state"], ddp_optimizer["state"], atol=0, rtol=0, msg=lambda m: f"{s} {tag}: {m}")
            assert [{k: v for k, v in g.items()} for g in osd["param_groups"]] == ddp_optimizer["param_groups"], (s, tag)
    ref = [json.loads((tmp_path / f"init-ddp.rank{r}.json").read_text()) for r in (0, 1)]
    assert ref[0] == {"empty_init=True": False, "empty_init=False": True, "empty_init=None": True}, ref[0]
    for s in ("zero1", "zero2"):
        for r in (0, 1):
            assert json.loads((tmp_path / f"init-{s}.rank{r}.json").read_text()) == ref[r], s


# ======================================================================================
# the workload
# ======================================================================================
def _main(out):
    import warnings

    import torch
    import torch.nn.functional as F
    from lightning.fabric import Fabric
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from models import ResidualBlock as Block
    from zero_strategy.integrations.lightning import ZeroFabricStrategy, consolidate_checkpoint

    def strategy(s):
        return ZeroFabricStrategy(stage=3, param_persistence_threshold=0) if s == "zero3-t0" else s

    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, WIDTH), Block(WIDTH), nn.Linear(WIDTH, 1))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def weights(fabric, model):
        engine = getattr(fabric.strategy, "engine", None)
        if engine is not None:
            return engine.full_state_dict(rank0_only=True)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def save_weights(fabric, model, name):
        sd = weights(fabric, model)
        if fabric.global_rank == 0:
            torch.save(sd, out / name)

    def save_optimizer(fabric, name):
        osd = fabric.strategy.engine.full_optimizer_state_dict(rank0_only=True)
        if fabric.global_rank == 0:
            torch.save(osd, out / name)

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    out = Path(out)

    # ddp: a few steps, then its single-file checkpoint and a raw state-dict file.
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    model, optimizer = fabric.setup(*build(0))
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=4))
    for _, (xb, yb) in zip(range(3), loader):
        fabric.backward(F.mse_loss(model(xb), yb))
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(out / "ddp.ckpt", {"model": model, "optimizer": optimizer, "step": 3})
    save_weights(fabric, model, "ddp.pt")
    if fabric.global_rank == 0:
        torch.save(model.module.state_dict(), out / "raw.pt")
        torch.save(optimizer.optimizer.state_dict(), out / "raw-optimizer.pt")
    fabric.barrier()

    for s in ZERO:
        info = {}
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy(s))
        fabric.launch()
        model, optimizer = fabric.setup(*build(1))  # other initial weights: they must come from the file
        state = {"model": model, "optimizer": optimizer, "step": 0}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fabric.load(out / "ddp.ckpt", state)
        info["optimizer_warnings"] = [str(w.message) for w in caught if "optimizer state" in str(w.message)]
        info["step"] = state["step"]
        save_weights(fabric, model, f"{s}-load.pt")
        save_optimizer(fabric, f"{s}-load-optimizer.pt")

        model2, optimizer2 = fabric.setup(*build(2))
        fabric.load_raw(out / "raw.pt", model2)
        save_weights(fabric, model2, f"{s}-load_raw.pt")
        try:
            fabric.load_raw(out / "ddp.ckpt", optimizer2)
            info["raw_optimizer_error"] = ""
        except ValueError as e:
            info["raw_optimizer_error"] = str(e)
        fabric.load_raw(out / "raw-optimizer.pt", optimizer2)
        save_optimizer(fabric, f"{s}-load_raw-optimizer.pt")

        # A per-rank name: every rank writes to rank 0's path (one directory).
        fabric.save(out / f"{s}-rank{fabric.global_rank}-dir", {"model": model, "optimizer": optimizer, "step": 3})
        info["per_rank_dirs"] = sorted(p.name for p in out.glob(f"{s}-rank*-dir"))
        # Our directory, consolidated into one file, loads back the same way.
        fabric.save(out / f"{s}-dir", {"model": model, "optimizer": optimizer, "step": 3})
        if fabric.global_rank == 0:
            consolidate_checkpoint(out / f"{s}-dir", out / f"{s}-consolidated.ckpt")
        fabric.barrier()
        model3, optimizer3 = fabric.setup(*build(3))
        state3 = {"model": model3, "optimizer": optimizer3, "step": 0}
        fabric.load(out / f"{s}-consolidated.ckpt", state3)
        info["consolidated_step"] = state3["step"]
        save_weights(fabric, model3, f"{s}-consolidated.pt")
        save_optimizer(fabric, f"{s}-consolidated-optimizer.pt")
        (out / f"{s}.rank{fabric.global_rank}.json").write_text(json.dumps(info))

    class Filled(nn.Module):
        def __init__(self, value):
            super().__init__()
            self.w = nn.Parameter(torch.empty(64, 64))
            nn.init.constant_(self.w, value)

    # A new value each time: uninitialised memory may hold an earlier model's values.
    values = iter(range(1000, 2000))
    for s in ("ddp", "zero1", "zero2"):
        fabric = Fabric(accelerator="cpu", devices=2, strategy=s)
        fabric.launch()
        initialised = {}
        for empty in (True, False, None):
            value = float(next(values))
            with fabric.init_module(empty_init=empty):
                m = Filled(value)
            initialised[f"empty_init={empty}"] = bool((m.w == value).all())
        (out / f"init-{s}.rank{fabric.global_rank}.json").write_text(json.dumps(initialised))

    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1])
