"""The one line a framework prints on rank 0 when it builds an engine: what runs.

The engine's ``describe()`` (stage, world size, flat units, unit modules and gather
groups, model-state GiB on this rank now) and, beside it, the ZeRO paper's per-rank
figure for the same model (``estimate``, with K for the optimizer in use; left out for
an optimizer the formula has no K for).  Lightning's strategies and ZeroAccelerator
both print it, so a user sees that ZeRO is on and what it partitioned.
"""
from __future__ import annotations

from .units import gib


def startup_line(engine) -> str:
    line = engine.describe()
    try:
        from .estimate import estimate

        summary = engine.unit_summary()
        psi = sum(u["numel"] for u in summary["units"])
        opts = engine.inner_optimizers
        opt = opts[0] if len(opts) == 1 else None  # the formula has one K: one optimizer
        if psi and opt is not None:
            name = type(opt).__name__.lower()
            if name == "sgd" and not any(g.get("momentum", 0) for g in opt.param_groups):
                name = "sgd_nomomentum"
            formula = estimate(psi, summary["world_size"], summary["stage"], engine.policies.precision.storage, name).total
            line += f" (the ZeRO paper's formula: {gib(formula)} per rank for {psi:,} parameters, {type(opt).__name__})"
    except (ValueError, KeyError, TypeError):
        pass  # the formula is an aside; what runs is the line itself
    return line


__all__ = ["startup_line"]
