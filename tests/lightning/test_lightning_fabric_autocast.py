"""Lightning Fabric ``precision="bf16-mixed"``: ZeRO with ``autocast=True`` against ``ddp``.

Stock Lightning's "bf16-mixed" keeps fp32 parameters and runs the forward under
torch.autocast.  A ZeRO strategy built with ``autocast=True`` must give the same
numbers (fp32 rounding of the gradient sum apart) at stages 2 and 3, stage 3 with
every parameter partitioned; the default ZeRO mixed precision (16-bit compute copies)
is only within bf16 rounding of it, which the test also shows so that the comparison
can tell the two apart.

Run as a script (``python tests/lightning/test_lightning_fabric_autocast.py OUT``) so that
Fabric's own launcher starts the second CPU process.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from test_lightning import _assert_close_seq, _assert_state_close, _run

HERE = Path(__file__).resolve()
SYSTEMS = ("ddp", "zero2_autocast", "zero3_autocast", "zero3_default")


@pytest.mark.slow
def test_fabric_bf16_mixed_with_autocast_matches_ddp(tmp_path):
    import torch

    _run(HERE, tmp_path)
    ref = [json.loads((tmp_path / f"ddp.rank{r}.json").read_text()) for r in (0, 1)]
    ref_w = torch.load(tmp_path / "ddp.pt", weights_only=True)
    moved = max(float((ref_w[k] - v).abs().max()) for k, v in torch.load(tmp_path / "init.pt", weights_only=True).items())
    assert moved > 1e-3, "ddp did not train: nothing would be compared"
    for s in ("zero2_autocast", "zero3_autocast"):
        for r in (0, 1):
            got = json.loads((tmp_path / f"{s}.rank{r}.json").read_text())
            assert got["param_dtype"] == "torch.float32" and got["autocast"] is True
            assert got["matmul_dtype"] == ref[r]["matmul_dtype"] == "torch.bfloat16"  # autocast was on
            _assert_close_seq(got["losses"], ref[r]["losses"], 1e-5, 1e-7, f"fabric {s} rank {r} losses")
        _assert_state_close(torch.load(tmp_path / f"{s}.pt", weights_only=True), ref_w, 1e-5, 1e-6, f"fabric {s} weights")
    # The default kind computes from bf16 copies of the weights: visibly not stock's numbers.
    default = torch.load(tmp_path / "zero3_default.pt", weights_only=True)
    assert max(float((default[k] - ref_w[k]).abs().max()) for k in ref_w) > 1e-4


# ======================================================================================
# the workload
# ======================================================================================
def _main(out):
    import torch
    import torch.nn.functional as F
    from lightning.fabric import Fabric
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from zero_strategy.integrations.lightning import ZeroFabricStrategy

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 1, generator=g))
    data = TensorDataset(x, y)
    out = Path(out)
    for s in SYSTEMS:
        if s == "ddp":
            strategy = "ddp"
        else:
            stage = int(s[4])
            strategy = ZeroFabricStrategy(stage=stage, autocast=s.endswith("autocast"), param_persistence_threshold=0)
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="bf16-mixed")
        fabric.launch()
        loader = fabric.setup_dataloaders(DataLoader(data, batch_size=4, shuffle=False))
        model, optimizer = build()
        if s == "ddp" and fabric.global_rank == 0:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / "init.pt")
        model, optimizer = fabric.setup(model, optimizer)
        seen = {}
        inner = model.module if hasattr(model, "module") else model
        def record(module, args, output):
            seen.setdefault("dtype", str(output.dtype))

        inner[0].register_forward_hook(record)
        losses = []
        for _ in range(2):
            for xb, yb in loader:
                loss = F.mse_loss(model(xb).float(), yb)
                fabric.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(float(loss.detach()))
        engine = getattr(fabric.strategy, "engine", None)
        if engine is not None:
            sd = engine.full_state_dict(rank0_only=True)
        else:
            sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if fabric.global_rank == 0:
            torch.save(sd, out / f"{s}.pt")
        info = {"losses": losses, "matmul_dtype": seen["dtype"],
                "param_dtype": str(next(inner.parameters()).dtype),
                "autocast": None if engine is None else engine.config.autocast}
        (out / f"{s}.rank{fabric.global_rank}.json").write_text(json.dumps(info))

    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1])
