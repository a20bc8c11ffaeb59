"""The collectives themselves, as plain functions, with in-band headers.

[Note: in-band headers]
Each bulk collective on gloo carries what identifies it: a few elements appended to
its buffer hold a fingerprint of the position that issued it (step, call number, kind,
label such as the module, dtype and size).  After the wait every rank checks what it
received, so when the ranks issued different collectives (a module run on some ranks
only) the first divergent one fails on every rank, with no extra collective and no
extra host synchronisation.

* all-gather, broadcast (and the small control collectives built on all-gather): each
  rank's chunk ends with its own 16-byte header, written and read as raw bytes (the
  collective moves bytes untouched), so each rank learns exactly which peers issued
  something else.
* reduce-scatter (on gloo carried out as an all-reduce, see :func:`reduce_scatter`),
  all-reduce: the header is summed with the payload, so it cannot be compared as bytes.  Each chunk ends with 32 elements, the bits (0 or 1) of a 32-bit
  digest of the position; the received sums must be N times this rank's own bits.
  They are unless every rank had the same digest, as long as the sums are exact
  integers in the buffer's dtype (N <= 256 for bf16, 2048 for fp16, 2^24 for fp32);
  beyond that the header is left out (:func:`bitsum_header_fits`).

Receive-side header slots are pre-filled with values no header has (zero bytes,
-1), so a peer that sent less data than expected (gloo accepts a short message
silently) is caught too.  A peer that sent *more* than this rank posted is caught by
gloo itself, which aborts the receiving process (``op.preamble.length <= op.nbytes``):
no Python code can intercept that, so mismatched sizes end with that process gone and
the others reporting it (see docs/reliability.md).

[Note: riders]
A summed collective that gloo carries as an all-reduce can also sum a few values of
the caller's (``rider``) after its header, so a flag every rank needs (the engine's
"some parameter got no gradient here") costs no collective of its own.  The rider is
written in the buffer's dtype and read back after the wait; callers use it only for
non-negative flags, whose sum is zero exactly when every rank sent zero, whatever the
dtype rounds.  Not on NCCL: its reduce-scatter gives each rank only its slice.

A header costs a staging copy of a buffer that has no room after itself for it (the
payload cannot be followed in place by a header).  Gradient buffers keep that room
(grad_storage.py); gathers into kept buffers send their headers ahead ([Note:
announced gathers]) and other in-place gathers beside them ([Note: headers beside
in-place gathers]), so only small control traffic and gathers of some other tensor are
staged ([Note: staged gathers]).  Staging storage is released as soon as each
collective finishes.  The communicator counts the payload only (comm_report, 2Ψ / 3Ψ).

[Note: staged gathers]
An all-gather with headers whose input is some other tensor (control values, a
pickled report) gathers into one staging buffer of N rows (payload, then header),
whose own row is also the input, and copies the payloads out once it has completed.

[Note: headers beside in-place gathers]
An all-gather whose input is already this rank's own row of its output (stage 3's
gathers: the shard, or the master cast, is written into the unit's buffer first) needs
no staging: its header travels in a separate 16-byte-a-rank all-gather issued just
before the payload, both asynchronous.  A gather in flight then holds the unit's own
buffer and nothing else, and no copy is made out of a staging buffer.  The header is
checked as soon as its all-gather completes, and a mismatch ends the wait there: the
peers issued something else (perhaps not a gather at all), so the payload may never
complete.  Its buffer may then hold anything; the error stops the run.

[Note: announced gathers]
A gather into a buffer that already exists and whose own chunk is the input (stages
1-2 bring every rank's updated shard into the kept whole parameters after the
optimizer step) needs no staging at all if the header travels separately.  So a batch
of such gathers is announced first: one all-gather of nothing but a header whose
identity digests every gather of the batch (:meth:`Identity.of_batch`), waited for,
and only then the payload gathers, straight into their buffers with no header.  Ranks
that were about to issue different gathers (other units, sizes or steps) fail at the
announcement, on every rank and before any payload moves, so even differing sizes
end with an error rather than gloo aborting the process; the payloads skip a
model-sized staging buffer, the copy into it and the copy out of it.

[Note: gathers carried as broadcasts]
gloo's all-gather into one tensor receives into a flat buffer of its own, the size of
the output, and copies that into the output afterwards.  On gloo a large in-place
gather (the two kinds above) is therefore carried as N broadcasts, one per rank's row of the output, each in place
(rank r sends its row, the others receive straight into theirs): the same bytes on
every link, no temporary, and on the 2-core test machine less than half the time
(fp32, 124M elements at N=2: 0.19 s against 0.43 s; at N=4 0.41 s against 0.71 s).
Small gathers go the same way although one all-gather would be quicker there (2 KiB
rows: about 0.66 against 0.44 ms a gather): every in-place gather is then the same
sequence of collectives whatever its size, so the collectives of ranks that diverged
still pair up one for one, and the header catches the difference instead of a payload
waiting forever for a peer that issued a different number of collectives.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

# torch >= 2.10 renamed the tensor collectives; keep working on older releases.
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

HEADER_BYTES = 16  # two int64: the identity of the call and (step, call number)
DIGEST_BITS = 32  # elements of a summed header
# Elements a summed collective may carry after its header for the caller ([Note: riders]).
RIDER_ELEMENTS = 1
# Elements a gradient buffer reserves after itself, so the gloo path's all-reduce can
# append its header (and a rider) in place (reduce_scatter's inp_is_scratch,
# all_reduce's room_after).
HEADER_ROOM = DIGEST_BITS + RIDER_ELEMENTS

# The largest N for which sums of N zeros and ones are exact in the dtype.
_EXACT_COUNT = {
    torch.bfloat16: 2**8,
    torch.float16: 2**11,
    torch.float32: 2**24,
    torch.float64: 2**53,
}


def _signed64(value: int) -> int:
    return struct.unpack("<q", struct.pack("<Q", value & 0xFFFFFFFFFFFFFFFF))[0]


@dataclass(frozen=True)
class Identity:
    """What identifies one collective call, as the header carries it."""

    what: int  # crc32("kind for label") << 32 | crc32("dtype:numel")
    where: int  # step << 32 | call number

    @classmethod
    def of(cls, step: int, call: int, text: str, dtype: torch.dtype, numel: int) -> "Identity":
        high = zlib.crc32(text.encode())  # stable across processes, unlike hash()
        low = zlib.crc32(f"{dtype}:{numel}".encode())
        return cls(_signed64(high << 32 | low), _signed64((step & 0x7FFFFFFF) << 32 | (call & 0xFFFFFFFF)))

    @classmethod
    def of_batch(cls, members: Sequence["Identity"]) -> "Identity":
        """One identity standing for several ([Note: announced gathers]): any member
        that differs changes it; positioned at the first member."""
        packed = b"".join(struct.pack("<qq", m.what, m.where) for m in members)
        high = zlib.crc32(b"batch" + packed)
        return cls(_signed64(high << 32 | zlib.crc32(packed)), members[0].where)

    @property
    def text_code(self) -> int:
        return (self.what >> 32) & 0xFFFFFFFF

    @property
    def size_code(self) -> int:
        return self.what & 0xFFFFFFFF

    @property
    def step(self) -> int:
        return (self.where >> 32) & 0x7FFFFFFF

    @property
    def call(self) -> int:
        return self.where & 0xFFFFFFFF

    def raw(self, device) -> torch.Tensor:
        return torch.tensor([self.what, self.where], dtype=torch.int64).view(torch.uint8).to(device)

    def digest(self) -> int:
        return zlib.crc32(struct.pack("<qq", self.what, self.where)) or 1


def header_elements(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` that hold a raw header."""
    size = torch.empty((), dtype=dtype).element_size()
    return -(-HEADER_BYTES // size)


def bitsum_header_fits(dtype: torch.dtype, world_size: int) -> bool:
    return world_size <= _EXACT_COUNT.get(dtype, 0) or (not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool)


def _bits(digest: int, dtype, device) -> torch.Tensor:
    return torch.tensor([(digest >> i) & 1 for i in range(DIGEST_BITS)], dtype=dtype, device=device)


def _write_raw(dest: torch.Tensor, ident: Identity) -> None:
    dest.view(torch.uint8)[:HEADER_BYTES].copy_(ident.raw(dest.device))


def _read_raw(rows: torch.Tensor) -> List[Tuple[int, int]]:
    """(what, where) of each row of header elements."""
    raw = rows.clone().view(torch.uint8)[:, :HEADER_BYTES].clone().view(torch.int64)  # fresh, aligned storage
    return [tuple(r) for r in raw.tolist()]


def _release(*tensors: torch.Tensor) -> None:
    # The communicator keeps recent work handles (and so their buffers) alive for a
    # while (see comm.py, [Note: keeping recent work handles]): give the memory back now.
    for t in tensors:
        t.untyped_storage().resize_(0)


@dataclass
class Mismatch:
    """What the received headers said when they did not match this rank's own."""

    mine: Identity
    peers: Optional[List[Tuple[int, Tuple[int, int]]]]  # (rank, (what, where)) of each differing rank; None when summed
    detail: str


class Pending:
    """A collective in flight: the backend's work handle, and what to do once it has
    completed (check the headers, copy the payload out, free the staging)."""

    __slots__ = ("work", "_finish")

    def __init__(self, work, finish: Optional[Callable[[], Optional[Mismatch]]] = None) -> None:
        self.work = work
        self._finish = finish

    def finish(self) -> Optional[Mismatch]:
        f, self._finish = self._finish, None
        return f() if f is not None else None


class Works:
    """Several work handles waited for as one."""

    __slots__ = ("works",)

    def __init__(self, works: Sequence) -> None:
        self.works = list(works)

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self, *args) -> bool:
        for w in self.works:
            w.wait(*args)
        return True


