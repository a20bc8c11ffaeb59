"""What Lightning's own sharding strategies promise, checked for zero1/2/3 and zero3 with
every parameter partitioned (``param_persistence_threshold=0``), on the real Trainer.

Run as scripts like tests/lightning/test_lightning.py (Lightning's launcher starts the second CPU
process).  Every check compares against ``strategy="ddp"`` (or Lightning's documented
behaviour), never against the strategy's own output.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from test_lightning import WIDTH, _assert_close_seq, _assert_state_close, _classes, _data, _load, _run, _Run

HERE = Path(__file__).resolve()
# "zero3-t0": stage 3 with param_persistence_threshold=0 (every parameter partitioned).
ZERO = ("zero1", "zero2", "zero3", "zero3-t0")


def _scenario(name, out, *extra):
    return _run(HERE, name, out, *extra)


# ======================================================================================
# the pytest side
# ======================================================================================
@pytest.mark.slow
def test_checkpoint_path_errors_and_state_dict(tmp_path):
    """#14 items 1-3.  A ModelCheckpoint name formatted from a per-rank metric saves ONE
    checkpoint under rank 0's name (as ddp does); saving onto an existing plain file or a
    foreign directory fails on every rank with the same message and changes nothing;
    ``lightning_module_state_dict()`` gives ddp's state dict on rank 0."""
    _scenario("ckpt", tmp_path)
    for s in ("ddp",) + ZERO:
        ranks = [_load(tmp_path, f"ckpt-{s}", r) for r in (0, 1)]
        # The names really differ per rank (val_loss + rank, logged without sync_dist).
        assert ranks[0]["best"] != ranks[1]["best"], ranks
        assert ranks[0]["entries"] == [ranks[0]["best"]], f"{s}: {ranks[0]['entries']} (rank 0 best {ranks[0]['best']})"
    for s in ZERO:
        ranks = [_load(tmp_path, f"ckpt-{s}", r) for r in (0, 1)]
        for what in ("file", "dir"):
            errors = [r[f"{what}_error"] for r in ranks]
            assert all(errors), f"{s} {what}: {errors}"
            # Rank 1 raises the same error type, quoting rank 0's reason.
            assert errors[0][0] == errors[1][0] == "CheckpointError" and errors[0][1] in errors[1][1], errors
            message = errors[0][1]
            assert "refused" in message and ("choose another path" in message or "choose a new path" in message), errors
        assert ranks[0]["file_after"] == "precious" and ranks[0]["dir_after"] == ["notes.txt"], ranks[0]
        # Rank 0: the full state dict, like ddp's; the other ranks: {} (FSDP's full state dict).
        assert ranks[1]["state_dict_len"] == 0
        _assert_state_close(_weights(tmp_path, f"sd-{s}"), _weights(tmp_path, "sd-ddp"), 1e-5, 1e-6, f"{s} state dict")
        # trainer.save_checkpoint does not gather the model (the shards are the checkpoint).
        assert ranks[0]["gathers"] == {"state_dict": 1, "save_checkpoint": 0}, ranks[0]["gathers"]


