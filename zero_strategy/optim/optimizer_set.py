"""Several optimizers over one model, seen by the planner as one list of param groups.

[Note: several optimizers]
``initialize(model, [muon, adamw], config)`` lets each optimizer keep its own param
groups, hyperparameters, LR schedulers and state, as it would without ZeRO.  The
planner numbers every param group of every optimizer in order (optimizer 0's groups,
then optimizer 1's, ...), so a flat unit never mixes parameters of two optimizers
(units are split by param group); each unit then records which optimizer updates it
(``unit.optimizer_index``) and its group there (``unit.local_group_index``).

A step is one round over the optimizers ([Note: step rounds] in engine.py):
``engine.step()`` steps all of them; ``engine.optimizers[k].step()`` steps optimizer
``k`` alone (what Lightning's manual optimization and Accelerate call), and the round
ends when every optimizer has stepped or at ``zero_grad()``.  The gradient reduction,
the fp16 overflow check and ``gradient_clipping`` belong to the round, so clipping is
by the global norm over every optimizer's parameters (DeepSpeed's and DDP's
``clip_grad_norm_(model.parameters())`` meaning), and an overflow skips the round.
``optimizers[k].zero_grad()`` after ``k`` stepped leaves the others' gradients for their
steps (``a.step(); a.zero_grad(); b.step()`` works as under DDP); a backward while a
round is half done is an error naming the optimizers that have not stepped (stepping
optimizers at different rates over accumulated gradients is not supported).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch


def as_optimizer_list(optimizer) -> List[torch.optim.Optimizer]:
    """``None`` -> [], one optimizer -> [it], a list or tuple of optimizers -> a list."""
    if optimizer is None:
        return []
    items = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    for k, opt in enumerate(items):
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"zero_strategy.initialize: optimizer {k} is a {type(opt).__name__}, not a torch.optim.Optimizer; pass "
                "an optimizer, a list of optimizers (e.g. [muon, adamw]), or None"
            )
        if getattr(opt, "_engine", None) is not None:
            raise TypeError(
                f"zero_strategy.initialize: optimizer {k} is a ZeroOptimizer of another engine; pass the user's optimizer"
            )
    if len({id(o) for o in items}) != len(items):
        raise ValueError("zero_strategy.initialize: the same optimizer was passed twice")
    return items


class OptimizerSet:
    """Read-only view of several optimizers' param groups as one list (planning and the
    setup check use it as they would use one optimizer)."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        self.group_offsets = []
        at = 0
        for opt in self.optimizers:
            self.group_offsets.append(at)
            at += len(opt.param_groups)
        self.group_count = at

    @property
    def param_groups(self) -> list:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def locate(self, group_index: int) -> Tuple[int, int]:
        """(optimizer index, param group index within it) of a global group index."""
        for k in range(len(self.optimizers) - 1, -1, -1):
            if group_index >= self.group_offsets[k]:
                return k, group_index - self.group_offsets[k]
        raise IndexError(group_index)

    def group_name(self, group_index: int) -> str:
        k, local = self.locate(group_index)
        if len(self.optimizers) == 1:
            return f"param group {local}"
        return f"param group {local} of optimizer {k} ({type(self.optimizers[k]).__name__})"

    @property
    def class_name(self) -> str:
        return " + ".join(type(o).__qualname__ for o in self.optimizers)