def broadcast_rows(out: torch.Tensor, group, world_size: int) -> Works:
    """All-gather in place on gloo: ``out`` holds N equal rows, this rank's own row is
    filled in, and each rank's row reaches the others by one broadcast
    ([Note: gathers carried as broadcasts])."""
    rows = out.view(world_size, -1)
    ranks = dist.get_process_group_ranks(group) if group is not None else range(world_size)
    return Works([dist.broadcast(rows[r], src=src, group=group, async_op=True) for r, src in enumerate(ranks)])


# -- raw headers: each rank's chunk carries its own -------------------------------------------
def is_own_row(out: torch.Tensor, inp: torch.Tensor, world_size: int, rank: int) -> bool:
    """Whether ``inp`` is this rank's own row of ``out`` (an in-place all-gather)."""
    return (out.is_contiguous() and inp.is_contiguous() and out.dtype == inp.dtype
            and out.numel() == world_size * inp.numel() and out.view(world_size, -1)[rank].data_ptr() == inp.data_ptr())


def all_gather(out: torch.Tensor, inp: torch.Tensor, group, world_size: int, ident: Optional[Identity], *,
               rank: Optional[int] = None) -> Pending:
    """Concatenate every rank's ``inp`` into ``out`` (rank order); ``inp`` is cast to
    ``out``'s dtype on the header path unless it is ``out``'s own row, which gathers in
    place with its header beside it ([Note: headers beside in-place gathers]); any
    other input is staged ([Note: staged gathers])."""
    if ident is None:
        return Pending(all_gather_tensor(out, inp, group=group, async_op=True))
    if rank is None:
        rank = dist.get_rank(group)
    if inp.numel() and is_own_row(out, inp, world_size, rank):
        return _gather_with_header_beside(out, group, world_size, ident, rank)
    n = inp.numel()
    h = header_elements(out.dtype)
    recv = torch.empty(world_size * (n + h), dtype=out.dtype, device=inp.device)
    rows = recv.view(world_size, n + h)
    rows[:, n:].view(torch.uint8).zero_()
    # This rank's own row is the input (an in-place all-gather): no separate send buffer.
    send = rows[rank]
    send[:n].copy_(inp.reshape(-1))
    _write_raw(send[n:], ident)
    # One collective, whatever its size: a peer that issued something else then pairs
    # with it alone (staged gathers are small control traffic; the large ones run in place).
    work = all_gather_tensor(recv, send, group=group, async_op=True)

    def finish() -> Optional[Mismatch]:
        got = _read_raw(rows[:, n:])
        mine = (ident.what, ident.where)
        bad = [(r, g) for r, g in enumerate(got) if g != mine]
        if not bad:
            if out.is_contiguous():
                out.view(world_size, n).copy_(rows[:, :n])
            else:
                out.copy_(rows[:, :n].reshape(out.shape))
        _release(recv)
        return Mismatch(ident, bad, "") if bad else None

    return Pending(work, finish)


