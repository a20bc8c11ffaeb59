"""Fine-tune a tiny GPT-2 with the Lightning Trainer and ZeRO, on 2 CPU processes by default.

    .venv/bin/python examples/lightning/finetune_gpt2.py                     # strategy "zero3"
    .venv/bin/python examples/lightning/finetune_gpt2.py zero2 --precision bf16-mixed --accumulate 2
    .venv/bin/python examples/lightning/finetune_gpt2.py zero3 --ckpt-dir /tmp/gpt2-ckpt   # then resume:
    .venv/bin/python examples/lightning/finetune_gpt2.py zero3 --ckpt-dir /tmp/gpt2-ckpt --max-steps 60 --resume last
    .venv/bin/python examples/lightning/finetune_gpt2.py ddp                 # the same run with DDP, to compare
    .venv/bin/python examples/lightning/finetune_gpt2.py zero3 --accelerator gpu --devices 4 --precision bf16-mixed
    NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 .venv/bin/python examples/lightning/finetune_gpt2.py --num-nodes 2   # on node0,
    NODE_RANK=1 MASTER_ADDR=node0 MASTER_PORT=29500 .venv/bin/python examples/lightning/finetune_gpt2.py --num-nodes 2   # on node1

Nothing here imports zero_strategy: ``strategy="zero3"`` is registered at interpreter
start by the package's start-up hook (see docs/lightning.md).  Lightning's launcher
starts the other processes itself (``python`` is enough; torchrun/srun work too).

The model is built from a ``GPT2Config`` (nothing is downloaded) inside
``configure_model``.  Its default size (4 layers of width 192, 1.9M parameters) puts the
large matrices (110,592 to 147,456 elements) above ZeRO's default ``param_persistence_threshold``
(100,000 elements), so under "zero3" they are really partitioned: each rank prints the
parameter memory it holds, 4.09 MiB of the model's 7.19 MiB on 2 processes (smaller tensors --
biases, LayerNorms, the attention output projections of 36,864 elements, the 98,304-element
token embedding -- stay whole on every rank, as under DeepSpeed).  The default run (40 steps)
takes well under a minute on 2 CPU cores (20-30 s for the whole script on a shared 2-core
machine).  Every sequence is an arithmetic progression modulo the vocabulary,
so the loss falls quickly from ln(vocab) ~ 6.2.
"""
from __future__ import annotations

import argparse
import sys

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQ_LEN = 512, 32


def _print_line(text: str) -> None:
    """The whole line in one write to the pipe the ranks share: print() writes the text and
    its newline separately, and the other rank's line could land between them."""
    sys.stdout.flush()  # what is buffered goes first, so the line below is one short write
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def make_dataset(num_sequences: int, seed: int = 0) -> TensorDataset:
    """t_i = (a + i * d) % VOCAB with d in 1..4: after two tokens the rest is determined."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (num_sequences, 1), generator=g)
    stride = torch.randint(1, 5, (num_sequences, 1), generator=g)
    return TensorDataset((start + torch.arange(SEQ_LEN).unsqueeze(0) * stride) % VOCAB)


class TinyGPT2(L.LightningModule):
    def __init__(self, lr: float = 5e-3, warmup: int = 5, n_layer: int = 4, n_embd: int = 192):
        super().__init__()
        self.save_hyperparameters()
        self.model = None

    def configure_model(self):
        # Runs on every fit/validate/test: build once.  Under "zero3" the parameters
        # created here take no memory: the strategy materialises them partitioned.
        if self.model is not None:
            return
        from transformers import GPT2Config, GPT2LMHeadModel

        hp = self.hparams
        config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ_LEN, n_layer=hp.n_layer, n_embd=hp.n_embd, n_head=4,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        self.model = GPT2LMHeadModel(config)

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits

    def _loss(self, batch):
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=self.hparams.lr)
        warmup = max(1, self.hparams.warmup)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("strategy", nargs="?", default="zero3", help="zero1, zero2, zero3, zero, ddp, ... (default zero3)")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "16-mixed"])
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2, help="processes per node")
    parser.add_argument("--num-nodes", type=int, default=1,
                        help="Trainer(num_nodes=...): start the script once per node with NODE_RANK, MASTER_ADDR and "
                             "MASTER_PORT set (docs/multinode.md)")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch per process")
    parser.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient_clip_val (global norm); 0 = off")
    parser.add_argument("--ckpt-dir", default=None, help="save ZeRO checkpoints (directories) here")
    parser.add_argument("--resume", default=None, help="ckpt_path for trainer.fit, e.g. 'last' or a checkpoint directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    L.seed_everything(args.seed, verbose=False)
    train = DataLoader(make_dataset(1024, seed=1), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(make_dataset(64, seed=2), batch_size=args.batch_size)
    callbacks = []
    if args.ckpt_dir:
        callbacks.append(L.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=20, save_last=True))
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes, strategy=args.strategy,
        precision=args.precision,
        max_steps=args.max_steps, accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip or None,
        val_check_interval=20, limit_val_batches=4, logger=False, enable_checkpointing=bool(args.ckpt_dir),
        callbacks=callbacks, log_every_n_steps=5,
    )
    model = TinyGPT2()
    trainer.fit(model, train, val, ckpt_path=args.resume)
    metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
    engine = getattr(trainer.strategy, "engine", None)
    if engine is not None:  # what this rank holds, by category (MiB), against the whole model
        report = {k: round(v / 2**20, 2) for k, v in engine.memory_report().items()}
        full = {id(t): t for t in engine.full_state_dict(rank0_only=False).values()}  # tied weights once
        whole = sum(t.numel() * t.element_size() for t in full.values()) / 2**20
        _print_line(f"[rank {trainer.global_rank}] memory (MiB): {report}; the whole model's parameters: {whole:.2f} MiB")
    if trainer.is_global_zero:
        _print_line(f"{args.strategy} {args.precision}: {metrics}")
        if args.ckpt_dir:
            print("consolidate a checkpoint with: .venv/bin/python -m zero_strategy.integrations.lightning.consolidate "
                  f"{args.ckpt_dir}/last.ckpt model.ckpt")


if __name__ == "__main__":
    main()
