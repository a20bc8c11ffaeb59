"""``model.state_dict()`` on a stage-3 model: whole, exact values on every rank.

[Note: model.state_dict() at stage 3]
At stage 3 each rank holds 1/N of every partitioned parameter, so the ordinary
``model.state_dict()`` has nothing whole to return.  Code nobody here wrote calls it
anyway (``save_pretrained`` without ``state_dict=``, PEFT's adapter extraction, a
training script's final save), on every rank.  So, as FSDP's full state dict does,
calling it on the engine's root module (or on a module containing it) is a
*collective* that consolidates: a pre-hook gathers every unit once
(``engine.full_state_dict(rank0_only=False)``: values from the fp32 master where there
is one, in each parameter's original dtype, on CPU), the guard lets
``Module._save_to_state_dict`` take a placeholder for each partitioned parameter, and a
post-hook puts the consolidated values in their place.  Every rank gets the whole
dict (the whole model in host memory on every rank: for a large model use
``engine.full_state_dict()``, which gives it to rank 0 only).  ``keep_vars=True`` (the
parameter objects themselves) is not changed, and neither is a submodule's own
``state_dict()``, which still fails clearly on a partitioned parameter.
"""
from __future__ import annotations

import weakref
from typing import List

import torch

from ..reliability.guard import collecting_state_dict


def register_state_dict_hooks(engine) -> List[torch.utils.hooks.RemovableHandle]:
    if engine.gatherer is None:  # stages 0-2: parameters are whole, nothing to do
        return []
    engine_ref = weakref.ref(engine)
    pending = {}

    def pre(module, prefix, keep_vars):
        e = engine_ref()
        pending.pop("values", None)
        if e is None or keep_vars or e.phase.name == "CLOSED":
            return
        pending["values"] = e.full_state_dict(rank0_only=False)
        pending["collecting"] = collecting_state_dict()
        pending["collecting"].__enter__()

    def post(module, state_dict, prefix, local_metadata):
        values = pending.pop("values", None)
        collecting = pending.pop("collecting", None)
        if collecting is not None:
            collecting.__exit__(None, None, None)
        if values is None:
            return
        for name, value in values.items():
            if prefix + name in state_dict:
                state_dict[prefix + name] = value

    root = engine.module
    return [root.register_state_dict_pre_hook(pre), root.register_state_dict_post_hook(post)]
