"""Where the engine's state goes inside Accelerate's and the Trainer's checkpoint folders.

A checkpoint folder (``accelerator.save_state(dir)``, or a Trainer ``checkpoint-N``)
gets a ``zero_checkpoint/`` sub-folder holding every rank's shard of the model states
(weights, fp32 masters, optimizer state, loss scale).  Everything else in the folder
(RNG states, scheduler, sampler, trainer state, consolidated weights) is written by
Accelerate / the Trainer as usual.

The sharded format belongs to the core: ``engine.save_checkpoint`` /
``engine.load_checkpoint`` when the core has them, else one
``zero_rank<r>.pt`` file per rank with ``engine.state_dict()``.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

import torch

CHECKPOINT_SUBDIR = "zero_checkpoint"


def _rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"zero_rank{rank}.pt")


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def save_engine(engine, directory: str, rank: int, client_state: Optional[dict] = None) -> None:
    """Collective: every rank writes its shard into ``directory``."""
    if hasattr(engine, "save_checkpoint"):
        engine.save_checkpoint(directory, client_state=client_state)
        return
    os.makedirs(directory, exist_ok=True)
    path = _rank_file(directory, rank)
    torch.save({"engine": engine.state_dict(), "client_state": client_state}, path + ".tmp")
    os.replace(path + ".tmp", path)
    _barrier()


def load_engine(engine, directory: str, rank: int) -> Any:
    """Every rank restores its shard from ``directory``; returns the saved client state."""
    path = _rank_file(directory, rank)
    if os.path.isfile(path):
        data = torch.load(path, map_location="cpu", weights_only=True)
        engine.load_state_dict(data["engine"])
        return data.get("client_state")
    if hasattr(engine, "load_checkpoint") and os.path.isdir(directory):
        return engine.load_checkpoint(directory)
    raise FileNotFoundError(
        f"no ZeRO checkpoint for rank {rank} in {directory!r}: it was not saved with zero_config "
        f"at this world size (or the folder is incomplete)"
    )


def has_engine_checkpoint(folder: str) -> bool:
    return os.path.isdir(os.path.join(folder, CHECKPOINT_SUBDIR))


def read_consolidated_weights(folder: str) -> Dict[str, torch.Tensor]:
    """The full model weights saved in ``folder`` by ``save_model`` / ``save_pretrained``
    (safetensors, possibly sharded with an index, or a torch ``.bin``)."""
    from safetensors.torch import load_file

    single = os.path.join(folder, "model.safetensors")
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(single):
        return load_file(single, device="cpu")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        out: Dict[str, torch.Tensor] = {}
        for name in files:
            out.update(load_file(os.path.join(folder, name), device="cpu"))
        return out
    binary = os.path.join(folder, "pytorch_model.bin")
    if os.path.isfile(binary):
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no model weights (model.safetensors, its index, or pytorch_model.bin) in {folder!r}")
