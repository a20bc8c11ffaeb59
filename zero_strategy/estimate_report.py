"""What `zero-strategy estimate` prints: the estimates of estimate.py as tables that fit
100 columns, every size in GiB (units.py).

For each world size: the paper's formula per stage, what this implementation holds
(overheads, savings, what fits a budget), the offload configurations (where DeepSpeed's
``estimate_zero{2,3}_model_states_mem_needs_all_live`` prints per-GPU and per-CPU
memory: here device, host and disk per rank), and with a budget the largest model
each configuration fits.  For world sizes of more than one node: what a rank sends per
step and how much of it crosses nodes, plain and with ZeRO++ (estimate_traffic.py).
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

from .estimate import (OVERHEAD_DESCRIPTIONS, SAVING_DESCRIPTIONS, STAGE_NAMES, estimate, largest_fitting,
                       offload_estimate, optimizer_bytes_per_param)
from .estimate_traffic import step_traffic
from .units import PAPER_GB_NOTE, gib, gib_number

WIDTH = 100  # every line fits a terminal of this width

# (stage, offload_optimizer, offload_param): the combinations ZeroConfig accepts.
OFFLOAD_ROWS = ((1, "cpu", "none"), (2, "cpu", "none"), (3, "cpu", "none"),
                (1, "nvme", "none"), (2, "nvme", "none"), (3, "nvme", "none"), (3, "nvme", "nvme"))


@dataclass(frozen=True)
class EstimateRequest:
    """What the command line asked for, in the estimate functions' terms."""

    params: int
    world_sizes: Sequence[int]
    precision: str
    optimizer: str
    overhead_args: dict
    """estimate()'s keyword arguments for the overhead terms."""
    grow_units_with_model: bool
    """num_units was not given: one unit per reduce bucket, so it grows with the model
    (the largest-model search recomputes it for every candidate size)."""
    inflight_bytes: int
    memory_per_rank: Optional[int] = None
    disk_per_rank: Optional[int] = None
    ranks_per_node: int = 8


def print_report(req: EstimateRequest, out: Callable[[str], None] = print) -> None:
    for line in PAPER_GB_NOTE.splitlines():
        out(line)
    for n in req.world_sizes:
        out("")
        for line in report_lines(req, n):
            out(line)


def report_lines(req: EstimateRequest, n: int) -> List[str]:
    k = optimizer_bytes_per_param(req.optimizer, req.precision)
    results = [estimate(req.params, n, s, req.precision, req.optimizer, **req.overhead_args) for s in range(4)]
    budget = req.memory_per_rank
    lines = [f"{req.params:,} parameters, N = {n}, {req.precision}, {req.optimizer} "
             f"(K = {k} bytes/param); GiB per rank"]
    lines += _say("The paper's formula:")
    lines += _table([("stage", "params", "grads", "optimizer states", "total")] + [
        (_stage(s), gib_number(r.parameters), gib_number(r.gradients), gib_number(r.optimizer_states),
         gib_number(r.total)) for s, r in enumerate(results)])
    lines += _say("This implementation (backward-step: what it holds from backward to step, the peak):")
    lines += _table([("stage", "with overheads", "backward-step", "between steps")
                     + ((f"fits in {gib(budget)}",) if budget is not None else ())] + [
        (_stage(s), gib_number(r.total_with_overheads), gib_number(r.held_during_step),
         gib_number(r.held_between_steps)) + ((_fits(r.held_during_step, budget),) if budget is not None else ())
        for s, r in enumerate(results)])
    lines += _overheads(results) + _savings(results) + _offload(req, n) + _traffic(req, n)
    if budget is not None:
        lines += _largest(req, n)
    return lines


def _stage(s: int) -> str:
    return f"{s} {STAGE_NAMES[s]}"


def _fits(needed: int, budget: int) -> str:
    return "yes" if needed <= budget else f"no: +{gib_number(needed - budget)}"


def _say(text: str, indent: str = "", more: str = "") -> List[str]:
    """A sentence wrapped to WIDTH (continuation lines indented by ``more``)."""
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=more or indent)


