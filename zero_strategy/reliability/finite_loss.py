"""ZeroConfig.check_finite_loss: a NaN or inf loss stops every rank before backward.

Agreed by every rank ([Note: every rank fails together] in agreement.py): a lone rank
stopping would leave the others waiting in backward's collectives.
"""
from __future__ import annotations

import torch

from .. import agreement


def check_finite_loss(comm, loss: torch.Tensor, step: int) -> None:
    """Collective: raise FloatingPointError on every rank when any rank's loss is not finite."""
    finite = bool(torch.isfinite(loss.detach()).all())
    mine = None if finite else FloatingPointError(f"loss {float(loss.detach().float().reshape(-1)[0])}")
    ranks = agreement.exchange(comm, "the finite-loss check", mine, error_type=FloatingPointError).failed
    if ranks:
        raise FloatingPointError(
            f"the loss is not finite (NaN or inf) at step {step} on rank(s) {ranks} "
            f"(this rank's loss: {float(loss.detach().float().reshape(-1)[0])}); stopped by "
            "ZeroConfig.check_finite_loss before it reached the weights"
        )
