"""Collectives as plain functions over tensors and a process group, with accounting.

Every collective the engine issues goes through a :class:`Communicator`, which counts
elements and bytes per collective kind so ``comm_report()`` can be compared with the
paper's 2Ψ / 3Ψ.  Accounting convention (the paper's, first-order ring volume):

* ``reduce_scatter`` and ``all_gather`` count the size of the *full* (unsharded) tensor:
  in a ring each rank sends and receives about that many elements.
* ``all_reduce`` counts twice its size (it is a reduce-scatter followed by an all-gather).

``paper_volume`` in the report adds these up; small control collectives (overflow
flags, norms) are counted under their own kind and excluded from ``paper_volume``.

[Note: no silent hangs]
Every collective records where this rank is (kind, what it is for: a module name or a
unit, its number within the step).  On gloo every wait is bounded by
``collective_timeout``; when a collective times out or fails (a peer died, or the ranks
issued different collectives), this rank publishes its position in the process group's
store, collects the others' for a while, and raises :class:`CollectiveError` naming
each rank's position, so a divergence or a dead rank ends the job on every rank with
the same explanation instead of a hang.  (NCCL waits are not host-blocking; there the
process group's own timeout and watchdog apply.)  With ``check_call_order`` every
collective is preceded by a tiny exchange of positions, which stops the first
divergent call on every rank, before mismatched collectives can pair up.
"""
from __future__ import annotations

import atexit
import datetime
import gc
import json
import time
import weakref
import zlib
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

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


class CollectiveError(RuntimeError):
    """A ZeRO collective timed out or failed; the message says where every rank was."""


