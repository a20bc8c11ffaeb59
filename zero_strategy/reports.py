"""What a ShardedModel holds and how it was cut, as the engine reports it.

``memory_report`` is the engine's own bookkeeping (bytes per category on this rank);
accounting.py checks it independently.  ``unit_summary`` and ``describe`` say what was
partitioned how, for start-up logs and tests.
"""
from __future__ import annotations

from typing import Dict

from .accounting import optimizer_state_bytes
from .communication.multinode import describe as describe_nodes
from .units import gib


def memory_report(sharded) -> Dict[str, int]:
    """Bytes held on this rank now, by category (model states and comm buffers)."""
    offloads_optimizer = sharded.policies.offload.offloads_optimizer
    report = {"parameters": 0, "gradients": 0, "master_weights": 0, "optimizer_state": 0, "communication_buffers": 0, "offloaded": 0}
    for u in sharded.units:
        parts = dict(u.params_store.bytes())
        if u.grads is not None:  # summed: both may hold offloaded bytes (disk offload's shard)
            for k, v in u.grads.bytes().items():
                parts[k] = parts.get(k, 0) + v
        if offloads_optimizer:
            parts["offloaded"] = parts.get("offloaded", 0) + parts["master_weights"]
        for k, v in parts.items():
            report[k] = report.get(k, 0) + v
    for p in sharded.untouched.values():
        report["parameters"] += p.numel() * p.element_size()
        if p.grad is not None:
            report["gradients"] += p.grad.numel() * p.grad.element_size()
    if sharded.inner_optimizers:
        report["optimizer_state"] = sum(optimizer_state_bytes(opt) for opt in sharded.inner_optimizers)
        if offloads_optimizer:
            report["offloaded"] += report["optimizer_state"]

    offloaded = report.pop("offloaded")
    report["total"] = sum(report.values())
    # What stays on the training device (the saving ZeRO-Offload buys) and what lives in
    # host memory instead.
    on_disk = sharded.disk_offload is not None
    report["host"] = 0 if on_disk else offloaded
    report["disk"] = offloaded if on_disk else 0  # in disk-offload files, not memory
    report["device"] = report["total"] - offloaded
    # Not held now, so outside the total: what a whole-parameter optimizer's step adds
    # (the owned cut parameters' whole value and gradient, [Note: whole-parameter optimizers]).
    report["whole_param_step"] = sum(u.whole_params.step_bytes() for u in sharded.trainable_units
                                     if u.whole_params is not None)
    return report


def unit_summary(sharded) -> dict:
    """What was partitioned how: the stage, the unit module classes chosen (stage 3),
    every flat unit and, at stage 3, every gather group (module, class, elements)."""
    names = {id(m): n for n, m in sharded.module.named_modules()}
    stage = sharded.policies.stage
    gatherer = sharded.gatherer
    groups = []
    if gatherer is not None:
        for g in gatherer.groups:
            groups.append({"module": names.get(id(g.module), "") or "<root>", "class": type(g.module).__name__,
                           "modules": [names.get(id(m), "") or "<root>" for m in g.members],
                           "numel": g.numel, "units": [u.index for u in g.units]})
    units = sharded.units
    return dict(
        stage=stage.stage,
        world_size=sharded.comm.world_size,
        unit_modules=list(sharded.unit_module_classes),
        num_units=len(units),
        partitioned_elements=sum(u.layout.numel for u in units if not u.keep_full or stage.partitions_optimizer_state),
        whole_elements=sum(u.layout.numel for u in units if u.keep_full),
        units=[dict(index=u.index, label=u.label, numel=u.layout.numel, whole=u.keep_full, trainable=u.trainable)
               for u in units],
        groups=groups,
        on_demand_gathers=gatherer.on_demand_gathers if gatherer is not None else 0,
    )


def describe(sharded) -> str:
    """One line for a start-up log: stage, world size, units, model-state bytes per rank."""
    s = unit_summary(sharded)
    held = gib(memory_report(sharded)["total"])
    members = sum(len(g["modules"]) for g in s["groups"])
    merged = f", {members} modules merged into {len(s['groups'])} gathers" if members > len(s["groups"]) else ""
    what = (f", unit modules {', '.join(s['unit_modules']) or '(root only)'} ({len(s['groups'])} gather groups{merged})"
            if s["groups"] else "")
    cfg, pp = sharded.config, sharded.policies.precision
    precision = (f"{cfg.precision} autocast over fp32 parameters" if pp.autocast_dtype is not None
                 else f"{cfg.precision} with fp32 master weights" if pp.mixed else "fp32")
    topology = sharded.comm.topology
    nodes = ""
    if topology.multi_node or any(getattr(cfg, k) is not None for k in
                                  ("secondary_partition", "weight_quantization", "gradient_quantization")):
        nodes = f" ({describe_nodes(topology, cfg)})"
    return (f"ZeRO stage {s['stage']} on {s['world_size']} rank(s){nodes}: {s['num_units']} flat units{what}; "
            f"{precision}; model states {held} on this rank now")


class Reports:
    """ZeroEngine's report methods (mixed in; needs ``sharded`` and ``comm``)."""

    def memory_report(self) -> Dict[str, int]:
        """Bytes held on this rank now, by category (model states and comm buffers)."""
        return memory_report(self.sharded)

    def unit_summary(self) -> dict:
        """What was partitioned how (stage, unit module classes, flat units, gather groups)."""
        return unit_summary(self.sharded)

    def describe(self) -> str:
        """One line for a start-up log: stage, world size, units, model-state bytes per rank."""
        return describe(self.sharded)

    def comm_report(self):
        """Elements and bytes moved per collective kind since the last reset."""
        return self.comm.report()

    def reset_comm_report(self) -> None:
        self.comm.reset()