@pytest.mark.slow
def test_layer_sync_lr_monitor_and_backward_warning(tmp_path):
    """#14 items 4-6.  sync_batchnorm=True converts the BatchNorm layers as ddp does, and a
    LayerSync plugin gives ddp's running statistics (identical on both ranks);
    LearningRateMonitor logs ddp's series; an overridden LightningModule.backward that the
    engine bypasses is reported once, on rank 0."""
    import torch

    _scenario("layers", tmp_path)
    ref = [_load(tmp_path, "layers-ddp", r) for r in (0, 1)]
    assert ref[0]["plugin_types"] == ["GlobalBatchNorm"] and ref[0]["expected_types"] == ["SyncBatchNorm"], ref[0]
    # Without a sync the ranks' running statistics differ: the check below means something.
    plain = [torch.tensor(_load(tmp_path, "layers-ddp-nosync", r)["running_mean"]) for r in (0, 1)]
    assert (plain[0] - plain[1]).abs().max() > 1e-3
    for s in ZERO:
        got = [_load(tmp_path, f"layers-{s}", r) for r in (0, 1)]
        for r in (0, 1):
            assert got[r]["sync_batchnorm_types"] == ref[r]["expected_types"], (s, got[r]["sync_batchnorm_types"])
            assert got[r]["plugin_types"] == ref[r]["plugin_types"], (s, got[r]["plugin_types"])
            for key in ("running_mean", "running_var"):
                _assert_close_seq(got[r][key], ref[r][key], 1e-5, 1e-6, f"{s} rank {r} {key}")
                _assert_close_seq(got[r][key], got[1 - r][key], 0, 0, f"{s} {key} rank {r} vs {1 - r}")
            _assert_close_seq(got[r]["losses"], ref[r]["losses"], 1e-5, 1e-7, f"{s} rank {r} losses")
        assert got[0]["lr_keys"] == ref[0]["lr_keys"], (got[0]["lr_keys"], ref[0]["lr_keys"])
        # ddp calls the override; the engine does not, and says so once, on rank 0 only.
        assert ref[0]["backward_calls"] > 0 and ref[0]["backward_warnings"] == []
        assert got[0]["backward_calls"] == 0 and got[1]["backward_calls"] == 0
        assert len(got[0]["backward_warnings"]) == 1 and got[1]["backward_warnings"] == [], got
        assert "on_before_backward" in got[0]["backward_warnings"][0]


@pytest.mark.slow
def test_lightning_cli_takes_zero_options_as_init_args(tmp_path):
    """#14 item 10: a real LightningCLI run with ZeRO options as init_args, on the command
    line and in a YAML class_path/init_args, runs zero3 with every parameter partitioned and
    trains like ``--trainer.strategy ddp``."""
    pytest.importorskip("jsonargparse")
    _scenario("cli", tmp_path)
    for tag in ("cli-flags", "cli-yaml"):
        for r in (0, 1):
            got, ref = _load(tmp_path, tag, r), _load(tmp_path, "cli-ddp", r)
            expected = {"stage": 3, "param_persistence_threshold": 0,
                        "reduce_bucket_size": 4096 if tag == "cli-yaml" else 5_000_000}
            assert got["config"] == expected, (tag, got["config"])
            # Threshold 0: every parameter is partitioned, each rank holds about half.
            assert got["param_bytes"] <= 0.55 * got["full_bytes"], got
            _assert_close_seq(got["losses"], ref["losses"], 1e-5, 1e-7, f"{tag} rank {r} vs ddp")


def _weights(out, tag):
    import torch

    return torch.load(Path(out) / f"{tag}.pt", weights_only=True)


# ======================================================================================
# the workloads
# ======================================================================================
def _strategy(name):
    if name == "zero3-t0":
        from zero_strategy.integrations.lightning import ZeroStrategy

        return ZeroStrategy(stage=3, param_persistence_threshold=0)
    return name


def _rank():
    return int(os.environ.get("LOCAL_RANK", "0"))


class _CountGathers:
    """Counts the engine's full-state-dict gathers (instrumentation of this test only)."""

    def __init__(self, engine):
        self.calls, original = 0, engine.full_state_dict

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        engine.full_state_dict = counted


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test side checks type and message
        return [type(e).__name__, str(e)]
    return None