class _HeaderFirst:
    """The header's all-gather and then the payload's works, waited for as one, except
    that a header showing another collective ends the wait at once: the payload may then
    never complete (the peers issued something else, perhaps as a different number of
    collectives), and the error must not wait for a timeout."""

    __slots__ = ("header", "payload", "check", "mismatch")

    def __init__(self, header, payload, check: Callable[[], Optional[Mismatch]]) -> None:
        self.header, self.payload, self.check = header, payload, check
        self.mismatch: Optional[Mismatch] = None

    def _header_differs(self) -> bool:
        if self.check is not None and self.header.is_completed():
            self.header.wait()
            self.mismatch, self.check = self.check(), None
        return self.mismatch is not None

    def is_completed(self) -> bool:
        return self.header.is_completed() and (self._header_differs() or self.payload.is_completed())

    def wait(self, *args) -> bool:
        self.header.wait(*args)
        if not self._header_differs():
            self.payload.wait(*args)
        return True


def _gather_with_header_beside(out: torch.Tensor, group, world_size: int, ident: Identity, rank: int) -> Pending:
    heads = torch.zeros(world_size, 2, dtype=torch.int64, device=out.device)  # zeros: what no header reads as
    heads[rank] = torch.tensor([ident.what, ident.where], dtype=torch.int64)
    header = all_gather_tensor(heads.view(-1), heads[rank], group=group, async_op=True)

    def check() -> Optional[Mismatch]:
        mine = (ident.what, ident.where)
        bad = [(r, tuple(g)) for r, g in enumerate(heads.tolist()) if tuple(g) != mine]
        return Mismatch(ident, bad, "") if bad else None

    work = _HeaderFirst(header, broadcast_rows(out, group, world_size), check)
    return Pending(work, lambda: work.mismatch)