def _table(rows: List[tuple], right_from: int = 1) -> List[str]:
    """Rows indented by two spaces; columns from ``right_from`` on are numbers, right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.rjust(w) if i >= right_from else cell.ljust(w)
                             for i, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in rows]


def _overheads(results) -> List[str]:
    terms = [t for t in OVERHEAD_DESCRIPTIONS if any(t in r.overheads for r in results)]
    if not terms:
        return _say("Overheads: none requested (pass --reduce-bucket-size, --num-units, --largest-unit, "
                    "--prefetch-bucket-size or --persistent-params).")
    lines = _say("Overheads this implementation adds beyond the paper's formula:")
    for term in terms:
        lines += _say(f"{term}: {OVERHEAD_DESCRIPTIONS[term]}", "  ", "    ")
        lines += [f"    stage {s}: {gib(r.overheads[term])}" for s, r in enumerate(results) if term in r.overheads]
    return lines


def _savings(results) -> List[str]:
    terms = [t for t in SAVING_DESCRIPTIONS if any(t in r.savings for r in results)]
    lines = _say("Below the formula:")
    for term in terms:
        lines += _say(f"{term}: {SAVING_DESCRIPTIONS[term]}", "  ", "    ")
    return lines + _say("stages 2-3 free their gradient shards in step(): 'between steps' leaves them out", "  ")


def _offload(req: EstimateRequest, n: int) -> List[str]:
    budget, disk = req.memory_per_rank, req.disk_per_rank
    fits = ""
    if budget is not None:
        fits = f" 'memory fits': device + host within {gib(budget)} (one memory in CPU training)"
        fits += f"; 'disk fits': disk within {gib(disk)}." if disk is not None else "."
    lines = _say("With offload, GiB per rank (cpu: offload_optimizer cpu; nvme: offload_optimizer nvme; "
                 "nvme+param: also offload_param nvme): device = the training device (GPU); host = CPU "
                 "memory (R ranks on one machine need R times it); disk = files under nvme_path, of which "
                 f"nvme reads at most nvme_inflight_bytes ({gib(req.inflight_bytes)}) into host memory during "
                 "step(). The overheads above come on top." + fits)
    rows = [("stage", "offload", "device", "host", "disk")
            + (("memory fits",) if budget is not None else ())
            + (("disk fits",) if disk is not None else ())]
    for stage, optimizer_to, param_to in OFFLOAD_ROWS:
        r = _offload_at(req, req.params, n, stage, optimizer_to, param_to)
        rows.append((str(stage), _offload_name(optimizer_to, param_to), gib_number(r.device), gib_number(r.host),
                     gib_number(r.disk))
                    + ((_fits(r.memory, budget),) if budget is not None else ())
                    + ((_fits(r.disk, disk) if optimizer_to == "nvme" else "-",) if disk is not None else ()))
    return lines + _table(rows, right_from=2)


# (label, stage, hpZ, qwZ bits, qgZ bits): the rows of the traffic table.
TRAFFIC_ROWS = (("0 baseline", 0, False, None, None), ("1 P_os", 1, False, None, None), ("2 P_os+g", 2, False, None, None),
                ("3 P_os+g+p", 3, False, None, None), ("3 + hpZ", 3, True, None, None),
                ("3 + hpZ + qwZ int8 + qgZ int4", 3, True, 8, 4))


def _traffic(req: EstimateRequest, n: int) -> List[str]:
    l = req.ranks_per_node
    if n <= l or n % l:
        why = "one node" if n <= l else f"{l} does not divide N"
        return _say(f"Cross-node traffic: none ({why}; --ranks-per-node {l}).")
    lines = _say(f"Per training step, GiB each rank sends, {n // l} nodes x {l} ranks (--ranks-per-node); "
                 "cross-node: to ranks on other nodes; hpZ memory: its secondary partition, held from forward "
                 "to backward (block 256):")
    rows = [("configuration", "sent", "cross-node", "vs stage 3", "hpZ memory")]
    plain = step_traffic(req.params, n, l, 3, req.precision).cross_node
    for label, stage, hpz, wbits, gbits in TRAFFIC_ROWS:
        t = step_traffic(req.params, n, l, stage, req.precision, secondary_partition=hpz, weight_bits=wbits,
                         gradient_bits=gbits)
        rows.append((label, gib_number(t.sent), gib_number(t.cross_node), f"{t.cross_node / plain:.2f}x",
                     gib_number(t.extra_memory) if hpz else "-"))
    return lines + _table(rows)


def _offload_name(optimizer_to: str, param_to: str) -> str:
    return optimizer_to + ("+param" if param_to == "nvme" else "")


def _offload_at(req: EstimateRequest, psi: int, n: int, stage: int, optimizer_to: str, param_to: str):
    return offload_estimate(psi, n, stage, req.precision, req.optimizer, offload=optimizer_to,
                            offload_param=param_to == "nvme", inflight_bytes=req.inflight_bytes)


def _largest(req: EstimateRequest, n: int) -> List[str]:
    """The largest parameter count each configuration fits in --memory-per-rank (and
    --disk-per-rank for disk offload), by the same estimates as the tables above."""
    budget, disk = req.memory_per_rank, req.disk_per_rank
    lines = _say(f"Largest model whose model states fit in {gib(budget)} per rank (N = {n}; stages: "
                 "backward-step; offload: device + host" + (f"; nvme also within {gib(disk)} of disk"
                                                             if disk is not None else "") + "):")

    def held(stage):
        def needed(psi):
            kw = dict(req.overhead_args)
            if req.grow_units_with_model:
                kw["num_units"] = max(1, -(-psi // kw["reduce_bucket_size"]))
            kw["persistent_params"] = min(kw["persistent_params"], psi)
            return estimate(psi, n, stage, req.precision, req.optimizer, **kw).held_during_step
        return needed

    rows = [("configuration", "largest model (parameters)")]
    rows += [(f"stage {s}", f"{largest_fitting(held(s), budget):,}") for s in range(4)]
    for stage, optimizer_to, param_to in OFFLOAD_ROWS:
        def memory(psi, stage=stage, optimizer_to=optimizer_to, param_to=param_to):
            return _offload_at(req, psi, n, stage, optimizer_to, param_to).memory
        psi, limit = largest_fitting(memory, budget), "memory"
        if disk is not None and optimizer_to == "nvme":
            def on_disk(p, stage=stage, param_to=param_to):
                return _offload_at(req, p, n, stage, "nvme", param_to).disk
            by_disk = largest_fitting(on_disk, disk)
            if by_disk < psi:
                psi, limit = by_disk, "disk"
        rows.append((f"stage {stage}, offload {_offload_name(optimizer_to, param_to)}", f"{psi:,} (limited by {limit})"))
    return lines + _table(rows, right_from=2)


__all__ = ["EstimateRequest", "OFFLOAD_ROWS", "WIDTH", "print_report", "report_lines"]
