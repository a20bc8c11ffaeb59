"""Whole parameters for optimizers that are not element-wise.

[Note: whole-parameter optimizers]
An optimizer whose update depends on the whole parameter (Adafactor, Muon, LAMB, ...;
[Note: element-wise or whole-parameter] in optimizer_kinds.py) is handed each
parameter whole, on one rank, its *owner*.  Storage and communication stay flat: the
flat units, their reduce-scatter and all-gather are exactly those of an element-wise
optimizer.  Only the step changes:

* a parameter that lies inside one rank's shard (most of them: a shard is a run of
  whole parameters, cut only at its two ends) is owned by that rank and updated in
  place through a shaped view of the shard, as an element-wise optimizer's is: no
  extra memory, no extra communication;
* a parameter cut by a shard boundary is owned by one of the ranks holding a piece of
  it (the largest cut parameters first, each to the holder with the least work so far,
  as DistMuon deals matrices out block-cyclically by size).  At the step, each holder
  sends its pieces of the gradient and of the fp32 value to the owner (one all-to-all
  per unit), the owner steps the whole tensor, and sends the updated pieces back (a
  second all-to-all), which land in the holders' shards.

Communication per step, in elements per rank: with ``Ψc`` the elements of the cut
parameters and every rank holding ``1/N`` of them, each rank sends at most
``2Ψc/N`` (gradient and value) and receives back at most ``Ψc/N``: ``3Ψc/N`` at most,
beside the ``2Ψ`` (stages 1-2) or ``3Ψ`` (stage 3) of the paper's formulas.  A unit has
at most ``N - 1`` cut parameters, so ``Ψc`` is bounded by ``N - 1`` parameters per
unit; it is 0 at stage 0 (one shard holds everything) and whenever the boundaries fall
between parameters.  The communicator counts it as ``whole_param_exchange``.

Memory: the optimizer state of a parameter lives whole on its owner (its size is the
optimizer's: a factored Adafactor keeps rows + columns, not a matrix); balanced by
size, so about ``1/N`` of the model's state per rank, as in the paper's P_os.  During
the step the owner of a cut parameter holds its whole fp32 value and gradient
(``2 x 4`` bytes per element, one unit at a time when the optimizer steps unit by
unit, every unit's at once otherwise), freed after the step; ``memory_report()``
names it ``whole_param_step``.

Unused parameters stay exact: the owner gives a parameter that got no gradient on any
rank no ``.grad``, so the optimizer skips it, and the values sent back are unchanged.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .layout import FlatLayout


def pieces_of(layout: FlatLayout, i: int) -> List[Tuple[int, int, int, int]]:
    """``(shard, start_in_tensor, start_in_shard, length)`` of every shard holding part
    of tensor ``i`` (none for an empty tensor)."""
    off, n, s = layout.offsets[i], layout.numels[i], layout.shard_numel
    out = []
    if n == 0:
        return out
    for r in range(off // s, (off + n - 1) // s + 1):
        a, b = max(r * s, off), min((r + 1) * s, off + n)
        out.append((r, a - off, a - r * s, b - a))
    return out


def assign_owners(layouts: Sequence[FlatLayout]) -> List[List[int]]:
    """Per unit, per tensor: the shard whose rank updates that tensor whole.

    Pure and deterministic (every rank computes the same answer): a tensor inside one
    shard is that shard's; cut tensors go, largest first, to the holding shard with the
    least work so far (ties: the larger piece, then the lower shard, so that less moves)."""
    world = max((l.world_size for l in layouts), default=1)
    load = [0] * world
    owners: List[List[int]] = []
    cut = []
    for ui, layout in enumerate(layouts):
        row = []
        for i, n in enumerate(layout.numels):
            pieces = pieces_of(layout, i)
            if len(pieces) == 1:
                row.append(pieces[0][0])
                load[pieces[0][0]] += n
            elif not pieces:  # empty: the shard its offset falls in
                row.append(min(layout.offsets[i] // layout.shard_numel, layout.world_size - 1))
            else:
                row.append(-1)
                cut.append((n, ui, i, pieces))
        owners.append(row)
    cut.sort(key=lambda c: (-c[0], c[1], c[2]))
    for n, ui, i, pieces in cut:
        shard = min(pieces, key=lambda p: (load[p[0]], -p[3], p[0]))[0]
        owners[ui][i] = shard
        load[shard] += n
    return owners


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _allocate(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


class WholeParams:
    """One unit's optimizer tensors for a whole-parameter optimizer on this rank: one
    whole tensor per parameter this rank owns (see the module note), and the two
    exchanges that bring cut parameters to their owners and back."""

    def __init__(self, layout: FlatLayout, shard_index: int, owners: Sequence[int], shapes: Sequence[tuple],
                 target: torch.Tensor, label: str) -> None:
        self.layout, self.me, self.owners, self.label = layout, shard_index, list(owners), label
        self.target = target
        world = layout.world_size
        self.positions = [i for i, o in enumerate(self.owners) if o == shard_index]
        self._local: Dict[int, Tuple[int, int, int]] = {}  # i -> (t_start, s_start, length) of this shard's piece
        cut = []
        for i in range(len(self.owners)):
            pieces = pieces_of(layout, i)
            for r, t0, s0, n in pieces:
                if r == shard_index:
                    self._local[i] = (t0, s0, n)
            if len(pieces) > 1:
                cut.append((i, pieces))
        self.cut = {i for i, _ in cut}
        # The same on every rank (layout and owners are), so every rank joins the exchanges.
        self.exchanges = bool(self.cut)
        self._send: List[List[Tuple[int, int, int, int]]] = [[] for _ in range(world)]  # to owner o: my pieces
        self._recv: List[List[Tuple[int, int, int]]] = [[] for _ in range(world)]  # from holder r: its pieces of mine
        for i, pieces in cut:  # ascending i on both sides, so the chunks line up
            o = self.owners[i]
            for r, t0, s0, n in pieces:
                if r == o:
                    continue
                if r == shard_index:
                    self._send[o].append((i, t0, s0, n))
                if o == shard_index:
                    self._recv[r].append((i, t0, n))
        self.tensors: List[nn.Parameter] = []
        self._grads: Dict[int, torch.Tensor] = {}
        for i in self.positions:
            if i in self.cut:
                buf = torch.empty(shapes[i], dtype=target.dtype, device=target.device)
                _free(buf)  # allocated only during the step
                self.tensors.append(nn.Parameter(buf, requires_grad=True))
            else:
                _, s0, n = self._local.get(i, (0, 0, 0))
                # A Parameter made from a view shares its storage: the update lands in the shard.
                self.tensors.append(nn.Parameter(target[s0 : s0 + n].view(shapes[i]), requires_grad=True))

    def step_bytes(self) -> int:
        """Bytes this rank holds for its cut parameters during the step (value + gradient)."""
        return sum(2 * t.numel() * t.element_size() for t, i in zip(self.tensors, self.positions) if i in self.cut)

    # -- the step --------------------------------------------------------------------------
    def arrive(self, grad: torch.Tensor, used: Optional[Sequence[bool]], comm, device: torch.device) -> None:
        """Collective when :attr:`exchanges`.  Give every owned tensor its whole value and
        gradient (``grad``: this rank's flat fp32 gradient slice), or no gradient where
        ``used[position]`` is False."""
        target = self.target
        if self.exchanges:
            world = self.layout.world_size
            in_splits = [2 * sum(p[3] for p in self._send[r]) for r in range(world)]
            out_splits = [2 * sum(p[2] for p in self._recv[r]) for r in range(world)]
            send = torch.empty(sum(in_splits), dtype=target.dtype, device=device)
            at = 0
            for r in range(world):
                for source in (grad, target):
                    for _, _, s0, n in self._send[r]:
                        send[at : at + n].copy_(source[s0 : s0 + n])
                        at += n
            recv = torch.empty(sum(out_splits), dtype=target.dtype, device=device)
            comm.all_to_all(recv, send, out_splits, in_splits, label=f"the whole parameters of {self.label}")
            del send
            for t, i in zip(self.tensors, self.positions):
                if i not in self.cut:
                    continue
                _allocate(t.data)
                g = self._grads[i] = torch.empty(t.numel(), dtype=target.dtype, device=target.device)
                t0, s0, n = self._local[i]
                g[t0 : t0 + n].copy_(grad[s0 : s0 + n])
                t.data.view(-1)[t0 : t0 + n].copy_(target[s0 : s0 + n])
            at = 0
            by_pos = dict(zip(self.positions, self.tensors))
            for r in range(world):
                for into_grad in (True, False):
                    for i, t0, n in self._recv[r]:
                        dest = self._grads[i] if into_grad else by_pos[i].data.view(-1)
                        dest[t0 : t0 + n].copy_(recv[at : at + n])
                        at += n
            del recv
        for t, i in zip(self.tensors, self.positions):
            if used is not None and not used[i]:
                t.grad = None
            elif i in self.cut:
                t.grad = self._grads[i].view(t.shape)
            else:
                _, s0, n = self._local.get(i, (0, 0, 0))
                t.grad = grad[s0 : s0 + n].view(t.shape)

    def depart(self, comm, device: torch.device) -> None:
        """Collective when :attr:`exchanges`.  Send the updated cut parameters back to the
        shards that hold them, and free their whole copies."""
        target = self.target
        for t in self.tensors:
            t.grad = None
        self._grads.clear()
        if not self.exchanges:
            return
        world = self.layout.world_size
        by_pos = dict(zip(self.positions, self.tensors))
        in_splits = [sum(p[2] for p in self._recv[r]) for r in range(world)]
        out_splits = [sum(p[3] for p in self._send[r]) for r in range(world)]
        send = torch.empty(sum(in_splits), dtype=target.dtype, device=device)
        at = 0
        for r in range(world):
            for i, t0, n in self._recv[r]:
                send[at : at + n].copy_(by_pos[i].data.view(-1)[t0 : t0 + n])
                at += n
        recv = torch.empty(sum(out_splits), dtype=target.dtype, device=device)
        comm.all_to_all(recv, send, out_splits, in_splits, label=f"the updated whole parameters of {self.label}")
        for t, i in zip(self.tensors, self.positions):
            if i in self.cut:
                t0, s0, n = self._local[i]
                target[s0 : s0 + n].copy_(t.data.view(-1)[t0 : t0 + n])
                _free(t.data)
        at = 0
        for r in range(world):
            for _, _, s0, n in self._send[r]:
                target[s0 : s0 + n].copy_(recv[at : at + n])
                at += n

    def clear(self) -> None:
        for t in self.tensors:
            t.grad = None
        self._grads.clear()
