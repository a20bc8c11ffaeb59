"""ZeRO-R activation memory: checkpointing of repeated blocks, optionally offloaded.

Each chosen block's forward runs under torch's non-reentrant activation checkpoint:
only the block's inputs (the *activation checkpoints*) are kept between forward and
backward, and the block is recomputed when backward reaches it.  With
``offload_activations`` those inputs are stored as host copies and moved back to the
device for the recomputation (P_a+cpu); autograd carries gradients across both moves,
so the results are unchanged.  On a CPU-only machine the host *is* the device and the
offload is a no-op.

P_a proper (partitioning checkpoints across model-parallel ranks) needs tensor
parallelism; under pure data parallelism there is nothing to partition, so it is not
offered.
"""
from __future__ import annotations

import functools
from typing import Callable, List

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .planner import find_unit_module_classes


def _to_host(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.device.type != "cpu":
        return x.to("cpu")
    return x


def checkpointed(fn: Callable, offload: bool = False) -> Callable:
    """Wrap ``fn`` (a block's forward) in activation checkpointing; usable directly
    on hand-written models: ``block.forward = checkpointed(block.forward)``."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        if not offload:
            return checkpoint(fn, *args, use_reentrant=False, **kwargs)
        devices = [a.device if isinstance(a, torch.Tensor) else None for a in args]
        host_args = [_to_host(a) for a in args]

        def on_device(*stored, **kw):
            return fn(*[s.to(d) if d is not None and isinstance(s, torch.Tensor) else s for s, d in zip(stored, devices)], **kw)

        return checkpoint(on_device, *host_args, use_reentrant=False, **kwargs)

    return run


def apply_activation_checkpointing(model: nn.Module, classes, offload: bool) -> List[Callable[[], None]]:
    """Checkpoint every module of the given classes; returns undo callbacks."""
    names = set(find_unit_module_classes(model, classes, field="activation_checkpointing"))
    undo = []
    for module in model.modules():
        if module is model or type(module).__name__ not in names:
            continue
        had_attr = "forward" in module.__dict__
        original = module.forward
        module.forward = checkpointed(original, offload)

        def restore(m=module, o=original, had=had_attr):
            if had:
                m.forward = o
            else:
                del m.forward

        undo.append(restore)
    # A model that caches keys/values would append to its cache twice (forward and
    # recomputation); transformers disables the cache when checkpointing for this reason.
    config = getattr(model, "config", None)
    if undo and config is not None and getattr(config, "use_cache", False):
        config.use_cache = False
    return undo
