"""Where the engine's state goes inside Accelerate's and the Trainer's checkpoint folders.

A checkpoint folder (``accelerator.save_state(dir)``, or a Trainer ``checkpoint-N``)
gets a ``zero_checkpoint/`` sub-folder holding every rank's shard of the model states
(weights, fp32 masters, optimizer state, loss scale); with several models, each on its
own engine, the i-th engine built (from 0) writes ``zero_checkpoint_<i>/`` (the first
keeps ``zero_checkpoint/``).  Everything else in the folder
(RNG states, scheduler, sampler, trainer state, consolidated weights) is written by
Accelerate / the Trainer as usual.

The sharded format is the core's (``engine.save_checkpoint`` / ``load_checkpoint``,
docs/checkpoints.md).
"""
from __future__ import annotations

import os
from typing import Dict

import torch

from zero_strategy.materialize import weight_files

CHECKPOINT_SUBDIR = "zero_checkpoint"


def subdir_for(index: int) -> str:
    """The sub-folder of the ``index``-th engine an Accelerator built (0 is the first)."""
    return CHECKPOINT_SUBDIR if index == 0 else f"{CHECKPOINT_SUBDIR}_{index}"


def save_engine(engine, folder: str, subdir: str = CHECKPOINT_SUBDIR) -> None:
    """Collective: every rank writes its shard into ``folder/<subdir>``."""
    engine.save_checkpoint(os.path.join(folder, subdir))


def load_engine(engine, folder: str, subdir: str = CHECKPOINT_SUBDIR):
    """Collective: every rank restores its shard from ``folder/<subdir>``."""
    from zero_strategy.checkpoint import existing_checkpoint as existing

    directory = os.path.join(folder, subdir)
    # existing() also finds ``zero_checkpoint.old``, where the previous checkpoint is
    # when a save was interrupted between its two renames; load_checkpoint reads it.
    if existing(directory) is None:
        raise FileNotFoundError(
            f"{folder!r} has no {subdir}/ for the {type(engine.module).__name__} on ZeRO: it was not saved by a run "
            "with a zero_config section that prepared the same models in the same order"
        )
    return engine.load_checkpoint(directory)


def read_consolidated_weights(folder: str) -> Dict[str, torch.Tensor]:
    """The full model weights saved in ``folder`` by ``save_model`` / ``save_pretrained``
    (safetensors, possibly sharded with an index, or a torch ``.bin``)."""
    from safetensors.torch import load_file

    single = os.path.join(folder, "model.safetensors")
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.lexists(single) or os.path.lexists(index):
        # weight_files refuses FIFOs, devices and index entries that lead outside the folder
        out: Dict[str, torch.Tensor] = {}
        for f in sorted(set(weight_files(single if os.path.lexists(single) else folder).values())):
            out.update(load_file(str(f), device="cpu"))
        return out
    binary = os.path.join(folder, "pytorch_model.bin")
    if os.path.isfile(binary):
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no model weights (model.safetensors, its index, or pytorch_model.bin) in {folder!r}")
