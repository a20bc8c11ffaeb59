"""Communicator: every collective the engine issues, with accounting and positions.

Every collective the engine issues goes through a :class:`Communicator`, which counts
elements and bytes per collective kind so ``comm_report()`` can be compared with the
paper's 2Ψ / 3Ψ.  Accounting convention (the paper's, first-order ring volume):

* ``reduce_scatter`` and ``all_gather`` count the size of the *full* (unsharded) tensor:
  in a ring each rank sends and receives about that many elements.
* ``all_reduce`` counts twice its size (it is a reduce-scatter followed by an all-gather).
* ``whole_param_exchange`` (all-to-all, [Note: whole-parameter optimizers] in
  whole_params.py) counts what this rank sends to the others.

``paper_volume`` in the report adds these up; small control collectives (overflow
flags, norms) are counted under their own kind and excluded from ``paper_volume``.
Only payloads are counted, never the in-band headers.  Besides, every kind counts the
bytes this rank sends to ranks on its own node and on other nodes ([Note:
direct-exchange bytes] in topology.py); ZeRO++'s hierarchical collectives run on the
node and cross-node sub-communicators (:meth:`Communicator.sub`), which add to the same
tally.  A quantized collective counts its elements as the tensor's and its bytes as
what moves (int8 or int4 payload plus scales), so ``bits_per_element`` shows the
compression.

[Note: no silent hangs]
Every collective records where this rank is (kind, what it is for: a module name or a
unit, its number within the step).  On gloo:

* every wait is bounded by ``collective_timeout`` (bounded.py, [Note: bounded waits]);
* every collective carries a header identifying that position, checked on receipt
  (collectives.py, [Note: in-band headers]), so ranks that issued different
  collectives fail at the first one, on every rank;
* a failing rank publishes its position in the store and collects the others'
  (diagnosis.py, [Note: failure reports]); its :class:`CollectiveError` names every
  rank's position, the timeout that fired (ours or the process group's) and, when the
  reports show it, a collective API called on some ranks only.  A communicator that
  failed refuses further collectives (gloo may still hold the abandoned one).

(NCCL waits are not host-blocking; there the process group's own timeout and watchdog
apply, and collectives carry no header.)  With ``check_call_order`` every collective is
preceded by a tiny exchange of positions, which stops the first divergent call on
every rank before any mismatched collective is issued - even one whose size differs,
which gloo would otherwise answer by aborting a process.
"""
from __future__ import annotations

import atexit
import dataclasses
import gc
import os
import pickle
import weakref
import zlib
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import agreement
from . import collectives as C
from .bounded import PeerFailed, WaitTimeout, wait_work
from .topology import GroupPlacement, Topology, sent_bytes
from .diagnosis import CollectiveError, Reports, build_error, current_api, describe, report_window

BULK_KINDS = ("reduce_scatter", "all_gather", "all_reduce")

# Set to "0" to issue collectives without in-band headers (to measure what they cost).
HEADERS_ENV = "ZERO_STRATEGY_COLLECTIVE_HEADERS"


@dataclass
class _Tally:
    calls: int = 0
    elements: int = 0
    bytes: int = 0
    intra_node_bytes: int = 0  # sent to ranks on this rank's node ([Note: direct-exchange bytes])
    cross_node_bytes: int = 0  # sent to ranks on other nodes

    @property
    def bits_per_element(self) -> float:
        return 8 * self.bytes / self.elements if self.elements else 0.0


