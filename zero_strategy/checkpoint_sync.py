"""Cross-rank agreement for the collective checkpoint operations.

[Note: every rank fails together]
``save_checkpoint`` and ``load_checkpoint`` run in phases (agree on the path, prepare
the directory, write, publish; or validate, apply).  Each rank runs a phase catching
its exception, then all ranks call :func:`agree`: one small max-all-reduce through the
engine's Communicator (bounded by ``collective_timeout``) of a per-rank failure flag,
plus hashes of values that must be equal on every rank (the path) and small integers
one rank proposes (the checkpoint id).  If any rank failed, the failures' messages are
gathered and every rank raises a :class:`CheckpointError` with them, the failing rank
chaining its own exception; if the ranks disagree on a value, every rank raises an
error naming each rank's value.  No rank is left waiting in a barrier for a peer that
gave up.
"""
from __future__ import annotations

import hashlib
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from .checkpoint_files import CheckpointError

_BITS = (1 << 62) - 1


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & _BITS


def _device(comm) -> torch.device:
    if comm.group is not None and dist.get_backend(comm.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def describe(exc: BaseException) -> str:
    text = str(exc).strip() or "(no message)"
    return text if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {text}"


def agree(comm, what: str, error: Optional[BaseException], *, same: Optional[Dict[str, str]] = None,
          proposed: Sequence[int] = ()) -> List[int]:
    """Collective.  Raise on every rank if ``error`` is set on any rank, or if ``same``
    differs between ranks; else return the maximum over ranks of each ``proposed``
    value (non-negative, below 2**62)."""
    same = same or {}
    ws, rank = comm.world_size, comm.rank
    hashes = [_hash(v) for v in same.values()]
    values = [0] * ws + [x for h in hashes for x in (h, -h)] + [int(v) for v in proposed]
    values[rank] = 1 if error is not None else 0
    if ws > 1:
        t = torch.tensor(values, dtype=torch.int64, device=_device(comm))
        comm.control_all_reduce(t, "max", label=f"{what}: agreeing on success")
        values = t.tolist()
    failed = [r for r in range(ws) if values[r]]
    if failed:
        mine = describe(error) if error is not None else None
        messages = comm.all_gather_object(mine, label=f"{what}: failure report")
        if error is not None and len(failed) == 1:
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"{what} failed on rank {rank}: {mine}") from error
        lines = "; ".join(f"rank {r}: {messages[r]}" for r in failed)
        raise CheckpointError(
            f"{what} failed on rank(s) {failed}, so every rank stops: {lines}") from error
    pos = ws
    for label, h in zip(same, hashes):
        hi, neg_lo = values[pos], values[pos + 1]
        pos += 2
        if hi != -neg_lo:
            everyone = comm.all_gather_object(same[label], label=f"{what}: {label}")
            listed = "; ".join(f"rank {r}: {v!r}" for r, v in enumerate(everyone))
            raise CheckpointError(
                f"{what} refused: the ranks were given different {label}s ({listed}). It is collective: every rank "
                f"must pass the same {label} (compute it once, e.g. on rank 0, and broadcast it)"
            )
    return values[pos:]
