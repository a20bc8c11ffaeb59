"""Which parameters got a gradient this step on any rank, and whether fp16 overflowed.

A step leaves a parameter that got no gradient on every rank alone, as DDP does ([Note:
one optimizer tensor per parameter] in flat_unit.py), so each synchronised step agrees
on one flag per parameter (max over ranks), together with fp16's overflow flag.

[Note: usage rider]
Usually every parameter got one, and a collective of its own costs a fixed latency,
which on a small model is a large part of the step.  So on gloo the last gradient
collective carries one flag per rank ("some parameter got no gradient here", [Note:
riders] in collectives.py); only when its sum is not zero do the ranks exchange the
per-parameter flags, after the flush.  Elsewhere (NCCL) the exchange is issued while the
last buckets are in flight, so its latency hides behind theirs.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

# What the agreement settles to when the rider said no rank missed a gradient.
_EVERY_PARAMETER_USED = object()


class UsageAgreement:
    def __init__(self, sharded) -> None:
        self._sharded = sharded
        self._in_flight = None  # a control reduction in flight, or _EVERY_PARAMETER_USED
        self._rider: Optional[torch.Tensor] = None  # this backward's rider, once the last unit was launched
        self._used: Optional[Dict[int, List[bool]]] = None  # per unit: which parameters got a gradient

    def reset(self) -> None:
        """A new backward may add gradients, or a step ended: agree again."""
        self._in_flight = None
        self._rider = None

    def clear(self) -> None:
        self.reset()
        self._used = None

    def used_of(self, unit) -> Optional[List[bool]]:
        """Which of ``unit``'s parameters got a gradient on some rank (None: all did),
        less those whose ``.grad`` was set to None since ([Note: .grad under ZeRO] in
        sharding/grad_reads.py: every rank sets it alike)."""
        used = None if self._used is None else self._used.get(unit.index)
        dropped = unit.grads.dropped
        if not dropped:
            return used
        return [(used is None or used[i]) and i not in dropped for i in range(len(unit.params))]

    def _flags(self, overflow: float = 0.0) -> torch.Tensor:
        flags = [overflow]
        for u in self._sharded.trainable_units:
            received = u.grads.received
            flags.extend(1.0 if i in received else 0.0 for i in range(len(u.params)))
        return torch.tensor(flags, device=self._sharded.compute_device())

    def _wanted(self) -> bool:
        # Not with fp16 loss scaling (its overflow flag needs the reduced gradients) nor
        # on a planning dry run (meta tensors).
        s = self._sharded
        return not (s.policies.precision.loss_scaling or not s.trainable_units or s.compute_device().type == "meta")

    def rider(self, synced: bool = True) -> Optional[torch.Tensor]:
        """The flag the last gradient collective carries (gloo), or None.  A backward
        that does not synchronise (no_sync) carries a zero in its place, unread: the
        collective then has the same size either way, so ranks that disagree on whether
        this micro-batch ends a step (one skipped a batch) fail on the header instead
        of gloo aborting the receiving process on a longer message."""
        s = self._sharded
        if not (s.comm.carries_riders and self._wanted()):
            return None
        if not synced:
            return torch.zeros(1, device=s.compute_device())
        missed = any(len(u.grads.received) < len(u.params) for u in s.trainable_units)
        self._rider = torch.tensor([1.0 if missed else 0.0], device=s.compute_device())
        return self._rider

    def read_rider(self) -> None:
        """After the flush: settle on the rider's sum, or exchange the flags when some rank
        missed a gradient."""
        rider, self._rider = self._rider, None
        if rider is None:
            return
        if float(rider.item()) == 0.0:
            self._in_flight = _EVERY_PARAMETER_USED
        else:
            self._in_flight = self._sharded.comm.control_all_reduce_async(
                self._flags(), "max", label="which parameters got gradients")

    def start(self) -> None:
        """Issue the agreement while the last gradient buckets are still in flight (unless
        the last bucket carries the rider)."""
        self._in_flight = None
        if self._rider is not None or not self._wanted():
            return
        self._in_flight = self._sharded.comm.control_all_reduce_async(
            self._flags(), "max", label="which parameters got gradients")

    def settle(self) -> bool:
        """Wait for (or run) the agreement; returns whether any rank overflowed (fp16)."""
        s = self._sharded
        loss_scaling = s.policies.precision.loss_scaling
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is _EVERY_PARAMETER_USED:
            self._used = None
            return False
        if in_flight is not None:
            agreed = in_flight.result()
        else:
            overflow = 0.0
            if loss_scaling:
                overflow = float(any(not bool(torch.isfinite(u.grads.reduced()).all()) for u in s.trainable_units))
            agreed = self._flags(overflow)
            if agreed.numel() > 1 or loss_scaling:
                what = "which parameters got gradients" + (" and the fp16 overflow check" if loss_scaling else "")
                agreed = s.comm.control_all_reduce(agreed, "max", label=what)
        if agreed.device.type == "meta":  # a planning dry run: every parameter counts as used
            self._used = None
            return False
        values = agreed.tolist()
        self._used, at = {}, 1
        for u in s.trainable_units:
            self._used[u.index] = [v > 0 for v in values[at : at + len(u.params)]]
            at += len(u.params)
        return values[0] > 0
