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

[Note: kept for backward]
Two orders are recorded: the order groups start their forward (what both forward and
backward prefetch by) and the order they are released at the end of their forward.  A
group that encloses others (the root: embeddings and head) starts first but is released
last, and its backward comes first.  The group released last in a grad-enabled forward
is not released at all: backward would gather it again as its first collective, with
nothing run in between that needs the memory back (the same choice as FSDP2's
unresharded root and DeepSpeed's reuse distance).  It is released as usual after its
own backward, or by step / zero_grad / a no-grad forward when no backward comes.
Backward deliberately does not prefetch by reverse release order: that would gather the
last block during the head's backward, while the logits' gradient is alive, raising the
peak by one block (25M GPT-2, fp32, N=2: 447 -> 475 MB of tensors) for no measurable
step time; the last block is gathered at its own backward, and each one prefetches the
block before it.

[Note: merged groups]
Sibling unit modules too small to be worth a collective each (planner.py,
``min_gather_numel``) share one group: its *members*, in registration order.  Each
member's hooks run as above, but the group stays gathered from its first member's
pre-forward until its last member's post-forward, and in backward until the first
member's post-backward when no member's backward is still running (members may be
parallel branches, e.g. experts, whose backward autograd interleaves).  Members run in
another order, or skipped, cost at most a repeated gather or a group held until the
end of forward / backward, never a wrong value.

[Note: on-demand gathers]
Code may use a partitioned parameter outside its own module's forward: TRL reads
``lm_head.weight`` for a fused loss after the model's forward, torch.nn's
TransformerEncoder inspects its layers' weights before running them, a parent module
may use a child's weight.  The guard (guard.py) sees every such use and asks
:meth:`ParameterGatherer.on_access`.  Inside the training window (a root forward, a
backward, or between a grad-enabled root forward and its backward) the group is
gathered if it is not, and *pinned*: autograd may have saved the parameter for
backward, so the group stays gathered until the end of that backward (or, after a
no-grad forward, until the forward ends; at the latest until step / zero_grad).
Every rank runs the same code, so every rank makes the same gather.  Each group's
first on-demand gather is logged once at DEBUG level (logger ``zero_strategy``) and
all of them are counted in ``on_demand_gathers``.  Outside the window the guard
raises its PartitionedParameterError instead, since a gather issued by one rank alone
would hang.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from ..reliability.guard import set_guard
from .param_shard import ShardState

log = logging.getLogger("zero_strategy")


class ModuleGroup:
    def __init__(self, module: nn.Module, name: str, units, members=()) -> None:
        self.module = module  # the first member
        self.members = tuple(members) or (module,)  # see [Note: merged groups]
        self.name = name
        self.units = list(units)
        self.numel = sum(u.layout.padded_numel for u in self.units)
        self._active = False  # a member's forward or backward is running (or the span between members)
        self.in_backward_members = 0  # members whose backward started and has not finished
        self._pinned = False  # used outside its module: kept gathered (see [Note: on-demand gathers])
        self.held = False  # inside engine.keep_gathered(): not released until the region ends
        self.kept_for_backward = False  # released last by forward: backward needs it first ([Note: kept for backward])
        self.logged_on_demand = False
        self.logged_opaque = False

    # Every use of an active or pinned group is allowed, so while it is one (and
    # gathered) its parameters go without the guard's per-operation check
    # ([Note: guard lifted while in use] in guard.py).
    @property
    def active(self) -> bool:
        return self._active

    @active.setter
    def active(self, value: bool) -> None:
        self._active = value
        self._refresh_guard()

    @property
    def pinned(self) -> bool:
        return self._pinned

    @pinned.setter
    def pinned(self, value: bool) -> None:
        self._pinned = value
        self._refresh_guard()

    def _refresh_guard(self) -> None:
        in_use = self._active or self._pinned
        for u in self.units:
            set_guard(u, not in_use)

    @property
    def gathered(self) -> bool:
        return all(u.state is not ShardState.SHARDED for u in self.units)

    def start_gather(self, comm, quantization=None) -> None:
        for u in self.units:
            u.params_store.start_gather(comm, u.label, quantization)

    def wait(self) -> None:
        for u in self.units:
            u.params_store.finish_gather()

    def release(self, keep_secondary: bool = False) -> None:
        if self.pinned or self.held or self.kept_for_backward:
            return
        for u in self.units:
            u.params_store.release(keep_secondary)

    def unpin_and_release(self) -> None:
        self.kept_for_backward = False
        self.pinned = False
        self.release()


_PLAIN = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, type(None))


