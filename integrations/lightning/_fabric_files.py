"""``fabric.load`` / ``fabric.load_raw`` of an ordinary single-file checkpoint under ZeRO.

A file ``torch.save``'d by another strategy (``fabric.save`` under ddp writes one), a raw
``model.state_dict()``, or a file consolidated from one of our directories
(``consolidate_checkpoint``) is read whole on every rank; each rank keeps its slices of the
weights.  Optimizer state in such a file (torch's format, whole tensors) goes into the
sharded optimizer through ``engine.load_full_optimizer_state_dict``: each rank keeps its
pieces, as the Trainer strategy does.

No Lightning import here (this module is shared by the ``lightning.fabric`` and
``lightning_fabric`` twins of ``fabric``); the strategy passes its rank-zero warning.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

# Our directories record which state key held the model (consolidated files keep it, with
# the weights under "state_dict").
OBJECTS_KEY = "__zero_strategy_objects__"


def _checkpoint_dict(path, checkpoint) -> dict:
    if not isinstance(checkpoint, dict):
        raise TypeError(f"{path} holds a {type(checkpoint).__name__}, not a checkpoint dict or a state dict")
    return checkpoint


def _model_state(checkpoint: dict) -> dict:
    """A raw state dict, or the weights of a file consolidated from our directory."""
    if OBJECTS_KEY in checkpoint and "state_dict" in checkpoint:
        return checkpoint["state_dict"]
    return checkpoint


def _unpack_consolidated(checkpoint: dict) -> dict:
    """A consolidated file keeps the model under "state_dict"; put it back under the key
    it was saved with (e.g. "model") so the same ``state`` dict restores it."""
    objects = checkpoint.pop(OBJECTS_KEY, None)
    if isinstance(objects, dict) and "state_dict" in checkpoint and objects.get("module") not in checkpoint:
        checkpoint[objects["module"]] = checkpoint.pop("state_dict")
    return checkpoint


def load_single_file(strategy, path, state, strict: bool, weights_only, warn: Callable[[str], Any]) -> dict:
    """``ZeroFabricStrategy.load_checkpoint`` for a file (every rank reads it)."""
    checkpoint = _checkpoint_dict(path, strategy.checkpoint_io.load_checkpoint(path, weights_only=weights_only))
    if not state:
        return checkpoint
    if isinstance(state, nn.Module):  # fabric.load_raw(path, model)
        strategy.load_module_state_dict(state, _model_state(checkpoint), strict=strict)
        return {}
    if isinstance(state, torch.optim.Optimizer):  # fabric.load_raw(path, optimizer)
        _load_optimizer(strategy, state, checkpoint)
        return {}
    checkpoint = _unpack_consolidated(checkpoint)
    missing = [k for k in state if k not in checkpoint]
    if strict and missing:
        raise KeyError(f"The requested state contains keys {missing} that do not exist in {path} "
                       f"(it holds {sorted(checkpoint)}); pass strict=False to skip them")
    for key, obj in list(state.items()):
        if key not in checkpoint:
            continue
        value = checkpoint.pop(key)
        if isinstance(obj, nn.Module):
            strategy.load_module_state_dict(obj, value, strict=strict)
        elif isinstance(obj, torch.optim.Optimizer):
            _load_optimizer(strategy, obj, value)
        elif hasattr(obj, "load_state_dict") and hasattr(obj, "state_dict"):
            obj.load_state_dict(value)
        else:
            state[key] = value
    return checkpoint


def _load_optimizer(strategy, optimizer, optimizer_state: dict) -> None:
    """A torch-format optimizer state dict (what ddp or a single device saves, or a
    consolidated file holds): into the sharded optimizer of a set-up module (each rank
    keeps its pieces), or as usual into an optimizer not set up yet."""
    if not (isinstance(optimizer_state, dict) and "state" in optimizer_state and "param_groups" in optimizer_state):
        held = sorted(optimizer_state) if isinstance(optimizer_state, dict) else type(optimizer_state).__name__
        raise ValueError(
            f"the optimizer's entry is not a torch optimizer state dict ({{'state': ..., 'param_groups': ...}}); it "
            f"holds {held}. fabric.load_raw(path, optimizer) takes a torch.save(optimizer.state_dict()) file; a "
            "fabric.save checkpoint loads with fabric.load(path, {'model': model, 'optimizer': optimizer})"
        )
    engine = strategy._engine_of_optimizer(optimizer)
    if engine is None:
        optimizer.load_state_dict(optimizer_state)
    else:
        engine.load_full_optimizer_state_dict(optimizer_state, optimizer=strategy._index_in(engine, optimizer))