def scenario_ckpt(run):
    torch, pl = run.torch, run.pl
    _, Net = _classes(pl)

    class PerRankVal(Net):
        def validation_step(self, batch, batch_idx):
            # Differs per rank and is not synced: ModelCheckpoint's name differs per rank.
            self.log("val_loss", self._loss(batch) + self.global_rank)

    for s in ("ddp",) + ZERO:
        folder = run.out / f"ckpts-{s}"
        mc = pl.callbacks.ModelCheckpoint(dirpath=folder, filename="{epoch}-{val_loss:.4f}")
        pl.seed_everything(0, verbose=False)
        model = PerRankVal()
        trainer = run.trainer(_strategy(s), max_epochs=2, callbacks=[mc], enable_checkpointing=True)
        trainer.fit(model, _data(8), _data(8))
        data = {"best": Path(mc.best_model_path).name, "entries": sorted(p.name for p in folder.iterdir())}

        counter = _CountGathers(trainer.strategy.engine) if s != "ddp" else None
        sd = trainer.strategy.lightning_module_state_dict()
        data["state_dict_len"] = len(sd)
        if trainer.global_rank == 0:
            torch.save({k: v.detach().cpu().clone() for k, v in sd.items()}, run.out / f"sd-{s}.pt")
        if s != "ddp":
            gathers = counter.calls
            trainer.save_checkpoint(run.out / f"extra-{s}.ckpt")
            data["gathers"] = {"state_dict": gathers, "save_checkpoint": counter.calls - gathers}
            # An existing plain file, and a directory that is not one of our checkpoints.
            file, foreign = run.out / f"plain-{s}.ckpt", run.out / f"foreign-{s}"
            if trainer.global_rank == 0:
                file.write_text("precious")
                foreign.mkdir()
                (foreign / "notes.txt").write_text("mine")
            trainer.strategy.barrier()
            data["file_error"] = _error(lambda: trainer.save_checkpoint(file))
            data["dir_error"] = _error(lambda: trainer.save_checkpoint(foreign))
            data["file_after"] = file.read_text()
            data["dir_after"] = sorted(p.name for p in foreign.iterdir())
        run.dump(f"ckpt-{s}", trainer, **data)


def _bn_types(module):
    return sorted({type(m).__name__ for m in module.modules() if "BatchNorm" in type(m).__name__})


def _bn_classes(pl):
    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_nn
    from lightning.pytorch.plugins.layer_sync import LayerSync
    from torch import nn
    from torch.nn import functional as F

    class GlobalBatchNorm(nn.BatchNorm1d):
        """Batch statistics over every rank's batch, on CPU (torch's SyncBatchNorm is GPU-only)."""

        def forward(self, x):
            if not self.training:
                return super().forward(x)
            n = torch.tensor(float(x.shape[0]))
            dist.all_reduce(n)
            mean = dist_nn.all_reduce(x.sum(0)) / n
            var = dist_nn.all_reduce((x * x).sum(0)) / n - mean * mean
            with torch.no_grad():
                self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
                self.running_var.mul_(1 - self.momentum).add_(self.momentum * var * n / (n - 1))
                self.num_batches_tracked += 1
            return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias

    def swap(model, old, new):
        for name, child in model.named_children():
            if type(child) is old:
                repl = new(child.num_features, child.eps, child.momentum)
                repl.weight, repl.bias = child.weight, child.bias
                repl.running_mean, repl.running_var = child.running_mean, child.running_var
                repl.num_batches_tracked = child.num_batches_tracked
                setattr(model, name, repl)
            else:
                swap(child, old, new)
        return model

    class GlobalBatchNormSync(LayerSync):
        def apply(self, model):
            return swap(model, nn.BatchNorm1d, GlobalBatchNorm)

        def revert(self, model):
            return swap(model, GlobalBatchNorm, nn.BatchNorm1d)

    class BNNet(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1))
            self.losses, self.backward_calls, self.sync_types = [], 0, None

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            idx, x, y = batch
            loss = F.mse_loss(self(x).float(), y.float())
            self.losses.append(float(loss.detach()))
            return loss

        def backward(self, loss, *args, **kwargs):
            self.backward_calls += 1
            loss.backward(*args, **kwargs)

        def on_fit_start(self):
            self.sync_types = _bn_types(self)

        def configure_optimizers(self):
            opt = torch.optim.AdamW([{"params": [p for p in self.parameters() if p.ndim >= 2]},
                                     {"params": [p for p in self.parameters() if p.ndim < 2], "lr": 5e-4}], lr=1e-3)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return BNNet, GlobalBatchNormSync


def scenario_layers(run):
    import warnings

    pl = run.pl
    BNNet, GlobalBatchNormSync = _bn_classes(pl)
    from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm

    expected = _bn_types(TorchSyncBatchNorm().apply(BNNet()))  # what Lightning's plugin makes
    for s in ("ddp",) + ZERO + ("ddp-nosync",):
        converted = None
        if s.startswith("zero"):
            # sync_batchnorm=True: the layers when fit starts.  torch's SyncBatchNorm only
            # runs on GPUs (DDP refuses to wrap it on CPU): max_steps=0.
            model = BNNet()
            run.trainer(_strategy(s), sync_batchnorm=True, max_steps=0).fit(model, _data(8))
            converted = model.sync_types

        pl.seed_everything(0, verbose=False)
        model = BNNet()
        lr_monitor = pl.callbacks.LearningRateMonitor()
        plugins = [] if s.endswith("-nosync") else [GlobalBatchNormSync()]
        trainer = run.trainer(_strategy(s.replace("-nosync", "")), max_epochs=2, plugins=plugins, callbacks=[lr_monitor],
                              logger=pl.loggers.CSVLogger(run.out / f"logs-{s}"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, _data(8))
        bn = model.net[1]
        run.dump(f"layers-{s}", trainer, sync_batchnorm_types=converted, expected_types=expected,
                 plugin_types=model.sync_types, losses=model.losses,
                 running_mean=bn.running_mean.tolist(), running_var=bn.running_var.tolist(),
                 lr_keys=sorted(lr_monitor.lrs), backward_calls=model.backward_calls,
                 backward_warnings=[str(w.message) for w in caught if "backward is overridden" in str(w.message)])


def scenario_cli(run):
    from lightning.pytorch.cli import LightningCLI

    _, Net = _classes(run.pl)

    class CLINet(Net):
        def train_dataloader(self):
            return _data(8)

    yaml = run.out / f"zero.rank{_rank()}.yaml"  # each process writes its own (no race)
    yaml.write_text(
        "trainer:\n"
        "  strategy:\n"
        "    class_path: zero_strategy.integrations.lightning.ZeroStrategy\n"
        "    init_args:\n"
        "      stage: 3\n"
        "      param_persistence_threshold: 0\n"
        "      reduce_bucket_size: 4096\n"
    )
    common = ["fit", "--seed_everything=0", "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.max_epochs=1",
              "--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
              "--trainer.enable_model_summary=false"]
    runs = {
        "cli-flags": ["--trainer.strategy=zero_strategy.integrations.lightning.ZeroStrategy",
                      "--trainer.strategy.init_args.stage=3", "--trainer.strategy.init_args.param_persistence_threshold=0"],
        "cli-yaml": [f"--config={yaml}"],
        "cli-ddp": ["--trainer.strategy=ddp"],
    }
    for tag, args in runs.items():
        cli = LightningCLI(CLINet, args=[common[0], *args, *common[1:]], save_config_callback=None)
        trainer, model = cli.trainer, cli.model
        data = {"losses": model.losses, "full_bytes": sum(p.numel() * 4 for p in model.parameters())}
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            cfg = engine.config
            data["config"] = {"stage": cfg.stage, "param_persistence_threshold": cfg.param_persistence_threshold,
                              "reduce_bucket_size": cfg.reduce_bucket_size}
            data["param_bytes"] = engine.memory_report()["parameters"]
        run.dump(tag, trainer, **data)


def _main(argv):
    scenario, out = argv[0], Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    import lightning.pytorch as pl

    globals()[f"scenario_{scenario}"](_Run(pl, out), *argv[2:])
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1:])
