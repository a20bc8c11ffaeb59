"""The names inside a checkpoint directory, and the notes on its layout and integrity.

Sharded checkpoints are atomic directories that reload at any world size and stage
(save.py writes them, reader.py reads them, load.py restores an engine, consolidate.py
makes whole tensors of them).

[Note: checkpoint layout]
A checkpoint is a directory::

    .zero_strategy           written first: marks the directory as ours (files.py)
    manifest.json            written by rank 0, last: describes every tensor and file
    rank00000.safetensors    one per rank: that rank's slices (values, fp32 master,
    rank00001.safetensors    per-element optimizer state) plus per-parameter scalar
                             optimizer state and which parameters have state at all
    rank00000.json           per rank: RNG states and non-tensor optimizer state
    shared.safetensors       rank 0: buffers and parameters that are not partitioned
    client_state.pt          rank 0: the caller's extra state (trainer loops, ...)
    config.json              rank 0, when the model has a transformers-style config

The manifest records, for every parameter, its qualified names (tied weights share
one entry), global shape, original dtype, frozen flag, and where it lives: the unit
index and offset inside that unit's flat space.  A unit's flat space is split into
``world`` equal shards, so "which flat range each rank holds" is ``[r*S, (r+1)*S)``
with ``S = shard_numel``.  Loading at another world size or stage therefore only needs
slice arithmetic: each rank reads, from the old shard files, exactly the ranges that
overlap its new shard (safetensors reads slices without loading whole files).

[Note: integrity]
The manifest (format version 2 on) lists every file with its size and CRC-32, computed
while the file streams out, and a random ``checkpoint_id`` of the save; from version 4
it records the CRC-32 of its own content too ([Note: manifest checksum] in
manifest.py).  Only regular files are read, each compared with its recorded size
first ([Note: only regular files are read] in files.py).  Each rank
file's safetensors header (and its JSON sidecar) records its rank, the world size,
the checkpoint id and the layout digest ([Note: layout digest] in
manifest.py).  Loading validates the manifest's structure and arithmetic
before opening anything else, then verifies every file (each by one rank, round robin)
before the engine is touched: renamed, swapped, mixed-in, truncated or flipped files
and edited layouts are CheckpointErrors naming the file, on every rank.

Atomicity: every rank writes into ``<dir>.tmp`` (after rank 0 took ``<dir>.lock``);
after every rank's files are complete rank 0 writes the manifest, then swaps the
directory into place.  A process killed during a save leaves only the ``.tmp``
directory behind; the previous checkpoint is untouched.  Each phase ends with an
agreement of all ranks ([Note: every rank fails together] in agreement.py).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from .files import MANIFEST, CheckpointError

__all__ = ["MANIFEST", "CLIENT_STATE", "SHARED", "CONFIG", "TENSOR_KEY", "agree", "rank_file", "as_path"]

CLIENT_STATE = "client_state.pt"
SHARED = "shared.safetensors"
CONFIG = "config.json"
# The tensor keys inside a rank's safetensors file.
TENSOR_KEY = re.compile(r"^unit(\d+)\.(value|optim\.(.+)|optim_scalar\.(.+)|optim_present|whole_present|whole(\d+)\.(.+))$")


def agree(comm, what: str, error, **kwargs):
    # A checkpoint operation's phase ends with every rank agreeing on its success.
    return comm.agree(what, error, error_type=CheckpointError, **kwargs)


def rank_file(d: Path, r: int, ext: str) -> Path:
    return d / f"rank{r:05d}.{ext}"


def as_path(directory) -> Path:
    """An absolute path (not resolved through links), compared across ranks."""
    return Path(os.path.abspath(os.fspath(directory)))