# How each tally kind's bytes are sent ([Note: direct-exchange bytes] in topology.py).
_SHAPE_OF_KIND = {"reduce_scatter": "reduce_scatter", "all_reduce": "all_reduce", "control": "all_reduce",
                  "broadcast": "broadcast"}


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

    @property
    def cross_node_bytes(self) -> int:
        """Bytes this rank sent to other nodes, every kind."""
        return sum(t.cross_node_bytes for t in self.kinds.values())

    @property
    def intra_node_bytes(self) -> int:
        return sum(t.intra_node_bytes for t in self.kinds.values())

    def as_dict(self) -> Dict[str, Dict[str, int]]:
        out = {k: {"calls": t.calls, "elements": t.elements, "bytes": t.bytes, "intra_node_bytes": t.intra_node_bytes,
                   "cross_node_bytes": t.cross_node_bytes} for k, t in self.kinds.items()}
        out["paper_volume"] = {"elements": self.paper_volume}
        out["total"] = {"intra_node_bytes": self.intra_node_bytes, "cross_node_bytes": self.cross_node_bytes}
        return out

    def __getitem__(self, kind: str) -> _Tally:
        return self.kinds.get(kind, _Tally())


class _TimedWork:
    """A collective in flight whose ``wait`` is bounded, checked and explained
    (see [Note: no silent hangs]); waiting twice is harmless."""

    __slots__ = ("pending", "comm", "position", "done")

    def __init__(self, pending: C.Pending, comm: "Communicator", position) -> None:
        self.pending, self.comm, self.position, self.done = pending, comm, position, False

    def wait(self) -> bool:
        if not self.done:
            self.comm._wait(self.pending, self.position)
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done or self.pending.work.is_completed()


