"""Collectives as plain functions over tensors and a process group, with accounting.

Every collective the engine issues goes through a :class:`Communicator`, which counts
elements and bytes per collective kind so ``comm_report()`` can be compared with the
paper's 2Ψ / 3Ψ.  Accounting convention (the paper's, first-order ring volume):

* ``reduce_scatter`` and ``all_gather`` count the size of the *full* (unsharded) tensor:
  in a ring each rank sends and receives about that many elements.
* ``all_reduce`` counts twice its size (it is a reduce-scatter followed by an all-gather).

``paper_volume`` in the report adds these up; small control collectives (overflow
flags, norms) are counted under their own kind and excluded from ``paper_volume``.
"""
from __future__ import annotations

import atexit
import gc
import weakref
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
import torch.distributed as dist

# torch >= 2.10 renamed the tensor collectives; keep working on older releases.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

BULK_KINDS = ("reduce_scatter", "all_gather", "all_reduce")


@dataclass
class _Tally:
    calls: int = 0
    elements: int = 0
    bytes: int = 0


@dataclass
class CommReport:
    """Elements and bytes moved per collective kind since the last reset."""

    kinds: Dict[str, _Tally] = field(default_factory=dict)

    @property
    def paper_volume(self) -> int:
        """Elements moved per rank as the paper counts them (all-reduce = 2x)."""
        total = 0
        for kind, t in self.kinds.items():
            if kind == "all_reduce":
                total += 2 * t.elements
            elif kind in BULK_KINDS:
                total += t.elements
        return total

    def as_dict(self) -> Dict[str, Dict[str, int]]:
        out = {k: {"calls": t.calls, "elements": t.elements, "bytes": t.bytes} for k, t in self.kinds.items()}
        out["paper_volume"] = {"elements": self.paper_volume}
        return out

    def __getitem__(self, kind: str) -> _Tally:
        return self.kinds.get(kind, _Tally())


class _DoneWork:
    """Stands in for a Work handle when there is nothing to wait for (world size 1)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_LIVE_COMMUNICATORS: "weakref.WeakSet[Communicator]" = weakref.WeakSet()


@atexit.register
def _shut_down_cleanly() -> None:
    """At interpreter exit, before finalisation: tear down gloo process groups while
    the main thread still holds the last work handles, so no gloo thread frees a
    Python object after the interpreter has started shutting down (that aborts the
    process with "terminate called without an active exception").  NCCL groups are
    left to their owner: destroying them with peers gone can block."""
    comms = list(_LIVE_COMMUNICATORS)
    if not comms:
        return
    try:
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
            for c in comms:
                c.group = None
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - never fail at exit
        pass
    for c in comms:
        c._recent_works.clear()
    gc.collect()


class Communicator:
    """Owns the process group handle and the traffic tally. Never decides *when* to talk."""

    def __init__(self, process_group: Optional[dist.ProcessGroup]) -> None:
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        self.group = process_group
        if process_group is None:
            self.rank, self.world_size = 0, 1
        else:
            self.rank = dist.get_rank(process_group)
            self.world_size = dist.get_world_size(process_group)
        self._tally: Dict[str, _Tally] = defaultdict(_Tally)
        # [Note: keeping recent work handles]
        # A Work launched from inside backward captures thread-local autograd state
        # (a Python object).  If a gloo worker thread drops the last reference to it
        # while the interpreter is shutting down, the process aborts.  So the main
        # thread keeps the last few handles and releases each one only after several
        # newer collectives were issued, long after its worker let go of it.  Only a
        # few are kept because a handle also keeps its buffers alive.
        self._recent_works: deque = deque(maxlen=4)
        _LIVE_COMMUNICATORS.add(self)

    # -- accounting --------------------------------------------------------------------
    def _count(self, kind: str, numel: int, element_size: int) -> None:
        t = self._tally[kind]
        t.calls += 1
        t.elements += numel
        t.bytes += numel * element_size

    def report(self) -> CommReport:
        return CommReport({k: _Tally(t.calls, t.elements, t.bytes) for k, t in self._tally.items()})

    def reset(self) -> None:
        self._tally.clear()

    def _keep(self, work):
        if not isinstance(work, _DoneWork):
            self._recent_works.append(work)
        return work

    # -- collectives ----------------------------------------------------------------------
    def reduce_scatter(self, shard_out: torch.Tensor, full_in: torch.Tensor, async_op: bool = True):
        """Sum ``full_in`` over ranks; this rank receives its equal slice in ``shard_out``."""
        self._count("reduce_scatter", full_in.numel(), full_in.element_size())
        if self.world_size == 1:
            shard_out.copy_(full_in)
            return _DoneWork()
        return self._keep(_reduce_scatter(shard_out, full_in, group=self.group, async_op=async_op) or _DoneWork())

    def all_gather(self, full_out: torch.Tensor, shard_in: torch.Tensor, async_op: bool = True):
        """Concatenate every rank's ``shard_in`` into ``full_out`` (in rank order)."""
        self._count("all_gather", full_out.numel(), full_out.element_size())
        if self.world_size == 1:
            if full_out.data_ptr() != shard_in.data_ptr():
                full_out.copy_(shard_in)
            return _DoneWork()
        return self._keep(_all_gather(full_out, shard_in, group=self.group, async_op=async_op) or _DoneWork())

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = True):
        """Sum ``tensor`` in place over ranks (gradient all-reduce of stage 0)."""
        self._count("all_reduce", tensor.numel(), tensor.element_size())
        if self.world_size == 1:
            return _DoneWork()
        return self._keep(dist.all_reduce(tensor, group=self.group, async_op=async_op) or _DoneWork())

    def control_all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Small synchronous reductions (overflow flags, norms): counted as ``control``."""
        self._count("control", tensor.numel(), tensor.element_size())
        if self.world_size > 1:
            reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
            dist.all_reduce(tensor, op=reduce_op, group=self.group)
        return tensor

    def all_gather_for_state(self, full_out: torch.Tensor, shard_in: torch.Tensor) -> None:
        """Synchronous gather used by state-dict consolidation (counted as ``state_gather``)."""
        self._count("state_gather", full_out.numel(), full_out.element_size())
        if self.world_size == 1:
            full_out.copy_(shard_in)
        else:
            _all_gather(full_out, shard_in, group=self.group)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)
