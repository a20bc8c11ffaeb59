"""When gradients are reduced: bucket readiness, fixed launch order, bounded in-flight.

[Note: fixed launch order]
Units are reduced in one order fixed at construction (reverse registration order, the
order backward normally finishes them).  A unit whose gradients are complete is
launched only after every unit before it has been launched; whatever is left when
backward ends is launched then, in the same order.  So every rank issues the same
collectives in the same sequence even when a parameter gets no gradient on one rank
(an unused branch), which is what keeps mismatched collectives from hanging or
silently mixing buffers.

The last unit's collective may carry the engine's rider (``rider(synced)``: a callable
returning a small tensor of flags, or None), summed over ranks along with the gradients
([Note: riders] in collectives.py); a synchronised backward's is read after
:meth:`flush` has waited, a no_sync backward's is a zero placeholder that keeps the
collective the same size.

Reduction happens on synchronised backward passes; inside ``no_sync`` stages 0 and 1
only accumulate locally, while stages 2 and 3 still reduce every micro-batch (their
full-size gradient never outlives its bucket) unless ``no_sync_reduces`` is off.
"""
from __future__ import annotations

from collections import deque
from typing import Deque, Tuple

import torch

from ..communication.hierarchical import TwoLevelReduceScatter


class GradientReducer:
    """Launches each trainable unit's gradient collective in the fixed order, keeping at
    most ``max_in_flight`` elements of buckets in flight (the paper's C_B bound; a unit
    larger than the bound waits until nothing else is in flight and then goes alone, so
    the peak is at most max(max_in_flight, largest unit)).
    Which collective, and whether to reduce inside no_sync, is the unit's gradient
    storage's to say (see :mod:`~zero_strategy.grad_storage`)."""

    def __init__(self, units, comm, *, overlap: bool, max_in_flight: int, rider=None) -> None:
        self.units = list(units)  # trainable units, in launch order
        self.comm = comm
        self.rider = rider  # () -> a tensor or not, asked at the last launch of a synchronised backward
        self.overlap = overlap
        self.max_in_flight = max_in_flight
        self._next = 0  # index of the next unit to launch in this backward
        self._launched = [False] * len(self.units)
        self._pending: Deque[Tuple[object, object, torch.Tensor, torch.Tensor]] = deque()
        self._in_flight = 0
        self.peak_in_flight = 0  # elements: the C_B bound the tests check
        self.reduced_this_backward = False

    @staticmethod
    def reduces_now(unit, synced: bool) -> bool:
        return synced or unit.grads.reduces_unsynced

    def on_grad_ready(self, unit, synced: bool) -> None:
        """A parameter of ``unit`` finished accumulating; launch what is now in order."""
        if not self.reduces_now(unit, synced) or not self.overlap:
            return
        while self._next < len(self.units) and self.units[self._next].grads.complete:
            self._launch(self._next, synced)

    def _launch(self, i: int, synced: bool) -> None:
        unit = self.units[i]
        grads = unit.grads
        self._launched[i] = True
        self._next = i + 1
        # C_B: make room first, so buffers in flight never exceed the bound.
        while self._pending and self._in_flight + unit.layout.padded_numel > self.max_in_flight:
            self._finish_oldest()
        full = grads.reduction_input(self.comm.world_size)
        label = f"the gradients of {unit.label}"
        # Every unit was launched before the last one, so whatever the rider reports is final.
        rider = self.rider(synced) if self.rider is not None and i == len(self.units) - 1 else None
        if not isinstance(rider, torch.Tensor):
            rider = None  # none wanted, or (held weakly) its engine is gone
        if grads.collective == "all_reduce":
            work = self.comm.all_reduce(full, async_op=True, label=label, rider=rider,
                                        room_after=grads.reduction_input_has_room)
            out = full
        elif self.comm.gradient_quantization is not None:  # qgZ ([Note: two-level reduction] in hierarchical.py)
            out = grads.reduction_output()
            work = TwoLevelReduceScatter(self.comm, out, full, *self.comm.gradient_quantization, label)
        else:
            out = grads.reduction_output()
            work = self.comm.reduce_scatter(out, full, async_op=True, label=label, scratch=grads.reduction_input_is_scratch,
                                            kept=grads.reduction_input_is_kept,
                                            rider=rider)
        # Keep ``full`` referenced until the collective has finished with it.
        self._pending.append((unit, work, out, full))
        self._in_flight += full.numel()
        self.peak_in_flight = max(self.peak_in_flight, self._in_flight)

    def _finish_oldest(self) -> None:
        unit, work, out, full = self._pending.popleft()
        work.wait()
        self._in_flight -= full.numel()
        unit.grads.finish_reduction(out)

    def flush(self, synced: bool, while_in_flight=None) -> None:
        """End of backward: launch the rest in order, call ``while_in_flight()`` (work
        whose latency may overlap the last reductions), then wait for everything."""
        any_reduced = False
        for i, unit in enumerate(self.units):
            if not self._launched[i] and self.reduces_now(unit, synced):
                self._launch(i, synced)
            any_reduced = any_reduced or self._launched[i]
        if while_in_flight is not None:
            while_in_flight()
        while self._pending:
            self._finish_oldest()
        self._next = 0
        self._launched = [False] * len(self.units)
        for u in self.units:
            u.grads.end_of_backward()
        self.reduced_this_backward = any_reduced

    @property
    def busy(self) -> bool:
        return bool(self._pending)