class _ControlResult:
    """A control reduction in flight: ``result()`` waits and returns the reduced tensor
    (the caller's, written in place)."""

    def __init__(self, tensor: torch.Tensor, work, reduce=None) -> None:
        self._tensor, self._work, self._reduce = tensor, work, reduce

    def result(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
            if self._reduce is not None:
                self._tensor.copy_(self._reduce().view_as(self._tensor))
        return self._tensor


class _DoneWork:
    """Stands in for a Work handle when there is nothing to wait for (world size 1)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_LIVE_COMMUNICATORS: "weakref.WeakSet[Communicator]" = weakref.WeakSet()
_GENERATIONS: Dict[str, int] = defaultdict(int)  # communicators built per process group


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


def _process_group_timeout(group) -> Optional[float]:
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - private API; only used in messages
        return None


class Communicator:
    """Owns the process group handle and the traffic tally. Never decides *when* to talk."""

    def __init__(self, process_group: Optional[dist.ProcessGroup], _tally: Optional[Dict[str, _Tally]] = None) -> None:
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        self.group = process_group
        if process_group is None:
            self.rank, self.world_size = 0, 1
        else:
            self.rank = dist.get_rank(process_group)
            self.world_size = dist.get_world_size(process_group)
        self._tally: Dict[str, _Tally] = _tally if _tally is not None else defaultdict(_Tally)
        # [Note: node structure] in topology.py: one node until the engine says otherwise.
        self.topology = Topology(self.world_size, self.world_size)
        self._placement = GroupPlacement(self.world_size, 0)
        self._subs: List["Communicator"] = []
        # ZeRO++'s sub-communicators (hpZ's gathers, qgZ's two levels), set by the engine.
        self.node_comm: Optional["Communicator"] = None
        self.cross_comm: Optional["Communicator"] = None
        self.gradient_quantization: Optional[Tuple[int, int]] = None  # qgZ: (bits, block), with both above
        # [Note: keeping recent work handles]
        # A Work launched from inside backward captures thread-local autograd state
        # (a Python object).  If a gloo worker thread drops the last reference to it
        # while the interpreter is shutting down, the process aborts.  So the main
        # thread keeps the last few handles and releases each one only after several
        # newer collectives were issued, long after its worker let go of it.  Only a
        # few are kept because a handle also keeps its buffers alive (header staging
        # buffers are freed when their collective finishes).
        self._recent_works: deque = deque(maxlen=4)
        _LIVE_COMMUNICATORS.add(self)
        self.timeout: Optional[float] = None  # seconds; None = the process group's own
        self.check_order = False
        self.step = 0
        self._call = 0
        # Training forwards (grad enabled, module in training mode) begun on this rank:
        # part of every header, so a rank that skipped a batch is caught at its next
        # collective ([Note: a skipped batch] in diagnosis.py).
        self.training_forwards = 0
        self.position: Optional[Tuple[int, int, str, str, int]] = None  # (step, call, kind, label, training forwards)
        self._labels: Dict[int, str] = {}
        self._failed: Optional[str] = None
        backend = dist.get_backend(process_group) if process_group is not None else None
        self._gloo = backend == "gloo" and self.world_size > 1
        self._nccl = backend == "nccl"
        self.headers = self._gloo and os.environ.get(HEADERS_ENV, "1") != "0"
        self.pg_timeout = _process_group_timeout(process_group) if self._gloo else None
        self._reports: Optional[Reports] = None
        if self._gloo:
            name = getattr(process_group, "group_name", None) or "world"
            _GENERATIONS[name] += 1
            self._namespace = f"zero_strategy/{name}/{_GENERATIONS[name]}"
            self._global_ranks = dist.get_process_group_ranks(process_group)

    def configure(self, timeout: Optional[float], check_order: bool) -> None:
        self.timeout = timeout
        self.check_order = check_order
        for sub in self._subs:
            sub.configure(timeout, check_order)
        if self._gloo:
            try:
                store = dist.distributed_c10d._get_default_store()
            except Exception:  # noqa: BLE001 - no store: reports are skipped, waits stay bounded
                store = None
            self._reports = Reports(store, self._namespace, timeout)

    def start_step(self, step: int) -> None:
        """Positions are numbered within a step, so they can be compared across ranks."""
        self.step, self._call = step, 0
        for sub in self._subs:
            sub.start_step(step)

    # -- topology ([Note: node structure] in topology.py) ---------------------------------
    def global_ranks(self) -> List[int]:
        if self.group is None:
            return [0]
        return list(dist.get_process_group_ranks(self.group))

    def set_topology(self, topology: Topology) -> None:
        """Which ranks share a node: decides the intra/cross split of every count."""
        ranks = self.global_ranks()
        self.topology = topology
        self._placement = GroupPlacement.of(topology, ranks, ranks[self.rank])

    def sub(self, groups: Sequence[Sequence[int]], what: str) -> "Communicator":
        """A communicator over the one of ``groups`` (global ranks, together covering
        every rank of this communicator) that holds this rank.  Every rank builds every
        group, in the same order, as ``dist.new_group`` requires.  It adds to this
        communicator's tally, follows its steps and settings, and is what ``what``
        names in messages."""
        me = self.global_ranks()[self.rank]
        mine = None
        for ranks in groups:
            group = dist.new_group(list(ranks), use_local_synchronization=False)
            if me in ranks:
                mine = group
        sub = Communicator(mine, _tally=self._tally)
        sub.set_topology(self.topology)
        sub.what = what
        sub.configure(self.timeout, self.check_order)
        sub.start_step(self.step)
        self._subs.append(sub)
        return sub

    what = "every rank"

    # -- positions, waits, diagnosis ---------------------------------------------------------
    def _enter(self, kind: str, label: str, tensor: Optional[torch.Tensor] = None, numel: int = 0):
        """Record the position of the next collective; return it and the identity its
        header carries (None when collectives carry no header)."""
        if self._failed is not None:
            raise CollectiveError(
                f"an earlier ZeRO collective failed on this rank ({self._failed}), so no further collective is "
                f"issued (gloo may still hold the failed one); was about to issue {kind} for {label}. Restart from "
                "the last checkpoint."
            )
        self._call += 1
        self.position = (self.step, self._call, kind, label, self.training_forwards)
        if self.check_order and self.world_size > 1:
            self._check_same_position()
        if not self.headers:
            return self.position, None
        text = f"{kind} for {label} after training forward {self.training_forwards}"
        ident = C.Identity.of(self.step, self._call, text, tensor.dtype if tensor is not None else torch.int64, numel)
        self._labels[ident.text_code] = text
        return self.position, ident

    _describe = staticmethod(describe)

    def _check_same_position(self) -> None:
        step, call, kind, label, forwards = self.position
        text = f"{kind} for {label} after training forward {forwards}"
        code = zlib.crc32(text.encode())  # stable across processes, unlike hash()
        self._labels[code] = text
        mine = torch.tensor([step, call, code], dtype=torch.int64, device=self._control_device())
        everyone = torch.empty(self.world_size * 3, dtype=torch.int64, device=mine.device)
        self._wait(C.all_gather(everyone, mine, self.group, self.world_size, None), self.position)
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
            "passes or generate() steps, a batch skipped on some ranks). Every rank must call the same modules in "
            "the same order under ZeRO stage 3; run the extra work on every rank or outside the engine's model.\n"
            + "\n".join(lines)
        )

    def _control_device(self) -> torch.device:
        if self._nccl:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _peer_failed(self) -> bool:
        return self._reports is not None and self._reports.any_failure()

    def _wait(self, pending: C.Pending, position) -> bool:
        try:
            if self._gloo and self.timeout is not None:
                wait_work(pending.work, self.timeout, self._peer_failed)
            else:
                pending.work.wait()
        except WaitTimeout:
            raise self._failure("timeout", position) from None
        except PeerFailed:
            raise self._failure("peer", position) from None
        except RuntimeError as exc:
            reason = "pg_timeout" if "timed out" in str(exc).lower() else "error"
            raise self._failure(reason, position, exc) from exc
        mismatch = pending.finish()
        if mismatch is not None:
            raise self._failure("mismatch", position, mismatch=mismatch)
        return True

    def _decode(self, what: int, where: int) -> str:
        ident = C.Identity(what, where)
        if what == 0 and where == 0:
            return "no header: it sent a different amount of data (another collective, or another size)"
        text = self._labels.get(ident.text_code)
        text = text if text is not None else f"<a collective this rank has not issued, fingerprint {ident.text_code:08x}>"
        return f"{text} (collective #{ident.call} of step {ident.step})"

    _WHY = {"timeout": "timed out", "pg_timeout": "the process group's timeout fired", "error": "failed",
            "mismatch": "diverged", "peer": "stopped: another rank failed"}

    def _failure(self, reason: str, position, exc: Optional[BaseException] = None,
                 mismatch: Optional[C.Mismatch] = None) -> CollectiveError:
        """Publish this rank's position, collect the others' (bounded), build the error."""
        ranks = self._global_ranks if self._gloo else list(range(self.world_size))
        me = ranks[self.rank]
        mine = {"position": describe(position), "api": current_api(), "why": self._WHY.get(reason, reason)}
        reports: Dict[int, Optional[dict]] = {r: None for r in ranks}
        reports[me] = mine
        store_ok = True
        if self._reports is not None:
            store_ok = self._reports.publish(me, mine)
            if store_ok:
                got = self._reports.collect([r for r in ranks if r != me], report_window(self.timeout))
                reports.update({r: v for r, v in got.items() if v is not None})
                store_ok = not self._reports.store.dead
        mismatch_lines = None
        if mismatch is not None:
            if mismatch.peers is not None:
                mismatch_lines = [
                    f"  {'the source rank' if r < 0 else f'rank {ranks[r]}'}: {self._decode(*got)}"
                    for r, got in mismatch.peers
                ]
                # A rank whose report did not arrive is still named by its header.
                for r, got in mismatch.peers:
                    if r >= 0 and reports.get(ranks[r]) is None and got != (0, 0):
                        reports[ranks[r]] = {"position": self._decode(*got), "api": None, "why": "from its header"}
            else:
                mismatch_lines = [f"  {mismatch.detail}"]
        err = build_error(me=me, ranks=ranks, mine=mine, reason=reason, position=position, timeout=self.timeout,
                          pg_timeout=self.pg_timeout, reports=dict(sorted(reports.items())), store_ok=store_ok,
                          exc=exc, mismatch_lines=mismatch_lines)
        self._failed = f"{self._WHY.get(reason, reason)} in {describe(position)}"
        return err

    # -- accounting --------------------------------------------------------------------
    def _count(self, kind: str, numel: int, element_size: int, *, nbytes: Optional[int] = None,
               is_source: bool = True, sent: Optional[Tuple[int, int]] = None) -> None:
        """One collective of ``numel`` elements; ``nbytes`` where what moves is not
        ``numel * element_size`` (quantized), ``sent`` where the (intra, cross) split is
        known exactly (all-to-all)."""
        t = self._tally[kind]
        nbytes = numel * element_size if nbytes is None else nbytes
        t.calls += 1
        t.elements += numel
        t.bytes += nbytes
        if sent is None:
            sent = sent_bytes(_SHAPE_OF_KIND.get(kind, "all_gather"), nbytes, self._placement, is_source)
        t.intra_node_bytes += sent[0]
        t.cross_node_bytes += sent[1]

    def report(self) -> CommReport:
        return CommReport({k: dataclasses.replace(t) for k, t in self._tally.items()})

    def reset(self) -> None:
        self._tally.clear()

    # -- collectives ----------------------------------------------------------------------
    def _issue(self, pending: C.Pending, position, async_op: bool):
        self._recent_works.append(pending.work)
        timed = _TimedWork(pending, self, position)
        if not async_op:
            timed.wait()
        return timed

    @property
    def carries_riders(self) -> bool:
        """Whether gradient collectives can sum a caller's flag along ([Note: riders] in
        collectives.py): on gloo with more than one rank."""
        return self._gloo and self.gradient_quantization is None

    def reduce_scatter(self, shard_out: torch.Tensor, full_in: torch.Tensor, async_op: bool = True, label: str = "gradients",
                       scratch: bool = False, kept: bool = False, rider: Optional[torch.Tensor] = None):
        """Sum ``full_in`` over ranks; this rank receives its equal slice in ``shard_out``.
        ``scratch``: the caller discards ``full_in``'s values afterwards, so it may be
        overwritten; ``kept``: ... but not its storage, which must not be freed.
        ``rider`` (only where :attr:`carries_riders`): summed over ranks in place, uncounted."""
        self._count("reduce_scatter", full_in.numel(), full_in.element_size())
        if self.world_size == 1:
            shard_out.copy_(full_in)
            return _DoneWork()
        position, ident = self._enter("reduce_scatter", label, full_in, full_in.numel())
        return self._issue(C.reduce_scatter(shard_out, full_in, self.group, self.world_size, ident, via_all_reduce=self._gloo,
                                           inp_is_scratch=scratch, inp_is_kept=kept, rider=rider), position, async_op)

    def all_gather(self, full_out: torch.Tensor, shard_in: torch.Tensor, async_op: bool = True,
                   label: str = "parameters", tally: str = "all_gather"):
        """Concatenate every rank's ``shard_in`` into ``full_out`` (in rank order); with
        ``shard_in`` this rank's own chunk of ``full_out`` it runs in place, on gloo too
        ([Note: headers beside in-place gathers] in collectives.py)."""
        self._count(tally, full_out.numel(), full_out.element_size())
        if self.world_size == 1:
            if full_out.data_ptr() != shard_in.data_ptr():
                full_out.copy_(shard_in)
            return _DoneWork()
        position, ident = self._enter("all_gather", label, shard_in, shard_in.numel())
        return self._issue(C.all_gather(full_out, shard_in, self.group, self.world_size, ident, rank=self.rank),
                           position, async_op)

    def all_gather_quantized(self, q_full: torch.Tensor, q_own: torch.Tensor, s_full: torch.Tensor, s_own: torch.Tensor,
                             *, numel: int, bits: int, label: str = "parameters"):
        """qwZ: gather every rank's quantized payload row (``q_own`` within ``q_full``) and
        scales row alike; counted once under ``all_gather`` as ``numel`` elements and
        the bytes that move ([Note: block quantization] in quantize.py)."""
        self._count("all_gather", numel, 0, nbytes=q_full.numel() * q_full.element_size()
                    + s_full.numel() * s_full.element_size())
        works = []
        for full, own, what in ((q_full, q_own, f"int{bits}"), (s_full, s_own, "scales")):
            position, ident = self._enter("all_gather", f"{label} ({what})", own, own.numel())
            works.append(self._issue(C.all_gather(full, own, self.group, self.world_size, ident, rank=self.rank),
                                     position, True))
        return C.Works(works)

    def all_gather_kept(self, gathers: Sequence[Tuple[torch.Tensor, torch.Tensor, str]], tally: str = "all_gather") -> list:
        """Several all-gathers into buffers that are kept allocated, each ``(full_out,
        shard_in, label)`` with ``shard_in`` this rank's own chunk of ``full_out``; all
        issued now, one waitable each.  With headers the batch is announced by one
        header-only gather first, and the payloads carry none, so they need no staging
        ([Note: announced gathers] in collectives.py).  ``tally``: the comm_report kind
        they count under (``grad_read`` for gradients gathered for ``.grad``: not part of
        the paper's volume)."""
        if self.world_size == 1 or not self.headers or not gathers:
            return [self.all_gather(out, inp, async_op=True, label=label, tally=tally) for out, inp, label in gathers]
        entered = []
        for out, inp, label in gathers:
            if not C.is_own_row(out, inp, self.world_size, self.rank):
                raise ValueError(f"all_gather_kept for {label}: the input must be this rank's own chunk of the output")
            self._count(tally, out.numel(), out.element_size())
            entered.append(self._enter("all_gather", label, inp, inp.numel()))
        batch = C.Identity.of_batch([ident for _, ident in entered])
        first, last = gathers[0][2], gathers[-1][2]
        names = first if len(gathers) == 1 else f"{first} ... {last}"
        self._labels[batch.text_code] = f"the announcement of {len(gathers)} all_gather(s) for {names}"
        empty = torch.empty(0, dtype=torch.int64, device=self._control_device())
        self._issue(C.all_gather(empty, empty, self.group, self.world_size, batch, rank=self.rank), entered[0][0], False)
        return [self._issue(C.Pending(C.broadcast_rows(out, self.group, self.world_size)), position, True)
                for (out, _, _), (position, _) in zip(gathers, entered)]

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = True, label: str = "gradients",
                   rider: Optional[torch.Tensor] = None, room_after: bool = False):
        """Sum ``tensor`` in place over ranks (gradient all-reduce of stage 0); ``rider`` as
        in :meth:`reduce_scatter`; ``room_after`` as in ``collectives.all_reduce``."""
        self._count("all_reduce", tensor.numel(), tensor.element_size())
        if self.world_size == 1:
            return _DoneWork()
        position, ident = self._enter("all_reduce", label, tensor, tensor.numel())
        return self._issue(C.all_reduce(tensor, self.group, self.world_size, ident, rider=rider, room_after=room_after),
                           position, async_op)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
                   label: str = "whole parameters", kind: str = "whole_param_exchange") -> None:
        """Synchronous personalised exchange: chunk ``r`` of ``inp`` (``in_splits[r]``
        elements) goes to rank ``r``, chunk ``r`` of ``out`` comes from it.  Counted
        under ``kind`` as the elements this rank sends to the others (its own chunk
        moves nowhere), outside ``paper_volume``."""
        size = inp.element_size()
        ranks, me = self.global_ranks(), self.global_ranks()[self.rank]
        cross = sum(n for r, n in enumerate(in_splits) if self.topology.node_of(ranks[r]) != self.topology.node_of(me))
        total = sum(n for r, n in enumerate(in_splits) if r != self.rank)
        self._count(kind, total, size, sent=((total - cross) * size, cross * size))
        if self.world_size == 1:
            out.copy_(inp)
            return
        # The size in the header is the same on every rank (the chunks are not).
        position, ident = self._enter("all_to_all", label, inp, 0)
        self._issue(C.all_to_all(out, inp, out_splits, in_splits, self.group, self.world_size, ident), position, False)

    def all_to_all_quantized(self, q_out: torch.Tensor, q_in: torch.Tensor, s_out: torch.Tensor, s_in: torch.Tensor, *,
                             rows: int, numel_per_row: int, bits: int, label: str) -> None:
        """qgZ's exchange ([Note: two-level reduction] in hierarchical.py): row ``r`` of the
        payload and of the scales goes to rank ``r``.  Counted once, under
        ``reduce_scatter_cross_node``: the elements this rank sends to the others and
        the bytes that carry them."""
        q_row, s_row = q_in.numel() // rows, s_in.numel() // rows
        ranks, me = self.global_ranks(), self.global_ranks()[self.rank]
        sent = cross = 0
        for r in range(rows):
            if r != self.rank:
                nbytes = q_row * q_in.element_size() + s_row * s_in.element_size()
                sent += nbytes
                cross += nbytes if self.topology.node_of(ranks[r]) != self.topology.node_of(me) else 0
        self._count("reduce_scatter_cross_node", (rows - 1) * numel_per_row, 0, nbytes=sent, sent=(sent - cross, cross))
        if self.world_size == 1:
            q_out.copy_(q_in)
            s_out.copy_(s_in)
            return
        for out, inp, n, what in ((q_out, q_in, q_row, f"int{bits}"), (s_out, s_in, s_row, "scales")):
            position, ident = self._enter("all_to_all", f"{label} ({what})", inp, 0)
            self._issue(C.all_to_all(out, inp, [n] * rows, [n] * rows, self.group, self.world_size, ident), position, False)

    def control_all_reduce(self, tensor: torch.Tensor, op: str = "sum", label: str = "a control value") -> torch.Tensor:
        """Small synchronous reductions (overflow flags, norms): counted as ``control``.
        With headers they are an all-gather reduced locally, in rank order."""
        return self.control_all_reduce_async(tensor, op, label).result()

    def control_all_reduce_async(self, tensor: torch.Tensor, op: str = "sum",
                                 label: str = "a control value") -> "_ControlResult":
        """:meth:`control_all_reduce` issued now and waited for by ``.result()``, so its
        latency can overlap other work (the engine's end-of-backward agreement)."""
        self._count("control", tensor.numel(), tensor.element_size())
        if self.world_size == 1:
            return _ControlResult(tensor, _DoneWork())
        position, ident = self._enter("all_reduce", label, tensor, tensor.numel())
        if ident is None:
            reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
            work = dist.all_reduce(tensor, op=reduce_op, group=self.group, async_op=True)
            return _ControlResult(tensor, self._issue(C.Pending(work), position, True))
        flat = tensor.detach().reshape(-1)
        rows = torch.empty(self.world_size * flat.numel(), dtype=tensor.dtype, device=tensor.device)
        work = self._issue(C.all_gather(rows, flat, self.group, self.world_size, ident, rank=self.rank), position, True)
        return _ControlResult(tensor, work, lambda: C.reduce_gathered(rows.view(self.world_size, -1), op))

    def all_gather_for_state(self, full_out: torch.Tensor, shard_in: torch.Tensor, label: str = "a state dict") -> None:
        """Synchronous gather used by state-dict consolidation (counted as ``state_gather``)."""
        self._count("state_gather", full_out.numel(), full_out.element_size())
        if self.world_size == 1:
            full_out.copy_(shard_in)
        else:
            position, ident = self._enter("all_gather", label, shard_in, shard_in.numel())
            self._issue(C.all_gather(full_out, shard_in, self.group, self.world_size, ident, rank=self.rank), position, False)

    def broadcast(self, tensor: torch.Tensor, src: int, label: str = "parameters") -> None:
        """Synchronous broadcast from group rank ``src`` (counted as ``broadcast``)."""
        self._count("broadcast", tensor.numel(), tensor.element_size(), is_source=self.rank == src)
        if self.world_size > 1:
            position, ident = self._enter("broadcast", label, tensor, tensor.numel())
            root = dist.get_global_rank(self.group, src)
            pending = C.broadcast(tensor, root, self.rank == src, self.group, ident)
            self._issue(pending, position, False)

    def all_gather_object(self, obj, label: str = "a report") -> list:
        """Every rank's picklable ``obj``, in rank order (small diagnostics only; what
        ``dist.all_gather_object`` does, from the ranks of this job).  Two bounded,
        headed all-gathers: the lengths, then the padded pickles."""
        if self.world_size == 1:
            return [obj]
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self._control_device())
        sizes = torch.empty(self.world_size, dtype=torch.int64, device=data.device)
        mine = torch.tensor([data.numel()], dtype=torch.int64, device=data.device)
        position, ident = self._enter("all_gather_object", f"the sizes of {label}", mine, 1)
        self._issue(C.all_gather(sizes, mine, self.group, self.world_size, ident, rank=self.rank), position, False)
        longest = int(sizes.max())
        padded = torch.zeros(longest, dtype=torch.uint8, device=data.device)
        padded[: data.numel()] = data
        out = torch.empty(self.world_size * longest, dtype=torch.uint8, device=data.device)
        position, ident = self._enter("all_gather_object", label, padded, longest)
        self._issue(C.all_gather(out, padded, self.group, self.world_size, ident, rank=self.rank), position, False)
        rows = out.view(self.world_size, longest).cpu()
        return [pickle.loads(rows[r, : int(sizes[r])].numpy().tobytes()) for r in range(self.world_size)]

    # -- run, then agree ([Note: every rank fails together] in agreement.py) ---------------------
    def agree(self, what: str, error: Optional[BaseException], **kwargs):
        """:func:`agreement.agree` over this communicator."""
        return agreement.agree(self, what, error, **kwargs)

    def run_and_agree(self, what: str, work: Callable, **kwargs):
        """``work()`` on every rank; if it raised on any rank, every rank raises."""
        return agreement.run_and_agree(self, what, work, **kwargs)

    def broadcast_object(self, obj, src: int = 0, label: str = "an object"):
        """Rank ``src``'s picklable ``obj`` on every rank (bounded and headed, like
        :meth:`broadcast`): its length, then its bytes."""
        if self.world_size == 1:
            return obj
        data = pickle.dumps(obj) if self.rank == src else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self._control_device())
        self.broadcast(size, src, label=f"the size of {label}")
        buf = torch.zeros(int(size), dtype=torch.uint8, device=size.device)
        if self.rank == src:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.broadcast(buf, src, label=label)
        return obj if self.rank == src else pickle.loads(buf.cpu().numpy().tobytes())

    def barrier(self, label: str = "a barrier") -> None:
        """With headers: an all-gather of nothing but the header (so a barrier is
        identified like any other collective)."""
        if self.world_size == 1:
            return
        empty = torch.empty(0, dtype=torch.int64, device=self._control_device())
        position, ident = self._enter("barrier", label, empty, 0)
        if ident is None:
            self._issue(C.Pending(dist.barrier(group=self.group, async_op=True)), position, False)
        else:
            out = torch.empty(0, dtype=torch.int64, device=empty.device)
            self._issue(C.all_gather(out, empty, self.group, self.world_size, ident, rank=self.rank), position, False)


__all__: List[str] = ["Communicator", "CommReport", "CollectiveError"]
