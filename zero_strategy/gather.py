"""Stage 3: when partitioned parameters are gathered, prefetched and released.

[Note: module groups]
A :class:`ModuleGroup` is the set of flat units owned by one unit module (a transformer
block, or the root for everything else).  Its life in one training step:

  forward:  pre-forward   -> gather (wait for a prefetch if one is in flight),
                             prefetch the next groups in recorded forward order
            post-forward  -> release; register pre-backward hooks on the outputs
  backward: pre-backward  -> gather again, prefetch the next groups in reverse order
            post-backward -> release (gradients were already copied out by the
                             parameter hooks); fires from an identity autograd
                             function applied to the module's inputs
  end of backward         -> release anything still gathered

Forward order is recorded on the first training forward and reused; all ranks must run
the same modules in the same order (the reliability checks enforce this).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from .param_shard import ShardState


class ModuleGroup:
    def __init__(self, module: nn.Module, name: str, units) -> None:
        self.module = module
        self.name = name
        self.units = list(units)
        self.numel = sum(u.layout.padded_numel for u in self.units)

    @property
    def gathered(self) -> bool:
        return all(u.state is not ShardState.SHARDED for u in self.units)

    def start_gather(self, comm) -> None:
        for u in self.units:
            u.params_store.start_gather(comm, u.label)

    def wait(self) -> None:
        for u in self.units:
            u.params_store.finish_gather()

    def release(self) -> None:
        for u in self.units:
            u.params_store.release()


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs whose backward marks the module's backward as done."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None,) + grads


class ParameterGatherer:
    """Decides when each module group is gathered and released (stage 3)."""

    def __init__(self, groups: List[ModuleGroup], root: nn.Module, comm, *, prefetch_numel: int) -> None:
        self.groups = groups
        self.by_module: Dict[int, ModuleGroup] = {id(g.module): g for g in groups}
        self.root_group = self.by_module.get(id(root))
        self.comm = comm
        self.prefetch_numel = prefetch_numel
        self.forward_order: List[ModuleGroup] = []
        self._order_frozen = False
        self.in_backward = False

    # -- helpers ------------------------------------------------------------------------
    def ensure_gathered(self, group: ModuleGroup) -> None:
        group.start_gather(self.comm)
        group.wait()

    def _prefetch(self, candidates) -> None:
        """Gather ahead the groups that come next, within ``prefetch_numel`` elements
        (counting those already gathered): always the next one, then more only while
        they fit, so the parameters held ahead never exceed max(budget, next group)."""
        budget = self.prefetch_numel
        if budget <= 0:
            return
        for i, g in enumerate(candidates):
            if i > 0 and g.numel > budget:
                break
            if not g.gathered:
                g.start_gather(self.comm)
            budget -= g.numel
            if budget <= 0:
                break

    # -- forward ------------------------------------------------------------------------
    def pre_forward(self, group: ModuleGroup) -> None:
        self.ensure_gathered(group)
        if not self._order_frozen and torch.is_grad_enabled() and not self.in_backward:
            if group not in self.forward_order:
                self.forward_order.append(group)
        elif self._order_frozen and not self.in_backward and group in self.forward_order:
            i = self.forward_order.index(group)
            self._prefetch(self.forward_order[i + 1 :])

    def post_forward(self, group: ModuleGroup, output) -> None:
        if self.in_backward:
            return  # recomputation inside backward (activation checkpointing): keep it
        group.release()
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            fired = [False]

            def pre_backward_hook(grad, group=group):
                if not fired[0]:
                    fired[0] = True
                    self.pre_backward(group)
                return grad

            for t in tensors:
                t.register_hook(pre_backward_hook)

    def wrap_inputs_for_post_backward(self, group: ModuleGroup, args, kwargs):
        """Route the module's floating inputs through :class:`_PostBackward`."""
        if not torch.is_grad_enabled() or self.in_backward:
            return args, kwargs
        positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        if not positions and not keys:
            return args, kwargs
        inputs = [args[i] for i in positions] + [kwargs[k] for k in keys]
        outs = _PostBackward.apply(lambda g=group: self.post_backward(g), *inputs)
        args = list(args)
        for j, i in enumerate(positions):
            args[i] = outs[j]
        kwargs = dict(kwargs)
        for j, k in enumerate(keys):
            kwargs[k] = outs[len(positions) + j]
        return tuple(args), kwargs

    def end_of_forward(self) -> None:
        """Root forward finished: release every group a lazy hook may have gathered."""
        if self.in_backward:
            return
        for g in self.groups:
            g.release()

    # -- backward -----------------------------------------------------------------------
    def pre_backward(self, group: ModuleGroup) -> None:
        self.in_backward = True
        if not self._order_frozen and self.forward_order:
            self._order_frozen = True
        self.ensure_gathered(group)
        if group in self.forward_order:
            i = self.forward_order.index(group)
            self._prefetch(reversed(self.forward_order[:i]))

    def post_backward(self, group: ModuleGroup) -> None:
        group.release()

    def end_of_backward(self) -> None:
        for g in self.groups:
            g.release()
        self.in_backward = False
