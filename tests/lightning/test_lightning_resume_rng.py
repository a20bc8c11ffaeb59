"""Resuming restores each rank's random state (issue #34 item 7).

A model with dropout trains two epochs without interruption (with a validation loader,
so the sanity check and the epoch-end validation run as usual); a second run trains one
epoch and saves a checkpoint (ModelCheckpoint at the epoch's end), and a third, started
afresh as a new script would be (``seed_everything`` and a newly built model), resumes
it with ``fit(ckpt_path=...)``.  The ZeRO checkpoint holds every rank's torch generator
state (``rank<r>.json``), so the resumed second epoch draws the dropout masks the
uninterrupted run drew and repeats its losses bit for bit.  ``strategy="ddp"`` is the
control: a Lightning checkpoint holds no random state, so its resumed epoch draws other
masks and its losses differ -- which also shows that the comparison can fail (without
dropout, or with its draws not mattering, the ZeRO check would prove nothing).
docs/checkpoints.md (Random state) quotes the gaps ddp shows here.

Launched as users launch (``python script``: Lightning's launcher starts the second CPU
process).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from test_lightning import _run

HERE = Path(__file__).resolve()
STRATEGIES = ("ddp", "zero3")


@pytest.mark.slow
def test_resume_with_dropout_repeats_the_uninterrupted_run(tmp_path):
    _run(HERE, tmp_path)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for s in STRATEGIES:
            full, resumed = got[s]["full"], got[s]["resumed"]
            assert len(full) == 8 and len(resumed) == 4, (s, full, resumed)
            gap = max(abs(a - b) for a, b in zip(resumed, full[4:]))
            if s == "ddp":
                # Lightning's checkpoint has no random state: other dropout masks.
                assert gap > 1e-3, f"ddp rank {rank}: resumed {resumed} equals uninterrupted {full[4:]}"
            else:
                assert resumed == full[4:], f"{s} rank {rank}: resumed {resumed} vs uninterrupted {full[4:]} (gap {gap})"


# ======================================================================================
# the workload (run as a script; Lightning is imported only here)
# ======================================================================================
def _net(pl):
    import torch
    from torch import nn

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            # Linear(320, 320): 102,720 elements, above param_persistence_threshold, so
            # zero3 partitions it.
            self.net = nn.Sequential(nn.Linear(8, 320), nn.ReLU(), nn.Dropout(0.3), nn.Linear(320, 320), nn.ReLU(),
                                     nn.Dropout(0.3), nn.Linear(320, 1))
            self.losses = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.losses.append(float(loss.detach()))
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Net


def _data():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 1, generator=g))
    return DataLoader(TensorDataset(x, y), batch_size=4)  # 4 batches per rank per epoch


def main(out):
    import lightning.pytorch as pl

    out = Path(out)
    Net = _net(pl)

    def trainer(strategy, epochs, **kw):
        return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, logger=False,
                          enable_progress_bar=False, enable_model_summary=False, **kw)

    result = {}
    for s in STRATEGIES:
        pl.seed_everything(0, verbose=False)
        model = Net()
        t = trainer(s, 2, enable_checkpointing=False)
        t.fit(model, _data(), _data())
        full = model.losses

        pl.seed_everything(0, verbose=False)
        model = Net()
        mc = pl.callbacks.ModelCheckpoint(dirpath=out / f"ckpt-{s}", every_n_epochs=1, save_top_k=-1)
        t = trainer(s, 1, callbacks=[mc])
        t.fit(model, _data(), _data())
        path = mc.best_model_path or mc.last_model_path

        pl.seed_everything(0, verbose=False)  # a new script: same seed, a newly built model
        model = Net()
        t = trainer(s, 2, enable_checkpointing=False)
        t.fit(model, _data(), _data(), ckpt_path=path)
        result[s] = {"full": full, "resumed": model.losses}
    (out / f"rank{t.global_rank}.json").write_text(json.dumps(result))

    import torch.distributed as dist

    if dist.is_initialized():  # plain ddp runs otherwise abort at exit here (gloo threads)
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
