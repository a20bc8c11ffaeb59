"""Run, then agree: the one way ranks stop together.

[Note: every rank fails together]
A step of collective work that may fail on some ranks only (writing a checkpoint file,
reading a weights file, a disk-offload write, a NaN loss, a setup that differs) must not
leave the healthy ranks waiting in the next collective for a peer that gave up.  So each
rank runs its part catching its exception, and then every rank calls :func:`exchange`:
one small max-all-reduce through the Communicator (bounded by ``collective_timeout``,
identified by its in-band header like every other collective) of

* a per-rank failure flag,
* a hash pair (h, -h) for each value that must be equal on every rank (the maximum of -h
  is minus the minimum, so one reduction tells whether all agree), and
* small non-negative integers that ranks propose (the maximum wins: a checkpoint id).

Only when something failed or differs does a second collective gather the messages or
the differing values (bounded too).  :func:`agree` then raises the same error on every
rank, naming each failing rank and its message; :func:`run_and_agree` wraps a callable.
Nothing here blocks without a bound, and no rank raises alone.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Type, TypeVar

import torch

T = TypeVar("T")
_BITS = (1 << 62) - 1


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & _BITS


def describe(exc: BaseException, error_type: Type[BaseException] = RuntimeError) -> str:
    """A one-line account of ``exc`` for the other ranks (its type named unless it is
    already of the kind every rank raises)."""
    text = str(exc).strip() or "(no message)"
    return text if isinstance(exc, error_type) else f"{type(exc).__name__}: {text}"


@dataclass
class Outcome:
    """What :func:`exchange` learned, identical on every rank."""

    failed: List[int] = field(default_factory=list)  # ranks whose part raised
    messages: Dict[int, str] = field(default_factory=dict)  # their messages (only when some failed)
    differing: List[str] = field(default_factory=list)  # labels of ``same`` values that differ
    proposed: List[int] = field(default_factory=list)  # the maximum over ranks of each proposal


def exchange(comm, what: str, error: Optional[BaseException], *, same: Optional[Dict[str, str]] = None,
             proposed: Sequence[int] = (), error_type: Type[BaseException] = RuntimeError) -> Outcome:
    """Collective: every rank's failure flag, whether the ``same`` values agree, and the
    maxima of the ``proposed`` values (non-negative, below 2**62)."""
    same = same or {}
    ws, rank = comm.world_size, comm.rank
    hashes = [_hash(v) for v in same.values()]
    values = [0] * ws + [x for h in hashes for x in (h, -h)] + [int(v) for v in proposed]
    values[rank] = 1 if error is not None else 0
    if ws > 1:
        t = torch.tensor(values, dtype=torch.int64, device=comm._control_device())
        comm.control_all_reduce(t, "max", label=f"{what}: agreeing on success")
        values = t.tolist()
    out = Outcome(failed=[r for r in range(ws) if values[r]], proposed=values[ws + 2 * len(hashes):])
    if out.failed:
        mine = describe(error, error_type) if error is not None else None
        everyone = comm.all_gather_object(mine, label=f"{what}: failure report") if ws > 1 else [mine]
        out.messages = {r: everyone[r] for r in out.failed}
    for i, label in enumerate(same):
        hi, neg_lo = values[ws + 2 * i], values[ws + 2 * i + 1]
        if hi != -neg_lo:
            out.differing.append(label)
    return out


def failure_message(what: str, outcome: Outcome) -> str:
    lines = "; ".join(f"rank {r}: {outcome.messages[r]}" for r in outcome.failed)
    return f"{what} failed on rank(s) {outcome.failed}, so every rank stops: {lines}"


def agree(comm, what: str, error: Optional[BaseException], *, same: Optional[Dict[str, str]] = None,
          proposed: Sequence[int] = (), error_type: Type[BaseException] = RuntimeError,
          own: str = "typed") -> List[int]:
    """Collective.  Raise on every rank if ``error`` is set on any rank, or if a ``same``
    value differs between ranks (naming each rank's value); else return the maxima of
    ``proposed``.  The ranks that did not fail raise ``error_type`` naming every failing
    rank and its message; a rank that failed raises, by ``own``: ``"typed"`` its own
    error when it failed alone and that error is an ``error_type`` (else ``error_type``
    chained to it), ``"always"`` its own error, ``"never"`` the common message."""
    if own not in ("typed", "always", "never"):
        raise ValueError(f"own must be 'typed', 'always' or 'never', not {own!r}")
    outcome = exchange(comm, what, error, same=same, proposed=proposed, error_type=error_type)
    if outcome.failed:
        if error is not None and own == "always":
            raise error
        if error is not None and own == "typed" and outcome.failed == [comm.rank]:
            if isinstance(error, error_type):
                raise error
            raise error_type(f"{what} failed on rank {comm.rank}: {outcome.messages[comm.rank]}") from error
        raise error_type(failure_message(what, outcome)) from error
    if outcome.differing:
        label = outcome.differing[0]
        everyone = comm.all_gather_object(same[label], label=f"{what}: {label}")
        listed = "; ".join(f"rank {r}: {v!r}" for r, v in enumerate(everyone))
        raise error_type(
            f"{what} refused: the ranks were given different {label}s ({listed}). It is collective: every rank "
            f"must pass the same {label} (compute it once, e.g. on rank 0, and broadcast it)"
        )
    return outcome.proposed


def run_and_agree(comm, what: str, work: Callable[[], T], *, error_type: Type[BaseException] = RuntimeError,
                  own: str = "typed") -> T:
    """``work()`` on every rank, then :func:`agree` on its success: if it raised on any
    rank, every rank raises (none is left waiting for a peer that gave up)."""
    error, result = None, None
    try:
        result = work()
    except Exception as exc:  # noqa: BLE001 - agreed on by every rank below
        error = exc
    agree(comm, what, error, error_type=error_type, own=own)
    return result


def communicator(process_group=None, timeout: Optional[float] = None):
    """A Communicator over ``process_group`` (default: the initialised default group, or a
    single process) whose waits are bounded by ``timeout`` seconds (default: the
    ``collective_timeout`` default), for agreements made before any engine exists."""
    from .communication.comm import Communicator
    from .config import ZeroConfig

    comm = Communicator(process_group)
    comm.configure(ZeroConfig().collective_timeout if timeout is None else timeout, False)
    return comm


__all__ = ["Outcome", "agree", "communicator", "describe", "exchange", "run_and_agree"]