def broadcast(tensor: torch.Tensor, src_global: int, is_src: bool, group, ident: Optional[Identity]) -> Pending:
    """``tensor`` from the source rank on every rank (in place)."""
    if ident is None:
        return Pending(dist.broadcast(tensor, src=src_global, group=group, async_op=True))
    n = tensor.numel()
    h = header_elements(tensor.dtype)
    buf = torch.empty(n + h, dtype=tensor.dtype, device=tensor.device)
    if is_src:
        buf[:n].copy_(tensor.reshape(-1))
        _write_raw(buf[n:], ident)
    else:
        buf[n:].view(torch.uint8).zero_()
    work = dist.broadcast(buf, src=src_global, group=group, async_op=True)

    def finish() -> Optional[Mismatch]:
        bad = None
        if not is_src:
            got = _read_raw(buf[n:].view(1, h))[0]
            if got != (ident.what, ident.where):
                bad = Mismatch(ident, [(-1, got)], "the source rank's broadcast")
            else:
                tensor.copy_(buf[:n].view_as(tensor))
        _release(buf)
        return bad

    return Pending(work, finish)


# -- summed headers: the sums say whether every rank agreed ----------------------------------
def _check_sums(got: torch.Tensor, expected: torch.Tensor, ident: Identity, world_size: int) -> Optional[Mismatch]:
    if torch.equal(got, expected):
        return None
    counts = got.float().tolist()
    return Mismatch(ident, None, f"the summed header of {world_size} ranks was {counts[:8]}..., not {world_size} x this rank's bits")


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, world_size: int, ident: Optional[Identity],
                   via_all_reduce: bool = False, inp_is_scratch: bool = False, inp_is_kept: bool = False,
                   rider: Optional[torch.Tensor] = None) -> Pending:
    """Sum ``inp`` over ranks; this rank receives its equal slice in ``out``.

    ``via_all_reduce`` (gloo): gloo's reduce-scatter does its work inside ``wait()``
    (``is_completed()`` stays False until then), so no deadline can bound it; it is
    carried out as an all-reduce of a copy of ``inp``, of which this rank keeps its
    slice, with the summed header at the end (measured: the same time as gloo's own
    reduce-scatter, plus the copy).  When the caller discards ``inp`` afterwards
    (``inp_is_scratch``) and its storage has room for the header right after it
    (:data:`HEADER_ROOM` elements, see grad_storage.py), the all-reduce runs in place:
    no copy, and no second unit-sized buffer; its storage is then freed once the slice is
    out, unless the caller keeps it (``inp_is_kept``: stage 1's gradient buffer, which
    ``param.grad`` views).  ``rider``: summed along ([Note: riders]); only with
    ``via_all_reduce``."""
    if not via_all_reduce:
        if rider is not None:
            raise ValueError("a rider needs the reduce-scatter carried as an all-reduce (gloo)")
        return Pending(reduce_scatter_tensor(out, inp, group=group, async_op=True))
    s = out.numel()
    rank = dist.get_rank(group)
    if not bitsum_header_fits(inp.dtype, world_size):
        ident = None
    n = inp.numel()
    room = n + _trailer_numel(ident, rider)
    buf = _in_place(inp, room) if inp_is_scratch else None
    release = buf is None or not inp_is_kept
    if buf is None:
        buf = torch.empty(room, dtype=inp.dtype, device=inp.device)
        buf[:n].copy_(inp.reshape(-1))
    return _summed(buf, n, group, world_size, ident, rider,
                   lambda payload: out.copy_(payload[rank * s : (rank + 1) * s].view_as(out)), release=release)