class _TimedWork:
    """A Work handle whose ``wait`` is bounded and explained (see [Note: no silent hangs])."""

    __slots__ = ("work", "comm", "position")

    def __init__(self, work, comm: "Communicator", position) -> None:
        self.work, self.comm, self.position = work, comm, position

    def wait(self) -> bool:
        return self.comm._wait(self.work, self.position)

    def is_completed(self) -> bool:
        return self.work.is_completed()


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
        self.timeout: Optional[float] = None  # seconds; None = the process group's own
        self.check_order = False
        self.step = 0
        self._call = 0
        self.position: Optional[Tuple[int, int, str, str]] = None  # (step, call, kind, label)
        self._labels: Dict[int, str] = {}
        self._blocking_waits = process_group is not None and dist.get_backend(process_group) == "gloo"

    def configure(self, timeout: Optional[float], check_order: bool) -> None:
        self.timeout = timeout
        self.check_order = check_order

    def start_step(self, step: int) -> None:
        """Positions are numbered within a step, so they can be compared across ranks."""
        self.step, self._call = step, 0

    # -- positions, timeouts, diagnosis ------------------------------------------------------
    def _enter(self, kind: str, label: str):
        self._call += 1
        self.position = (self.step, self._call, kind, label)
        if self.check_order and self.world_size > 1:
            self._check_same_position()
        return self.position

    @staticmethod
    def _describe(position) -> str:
        if position is None:
            return "no ZeRO collective yet"
        step, call, kind, label = position
        return f"{kind} for {label} (collective #{call} of step {step})"

    def _check_same_position(self) -> None:
        step, call, kind, label = self.position
        text = f"{kind} for {label}"
        code = zlib.crc32(text.encode())  # stable across processes, unlike hash()
        self._labels[code] = text
        mine = torch.tensor([step, call, code], dtype=torch.int64, device=self._control_device())
        everyone = torch.empty(self.world_size * 3, dtype=torch.int64, device=mine.device)
        self._wait(_all_gather(everyone, mine, group=self.group, async_op=True), self.position)
        rows = everyone.view(self.world_size, 3).tolist()
        if all(r == rows[0] for r in rows):
            return
        lines = [
            f"  rank {r}: {self._labels.get(c, f'<a call this rank never made, fingerprint {c}>')} "
            f"(collective #{n} of step {s})"
            for r, (s, n, c) in enumerate(rows)
        ]
        raise CollectiveError(
            "ranks diverged (check_call_order): they are about to issue different collectives, so the "
            "modules they run differ (a branch taken on some ranks only, a different number of forward "
            "passes or generate() steps). Every rank must call the same modules in the same order under "
            "ZeRO stage 3; run the extra work on every rank or outside the engine's model.\n" + "\n".join(lines)
        )

    def _control_device(self) -> torch.device:
        if self.group is not None and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _wait(self, work, position) -> bool:
        try:
            if self.timeout is not None and self._blocking_waits:
                return work.wait(timeout=datetime.timedelta(seconds=self.timeout))
            return work.wait()
        except CollectiveError:
            raise
        except RuntimeError as exc:
            raise self._failure(exc, position) from exc

    def _failure(self, exc: BaseException, position) -> CollectiveError:
        """Publish this rank's position, collect the others' (bounded), build the error."""
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else [0]
        me = ranks[self.rank]
        peers: Dict[int, Optional[str]] = {r: None for r in ranks}
        peers[me] = self._describe(position)
        store = None
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(f"zero_strategy/failure/{me}", json.dumps(peers[me]))
            deadline = time.monotonic() + (self.timeout if self.timeout is not None else 30.0)
            while time.monotonic() < deadline and any(v is None for v in peers.values()):
                for r in ranks:
                    key = f"zero_strategy/failure/{r}"
                    if peers[r] is None and store.check([key]):
                        peers[r] = json.loads(store.get(key).decode())
                if any(v is None for v in peers.values()):
                    time.sleep(0.2)
        except Exception:  # noqa: BLE001 - the store may have died with rank 0
            pass
        silent = [r for r, v in peers.items() if v is None]
        lines = [f"  rank {r}: {v}" for r, v in peers.items() if v is not None]
        if silent:
            lines.append(
                f"  rank(s) {silent}: no answer - exited (killed, crashed) or blocked outside "
                "zero_strategy's collectives"
            )
        what = "timed out" if "timed out" in str(exc).lower() else "failed"
        after = f" after {self.timeout:g} s (ZeroConfig.collective_timeout)" if what == "timed out" and self.timeout else ""
        diverged = (
            "ranks that run different modules or a different number of steps issue different "
            "collectives (set check_call_order=True to stop at the first divergent call with every "
            "rank's module named)"
        )
        hint = (
            f"rank(s) {silent} did not answer: killed or crashed (gloo also aborts a process whose "
            f"collectives do not match its peers'). If a rank died, restart from the last checkpoint; else {diverged}"
            if silent
            else f"the ranks are out of step: {diverged}"
        )
        return CollectiveError(
            f"ZeRO collective {what}{after} on rank {me} while waiting in {self._describe(position)}: "
            f"{hint}.\nWhere each rank was:\n" + "\n".join(lines) + f"\n(underlying error: {exc})"
        )

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
    def _issue(self, work, position, async_op: bool):
        timed = _TimedWork(self._keep(work), self, position)
        if not async_op:
            timed.wait()
        return timed

    def reduce_scatter(self, shard_out: torch.Tensor, full_in: torch.Tensor, async_op: bool = True, label: str = "gradients"):
        """Sum ``full_in`` over ranks; this rank receives its equal slice in ``shard_out``."""
        self._count("reduce_scatter", full_in.numel(), full_in.element_size())
        if self.world_size == 1:
            shard_out.copy_(full_in)
            return _DoneWork()
        position = self._enter("reduce_scatter", label)
        return self._issue(_reduce_scatter(shard_out, full_in, group=self.group, async_op=True), position, async_op)

    def all_gather(self, full_out: torch.Tensor, shard_in: torch.Tensor, async_op: bool = True, label: str = "parameters"):
        """Concatenate every rank's ``shard_in`` into ``full_out`` (in rank order)."""
        self._count("all_gather", full_out.numel(), full_out.element_size())
        if self.world_size == 1:
            if full_out.data_ptr() != shard_in.data_ptr():
                full_out.copy_(shard_in)
            return _DoneWork()
        position = self._enter("all_gather", label)
        return self._issue(_all_gather(full_out, shard_in, group=self.group, async_op=True), position, async_op)

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = True, label: str = "gradients"):
        """Sum ``tensor`` in place over ranks (gradient all-reduce of stage 0)."""
        self._count("all_reduce", tensor.numel(), tensor.element_size())
        if self.world_size == 1:
            return _DoneWork()
        position = self._enter("all_reduce", label)
        return self._issue(dist.all_reduce(tensor, group=self.group, async_op=True), position, async_op)

    def control_all_reduce(self, tensor: torch.Tensor, op: str = "sum", label: str = "a control value") -> torch.Tensor:
        """Small synchronous reductions (overflow flags, norms): counted as ``control``."""
        self._count("control", tensor.numel(), tensor.element_size())
        if self.world_size > 1:
            reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
            position = self._enter("all_reduce", label)
            self._issue(dist.all_reduce(tensor, op=reduce_op, group=self.group, async_op=True), position, False)
        return tensor

    def all_gather_for_state(self, full_out: torch.Tensor, shard_in: torch.Tensor, label: str = "a state dict") -> None:
        """Synchronous gather used by state-dict consolidation (counted as ``state_gather``)."""
        self._count("state_gather", full_out.numel(), full_out.element_size())
        if self.world_size == 1:
            full_out.copy_(shard_in)
        else:
            position = self._enter("all_gather", label)
            self._issue(_all_gather(full_out, shard_in, group=self.group, async_op=True), position, False)

    def broadcast(self, tensor: torch.Tensor, src: int, label: str = "parameters") -> None:
        """Synchronous broadcast from group rank ``src`` (counted as ``broadcast``)."""
        self._count("broadcast", tensor.numel(), tensor.element_size())
        if self.world_size > 1:
            position = self._enter("broadcast", label)
            root = dist.get_global_rank(self.group, src)
            self._issue(dist.broadcast(tensor, src=root, group=self.group, async_op=True), position, False)

    def all_gather_object(self, obj, label: str = "a report") -> list:
        """Every rank's picklable ``obj``, in rank order (small diagnostics only)."""
        if self.world_size == 1:
            return [obj]
        self._enter("all_gather_object", label)
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self, label: str = "a barrier") -> None:
        if self.world_size > 1:
            position = self._enter("barrier", label)
            self._issue(dist.barrier(group=self.group, async_op=True), position, False)
