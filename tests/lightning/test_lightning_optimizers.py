"""Several optimizers under Lightning: Muon on the hidden matrices and AdamW on the rest,
stepped in manual optimization (``self.optimizers()``), the way a LightningModule does it
under ddp.  Each test launches this file as a script on 2 CPU processes through
Lightning's own launcher, runs ``strategy="ddp"`` and the ZeRO stages on the same seed
and data, and compares: losses, final weights, each optimizer's state in torch's format,
a resumed run, and the consolidated single-file checkpoint.  Fabric's
``fabric.setup(model, muon, adamw)`` is checked the same way against Fabric's ddp.

Every process runs Muon's Newton-Schulz iteration in fp32 (``muon_orthogonalise_in_fp32``):
stock Muon rounds to bf16 first, and then any two summation orders of the same gradient
(one process vs two ranks) differ by more than fp32 tolerances.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
WIDTH = 96  # Linear(96, 96): its weight is cut by the shard boundary at 2 ranks (whole-parameter exchange)
STRATEGIES = ("ddp", "zero1", "zero2", "zero3-t0")


# ======================================================================================
# the pytest side
# ======================================================================================
def _run(*args, timeout=480):
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    env.pop("LOCAL_RANK", None)
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, str(HERE), *map(str, args)], cwd=str(ROOT), env=env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def _load(out, tag, rank=0):
    return json.loads((Path(out) / f"{tag}.rank{rank}.json").read_text())


def _torch_load(path):
    import torch

    return torch.load(path, weights_only=True)


def _close(a, b, what, rtol=1e-5, atol=1e-6):
    import torch

    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, f"{what}: shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert torch.allclose(a, b, rtol=rtol, atol=atol), f"{what}: max |diff| {err:.3g}"


def _weights_close(got, ref, what):
    assert list(got) == list(ref), f"{what}: keys {list(got)} vs {list(ref)}"
    for k in ref:
        _close(got[k], ref[k], f"{what} {k}")


def _optimizer_states_close(got, ref, what):
    """Two lists of torch-format optimizer state dicts (one per optimizer)."""
    assert len(got) == len(ref) == 2, f"{what}: {len(got)} vs {len(ref)} optimizer states"
    for k, (g, r) in enumerate(zip(got, ref)):
        assert [grp["params"] for grp in g["param_groups"]] == [grp["params"] for grp in r["param_groups"]], what
        for grp_g, grp_r in zip(g["param_groups"], r["param_groups"]):
            assert {x: v for x, v in grp_g.items() if x != "params"} == {x: v for x, v in grp_r.items() if x != "params"}, \
                f"{what} optimizer {k}: hyper-parameters {grp_g} vs {grp_r}"
        assert sorted(g["state"]) == sorted(r["state"]), f"{what} optimizer {k}: state indices"
        for i in r["state"]:
            assert sorted(g["state"][i]) == sorted(r["state"][i]), f"{what} optimizer {k} param {i}: state keys"
            for key, v in r["state"][i].items():
                _close(g["state"][i][key], v, f"{what} optimizer {k} param {i} {key}")


@pytest.mark.slow
def test_trainer_muon_adamw_manual_optimization_matches_ddp(tmp_path):
    """Muon + AdamW from configure_optimizers, manual optimization with gradient
    accumulation 2 written as Lightning documents it (two manual_backward calls, no
    no_sync), clip_gradients per optimizer (Muon's by norm, AdamW's by value) and one LR
    scheduler each: zero1, zero2 and zero3 (every parameter
    partitioned) against ddp, fp32 within 1e-5: per-step losses, final weights, both
    optimizers' state (strategy.optimizer_state), then trainer.save_checkpoint, a resumed
    fit from the directory, and the consolidated file (two optimizer_states entries,
    equal to ddp's; loaded by a zero3 Trainer and resumed, equal to ddp's resume)."""
    _run("trainer", tmp_path)
    ref = {r: _load(tmp_path, "ddp", r) for r in (0, 1)}
    ddp_weights = _torch_load(tmp_path / "ddp.weights.pt")
    ddp_states = _torch_load(tmp_path / "ddp.optim.pt")
    assert len(ref[0]["losses"]) == 8 and ref[0]["muon_steps"] == 4 and ref[0]["adamw_steps"] == 4
    init = _torch_load(tmp_path / "init.pt")
    assert any((ddp_weights[k] - init[k]).abs().max() > 1e-3 for k in init), "training did not move the weights"
    for s in STRATEGIES[1:]:
        for r in (0, 1):
            got = _load(tmp_path, s, r)
            _close(got["losses"], ref[r]["losses"], f"{s} rank {r} losses")
            assert (got["muon_steps"], got["adamw_steps"]) == (4, 4), s
            _close(got["lrs"], ref[r]["lrs"], f"{s} rank {r} learning rates")
            _close(got["resumed_losses"], ref[r]["resumed_losses"], f"{s} rank {r} resumed from its checkpoint")
        _weights_close(_torch_load(tmp_path / f"{s}.weights.pt"), ddp_weights, f"{s} final weights")
        _optimizer_states_close(_torch_load(tmp_path / f"{s}.optim.pt"), ddp_states, f"{s} optimizer_state")
        consolidated = _torch_load(tmp_path / f"{s}.consolidated.ckpt")
        _weights_close(consolidated["state_dict"], _torch_load(tmp_path / "ddp.ckpt")["state_dict"], f"{s} consolidated")
        _optimizer_states_close(consolidated["optimizer_states"], _torch_load(tmp_path / "ddp.ckpt")["optimizer_states"],
                                f"{s} consolidated optimizer_states vs ddp's checkpoint")
    for r in (0, 1):
        got = _load(tmp_path, "zero3-from-file", r)
        _close(got["resumed_losses"], ref[r]["resumed_losses"], f"zero3 resumed from the consolidated file, rank {r}")


@pytest.mark.slow
def test_fabric_setup_with_two_optimizers_matches_ddp(tmp_path):
    """fabric.setup(model, muon, adamw) under zero3 (every parameter partitioned) and zero2
    against Fabric's ddp: losses and weights after 4 steps, fabric.save/fabric.load of a
    state holding both optimizers (the resumed steps equal ddp's), and the consolidated
    file holding each optimizer's state under its own key, equal to ddp's fabric.save."""
    _run("fabric", tmp_path)
    ref = {r: _load(tmp_path, "fabric-ddp", r) for r in (0, 1)}
    for s in ("zero2", "zero3-t0"):
        for r in (0, 1):
            got = _load(tmp_path, f"fabric-{s}", r)
            _close(got["losses"], ref[r]["losses"], f"fabric {s} rank {r} losses")
            _close(got["resumed_losses"], ref[r]["resumed_losses"], f"fabric {s} rank {r} after fabric.load")
        _weights_close(_torch_load(tmp_path / f"fabric-{s}.weights.pt"), _torch_load(tmp_path / "fabric-ddp.weights.pt"),
                       f"fabric {s} weights")
        consolidated = _torch_load(tmp_path / f"fabric-{s}.consolidated.ckpt")
        ddp_file = _torch_load(tmp_path / "fabric-ddp.ckpt")
        _weights_close(consolidated["model"], ddp_file["model"], f"fabric {s} consolidated model")
        _optimizer_states_close([consolidated["muon"], consolidated["adamw"]], [ddp_file["muon"], ddp_file["adamw"]],
                                f"fabric {s} consolidated optimizers")


# ======================================================================================
# the workloads (run as scripts on 2 processes)
# ======================================================================================
def _model(torch, seed=0):
    from models import ResidualBlock

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, WIDTH), ResidualBlock(WIDTH), ResidualBlock(WIDTH),
                               torch.nn.Linear(WIDTH, 1))


def _muon_adamw(torch, module):
    """Muon on the hidden (residual-block) matrices, AdamW on the rest."""
    hidden = [p for n, p in module.named_parameters() if p.ndim == 2 and ".lin." in n]
    rest = [p for n, p in module.named_parameters() if not (p.ndim == 2 and ".lin." in n)]
    return (torch.optim.Muon(hidden, lr=0.02, momentum=0.9, weight_decay=0.01),
            torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.01, eps=1e-6))


def _data(torch, n=64, batch_size=4):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 1, generator=g)) + 0.1 * torch.randn(n, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


def _strategy(name):
    if name == "zero3-t0":
        from zero_strategy.integrations.lightning import ZeroStrategy

        return ZeroStrategy(stage=3, param_persistence_threshold=0)
    return name


def _fabric_strategy(name):
    if name == "zero3-t0":
        from zero_strategy.integrations.lightning import ZeroFabricStrategy

        return ZeroFabricStrategy(stage=3, param_persistence_threshold=0)
    return name


def _dump(out, tag, rank, **data):
    (Path(out) / f"{tag}.rank{rank}.json").write_text(json.dumps(data))


def scenario_trainer(out):
    import lightning.pytorch as pl
    import torch
    from torch.nn import functional as F

    from models import muon_orthogonalise_in_fp32

    muon_orthogonalise_in_fp32()

    class TwoOptimizers(pl.LightningModule):
        def __init__(self, seed=0):
            super().__init__()
            self.automatic_optimization = False
            self.net = _model(torch, seed)
            self.losses, self.lrs, self.steps = [], [], [0, 0]

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self(x), y)
            self.losses.append(float(loss.detach()))
            # Gradient accumulation over 2 micro-batches as Lightning documents it for manual
            # optimization: a backward per batch, no no_sync, a step every second batch.
            self.manual_backward(loss / 2)
            if batch_idx % 2 == 1:
                muon, adamw = self.optimizers()
                # Each optimizer's own parameters, as under ddp: by norm, and by value.
                self.clip_gradients(muon, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
                self.clip_gradients(adamw, gradient_clip_val=2e-3, gradient_clip_algorithm="value")
                for k, (opt, sched) in enumerate(zip(self.optimizers(), self.lr_schedulers())):
                    opt.step()
                    sched.step()
                    self.steps[k] += 1
                for opt in self.optimizers():
                    opt.zero_grad()
                self.lrs.append([opt.param_groups[0]["lr"] for opt in self.optimizers()])

        def configure_optimizers(self):
            muon, adamw = _muon_adamw(torch, self.net)
            return [muon, adamw], [torch.optim.lr_scheduler.StepLR(muon, 1, gamma=0.7),
                                   torch.optim.lr_scheduler.LambdaLR(adamw, lambda step: 1.0 / (1.0 + step))]

    def trainer(strategy, **kw):
        opts = dict(accelerator="cpu", devices=2, strategy=_strategy(strategy), max_epochs=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    num_sanity_val_steps=0, limit_train_batches=8)
        return pl.Trainer(**{**opts, **kw})

    out = Path(out)
    for s in STRATEGIES:
        model = TwoOptimizers()
        if s == "ddp" and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            torch.save({k: v.clone() for k, v in model.state_dict().items()}, out / "init.pt")
        t = trainer(s)
        t.fit(model, _data(torch))
        rank = t.global_rank
        engine = getattr(t.strategy, "engine", None)
        weights = engine.full_state_dict(rank0_only=True) if engine is not None else \
            {k: v.detach().clone() for k, v in model.state_dict().items()}
        states = [t.strategy.optimizer_state(o) for o in t.optimizers]  # collective for ZeRO
        ckpt = out / (f"{s}.ckpt" if s == "ddp" else f"{s}.dir.ckpt")
        t.save_checkpoint(ckpt)
        if rank == 0:
            torch.save(weights, out / f"{s}.weights.pt")
            torch.save(states, out / f"{s}.optim.pt")
        record = dict(losses=model.losses, lrs=model.lrs, muon_steps=model.steps[0], adamw_steps=model.steps[1])
        # Resume from the checkpoint for a second epoch (fresh module, other seed: the
        # checkpoint must bring weights, both optimizers and both schedulers back).
        resumed = TwoOptimizers(seed=123)
        t2 = trainer(s, max_epochs=2)
        t2.fit(resumed, _data(torch), ckpt_path=ckpt)
        record["resumed_losses"] = resumed.losses
        _dump(out, s, rank, **record)
        if s != "ddp":
            t2.strategy.barrier()
            if rank == 0:
                from zero_strategy.integrations.lightning.consolidate import consolidate_checkpoint

                consolidate_checkpoint(ckpt, out / f"{s}.consolidated.ckpt")
            t2.strategy.barrier()
    # zero3 resumes from the consolidated single file (two optimizer_states entries).
    resumed = TwoOptimizers(seed=123)
    t3 = trainer("zero3-t0", max_epochs=2)
    t3.fit(resumed, _data(torch), ckpt_path=out / "zero3-t0.consolidated.ckpt")
    _dump(out, "zero3-from-file", t3.global_rank, resumed_losses=resumed.losses)


def scenario_fabric(out):
    import torch
    from lightning.fabric import Fabric
    from torch.nn import functional as F

    from models import muon_orthogonalise_in_fp32

    muon_orthogonalise_in_fp32()
    out = Path(out)

    def train(fabric, model, optimizers, batches):
        losses = []
        for x, y in batches:
            loss = F.mse_loss(model(x), y)
            fabric.backward(loss)
            for opt in optimizers:
                opt.step()
            for opt in optimizers:
                opt.zero_grad()
            losses.append(float(loss.detach()))
        return losses

    for s in ("ddp", "zero2", "zero3-t0"):
        fabric = Fabric(accelerator="cpu", devices=2, strategy=_fabric_strategy(s))
        fabric.launch()
        batches = [(x[fabric.global_rank::2], y[fabric.global_rank::2]) for x, y in _data(torch, n=64, batch_size=8)]
        module = _model(torch)
        muon, adamw = _muon_adamw(torch, module)
        model, muon, adamw = fabric.setup(module, muon, adamw)
        losses = train(fabric, model, (muon, adamw), batches[:4])
        path = out / (f"fabric-{s}.ckpt" if s == "ddp" else f"fabric-{s}.dir.ckpt")
        fabric.save(path, {"model": model, "muon": muon, "adamw": adamw})
        weights = model.state_dict() if s == "ddp" else fabric.strategy.get_module_state_dict(model)
        if fabric.global_rank == 0:
            torch.save({k: v.detach().clone() for k, v in weights.items()}, out / f"fabric-{s}.weights.pt")
        # A fresh model and optimizers from another seed, restored by fabric.load.
        module2 = _model(torch, seed=99)
        muon2, adamw2 = _muon_adamw(torch, module2)
        model2, muon2, adamw2 = fabric.setup(module2, muon2, adamw2)
        fabric.load(path, {"model": model2, "muon": muon2, "adamw": adamw2})
        resumed = train(fabric, model2, (muon2, adamw2), batches[4:8])
        _dump(out, f"fabric-{s}", fabric.global_rank, losses=losses, resumed_losses=resumed)
        fabric.barrier()
        if s != "ddp" and fabric.global_rank == 0:
            from zero_strategy.integrations.lightning.consolidate import consolidate_checkpoint

            consolidate_checkpoint(path, out / f"fabric-{s}.consolidated.ckpt")
        fabric.barrier()


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1] / "support"))
    scenario, target = sys.argv[1], Path(sys.argv[2])
    target.mkdir(parents=True, exist_ok=True)
    globals()[f"scenario_{scenario}"](target)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