def _in_place(t: torch.Tensor, room: int) -> Optional[torch.Tensor]:
    """``t`` extended over the ``room - t.numel()`` elements of its storage right after
    it, or None when it is not contiguous or its storage ends too soon."""
    storage, offset = t.untyped_storage(), t.storage_offset()
    if t.is_contiguous() and storage.nbytes() >= (offset + room) * t.element_size():
        return t.new_empty(0).set_(storage, offset, (room,))
    return None


def all_reduce(tensor: torch.Tensor, group, world_size: int, ident: Optional[Identity],
               rider: Optional[torch.Tensor] = None, room_after: bool = False) -> Pending:
    """Sum ``tensor`` in place over ranks; ``rider`` is summed along ([Note: riders]).

    ``room_after``: the elements of ``tensor``'s storage right after it are reserved for
    the header (:data:`HEADER_ROOM`, see grad_storage.py), so the header path sums in
    ``tensor`` itself instead of in a copy that is copied back."""
    if not bitsum_header_fits(tensor.dtype, world_size):
        ident = None
    if ident is None and rider is None:
        return Pending(dist.all_reduce(tensor, group=group, async_op=True))
    n = tensor.numel()
    room = n + _trailer_numel(ident, rider)
    buf = _in_place(tensor, room) if room_after else None
    if buf is not None:
        return _summed(buf, n, group, world_size, ident, rider, lambda payload: None, release=False)
    buf = torch.empty(room, dtype=tensor.dtype, device=tensor.device)
    buf[:n].copy_(tensor.reshape(-1))
    return _summed(buf, n, group, world_size, ident, rider, lambda payload: tensor.copy_(payload.view_as(tensor)))


