"""The user's optimizer, re-pointed at this rank's shards.

[Note: why the user's optimizer object is kept]
``initialize`` does not build a new optimizer: it replaces the ``params`` list of every
param group of the user's own optimizer with the flat fp32 shards this rank owns, and
keeps every other key of the group (lr, betas, weight_decay, ...).  So the optimizer
class and its per-group hyperparameters are untouched, and any LR scheduler built on it
(before or after ``initialize``) keeps writing ``lr`` into dicts the update reads.

:class:`ZeroOptimizer` is what frameworks receive as "the optimizer": it shares those
same param-group dicts and routes ``step`` / ``zero_grad`` / ``state_dict`` through the
engine, which handles reduction, loss scaling, clipping and the parameter all-gather.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Dict, List, Optional

import torch


def repoint_optimizer(optimizer: torch.optim.Optimizer, params_per_group: Dict[int, List[torch.Tensor]]) -> None:
    """Replace each param group's ``params`` with the shards for that group, in place."""
    if len(optimizer.state) > 0:
        raise ValueError(
            "the optimizer already holds state (it has taken a step): call zero_strategy.initialize "
            "before the first optimizer.step(), or load the optimizer state afterwards via engine.load_state_dict()"
        )
    for gi, group in enumerate(optimizer.param_groups):
        group["params"] = list(params_per_group.get(gi, []))
    # Some optimizers cache per-param lookups; the state is empty, so a fresh dict is safe.
    optimizer.state = defaultdict(dict)


class ZeroOptimizer(torch.optim.Optimizer):
    """torch.optim.Optimizer-compatible facade over the engine's sharded update.

    It deliberately does not call ``Optimizer.__init__``: it has no parameters of its
    own; ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's.
    """

    def __init__(self, engine, index: int = 0) -> None:  # noqa: D401 - see class docstring
        self._engine = engine
        self._index = index  # which of the engine's optimizers ([Note: several optimizers])
        self._inner = engine.inner_optimizers[index]
        # Attributes torch.optim machinery (LR schedulers, hooks) expects to exist.
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}
        self._zero_grad_profile_name = "ZeroOptimizer.zero_grad"

    # Shared, not copied: a scheduler on either object drives the same lr values.
    @property
    def param_groups(self):
        return self._inner.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self._inner.param_groups = value

    @property
    def state(self):
        return self._inner.state

    @state.setter
    def state(self, value):
        self._inner.state = value

    @property
    def defaults(self):
        return self._inner.defaults

    @defaults.setter
    def defaults(self, value):
        self._inner.defaults = value

    @property
    def inner(self) -> torch.optim.Optimizer:
        return self._inner

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The inner optimizer, under the attribute name wrapper-aware tools look for
        (Lightning's LearningRateMonitor names series after ``.optimizer``'s class)."""
        return self._inner

    @property
    def step_was_skipped(self) -> bool:
        """True when the last ``step`` was skipped because of an fp16 overflow."""
        return self._engine.last_step_skipped

    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # With one optimizer this is the engine's whole step; with several, this
        # optimizer's part of the round ([Note: step rounds] in engine.py).
        self._engine.step(None if len(self._engine.optimizers) == 1 else self._index)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears every gradient of the engine (its units hold them for all optimizers)
        and ends the step round; with several optimizers, after this one stepped in the
        round, nothing is left to clear until the round ends (``ZeroEngine.zero_grad_of``)."""
        self._engine.zero_grad_of(self._index)

    def state_dict(self) -> dict:
        """This rank's optimizer state over its shards (see ``ZeroEngine.state_dict``)."""
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self._inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError(
            "adding a param group after zero_strategy.initialize is not supported: "
            "put every parameter in the optimizer before calling initialize"
        )

    def __repr__(self) -> str:
        return (f"ZeroOptimizer(stage={self._engine.policies.stage.stage}, inner={self._inner.__class__.__name__}"
                + (f", index={self._index})" if len(self._engine.optimizers) > 1 else ")"))
