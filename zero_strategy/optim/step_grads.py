"""The gradients a step applies: each unit's reduced slice as the optimizer sees it, after
this step's fp16 unscale and any clipping.

Clipping does not rewrite the reduced gradients: it records an operation (multiply by a
coefficient, or clamp), applied when the step reads a unit's gradient, one unit's fp32
temporary at a time.  An operation names an optimizer (its units only) or None (all).
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch


class StepGradients:
    def __init__(self, sharded) -> None:
        self._sharded = sharded
        self._ops: List[tuple] = []  # (op, value, optimizer index or None)

    def begin(self, inv_scale: float = 1.0) -> None:
        """A new step's gradients: only the fp16 unscale (if any) so far."""
        self._ops = [("mul", inv_scale, None)] if inv_scale != 1.0 else []

    def scale(self, coef: float, k: Optional[int]) -> None:
        self._ops.append(("mul", coef, k))

    def clamp(self, value: float, k: Optional[int]) -> None:
        self._ops.append(("clamp", value, k))

    def pending(self, unit, start: int):
        """The operations from index ``start`` on that apply to ``unit``, and the index
        after the last (for ``.grad`` reads: sharding/grad_reads.py)."""
        return [(op, value) for op, value, k in self._ops[start:] if k is None or k == unit.optimizer_index], len(self._ops)

    def of(self, unit) -> torch.Tensor:
        """This unit's gradient as the optimizer will see it: this rank's reduced slice,
        on the optimizer's device in fp32, with this step's operations applied (those an
        edit through ``.grad`` has not already carried into the slice)."""
        g = unit.grads.reduced()
        target = unit.params_store.optimizer_target
        ops, _ = self.pending(unit, unit.grads.ops_baked)
        if not ops and g.dtype == target.dtype and g.device == target.device:
            return g
        out = g.to(device=target.device, dtype=target.dtype, copy=True)
        apply_operations(out, ops)
        return out

    def norm(self, units, norm_type: float) -> torch.Tensor:
        """Collective (stages 1-3).  The global ``norm_type`` norm of ``units``' step
        gradients over every rank's shard."""
        s = self._sharded
        dev = s.compute_device()
        local = torch.zeros((), device=dev, dtype=torch.float32)
        for u in units:  # one unit's fp32 temporary at a time
            g = self.of(u).float()
            part = g.abs().max() if norm_type == math.inf else g.norm(norm_type) ** norm_type
            local = torch.maximum(local, part.to(dev)) if norm_type == math.inf else local + part.to(dev)
            del g
        op = "max" if norm_type == math.inf else "sum"
        # Replicated gradients (stage 0) are whole on every rank: nothing to combine.
        if not s.policies.stage.gradients_are_replicated:
            local = s.comm.control_all_reduce(local.reshape(1), op, label="the gradient norm")[0]
        return local if norm_type == math.inf else local ** (1.0 / norm_type)


def apply_operations(t: torch.Tensor, ops) -> None:
    """Apply recorded ``(op, value)`` operations to ``t`` in place, in order."""
    for op, value in ops:
        if op == "mul":
            t.mul_(value)
        else:
            t.clamp_(-value, value)