def _trailer_numel(ident: Optional[Identity], rider: Optional[torch.Tensor]) -> int:
    return (DIGEST_BITS if ident is not None else 0) + (0 if rider is None else rider.numel())


def _summed(buf: torch.Tensor, n: int, group, world_size: int, ident: Optional[Identity],
            rider: Optional[torch.Tensor], take: Callable[[torch.Tensor], object], release: bool = True) -> Pending:
    """All-reduce ``buf``: its first ``n`` elements (the payload, already in place), then
    the summed header (with ``ident``) and the rider.  Once the sums check out,
    ``take(payload)`` copies the result out and the rider gets its sum; then ``buf``'s
    storage is freed, unless ``release`` is False (it is a caller's own buffer)."""
    h = DIGEST_BITS if ident is not None else 0
    bits = None
    if ident is not None:
        bits = _bits(ident.digest(), buf.dtype, buf.device)
        buf[n : n + h].copy_(bits)
    if rider is not None:
        buf[n + h :].copy_(rider.reshape(-1))
    work = dist.all_reduce(buf, group=group, async_op=True)

    def finish() -> Optional[Mismatch]:
        bad = _check_sums(buf[n : n + h], bits * world_size, ident, world_size) if bits is not None else None
        if bad is None:
            take(buf[:n])
            if rider is not None:
                rider.copy_(buf[n + h :].view_as(rider))
        if release:
            _release(buf)
        return bad

    return Pending(work, finish)


def reduce_gathered(rows: torch.Tensor, op: str) -> torch.Tensor:
    """The control reductions, done locally over every rank's gathered row (rank order,
    so every rank computes bit-identical results)."""
    if op == "sum":
        return rows.sum(dim=0)
    if op == "max":
        return rows.amax(dim=0)
    raise ValueError(f"unknown reduction {op!r}")


__all__: Sequence[str] = [
    "Identity", "Mismatch", "Pending", "all_gather", "all_reduce", "broadcast", "reduce_scatter",
    "reduce_gathered", "header_elements", "bitsum_header_fits",
]


def all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group,
               world_size: int, ident: Optional[Identity]) -> Pending:
    """Chunk ``r`` of ``inp`` (``in_splits[r]`` elements) goes to rank ``r``; chunk ``r``
    of ``out`` comes from rank ``r``.  With a header, every chunk carries its own after
    its payload (staged), so a rank that issued something else is named on receipt."""
    if ident is None:
        return Pending(dist.all_to_all_single(out, inp, list(out_splits), list(in_splits), group=group, async_op=True))
    h = header_elements(inp.dtype)
    send = torch.empty(sum(in_splits) + h * world_size, dtype=inp.dtype, device=inp.device)
    recv = torch.empty(sum(out_splits) + h * world_size, dtype=out.dtype, device=out.device)
    at = src = 0
    for n in in_splits:
        send[at : at + n].copy_(inp[src : src + n])
        send[at + n : at + n + h].view(torch.uint8).zero_()
        _write_raw(send[at + n : at + n + h], ident)
        at, src = at + n + h, src + n
    work = dist.all_to_all_single(recv, send, [n + h for n in out_splits], [n + h for n in in_splits],
                                  group=group, async_op=True)

    def finish() -> Optional[Mismatch]:
        mine = (ident.what, ident.where)
        bad, at, dst = [], 0, 0
        for r, n in enumerate(out_splits):
            got = _read_raw(recv[at + n : at + n + h].reshape(1, h))[0]
            if got != mine:
                bad.append((r, got))
            elif not bad:
                out[dst : dst + n].copy_(recv[at : at + n])
            at, dst = at + n + h, dst + n
        _release(send, recv)
        return Mismatch(ident, bad, "") if bad else None

    return Pending(work, finish)
