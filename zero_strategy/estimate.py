"""Model-state memory per rank, by the ZeRO paper's formulas, and what this
implementation actually holds beside them.

    stage 0 (baseline): (p + g + K) * Psi
    stage 1 (P_os):      p*Psi + g*Psi + K*Psi/N
    stage 2 (P_os+g):    p*Psi + (g + K)*Psi/N
    stage 3 (P_os+g+p):  (p + g + K) * Psi/N

p, g = bytes per parameter and per gradient (2 in fp16/bf16, 4 in fp32); K = optimizer
bytes per parameter, which in mixed precision includes the fp32 master copy.
All numbers are exact integers: a rank holds ceil(Psi/N) elements of a partitioned state.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Optional

from .config import canonical_precision

STAGE_NAMES = ("baseline", "P_os", "P_os+g", "P_os+g+p")

# Optimizer bytes per parameter: (mixed precision, fp32). In mixed precision the 4-byte
# fp32 master copy lives with the optimizer; in fp32 the parameters are the master.
_OPTIMIZER_BYTES = {
    "adam": (12, 8),
    "adamw": (12, 8),
    "sgd": (8, 4),  # one fp32 momentum buffer
    "sgd_nomomentum": (4, 0),
    "sgd_plain": (4, 0),
}

OVERHEAD_DESCRIPTIONS = {
    "padding": "each flat unit is padded to a multiple of N so it splits evenly; a "
               "unit adds at most N-1 padding elements in all, i.e. (N-1)/N per rank, "
               "for each partitioned state",
    "reduce_buckets": "two gradient buckets of reduce_bucket_size elements: one being "
                      "filled by backward while the other is reduced",
    "gathered_parameters": "full parameters and gradients of the unit in use "
                           "(largest_unit) plus the prefetched ones (prefetch_bucket_size)",
    "persistent_parameters": "small parameters kept whole on every rank instead of 1/N "
                             "of them (params and grads)",
}


SAVING_DESCRIPTIONS = {
    "compute_param_shard": "stage 3 with fp16/bf16 keeps no 16-bit parameter shard: the compute copy is "
                           "cast from the fp32 master into its place in each all-gather's output (p*Psi/N of the formula)",
}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of model states held by one rank."""

    parameters: int
    gradients: int
    optimizer_states: int
    """Includes the fp32 master copy in mixed precision (K * Psi/N from stage 1 on)."""
    overheads: dict = field(default_factory=dict)
    """Term name -> bytes this implementation adds beyond the paper's formula."""
    savings: dict = field(default_factory=dict)
    """Term name -> bytes of the formula this implementation does not hold (see SAVING_DESCRIPTIONS)."""
    freed_between_steps: int = 0
    """Gradient bytes that exist only from backward to step (stages 2-3 free them)."""

    @property
    def total(self) -> int:
        """The paper's formula value."""
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def total_with_overheads(self) -> int:
        return self.total + sum(self.overheads.values())

    @property
    def held_during_step(self) -> int:
        """What this implementation holds between backward and step (the peak of
        model states): the formula, less the savings, plus the overheads."""
        return self.total_with_overheads - sum(self.savings.values())

    @property
    def held_between_steps(self) -> int:
        """What stays between steps (the next forward runs beside this)."""
        return self.held_during_step - self.freed_between_steps


def bytes_per_element(precision: str) -> int:
    return 4 if canonical_precision(precision) == "fp32" else 2


def optimizer_bytes_per_param(optimizer: str, precision: str) -> int:
    """K in the paper: 12 for mixed-precision Adam, 8 for fp32 Adam, and so on."""
    key = optimizer.strip().lower().replace("-", "_") if isinstance(optimizer, str) else None
    if key not in _OPTIMIZER_BYTES:
        raise ValueError(
            f"unknown optimizer {optimizer!r}; known: adam, adamw, sgd, sgd_nomomentum, sgd-plain"
        )
    mixed, fp32 = _OPTIMIZER_BYTES[key]
    return fp32 if canonical_precision(precision) == "fp32" else mixed


def _count(name: str, value, minimum: int) -> int:
    """A whole number >= minimum; whole floats such as 7.5e9 are accepted."""
    result = None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        result = int(value)
    elif isinstance(value, float) and value.is_integer():  # False for inf and nan
        result = int(value)
    if result is None or result < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return result


