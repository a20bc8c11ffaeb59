"""Builds a ShardedModel: plan the units, cut the parameters into them, point the user's
optimizers at this rank's shards, and (stage 3) group the units for gathering.

No collective runs here except disk offload's agreed check that its files were made;
the set-up check and rank 0's broadcast come before (engine.py).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn as nn

from ..offload.disk_offload import make_disk_offload
from ..optim.optimizer import repoint_optimizer
from ..optim.optimizer_kinds import is_elementwise
from .flat_unit import FlatUnit
from ..communication import multinode
from .gather import ModuleGroup, ParameterGatherer
from .planner import plan_partitioned_params, plan_replicated_params
from .sharded_model import ShardedModel
from .whole_params import assign_owners


def group_name(members, module_names) -> str:
    """A gather's name in messages: its module, or the first and last of merged siblings."""
    names = [module_names.get(id(m), "") or "<root>" for m in members]
    if len(names) == 1:
        return names[0]
    return f"{names[0]} .. {names[-1]} ({len(names)} merged)"


def materialization_device(device, comm) -> torch.device:
    """Where deferred (meta) parameters are materialised: the given device; meta again on
    the fake process group (planning dry runs); else the current accelerator or CPU."""
    if device is not None:
        return torch.device(device)
    if comm.group is not None and torch.distributed.get_backend(comm.group) == "fake":
        return torch.device("meta")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_sharded_model(model: nn.Module, inner_optimizers: List[torch.optim.Optimizer], optimizer_set, config,
                        policies, comm, device: Optional[torch.device], pending: set) -> ShardedModel:
    """``optimizer_set``: the OptimizerSet over ``inner_optimizers`` (None without one);
    ``pending``: ids of the parameters still on the meta device (materialised later into
    ``device``)."""
    shards_parameters = policies.stage.shards_parameters
    plan = (plan_partitioned_params if shards_parameters else plan_replicated_params)(model, optimizer_set, config)
    orig_dtype_by_id = {id(p): p.dtype for p in model.parameters()}
    orig_dtype_untouched = {n: p.dtype for n, p in plan.untouched.items()}
    compute_dtype = policies.precision.compute_dtype
    for p in plan.untouched.values():
        if p.is_floating_point() and p.dtype != compute_dtype and id(p) not in pending:
            p.data = p.data.to(compute_dtype)

    module_names = {id(m): n for n, m in model.named_modules()}
    disk = make_disk_offload(policies.offload, comm)  # per-rank files; failures agreed on below
    units: List[FlatUnit] = []
    for i, spec in enumerate(plan.units):
        first, last = spec.names[0][0], spec.names[-1][0]
        whole = not shards_parameters or spec.persistent
        if not whole and spec.module is not None:
            label = f"module {group_name(spec.members or (spec.module,), module_names)}"
        else:
            label = f"bucket {i} ({first}{' ... ' + last if last != first else ''})"
        units.append(FlatUnit(i, spec.params, spec.names, group_index=spec.group_index, policies=policies,
                              rank=comm.rank, world_size=comm.world_size, whole=whole, device=device, label=label,
                              disk=disk))
    if disk is not None:
        disk.check("creating the disk-offload files")

    sharded = ShardedModel(module=model, config=config, policies=policies, comm=comm, device=device, units=units,
                           untouched=plan.untouched, orig_dtype_by_id=orig_dtype_by_id,
                           orig_dtype_untouched=orig_dtype_untouched, unit_module_classes=list(plan.unit_module_names),
                           inner_optimizers=list(inner_optimizers), disk_offload=disk)
    if optimizer_set is not None:
        _point_optimizers_at_shards(sharded, optimizer_set)
    sharded.reduction_order = _reduction_order(sharded, plan)
    if shards_parameters:
        sharded.gatherer = _gatherer(sharded, plan, module_names)
    return sharded


def _point_optimizers_at_shards(sharded: ShardedModel, optimizer_set) -> None:
    """The user's optimizers now update this rank's shards (whole parameters for the
    shape-aware ones: [Note: element-wise or whole-parameter] in optimizer_kinds.py)."""
    place = {id(p): (u.index, i) for u in sharded.units for i, p in enumerate(u.params)}
    sharded.optimizer_param_places = [[place.get(id(p)) for p in g["params"]] for g in optimizer_set.param_groups]
    sharded.group_offsets = optimizer_set.group_offsets
    for u in sharded.trainable_units:
        u.optimizer_index, u.local_group_index = optimizer_set.locate(u.group_index)
    elementwise = sharded.config.elementwise_optimizers
    whole = [u for u in sharded.trainable_units if not is_elementwise(sharded.inner_optimizers[u.optimizer_index], elementwise)]
    for u, owners in zip(whole, assign_owners([u.layout for u in whole])):
        u.use_whole_params(owners)
    for k, opt in enumerate(sharded.inner_optimizers):
        per_group: Dict[int, list] = {}
        for u in sharded.units_of(k):
            per_group.setdefault(u.local_group_index, []).extend(u.optim_params)
        repoint_optimizer(opt, per_group)


def _reduction_order(sharded: ShardedModel, plan) -> List[FlatUnit]:
    if not sharded.policies.stage.shards_parameters:
        return list(sharded.trainable_units)  # already built in reverse registration order
    # Stage 3: unit modules in reverse registration order, the root last, then the
    # small persistent units (their gradients are ready at various points).
    order = {id(m): i for i, m in enumerate(sharded.module.modules())}

    def key(u_spec):
        u, spec = u_spec
        if spec.persistent:
            return (2, 0)
        if spec.module is sharded.module:
            return (1, 0)
        return (0, -order[id(spec.module)])

    pairs = [(u, s) for u, s in zip(sharded.units, plan.units) if u.trainable]
    return [u for u, _ in sorted(pairs, key=key)]


def _gatherer(sharded: ShardedModel, plan, module_names) -> ParameterGatherer:
    groups: Dict[int, ModuleGroup] = {}
    for u, spec in zip(sharded.units, plan.units):
        if spec.module is None:
            continue
        g = groups.get(id(spec.module))
        if g is None:
            g = groups[id(spec.module)] = ModuleGroup(spec.module, group_name(spec.members or (spec.module,), module_names),
                                                      [], members=spec.members)
        g.units.append(u)
        g.numel += u.layout.padded_numel
    comm, cfg = sharded.comm, sharded.config
    # hpZ: every partitioned unit keeps its node chunk from forward to backward
    # ([Note: ZeRO++ in a shard] in param_shard.py).
    secondary = multinode.keeps_secondary(cfg) and comm.node_comm is not None
    if secondary:
        for g in groups.values():
            for u in g.units:
                u.params_store.enable_secondary(comm.node_comm.rank, comm.node_comm.world_size)
    return ParameterGatherer(list(groups.values()), sharded.module, comm,
                             prefetch_numel=sharded.policies.comm.prefetch_numel,
                             weight_quantization=multinode.weight_quantization(cfg), secondary_partition=secondary)
