"""Policy: which parameters form which flat unit.  No buffers, no collectives.

Stages 0-2: trainable parameters of the same (param group, dtype) are cut, in reverse
registration order (roughly the order backward produces their gradients), into units of
at most ``reduce_bucket_size`` elements.  Each unit is both the reduction bucket and the
partitioning granule, so every collective is an equal-size reduce-scatter/all-gather.

Stage 3: units follow modules.  Every instance of the *unit module classes* (``auto`` =
the repeated module class holding the most parameters, e.g. GPT2Block or
LlamaDecoderLayer) gathers its own parameters; everything else belongs to the root
module.  A parameter shared by two unit modules moves to the root so it is gathered
whenever either runs.  Parameters below ``param_persistence_threshold`` elements stay
whole on every rank (their units behave like stage-2 units).  Consecutive sibling unit
modules smaller than ``min_gather_numel`` are merged into one gather (the unit then has
several *members*, see gather.py's [Note: merged groups]): each collective has a fixed
cost, which dominates when blocks hold a few thousand elements; a whole model smaller
than that is gathered as one unit.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .layout import split_into_buckets


@dataclass
class UnitSpec:
    params: List[nn.Parameter]
    names: List[List[str]]
    group_index: Optional[int]  # None = not optimised (frozen, or no optimizer)
    module: Optional[nn.Module]  # stage 3: the (first) module whose forward gathers this unit
    persistent: bool = False
    # Stage 3: every module whose forward gathers this unit, in registration order (one,
    # or several consecutive siblings merged under ``min_gather_numel``).
    members: Tuple[nn.Module, ...] = ()


@dataclass
class Plan:
    units: List[UnitSpec] = field(default_factory=list)
    # Parameters left untouched (stages 0-2 frozen ones): name -> parameter.
    untouched: Dict[str, nn.Parameter] = field(default_factory=dict)
    unit_module_names: List[str] = field(default_factory=list)  # stage 3, for messages


def parameter_names(model: nn.Module) -> "OrderedDict[int, Tuple[nn.Parameter, List[str]]]":
    """id(param) -> (param, every qualified name it has), in registration order."""
    out: "OrderedDict[int, Tuple[nn.Parameter, List[str]]]" = OrderedDict()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in out:
            out[id(p)][1].append(name)
        else:
            out[id(p)] = (p, [name])
    return out


def group_index_of(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> Dict[int, Optional[int]]:
    """id(param) -> index of the optimizer param group holding it (None: not optimised)."""
    names = parameter_names(model)
    where: Dict[int, Optional[int]] = {pid: None for pid in names}
    if optimizer is None:
        return where
    group_name = getattr(optimizer, "group_name", lambda gi: f"param group {gi}")
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in where:
                raise ValueError(
                    "the optimizer holds a tensor that is not a parameter of the model "
                    f"(shape {tuple(p.shape)}, {group_name(gi)}); build the optimizer from model.parameters()"
                )
            if where[id(p)] is not None:
                raise ValueError(
                    f"parameter {names[id(p)][1][0]!r} appears twice: in {group_name(where[id(p)])} and in "
                    f"{group_name(gi)}; give each parameter to exactly one optimizer param group"
                )
            where[id(p)] = gi
    for pid, (p, pnames) in names.items():
        if p.requires_grad and where[pid] is None:
            raise ValueError(
                f"parameter {pnames[0]!r} requires grad but is in no optimizer param group: add it to the "
                "optimizer, or set requires_grad=False to freeze it"
            )
        if not p.requires_grad and where[pid] is not None:
            # Frozen but handed to the optimizer: it would never get a gradient; treat as frozen.
            where[pid] = None
    return where


def _category_key(p: nn.Parameter, gi: Optional[int]):
    return (gi if gi is not None else -1, str(p.dtype))


def _bucketize(entries, bucket_size: int, module, persistent: bool, members: Tuple[nn.Module, ...] = ()) -> List[UnitSpec]:
    """entries: list of (param, names, group_index) in the desired order."""
    by_cat: "OrderedDict[tuple, list]" = OrderedDict()
    for e in entries:
        by_cat.setdefault(_category_key(e[0], e[2]), []).append(e)
    units = []
    for cat_entries in by_cat.values():
        for idxs in split_into_buckets([e[0].numel() for e in cat_entries], bucket_size):
            chosen = [cat_entries[i] for i in idxs]
            units.append(
                UnitSpec(
                    params=[c[0] for c in chosen],
                    names=[c[1] for c in chosen],
                    group_index=chosen[0][2],
                    module=module,
                    persistent=persistent,
                    members=members,
                )
            )
    return units


def plan_replicated_params(model, optimizer, config) -> Plan:
    """Stages 0-2: bucketed units of parameters (frozen ones in units of their own, so
    their values are kept like any other's); non-floating ones untouched."""
    names = parameter_names(model)
    gidx = group_index_of(model, optimizer)
    plan = Plan()
    entries = []
    for pid, (p, pnames) in reversed(names.items()):
        if not p.is_floating_point():
            plan.untouched[pnames[0]] = p
        else:
            entries.append((p, pnames, gidx[pid]))
    plan.units = _bucketize(entries, config.reduce_bucket_size, None, persistent=False)
    return plan


def find_unit_module_classes(model: nn.Module, requested: Sequence[str], field: str = "unit_modules") -> List[str]:
    """Resolve ``unit_modules``: explicit class names, or ``auto``."""
    present = Counter(type(m).__name__ for m in model.modules())
    if tuple(requested) != ("auto",):
        missing = [c for c in requested if c not in present]
        if missing:
            raise ValueError(
                f"{field} names {missing} but the model has no module of that class; "
                f"module classes present: {sorted(present)}"
            )
        return list(requested)
    return auto_unit_module_classes(model)


# Modules that hold other modules but never run a forward of their own: a unit module
# must run forward, since that is where its parameters are gathered.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def auto_unit_module_classes(model: nn.Module) -> List[str]:
    """``unit_modules=("auto",)``: the classes whose instances become stage-3 units.

    1. A model that declares its blocks (transformers' ``_no_split_modules``, the same
       list its device-map and FSDP wrapping use, e.g. ``LlamaDecoderLayer`` or
       ``T5Block``) gets those classes.
    2. Otherwise: the *outermost repeated* classes.  A class is repeated when it has at
       least two instances holding parameters and is not a container (ModuleList and
       the like never run a forward); it is outermost when none of its instances lies
       inside an instance of another repeated class.  So nn.Transformer gets its
       encoder and decoder layers, a mixture of experts its blocks (not the experts'
       Linear layers), and a plain stack of Linear layers its Linear layers.
    """
    present = Counter(type(m).__name__ for m in model.modules() if m is not model)
    declared = set()
    for m in model.modules():
        declared.update(getattr(m, "_no_split_modules", None) or ())
    chosen = sorted(c for c in declared if present[c] > 0)
    if chosen:
        return chosen
    counts: Counter = Counter()
    for m in model.modules():
        if m is not model and not isinstance(m, _CONTAINERS) and any(True for _ in m.parameters()):
            counts[type(m).__name__] += 1
    repeated = {c for c, n in counts.items() if n >= 2}
    nested = set()  # repeated classes with an instance inside another repeated class's instance

    def visit(module: nn.Module, inside: frozenset) -> None:
        name = type(module).__name__
        if name in repeated and module is not model:
            if inside - {name}:
                nested.add(name)
            inside = inside | {name}
        for child in module.children():
            visit(child, inside)

    visit(model, frozenset())
    return sorted(repeated - nested)


def plan_partitioned_params(model, optimizer, config) -> Plan:
    """Stage 3: one gather group per unit module (plus the root)."""
    names = parameter_names(model)
    gidx = group_index_of(model, optimizer)
    classes = set(find_unit_module_classes(model, config.unit_modules))
    unit_modules = [m for m in model.modules() if type(m).__name__ in classes and m is not model]
    # Innermost unit module owning each parameter directly or through children.
    owner: Dict[int, Optional[nn.Module]] = {}
    for m in unit_modules:  # outer before inner, so inner modules overwrite
        for p in m.parameters():
            owner[id(p)] = m
    # A parameter also used (tied) outside that module goes to the root.
    for m in model.modules():
        for p in m.parameters(recurse=False):
            o = owner.get(id(p))
            if o is not None and not _is_within(m, o):
                owner[id(p)] = None
    plan = Plan(unit_module_names=sorted(classes))
    per_module: "OrderedDict[int, list]" = OrderedDict()
    modules_by_id = {id(model): model}
    per_module[id(model)] = []
    for m in unit_modules:
        modules_by_id[id(m)] = m
        per_module[id(m)] = []
    persistent = []
    for pid, (p, pnames) in names.items():
        if not p.is_floating_point():
            plan.untouched[pnames[0]] = p  # flat units hold floating-point values only
            continue
        if p.numel() < config.param_persistence_threshold:
            persistent.append((p, pnames, gidx[pid]))
            continue
        mod = owner.get(pid) or model
        per_module[id(mod)].append((p, pnames, gidx[pid]))
    total = sum(e[0].numel() for entries in per_module.values() for e in entries)
    if 0 < total < config.min_gather_numel:
        # The whole model is smaller than one gather is worth: gathered as one unit at
        # the root (two all-gathers and one reduce-scatter per step), in registration order.
        order = {pid: i for i, pid in enumerate(names)}
        everything = sorted((e for entries in per_module.values() for e in entries), key=lambda e: order[id(e[0])])
        per_module = OrderedDict([(id(model), everything)])
    root_entries = per_module.pop(id(model))
    if root_entries:
        plan.units += _bucketize(root_entries, 1 << 62, model, persistent=False, members=(model,))
    for members in merge_small_siblings(model, [modules_by_id[mid] for mid, e in per_module.items() if e],
                                        {mid: sum(e[0].numel() for e in entries) for mid, entries in per_module.items()},
                                        config.min_gather_numel):
        entries = [e for m in members for e in per_module[id(m)]]
        # One unit per (group, dtype) within a gather: no size split, the modules are the granule.
        plan.units += _bucketize(entries, 1 << 62, members[0], persistent=False, members=members)
    plan.units += _bucketize(list(reversed(persistent)), config.reduce_bucket_size, None, persistent=True)
    return plan


def merge_small_siblings(model: nn.Module, modules: List[nn.Module], numel: Dict[int, int],
                         min_numel: int) -> List[Tuple[nn.Module, ...]]:
    """Split ``modules`` (unit modules holding partitioned parameters, in registration
    order) into gathers: consecutive ones with the same parent are merged while the
    gather holds fewer than ``min_numel`` elements, so every gather but the last of a
    run of siblings reaches ``min_numel`` and none exceeds it by more than one module."""
    parent_of: Dict[int, int] = {}
    for parent in model.modules():
        for child in parent.children():
            parent_of.setdefault(id(child), id(parent))
    out: List[List[nn.Module]] = []
    held = 0
    for m in modules:
        current = out[-1] if out else None
        if (current is not None and min_numel > 0 and held < min_numel
                and parent_of.get(id(m)) == parent_of.get(id(current[-1]))):
            current.append(m)
            held += numel[id(m)]
        else:
            out.append([m])
            held = numel[id(m)]
    return [tuple(g) for g in out]


def _is_within(module: nn.Module, container: nn.Module) -> bool:
    return any(module is m for m in container.modules())