def estimate(
    num_params,
    world_size,
    stage,
    precision: str = "fp16",
    optimizer: str = "adam",
    *,
    reduce_bucket_size: Optional[int] = None,
    prefetch_bucket_size: Optional[int] = None,
    num_units: Optional[int] = None,
    persistent_params: int = 0,
    largest_unit: int = 0,
) -> MemoryEstimate:
    """Model-state bytes per rank for `stage`, plus optional implementation overheads.

    `total` is the paper's formula; `held_during_step` / `held_between_steps` are what
    this implementation holds (the formula less `savings`, plus `overheads`; stages 2-3
    free their gradient shards between steps). `overheads` holds what this implementation adds
    beyond the formula; each term is computed only when its argument is given:

    - "padding" (num_units, stages 1-3): each flat unit is padded to a multiple of N,
      at most N-1 extra elements per unit spread over N ranks, times the bytes of the
      states the stage partitions (K; g+K; p+g+K).
    - "reduce_buckets" (reduce_bucket_size, stages 0-2): 2 * reduce_bucket_size * g.
    - "gathered_parameters" (largest_unit and/or prefetch_bucket_size, stage 3):
      (largest_unit + max(prefetch_bucket_size, largest_unit)) * (p + g) (the next unit
      is always prefetched when prefetch is on), capped at the whole model.
    - "persistent_parameters" (persistent_params, stage 3):
      persistent_params * (p + g) * (1 - 1/N), rounded up.
    """
    psi = _count("num_params", num_params, 1)
    n = _count("world_size", world_size, 1)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    p = g = bytes_per_element(precision)
    k = optimizer_bytes_per_param(optimizer, precision)

    shard = -(-psi // n)  # ceil(psi / n): elements of a partitioned state on one rank
    parameters = p * (shard if stage == 3 else psi)
    gradients = g * (shard if stage >= 2 else psi)
    optimizer_states = k * (shard if stage >= 1 else psi)

    overheads = {}
    if num_units is not None and stage >= 1:
        units = _count("num_units", num_units, 1)
        partitioned = (k, g + k, p + g + k)[stage - 1]
        overheads["padding"] = -(-units * (n - 1) * partitioned // n)
    if reduce_bucket_size is not None and stage <= 2:
        overheads["reduce_buckets"] = 2 * _count("reduce_bucket_size", reduce_bucket_size, 1) * g
    largest = _count("largest_unit", largest_unit, 0)
    prefetch = None if prefetch_bucket_size is None else _count(
        "prefetch_bucket_size", prefetch_bucket_size, 0)
    if stage == 3 and (largest or prefetch is not None):
        # The unit in use, plus what is prefetched: the budget, but always the next unit
        # (at most the largest) when prefetch is on; never more than the whole model.
        ahead = max(prefetch, largest) if prefetch else 0
        overheads["gathered_parameters"] = min(largest + ahead, psi) * (p + g)
    persistent = _count("persistent_params", persistent_params, 0)
    if persistent > psi:
        raise ValueError(f"persistent_params ({persistent}) cannot exceed num_params ({psi})")
    if stage == 3 and persistent:
        overheads["persistent_parameters"] = -(-persistent * (p + g) * (n - 1) // n)

    savings = {}
    if stage == 3 and canonical_precision(precision) != "fp32":
        savings["compute_param_shard"] = parameters
    freed = gradients if stage >= 2 else 0
    return MemoryEstimate(parameters, gradients, optimizer_states, overheads, savings, freed)


def paper_table(num_params=7.5e9, world_sizes=(1, 4, 16, 64, 256, 1024), precision="fp16"):
    """Rows of (N, stage-1 GB, stage-2 GB, stage-3 GB) like the paper's Table 1 (GB = 1e9 B)."""
    return [
        (n, *(estimate(num_params, n, s, precision).total / 1e9 for s in (1, 2, 3)))
        for n in world_sizes
    ]


OFFLOAD_KINDS = ("cpu", "nvme")


@dataclass(frozen=True)
class OffloadEstimate:
    """Model-state bytes per rank with ``offload_optimizer`` "cpu" or "nvme", by where
    they live: the columns of DeepSpeed's ``estimate_zero{2,3}_model_states_mem_needs``
    (per GPU, per CPU) plus the files of disk offload.  Stage 3's gathered blocks and
    the reduce buckets are extra (the overheads of ``estimate``)."""

    device: int
    """On the training device: the 16-bit parameters the stage keeps (none of stage 3's
    with offload_param), and the 16-bit gradients that are not sent to the host: stage
    1's whole gradient in both cases, and the reduced slice with nvme (cpu sends it to
    the host in fp32 as each bucket finishes)."""
    host: int
    """In host memory: with cpu, the fp32 master shard, its fp32 gradient and the
    optimizer state; with nvme, at most ``inflight_bytes`` of master and optimizer state
    during the step."""
    disk: int
    """In files under nvme_path: the fp32 master shard and the optimizer state, plus the
    16-bit parameter shard with offload_param."""

    @property
    def memory(self) -> int:
        """Device and host together: all of it when both are one memory (CPU training)."""
        return self.device + self.host


def offload_estimate(num_params, world_size, stage, precision: str = "fp16", optimizer: str = "adam", *,
                     offload: str = "cpu", offload_param: bool = False,
                     inflight_bytes: int = 256 * 2**20) -> OffloadEstimate:
    """Device, host and disk bytes per rank with ``offload_optimizer`` = ``offload``
    (stages 1-3; ``offload_param`` only with "nvme" at stage 3, as ZeroConfig allows)."""
    psi = _count("num_params", num_params, 1)
    n = _count("world_size", world_size, 1)
    if offload not in OFFLOAD_KINDS:
        raise ValueError(f"offload must be 'cpu' or 'nvme', got {offload!r}")
    if isinstance(stage, bool) or stage not in (1, 2, 3):
        raise ValueError(f"offload needs stage 1, 2 or 3, got {stage!r}")
    if offload_param and (stage != 3 or offload != "nvme"):
        raise ValueError("offload_param needs stage 3 (only stage 3 partitions parameters) and nvme offload")
    p = g = bytes_per_element(precision)
    k = optimizer_bytes_per_param(optimizer, precision)
    # Offload always keeps an fp32 master of the shard; in fp32 training K does not count it.
    master_and_state = k if canonical_precision(precision) != "fp32" else k + 4
    shard = -(-psi // n)
    params = 0 if offload_param else p * (shard if stage == 3 else psi)
    if offload == "cpu":
        grads = g * psi if stage == 1 else 0  # stage 1's local gradient is whole until reduced
        host = (master_and_state + 4) * shard  # + the fp32 gradient slice the host step reads
        return OffloadEstimate(device=params + grads, host=host, disk=0)
    grads = g * (psi if stage == 1 else shard)
    host = min(_count("inflight_bytes", inflight_bytes, 1), master_and_state * shard)
    disk = master_and_state * shard + (p * shard if offload_param else 0)
    return OffloadEstimate(device=params + grads, host=host, disk=disk)


@dataclass(frozen=True)
class DiskOffloadEstimate:
    """Model-state bytes per rank with ``offload_optimizer: nvme`` (ZeRO-Infinity), for a
    machine whose device and host are one memory (see ``offload_estimate`` for both)."""

    ram: int
    """In memory from backward to step: the 16-bit parameters this rank keeps (none of
    stage 3's with offload_param), its gradients (stage 1: whole; 2-3: its slice, freed
    between steps), and at most ``inflight_bytes`` of master and optimizer state during
    the step.  Stage 3's gathered blocks and the buckets are extra (see the overheads)."""
    disk: int
    """In files under nvme_path: the fp32 master shard (in fp32 training a copy of the
    shard kept in memory) and the optimizer state, K*Psi/N (+4*Psi/N in fp32), plus
    the 16-bit parameter shard with offload_param."""


def disk_offload_estimate(num_params, world_size, stage, precision: str = "fp16", optimizer: str = "adam", *,
                          offload_param: bool = False, inflight_bytes: int = 256 * 2**20) -> DiskOffloadEstimate:
    """RAM and disk per rank for disk offload at ``stage`` (1-3; offload_param only at 3)."""
    r = offload_estimate(num_params, world_size, stage, precision, optimizer, offload="nvme",
                         offload_param=offload_param, inflight_bytes=inflight_bytes)
    return DiskOffloadEstimate(ram=r.memory, disk=r.disk)


def largest_fitting(bytes_for, budget: int, upper: int = 10**15) -> int:
    """The largest parameter count Ψ with ``bytes_for(Ψ) <= budget`` (0 when not even one
    parameter fits), by bisection; ``bytes_for`` must not decrease as Ψ grows (every
    estimate here is a sum of non-negative multiples of Ψ, ceil(Ψ/N) and constants)."""
    budget = _count("budget", budget, 0)
    if bytes_for(1) > budget:
        return 0
    lo, hi = 1, _count("upper", upper, 1)
    if bytes_for(hi) <= budget:
        return hi
    while hi - lo > 1:  # bytes_for(lo) fits, bytes_for(hi) does not
        mid = (lo + hi) // 2
        if bytes_for(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo
