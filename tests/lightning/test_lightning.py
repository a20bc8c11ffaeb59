"""Lightning Trainer integration, through the real Trainer launched as users launch it.

Each test runs this file as a script (``python tests/lightning/test_lightning.py SCENARIO OUT``)
with ``accelerator="cpu", devices=2``: Lightning's own launcher starts the second
process.  One launch runs several Trainers (imports dominate the cost on CPU).  The
workload scripts do NOT import zero_strategy or integrations (the strategy names come
from the start-up hook), except the fp16 scenario, which passes a ``ZeroStrategy``
instance to set loss-scale options.  Every check compares against ``strategy="ddp"``
on the same seed and data, or against an independent observation -- never against
the strategy's own output.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from processes import run_session

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
ZERO = ("zero1", "zero2", "zero3")
WIDTH = 320  # Linear(320, 320) has 102,720 elements: above param_persistence_threshold, so stage 3 partitions it


# ======================================================================================
# the pytest side
# ======================================================================================
def _run(*args, timeout=420, env_extra=None):
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"})
    for name in ("LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "NODE_RANK"):
        env.pop(name, None)  # Lightning's launcher picks a free port for each run
    env.update(env_extra or {})
    proc = run_session([sys.executable, *map(str, args)], cwd=str(ROOT), env=env, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def _scenario(name, out, *extra):
    return _run(HERE, name, out, *extra)


def _load(out, tag, rank=0):
    return json.loads((Path(out) / f"{tag}.rank{rank}.json").read_text())


def _weights(out, tag):
    import torch

    return torch.load(Path(out) / f"{tag}.pt", weights_only=True)


@pytest.mark.slow
def test_from_pretrained_in_configure_model_loads_each_ranks_slice(tmp_path):
    """Under zero3, a transformers model loaded with from_pretrained in configure_model
    comes unallocated and each rank reads its slices when fit starts; training matches
    ddp, which loads the whole checkpoint normally."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(5)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "hf")
    _scenario("pretrained", tmp_path, tmp_path / "hf")
    for r in (0, 1):
        z, d = _load(tmp_path, "pretrained-zero3", r), _load(tmp_path, "pretrained-ddp", r)
        assert z["meta_in_configure"] is True and d["meta_in_configure"] is False
        _assert_close_seq(z["losses"], d["losses"], 1e-5, 1e-7, "from_pretrained zero3 vs ddp")


def _assert_close_seq(a, b, rtol, atol, what):
    assert len(a) == len(b) and len(a) > 0, f"{what}: {len(a)} vs {len(b)} values"
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= atol + rtol * abs(y), f"{what}[{i}]: {x} vs {y}"


def _assert_state_close(got, ref, rtol, atol, what):
    import torch

    assert set(got) == set(ref), f"{what}: keys differ: {set(got) ^ set(ref)}"
    for k in ref:
        assert got[k].dtype == ref[k].dtype, f"{what}: {k} dtype {got[k].dtype} vs {ref[k].dtype}"
        torch.testing.assert_close(got[k], ref[k], rtol=rtol, atol=atol, msg=lambda m: f"{what}: {k}: {m}")


def _rel_diff(a, b, base):
    import torch

    num = sum(float((a[k].float() - b[k].float()).norm() ** 2) for k in base) ** 0.5
    den = sum(float((b[k].float() - base[k].float()).norm() ** 2) for k in base) ** 0.5
    return num / den


@pytest.mark.slow
def test_trainer_stages_match_ddp_fit_validate_test_predict(tmp_path):
    """zero1/2/3 in 32-true and bf16-mixed against ddp: per-step losses, final weights,
    the DistributedSampler split, sync_dist, validate/test/predict, two param groups +
    a step LR scheduler; strategy names only (no import in the script)."""
    _scenario("parity", tmp_path)
    for r in (0, 1):
        ref = _load(tmp_path, "fp32-ddp", r)
        # DistributedSampler: each rank sees its own half of the 64 samples, every epoch.
        for tag in ("fp32-ddp",) + tuple(f"fp32-{s}" for s in ZERO):
            seen = _load(tmp_path, tag, r)["seen"]
            other = _load(tmp_path, tag, 1 - r)["seen"]
            assert len(seen) == 2 * 32, f"{tag} rank {r} saw {len(seen)} samples in 2 epochs"
            assert set(seen[:32]).isdisjoint(other[:32]) and set(seen[:32]) | set(other[:32]) == set(range(64))
        for s in ZERO:
            got = _load(tmp_path, f"fp32-{s}", r)
            assert got["config"] == {"stage": int(s[-1]), "precision": "fp32"}
            _assert_close_seq(got["losses"], ref["losses"], 1e-5, 1e-7, f"fp32 {s} rank {r} losses")
            for key in ("val_loss", "test_loss"):
                _assert_close_seq([got["metrics"][key]], [ref["metrics"][key]], 1e-5, 1e-7, f"{s} {key}")
            # sync_dist=True: the mean of the ranks' values (0 and 1) on both ranks.
            assert got["metrics"]["rank_mean"] == pytest.approx(0.5) and ref["metrics"]["rank_mean"] == pytest.approx(0.5)
            _assert_close_seq(got["predictions"], ref["predictions"], 1e-5, 1e-6, f"{s} rank {r} predictions")
            assert len(got["predictions"]) == 32
    init = _weights(tmp_path, "init")
    ddp32 = _weights(tmp_path, "fp32-ddp")
    for s in ZERO:
        _assert_state_close(_weights(tmp_path, f"fp32-{s}"), ddp32, 1e-5, 1e-6, f"fp32 {s} final weights")
    # Stage 3 really partitioned the two 320x320 blocks (stage 2 keeps whole parameters).
    p2, p3 = (_load(tmp_path, f"fp32-{s}")["param_bytes"] for s in ("zero2", "zero3"))
    assert p3 < 0.6 * p2, (p2, p3)

    # bf16: the engine computes entirely in bf16 (parameters and inputs, targets included:
    # floating inputs are cast at the root forward) with fp32 master weights; DDP's
    # bf16-mixed autocasts only the matmuls and keeps fp32 parameters.  Both round
    # differently at the 2**-8 level, so: losses within 2%, and the final weights no
    # further from ddp-bf16 than twice the distance bf16 itself puts between ddp-bf16
    # and ddp-fp32 (measured: 0.022 vs 0.041, relative to how far training moved them).
    ddp16 = _weights(tmp_path, "bf16-ddp")
    bf16_noise = _rel_diff(ddp32, ddp16, init)
    for s in ZERO:
        for r in (0, 1):
            got, ref = _load(tmp_path, f"bf16-{s}", r), _load(tmp_path, "bf16-ddp", r)
            assert got["config"] == {"stage": int(s[-1]), "precision": "bf16"}
            _assert_close_seq(got["losses"], ref["losses"], 2e-2, 1e-3, f"bf16 {s} rank {r} losses")
        w = _weights(tmp_path, f"bf16-{s}")
        assert all(w[k].dtype == init[k].dtype for k in init)  # consolidated in the original fp32
        rel = _rel_diff(w, ddp16, init)
        assert rel < min(0.1, 2 * bf16_noise), f"bf16 {s}: |w - w_ddp| / |w_ddp - w0| = {rel:.3f} (bf16 noise {bf16_noise:.3f})"
        # ...and bf16 really ran: not bitwise the fp32 result.
        assert any(not (w[k] == _weights(tmp_path, f"fp32-{s}")[k]).all() for k in w)


@pytest.mark.slow
def test_trainer_accumulation_and_clipping_match(tmp_path):
    """accumulate_grad_batches=2 equals one batch of twice the size; gradient_clip_val
    with "norm" (global over the shards) and "value" matches ddp; stages 0/1 send no
    gradients on non-boundary micro-batches, stage 2/3 accumulate into sharded gradients."""
    _scenario("accum_clip", tmp_path)
    for s in ("ddp",) + ZERO:
        big = _weights(tmp_path, f"acc1-{s}")
        _assert_state_close(_weights(tmp_path, f"acc2-{s}"), big, 1e-5, 1e-6, f"{s}: accumulate 2 x 4 vs batch 8")
    ddp_plain = _weights(tmp_path, "acc1-ddp")
    for kind in ("clipn", "clipv"):
        ref = _weights(tmp_path, f"{kind}-ddp")
        # The clip was active (otherwise the comparison below proves nothing).
        assert _rel_diff(ref, ddp_plain, _weights(tmp_path, "init")) > 0.05, f"{kind} did not change training"
        for s in ZERO:
            _assert_state_close(_weights(tmp_path, f"{kind}-{s}"), ref, 1e-5, 1e-6, f"{s} {kind}")
            for r in (0, 1):
                _assert_close_seq(_load(tmp_path, f"{kind}-{s}", r)["losses"], _load(tmp_path, f"{kind}-ddp", r)["losses"],
                                  1e-5, 1e-7, f"{s} {kind} losses")
    # Communication per micro-batch (paper volume, elements) during accumulation.
    for s in ZERO:
        vol = _load(tmp_path, f"acc2-{s}")["comm_per_batch"]
        odd, even = vol[0::2], vol[1::2]  # micro-batches 0, 2, .. accumulate; 1, 3, .. step
        if s == "zero1":
            assert all(v == 0 for v in odd), f"stage 1 communicated on accumulation micro-batches: {vol}"
        else:
            assert all(v > 0 for v in odd), f"{s}: gradients are reduce-scattered every micro-batch: {vol}"
        assert all(v > 0 for v in even)


@pytest.mark.slow
def test_trainer_fp16_overflow_skips_step_and_scheduler(tmp_path):
    """16-mixed (also on CPU, where Lightning itself would fall back to bf16): dynamic
    loss scaling; an overflow skips the step on both ranks and the step LR scheduler
    is not stepped for it.  Also: configure_model under stage 3 (built deferred,
    materialised partitioned); fit twice, test from a new Trainer and a plain forward
    after fit; "zero2_offload"/"zero3_offload"; the standalone pytorch_lightning package
    against its own ddp."""
    _scenario("misc", tmp_path)
    for tag in ("fp16-instance", "fp16-name"):
        recs = [_load(tmp_path, tag, r) for r in (0, 1)]
        assert recs[0]["config"]["precision"] == "fp16"
        steps = recs[0]["steps"]
        assert [x["skipped"] for x in steps] == [x["skipped"] for x in recs[1]["steps"]], "ranks disagree on skips"
        # Independent evidence: the parameters did not move exactly when a step was skipped.
        for x in steps:
            assert x["changed"] == (not x["skipped"]), steps
        n_ok = sum(not x["skipped"] for x in steps)
        if tag == "fp16-instance":
            assert len(steps) - n_ok >= 1 and n_ok >= 2, f"expected overflow skips, then steps: {steps}"
        assert recs[0]["scheduler_steps"] == n_ok, (recs[0]["scheduler_steps"], steps)
        assert recs[0]["final_lr"] == pytest.approx(1e-3 / (1 + 0.1 * n_ok))
        assert all(v == v and abs(v) < 1e3 for v in recs[0]["losses"])
    # configure_model under stage 3: no parameter memory while building (deferred to the
    # meta device), partitioned when training starts; ddp builds the whole model.
    for r in (0, 1):
        cm = _load(tmp_path, "configure_model-zero3", r)
        assert cm["bytes_in_configure_model"] == 0, cm
        assert cm["param_bytes_at_fit_start"] < 0.6 * cm["full_param_bytes"], cm
    assert _load(tmp_path, "configure_model-ddp")["bytes_in_configure_model"] == cm["full_param_bytes"]
    for r in (0, 1):
        _assert_close_seq(_load(tmp_path, "configure_model-zero3", r)["losses"], _load(tmp_path, "configure_model-ddp", r)["losses"],
                          1e-5, 1e-7, "configure_model zero3 vs ddp")
        _assert_close_seq(_load(tmp_path, "pl-zero3", r)["losses"], _load(tmp_path, "pl-ddp", r)["losses"], 1e-5, 1e-7,
                          "pytorch_lightning zero3 vs ddp")
    _assert_state_close(_weights(tmp_path, "pl-zero3"), _weights(tmp_path, "pl-ddp"), 1e-5, 1e-6, "pytorch_lightning weights")
    for s in ("zero2_offload", "zero3_offload"):
        for r in (0, 1):
            got = _load(tmp_path, f"offload-{s}", r)
            assert got["offload"] == "cpu" and got["host_bytes"] > 0, got
            _assert_close_seq(got["losses"], _load(tmp_path, "refit-ddp", r)["losses"][:4], 1e-5, 1e-7, f"{s} vs ddp")
    for s, offload in (("zero2_offload_nvme", ["nvme", "none"]), ("zero3_offload_nvme", ["nvme", "nvme"])):
        for r in (0, 1):
            got = _load(tmp_path, f"offload-{s}", r)
            assert got["offload"] == offload and got["disk_bytes"] > 0 and got["held"] >= 1, got
            _assert_close_seq(got["losses"], _load(tmp_path, "refit-ddp", r)["losses"][:4], 1e-5, 1e-7, f"{s} vs ddp")
    assert [_load(tmp_path, "offload-nvme-collected", r)["left"] for r in (0, 1)] == [[], []]
    for r in (0, 1):
        got, ref = _load(tmp_path, "refit-zero3", r), _load(tmp_path, "refit-ddp", r)
        assert len(got["losses"]) == 8
        _assert_close_seq(got["losses"] + [got["test_loss"]] + got["forward"], ref["losses"] + [ref["test_loss"]] + ref["forward"],
                          1e-5, 1e-6, "fit twice / test from a new Trainer / plain forward, zero3 vs ddp")


@pytest.mark.slow
def test_trainer_checkpoint_resume_and_consolidation(tmp_path):
    """ModelCheckpoint writes a directory of per-rank shards; fit(ckpt_path=...) into a
    differently initialised model continues exactly like an uninterrupted run (also
    with another stage); a fresh model validates from it; the consolidated single file loads with
    LightningModule.load_from_checkpoint in a plain process and equals ddp's weights."""
    _scenario("ckpt", tmp_path)
    for s in ("zero3", "zero1"):
        path = Path(_load(tmp_path, f"first-{s}")["ckpt_path"])
        assert path.is_dir(), path
        names = sorted(p.name for p in path.iterdir())
        assert {"manifest.json", "client_state.pt", "rank00000.safetensors", "rank00001.safetensors"} <= set(names), names
        for r in (0, 1):
            full = _load(tmp_path, f"full-{s}", r)["losses"]
            resumed = _load(tmp_path, f"resumed-{s}", r)["losses"]
            assert len(full) == 8 and len(resumed) == 4
            _assert_close_seq(resumed, full[4:], 1e-6, 1e-8, f"{s} rank {r} resumed losses")
            if s == "zero1":
                _assert_close_seq(_load(tmp_path, "resumed-zero1-as-zero3", r)["losses"], full[4:], 1e-6, 1e-8,
                                  f"zero1 checkpoint resumed with zero3, rank {r}")
        first, evaluated = _load(tmp_path, f"first-{s}"), _load(tmp_path, f"evalckpt-{s}")
        _assert_close_seq([evaluated["val_loss"]], [first["val_loss"]], 1e-6, 1e-8, f"{s} validate(ckpt_path=...)")
    # Consolidate (CLI), then load in a plain process with the start-up hook disabled.
    for r in (0, 1):
        refusals = _load(tmp_path, "planted", r)["refusals"]
        assert len(refusals) == 2 and all(m and "weights_only=False" in m for m in refusals), refusals
    assert not (tmp_path / "planted_marker").exists(), "loading the planted checkpoint ran its code"
    ckpt = Path(_load(tmp_path, "first-zero3")["ckpt_path"])
    single = tmp_path / "consolidated.ckpt"
    env = {"ZERO_STRATEGY_AUTOLOAD": "0"}
    _run("-m", "zero_strategy.integrations.lightning.consolidate", ckpt, single, env_extra=env)
    _run(HERE, "load_consolidated", tmp_path, single, env_extra=env)
    loaded = _weights(tmp_path, "loaded")
    _assert_state_close(loaded, _weights(tmp_path, "ddp-epoch1"), 1e-5, 1e-6, "consolidated zero3 vs ddp after 1 epoch")


# ======================================================================================
# the workloads (run as scripts; Lightning is imported only here)
# ======================================================================================
def _classes(pl):
    import torch
    from torch import nn
    from torch.nn import functional as F

    from models import ResidualBlock as Block

    class Net(pl.LightningModule):
        def __init__(self, optim="adamw", lr=1e-3, sched=True, build_in_configure=False, width=WIDTH):
            super().__init__()
            self.save_hyperparameters()
            self.net = None if build_in_configure else self._build()
            self.losses, self.seen, self.bytes_in_configure_model = [], [], None

        def _build(self):
            d = self.hparams.width
            return nn.Sequential(nn.Linear(8, d), Block(d), Block(d), nn.Linear(d, 1))

        def configure_model(self):
            if self.net is None:
                self.net = self._build()
                # Parameter memory allocated by building the model here (meta = none).
                self.bytes_in_configure_model = sum(p.numel() * p.element_size() for p in self.parameters()
                                                    if p.device.type != "meta")

        def forward(self, x):
            return self.net(x)

        def _loss(self, batch):
            idx, x, y = batch
            return F.mse_loss(self(x).float(), y.float())

        def training_step(self, batch, batch_idx):
            loss = self._loss(batch)
            self.losses.append(float(loss.detach()))
            self.seen.extend(int(i) for i in batch[0])
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self._loss(batch), sync_dist=True)
            self.log("rank_mean", float(self.global_rank), sync_dist=True)

        def test_step(self, batch, batch_idx):
            self.log("test_loss", self._loss(batch), sync_dist=True)

        def predict_step(self, batch, batch_idx):
            return self(batch[1]).float()

        def configure_optimizers(self):
            hp = self.hparams
            matrices = [p for p in self.parameters() if p.ndim >= 2]
            vectors = [p for p in self.parameters() if p.ndim < 2]
            groups = [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0, "lr": hp.lr * 0.5}]
            if hp.optim == "adamw":
                opt = torch.optim.AdamW(groups, lr=hp.lr)
            else:
                opt = torch.optim.SGD(groups, lr=hp.lr, momentum=0.9)
            if not hp.sched:
                return opt
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.1 * step))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Block, Net


def _data(batch_size, shuffle=False, n=64):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 1, generator=g)) + 0.1 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(torch.arange(n), x, y), batch_size=batch_size, shuffle=shuffle)


class _Run:
    def __init__(self, pl, out):
        import torch

        self.pl, self.out, self.torch = pl, Path(out), torch
        self.Block, self.Net = _classes(pl)

    def trainer(self, strategy, precision="32-true", **kw):
        opts = dict(accelerator="cpu", devices=2, strategy=strategy, precision=precision, max_epochs=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    num_sanity_val_steps=0)
        opts.update(kw)
        return self.pl.Trainer(**opts)

    def model(self, seed=0, **kw):
        self.pl.seed_everything(seed, verbose=False)
        return self.Net(**kw)

    def dump(self, tag, trainer, **data):
        (self.out / f"{tag}.rank{trainer.global_rank}.json").write_text(json.dumps(data))

    def save_weights(self, tag, trainer, model):
        """Consolidated weights on rank 0 (collective for the zero strategies)."""
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            sd = engine.full_state_dict(rank0_only=True)
        else:
            sd = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        if trainer.global_rank == 0:
            self.torch.save(sd, self.out / f"{tag}.pt")

    @staticmethod
    def config(trainer):
        cfg = getattr(trainer.strategy, "config", None)
        return None if cfg is None else {"stage": cfg.stage, "precision": cfg.precision}

    @staticmethod
    def metrics(trainer):
        return {k: float(v) for k, v in trainer.callback_metrics.items()}


def scenario_parity(run):
    torch = run.torch
    first = True
    for precision in ("32-true", "bf16-mixed"):
        tag_p = "fp32" if precision == "32-true" else "bf16"
        for s in ("ddp",) + ZERO:
            model = run.model()
            if first:
                if int(os.environ.get("LOCAL_RANK", "0")) == 0:
                    torch.save({k: v.clone() for k, v in model.state_dict().items()}, run.out / "init.pt")
                first = False
            trainer = run.trainer(s, precision, max_epochs=2)
            trainer.fit(model, _data(8), _data(8))
            data = {"losses": model.losses, "seen": model.seen, "config": run.config(trainer)}
            engine = getattr(trainer.strategy, "engine", None)
            if engine is not None:
                data["param_bytes"] = engine.memory_report()["parameters"]
            run.save_weights(f"{tag_p}-{s}", trainer, model)
            if precision == "32-true":
                metrics = dict(trainer.validate(model, _data(8), verbose=False)[0])  # val_loss, rank_mean
                metrics.update(trainer.test(model, _data(8), verbose=False)[0])
                preds = trainer.predict(model, _data(8))
                data["metrics"] = metrics
                data["predictions"] = torch.cat(preds).flatten().tolist()
            run.dump(f"{tag_p}-{s}", trainer, **data)


class _CommPerBatch:
    """Callback: elements communicated (paper volume) during each micro-batch."""

    def __init__(self, pl):
        outer = self

        class CB(pl.Callback):
            def on_train_batch_start(self, trainer, *a):
                outer.before = trainer.strategy.engine.comm_report().paper_volume

            def on_train_batch_end(self, trainer, *a):
                outer.volumes.append(trainer.strategy.engine.comm_report().paper_volume - outer.before)

        self.volumes, self.before, self.callback = [], 0, CB()


def scenario_accum_clip(run):
    torch = run.torch
    sgd = dict(optim="sgd", lr=0.05, sched=False)
    for s in ("ddp",) + ZERO:
        cb = _CommPerBatch(run.pl) if s != "ddp" else None
        model = run.model(**sgd)
        if s == "ddp" and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            torch.save({k: v.clone() for k, v in model.state_dict().items()}, run.out / "init.pt")
        trainer = run.trainer(s, accumulate_grad_batches=2, callbacks=[cb.callback] if cb else [])
        trainer.fit(model, _data(4))
        run.save_weights(f"acc2-{s}", trainer, model)
        run.dump(f"acc2-{s}", trainer, losses=model.losses, comm_per_batch=cb.volumes if cb else [])
        for tag, kw in (("acc1", {}), ("clipn", dict(gradient_clip_val=0.05)),
                        ("clipv", dict(gradient_clip_val=0.002, gradient_clip_algorithm="value"))):
            model = run.model(**sgd)
            trainer = run.trainer(s, **kw)
            trainer.fit(model, _data(8))
            run.save_weights(f"{tag}-{s}", trainer, model)
            run.dump(f"{tag}-{s}", trainer, losses=model.losses)


def scenario_misc(run):
    torch, pl = run.torch, run.pl

    class StepRecorder(pl.Callback):
        def __init__(self):
            self.steps, self.prev = [], None

        def _flat(self, module):  # stage 2: every rank holds whole (fp16) parameters
            return torch.cat([p.detach().float().flatten() for p in module.parameters()])

        def on_train_batch_start(self, trainer, module, *a):
            self.prev = self._flat(module)

        def on_train_batch_end(self, trainer, module, *a):
            now = self._flat(module)
            self.steps.append({"skipped": bool(trainer.optimizers[0].step_was_skipped),
                               "changed": bool(not torch.equal(now, self.prev))})

    from zero_strategy.integrations.lightning import ZeroStrategy  # only to pass loss-scale options

    for tag, strategy in (("fp16-instance", ZeroStrategy(stage=2, initial_scale_power=20, hysteresis=1)),
                          ("fp16-name", "zero2")):
        rec = StepRecorder()
        model = run.model()
        trainer = run.trainer(strategy, "16-mixed", max_epochs=2, gradient_clip_val=1.0, callbacks=[rec])
        trainer.fit(model, _data(8))
        sched = trainer.lr_scheduler_configs[0].scheduler
        run.dump(tag, trainer, steps=rec.steps, losses=model.losses, config=run.config(trainer),
                 scheduler_steps=sched.last_epoch, final_lr=trainer.optimizers[0].param_groups[0]["lr"])

    class FitStart(pl.Callback):
        def on_fit_start(self, trainer, module):
            self.bytes = trainer.strategy.engine.memory_report()["parameters"]

    for s in ("zero3", "ddp"):
        cb = FitStart() if s != "ddp" else None
        model = run.model(build_in_configure=True)
        trainer = run.trainer(s, callbacks=[cb] if cb else [])
        trainer.fit(model, _data(8))
        full = sum(p.numel() * 4 for p in model.parameters())
        run.dump(f"configure_model-{s}", trainer, losses=model.losses, full_param_bytes=full,
                 bytes_in_configure_model=model.bytes_in_configure_model, param_bytes_at_fit_start=cb.bytes if cb else None)

    # A second fit (new Trainer, new optimizer: the engine is rebuilt), test from a third
    # Trainer (reuses the engine), and a plain forward after fit (both ranks).
    for s in ("zero3", "ddp"):
        model = run.model()
        run.trainer(s).fit(model, _data(8))
        trainer = run.trainer(s)
        trainer.fit(model, _data(8))
        test_loss = run.trainer(s).test(model, _data(8), verbose=False)[0]["test_loss"]
        with torch.no_grad():
            out = model(torch.randn(3, 8, generator=torch.Generator().manual_seed(5))).float()
        run.dump(f"refit-{s}", trainer, losses=model.losses, test_loss=test_loss, forward=out.flatten().tolist())

    # ZeRO-Offload names: optimizer state and step in host memory.
    for s in ("zero2_offload", "zero3_offload"):
        model = run.model()
        trainer = run.trainer(s)
        trainer.fit(model, _data(8))
        report = trainer.strategy.engine.memory_report()
        run.dump(f"offload-{s}", trainer, losses=model.losses, host_bytes=report.get("host", 0),
                 offload=trainer.strategy.config.offload_optimizer)

    # Disk-offload names (ZeRO-Infinity): nvme_path from the environment; the engine (and
    # its files) stays attached after fit, until the next fit releases it or it is collected.
    nvme_root = Path(run.out) / f"nvme-rank{torch.distributed.get_rank() if torch.distributed.is_initialized() else 0}"
    os.environ["ZERO_STRATEGY_NVME_PATH"] = str(nvme_root)
    for s in ("zero2_offload_nvme", "zero3_offload_nvme"):
        model = run.model()
        trainer = run.trainer(s)
        trainer.fit(model, _data(8))
        report = trainer.strategy.engine.memory_report()
        run.dump(f"offload-{s}", trainer, losses=model.losses, disk_bytes=report.get("disk", 0),
                 held=len(list(nvme_root.iterdir())),
                 offload=[trainer.strategy.config.offload_optimizer, trainer.strategy.config.offload_param])
    del os.environ["ZERO_STRATEGY_NVME_PATH"]
    rank = trainer.global_rank
    del model, trainer, report
    import gc

    gc.collect()
    (Path(run.out) / f"offload-nvme-collected.rank{rank}.json").write_text(
        json.dumps({"left": sorted(p.name for p in nvme_root.iterdir())}))

    # The standalone pytorch_lightning package: separate classes, separate registry.
    import pytorch_lightning

    other = _Run(pytorch_lightning, run.out)
    for s in ("zero3", "ddp"):
        model = other.model()
        trainer = other.trainer(s)
        trainer.fit(model, _data(8))
        other.save_weights(f"pl-{s}", trainer, model)
        other.dump(f"pl-{s}", trainer, losses=model.losses)


def scenario_ckpt(run):
    pl = run.pl
    for s in ("zero3", "zero1"):
        model = run.model()
        trainer = run.trainer(s, max_epochs=2)
        trainer.fit(model, _data(8, shuffle=True), _data(8))
        run.dump(f"full-{s}", trainer, losses=model.losses)

        ckpt_dir = run.out / f"ckpt-{s}"
        mc = pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1)
        model = run.model()
        trainer = run.trainer(s, max_epochs=1, callbacks=[mc], enable_checkpointing=True)
        trainer.fit(model, _data(8, shuffle=True), _data(8))
        val = trainer.validate(model, _data(8), verbose=False)[0]["val_loss"]
        path = mc.best_model_path
        run.dump(f"first-{s}", trainer, ckpt_path=str(path), val_loss=val)

        model = run.model(seed=123)  # different initial weights: they must come from the checkpoint
        run.pl.seed_everything(0, verbose=False)  # the sampler's shuffle seed, as in the first run
        trainer = run.trainer(s, max_epochs=2)
        trainer.fit(model, _data(8, shuffle=True), _data(8), ckpt_path=path)
        run.dump(f"resumed-{s}", trainer, losses=model.losses)

        model = run.model(seed=7)
        trainer = run.trainer(s)
        val = trainer.validate(model, _data(8), ckpt_path=path, verbose=False)[0]["val_loss"]
        run.dump(f"evalckpt-{s}", trainer, val_loss=val)

        if s == "zero3":  # a planted client_state.pt: refused whatever weights_only Lightning passes
            from test_untrusted_files import plant_client_state

            planted = run.out / "planted.ckpt"
            if trainer.global_rank == 0:
                import shutil

                shutil.copytree(path, planted)
                plant_client_state(planted, run.out / "planted_marker")
            trainer.strategy.barrier()
            refusals = []
            for weights_only in (True, None):
                try:
                    trainer.strategy.load_checkpoint(planted, weights_only=weights_only)
                    refusals.append(None)
                except Exception as e:  # noqa: BLE001 - the test side checks the message
                    refusals.append(str(e))
            run.dump("planted", trainer, refusals=refusals)

    # Another stage resumes the same directory (the core reshards on load).
    model = run.model(seed=123)
    run.pl.seed_everything(0, verbose=False)
    trainer = run.trainer("zero3", max_epochs=2)
    trainer.fit(model, _data(8, shuffle=True), _data(8), ckpt_path=run.out / "ckpt-zero1" / "epoch=0-step=4.ckpt")
    run.dump("resumed-zero1-as-zero3", trainer, losses=model.losses)

    model = run.model()
    trainer = run.trainer("ddp", max_epochs=1)
    trainer.fit(model, _data(8, shuffle=True), _data(8))
    run.save_weights("ddp-epoch1", trainer, model)


def scenario_pretrained(run, folder):
    """A transformers model loaded with from_pretrained in configure_model."""
    torch, pl = run.torch, run.pl
    from transformers import AutoModelForCausalLM

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lm, self.losses, self.meta_in_configure = None, [], None

        def configure_model(self):
            if self.lm is None:
                self.lm = AutoModelForCausalLM.from_pretrained(folder)
                self.meta_in_configure = all(p.is_meta for p in self.lm.parameters())

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            loss = self.lm(input_ids=ids, labels=ids).loss
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 64, (32, 16), generator=g)), batch_size=4)
    for s in ("zero3", "ddp"):
        model = LM()
        trainer = run.trainer(s, max_steps=3)
        trainer.fit(model, data)
        run.dump(f"pretrained-{s}", trainer, losses=model.losses, meta_in_configure=model.meta_in_configure)


def load_consolidated(out, ckpt):
    """A plain process: no strategy, no process group."""
    import lightning.pytorch as pl
    import torch

    _, Net = _classes(pl)
    model = Net.load_from_checkpoint(ckpt, map_location="cpu")
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, Path(out) / "loaded.pt")


def _main(argv):
    scenario, out = argv[0], Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    if scenario == "load_consolidated":
        return load_consolidated(out, argv[2])
    import lightning.pytorch as pl

    globals()[f"scenario_{scenario}"](_Run(pl, out), *argv[2:])
    import torch.distributed as dist

    if dist.is_initialized():  # plain ddp runs otherwise abort at exit here (gloo threads)
        dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1:])
