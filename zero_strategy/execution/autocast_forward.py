"""``ZeroConfig(autocast=True)``: mixed precision the way torch.autocast does it.

The engine's own mixed precision keeps 16-bit compute copies of the parameters (as
DeepSpeed and FSDP2 do): half the bytes gathered and held, but every operation, even
``x * a + b``, computes from rounded weights.  Stock Accelerate and Lightning instead
keep every parameter and gradient in fp32 and run the forward under torch.autocast,
which computes matrix products in the 16-bit dtype and leaves elementwise arithmetic
in fp32.  With ``autocast=True`` the engine stores, reduces and updates fp32 (the shard
is its own master copy, so there is no second one) and these two root hooks put the
model's forward inside ``torch.autocast``: the numbers are stock autocast training's,
at fp32's memory (16 bytes a parameter, 16Ψ/N at stage 3 instead of 14Ψ/N) and twice
the all-gather bytes at stage 3.

The context is entered by a pre-hook and left by an ``always_call`` forward hook, so
an exception inside forward still leaves autocast as it found it.  Backward needs no
context (autograd replays the dtypes the forward chose), and activation checkpointing
records the autocast state with each checkpoint and restores it for the recompute.
"""
from __future__ import annotations

from typing import List

import torch


def register_autocast(root: torch.nn.Module, dtype: torch.dtype, device_type) -> List[torch.utils.hooks.RemovableHandle]:
    """Hooks running ``root``'s forward under ``torch.autocast(device_type(), dtype)``.

    ``device_type`` is called at each forward: parameters materialised after the hooks
    are registered may sit on another device than the one the model was built on."""
    entered: list = []  # a stack: the root's forward may run inside another of its calls

    def enter(module, args):
        ctx = torch.autocast(device_type=device_type(), dtype=dtype)
        ctx.__enter__()
        entered.append(ctx)

    def leave(module, args, output):
        if entered:
            entered.pop().__exit__(None, None, None)

    # First of the pre-hooks (the engine's own run inside the context) and, registered
    # after every other forward hook of the engine, the last to leave.
    return [root.register_forward_pre_hook(enter, prepend=True),
            root.register_forward_hook(leave, always_call=True)]
