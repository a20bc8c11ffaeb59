"""The tiny GPT-2 of finetune_gpt2.py under LightningCLI: ZeRO options as init_args.

    python examples/lightning/cli.py fit --trainer.strategy zero3
    python examples/lightning/cli.py fit --trainer.strategy zero_strategy.integrations.lightning.ZeroStrategy \
        --trainer.strategy.init_args.stage 3 --trainer.strategy.init_args.param_persistence_threshold 0
    python examples/lightning/cli.py fit --config examples/lightning/zero3.yaml

Needs ``jsonargparse[signatures]`` (LightningCLI's parser).  Defaults: 2 CPU processes,
20 steps, no logger; any Trainer flag can be given as ``--trainer.<flag>``.
"""
from __future__ import annotations

import lightning.pytorch as L
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader

from finetune_gpt2 import TinyGPT2, make_dataset


class ProgressionData(L.LightningDataModule):
    def __init__(self, batch_size: int = 8):
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(make_dataset(1024, seed=1), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(make_dataset(64, seed=2), batch_size=self.batch_size)


class ReportMemory(L.Callback):
    def on_fit_end(self, trainer, module):
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            cfg = engine.config
            mib = engine.memory_report()["parameters"] / 2**20
            print(f"[rank {trainer.global_rank}] stage {cfg.stage}, param_persistence_threshold "
                  f"{cfg.param_persistence_threshold}: parameters held {mib:.2f} MiB")


if __name__ == "__main__":
    LightningCLI(
        TinyGPT2, ProgressionData, seed_everything_default=0, save_config_callback=None,
        trainer_defaults={"accelerator": "cpu", "devices": 2, "max_steps": 20, "logger": False,
                          "enable_checkpointing": False, "limit_val_batches": 2, "val_check_interval": 10,
                          "callbacks": [ReportMemory()]},
    )
