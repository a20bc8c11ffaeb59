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


class TrustRatioSGD(torch.optim.Optimizer):
    """A LAMB/LARS-like optimizer the engine does not know: each parameter's step is
    scaled by ``||p|| / ||g||`` (the whole parameter's norms), with momentum.  Any
    per-piece computation of the norms gives a different update."""

    def __init__(self, params, lr=0.05, momentum=0.9, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad + group["weight_decay"] * p
                w, gn = p.norm(), g.norm()
                trust = torch.where((w > 0) & (gn > 0), w / gn, torch.ones_like(w))
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = torch.zeros_like(p)
                buf.mul_(group["momentum"]).add_(g, alpha=trust)
                p.add_(buf, alpha=-group["lr"])


def muon_adamw(model, lr: float = 1e-2):
    """Muon on the 2-D hidden matrices, AdamW on the rest (embeddings, norms, biases):
    the split Moonlight and nanochat train with."""
    hidden, rest = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (hidden if p.ndim == 2 and "wte" not in n and "wpe" not in n else rest).append(p)
    return [torch.optim.Muon(hidden, lr=lr * 2, momentum=0.9, weight_decay=0.01),
            # eps above its 1e-8 default: GPT-2's key bias has an exactly-zero true gradient, whose
            # rounding noise Adam would otherwise normalise into steps that differ between any
            # two summation orders (one process vs N ranks) by more than fp32 tolerances.
            torch.optim.AdamW(rest, lr=lr, weight_decay=0.01, eps=1e-6)]


def muon_orthogonalise_in_fp32() -> None:
    """Make torch's Muon run its Newton-Schulz iteration in fp32 (in this process).

    Stock Muon rounds the gradient to bf16 first, so any two summation orders of the
    same gradient (one process vs N ranks) differ by bf16 rounding after the
    iteration; in fp32 the comparison can be held to fp32 tolerances.  Same iteration
    (quintic, torch's coefficients), only the dtype differs."""
    from torch.optim import _muon

    def newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
        a, b, c = ns_coefficients
        x = grad.float()
        tall = x.size(0) > x.size(1)
        if tall:
            x = x.T
        x = x / x.norm().clamp(min=eps)
        for _ in range(ns_steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x.T if tall else x

    _muon._zeropower_via_newtonschulz = newton_schulz_fp32
