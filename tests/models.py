"""Small models for tests, built from configs (nothing is downloaded)."""
from __future__ import annotations

import torch


def tiny_gpt2(seed: int = 0, n_layer: int = 2, n_embd: int = 32, vocab: int = 96, n_positions: int = 32):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=vocab, n_positions=n_positions,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    model = GPT2LMHeadModel(cfg)
    return model


def two_group_optimizer(model, lr: float = 1e-2, cls=torch.optim.AdamW, **defaults):
    """Decay / no-decay groups as fine-tuning scripts build them."""
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if (p.ndim < 2 or "ln" in n) else decay).append(p)
    return cls([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": lr * 0.5}], lr=lr, **defaults)


def lm_batches(steps: int, global_batch: int, seq: int = 16, vocab: int = 96, seed: int = 1234):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (global_batch, seq), generator=g) for _ in range(steps)]


class ResidualBlock(torch.nn.Module):
    """x + tanh(Linear(x)): the repeated block of the Lightning workloads (a unit module
    under stage 3)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.lin(x)) + x


class TanhBlock(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Trunk(torch.nn.Module):
    """Equal blocks (at stage 3, equal-sized all-gathers) and a head; returns the loss."""

    def __init__(self, width=16, depth=3):
        super().__init__()
        self.trunk = torch.nn.Sequential(*[TanhBlock(width) for _ in range(depth)])
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.trunk(x)).pow(2).mean()