def _grad_tensors(output, depth: int = 0):
    """Tensors requiring grad in a module's output, and whether some part of it could
    not be searched.  Containers the pytree knows (tuples, dicts, transformers' model
    outputs) are flattened; plain objects (SimpleNamespace, a class of one's own) are
    searched through their attributes, a few levels deep."""
    found, opaque = [], False
    for leaf in tree_flatten(output)[0]:
        if isinstance(leaf, torch.Tensor):
            if leaf.requires_grad and not isinstance(leaf, nn.Parameter):
                found.append(leaf)
        elif isinstance(leaf, _PLAIN) or isinstance(leaf, nn.Module):
            continue
        elif depth < 3 and hasattr(leaf, "__dict__"):
            more, hidden = _grad_tensors(list(vars(leaf).values()), depth + 1)
            found.extend(more)
            opaque = opaque or hidden
        else:
            opaque = True
    return found, opaque


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

    def __init__(self, groups: List[ModuleGroup], root: nn.Module, comm, *, prefetch_numel: int,
                 weight_quantization=None, secondary_partition: bool = False) -> None:
        self.groups = groups
        # ZeRO++ ([Note: ZeRO++ in a shard] in param_shard.py): (bits, block) for the
        # gathers that feed gradients; whether a forward's release keeps a node slice.
        self.weight_quantization = weight_quantization
        self.secondary_partition = secondary_partition
        self.by_module: Dict[int, ModuleGroup] = {id(m): g for g in groups for m in g.members}
        self.root_group = self.by_module.get(id(root))
        self.comm = comm
        self.prefetch_numel = prefetch_numel
        self.forward_order: List[ModuleGroup] = []  # by forward start: what prefetch follows
        # The group a grad forward released last, learnt in the first one ([Note: kept for backward]).
        self.released_last: Optional[ModuleGroup] = None
        self._order_frozen = False
        self.in_backward = False
        self.in_forward = False  # the root module's forward is running
        self.awaiting_backward = False  # a grad-enabled root forward ran; its backward has not
        self.group_of_unit: Dict[int, ModuleGroup] = {id(u): g for g in groups for u in g.units}
        self.on_demand_gathers = 0

    # -- uses outside a module's own forward (see [Note: on-demand gathers]) -----------
    @property
    def window_open(self) -> bool:
        return self.in_forward or self.in_backward or self.awaiting_backward

    def on_access(self, unit) -> bool:
        """A partitioned parameter of ``unit`` is being used; True if it may be (now
        gathered), False if the guard must refuse (outside the training window)."""
        group = self.group_of_unit.get(id(unit))
        if group is None:
            return unit.state is ShardState.GATHERED
        if group.active or group.pinned:
            if not group.gathered or any(u.state is ShardState.GATHERING for u in group.units):
                self.ensure_gathered(group)
            return True
        if not self.window_open:
            # Outside training (e.g. inside gathered_parameters): usable iff gathered.
            return unit.state is ShardState.GATHERED
        if not (group.gathered and all(u.state is ShardState.GATHERED for u in group.units)):
            self.ensure_gathered(group)
            self.on_demand_gathers += 1
            if not group.logged_on_demand:
                group.logged_on_demand = True
                log.debug("zero_strategy: parameters of %s used outside its forward; gathered on demand and kept "
                          "until the end of backward", group.name)
        group.pinned = True
        return True

    # -- helpers ------------------------------------------------------------------------
    def _quantization(self):
        """qwZ applies to the gathers whose values feed gradients: a grad-enabled forward
        and backward.  Evaluation forwards, keep_gathered() and gathered_parameters()
        gather exact values."""
        if self.weight_quantization is not None and (self.in_backward or torch.is_grad_enabled()):
            return self.weight_quantization
        return None

    def _keeps_secondary(self) -> bool:
        """hpZ: a release in a grad-enabled forward keeps the node slice for backward."""
        return self.secondary_partition and torch.is_grad_enabled() and not self.in_backward

    def drop_secondaries(self) -> None:
        if not self.secondary_partition:
            return
        for g in self.groups:
            for u in g.units:
                u.params_store.drop_secondary()

    def ensure_gathered(self, group: ModuleGroup) -> None:
        group.start_gather(self.comm, self._quantization())
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
                g.start_gather(self.comm, self._quantization())
            budget -= g.numel
            if budget <= 0:
                break

    # -- forward ------------------------------------------------------------------------
    def begin_forward(self) -> None:
        """The root module's forward starts."""
        if not self.in_backward:
            self.in_forward = True

    def pre_forward(self, group: ModuleGroup) -> None:
        self.ensure_gathered(group)
        group.active = True
        if not self._order_frozen and torch.is_grad_enabled() and not self.in_backward:
            if group not in self.forward_order:
                self.forward_order.append(group)
        elif self._order_frozen and not self.in_backward and group in self.forward_order:
            i = self.forward_order.index(group)
            self._prefetch(self.forward_order[i + 1 :])

    def post_forward(self, group: ModuleGroup, output, module: Optional[nn.Module] = None) -> None:
        if self.in_backward:
            return  # recomputation inside backward (activation checkpointing): keep it
        tensors, opaque = (_grad_tensors(output) if torch.is_grad_enabled() else ([], False))
        if opaque and not tensors:
            # Backward may still reach this module through an output we cannot see
            # into, and no hook would gather it again: keep it gathered until then.
            group.pinned = True
            if not group.logged_opaque:
                group.logged_opaque = True
                log.warning("zero_strategy: %s returned an object whose tensors cannot be found (not a tensor, "
                            "container, dataclass or plain object); its parameters stay gathered until the end of "
                            "backward. Return tensors, tuples, dicts or dataclasses to let it be released.", group.name)
        if module is None or module is group.members[-1]:
            group.active = False
            if torch.is_grad_enabled():
                if not self._order_frozen:
                    self.released_last = group
                self._keep_if_backward_starts_with(group)
            group.release(self._keeps_secondary())
        if tensors:
            fired = [False]

            def pre_backward_hook(grad, group=group):
                if not fired[0]:
                    fired[0] = True
                    self.pre_backward(group)
                    group.in_backward_members += 1
                return grad

            for t in tensors:
                t.register_hook(pre_backward_hook)

    def wrap_inputs_for_post_backward(self, group: ModuleGroup, args, kwargs, module: Optional[nn.Module] = None):
        """Route the module's floating inputs through :class:`_PostBackward`."""
        if not torch.is_grad_enabled() or self.in_backward:
            return args, kwargs
        positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        if not positions and not keys:
            return args, kwargs
        inputs = [args[i] for i in positions] + [kwargs[k] for k in keys]
        first = module is None or module is group.members[0]
        outs = _PostBackward.apply(lambda g=group, f=first: self.post_backward(g, f), *inputs)
        args = list(args)
        for j, i in enumerate(positions):
            args[i] = outs[j]
        kwargs = dict(kwargs)
        for j, k in enumerate(keys):
            kwargs[k] = outs[len(positions) + j]
        return tuple(args), kwargs

    def _keep_if_backward_starts_with(self, group: ModuleGroup) -> None:
        if self._order_frozen and group is self.released_last:
            group.kept_for_backward = True

    def end_of_forward(self) -> None:
        """Root forward finished: release every group a lazy hook may have gathered;
        groups pinned by an on-demand use stay gathered for the backward, if one can follow."""
        if self.in_backward:
            return
        self.in_forward = False
        grad = torch.is_grad_enabled()
        self.awaiting_backward = self.awaiting_backward or grad
        for g in self.groups:
            g.active = False
            if grad:
                if g.gathered:
                    self._keep_if_backward_starts_with(g)
                g.release(self._keeps_secondary())
            else:
                g.unpin_and_release()

    def end_of_step(self) -> None:
        """step() / zero_grad(): nothing gathered on demand, or kept for a backward that
        did not come, outlives the step."""
        self.awaiting_backward = False
        for g in self.groups:
            if g.pinned or g.kept_for_backward:
                g.unpin_and_release()
        self.drop_secondaries()

    # -- backward -----------------------------------------------------------------------
    def pre_backward(self, group: ModuleGroup) -> None:
        if not self.in_backward:
            for g in self.groups:  # from now on released by their own backward
                g.kept_for_backward = False
        self.in_backward = True
        if not self._order_frozen and self.forward_order:
            self._order_frozen = True
        self.ensure_gathered(group)
        group.active = True
        if group in self.forward_order:  # not by release order: [Note: kept for backward]
            i = self.forward_order.index(group)
            self._prefetch(reversed(self.forward_order[:i]))

    def post_backward(self, group: ModuleGroup, first_member: bool = True) -> None:
        group.in_backward_members = max(0, group.in_backward_members - 1)
        if first_member and group.in_backward_members == 0:
            group.active = False
            group.release()

    def end_of_backward(self) -> None:
        for g in self.groups:
            g.active = False
            g.in_backward_members = 0
            g.unpin_and_release()
        self.drop_secondaries()
        self.in_backward = False
        self.awaiting_backward = False

    # -- inference regions (keep_gathered.py, [Note: keep gathered]) ---------------------
    def gather_units(self, units, bucket_numel: int) -> None:
        """Gather ``units`` (those still sharded), at most ``bucket_numel`` elements in flight."""
        in_flight, numel = [], 0
        for u in units:
            if u.state is ShardState.SHARDED:
                u.params_store.start_gather(self.comm, u.label)
                in_flight.append(u)
                numel += u.layout.padded_numel
            if numel >= bucket_numel:
                for v in in_flight:
                    v.params_store.finish_gather()
                in_flight, numel = [], 0
        for v in in_flight:
            v.params_store.finish_gather()

    def hold_all(self, gathered_here: list, bucket_numel: int) -> None:
        """Gather every group and keep it gathered; the units this call gathered are
        appended to ``gathered_here`` (filled as it goes, so a failure leaves it true)."""
        for g in self.groups:
            g.held = True
        units = [u for g in self.groups for u in g.units if u.state is ShardState.SHARDED]
        gathered_here.extend(units)
        self.gather_units(units, bucket_numel)
        for g in self.groups:
            g.wait()  # a prefetch may still be in flight

    def refresh_held(self, units, bucket_numel: int) -> None:
        """The shards of ``units`` changed (a step, a load): gather again those a region
        holds, so it never serves the values from before."""
        stale = [u for u in units if u.state is not ShardState.SHARDED and id(u) in self.group_of_unit
                 and self.group_of_unit[id(u)].held]
        for u in stale:
            u.params_store.release()
        self.gather_units(stale, bucket_numel)

    def end_hold(self, gathered_here) -> None:
        """The region ends: release what it gathered, unless something else needs it now
        (a running module, an on-demand use pinned for backward)."""
        for g in self.groups:
            g.held = False
        if self.window_open:
            # A forward ran with gradients and its backward is still to come: autograd may
            # have saved any of these parameters (the guard, lifted inside the region, did
            # not pin them one by one), so they stay until that backward ends.
            for u in gathered_here:
                self.group_of_unit[id(u)].pinned = True
            return
        for u in gathered_here:
            g = self.group_of_unit[id(u)]
            if not (g.pinned or g.active):
                u.params_store.release()
