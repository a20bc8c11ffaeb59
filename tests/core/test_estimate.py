"""Memory estimates checked against the ZeRO paper (Table 1 and the formulas of Rajbhandari et al., SC 2020).
What `zero-strategy estimate` prints is tested in test_estimate_cli.py."""

import pytest

from zero_strategy.cli import main, parse_count
from zero_strategy.estimate import estimate, paper_table

GB = 1e9
PSI = 7_500_000_000

# Table 1 of the paper: N -> (P_os, P_os+g, P_os+g+p) in GB per device, Psi = 7.5B, K = 12,
# as printed (1 decimal, or 2 where the paper gives 2).
PAPER_TABLE_1 = {
    1: ("120", "120", "120"),
    4: ("52.5", "41.3", "30"),
    16: ("35.6", "21.6", "7.5"),
    64: ("31.4", "16.6", "1.88"),
    256: ("30.4", "15.4", "0.47"),
    1024: ("30.1", "15.1", "0.12"),
}


def _matches_printed(value_gb: float, printed: str) -> bool:
    """True if rounding value_gb half-up to the printed number of decimals gives it
    (41.25 is printed as 41.3, so a plain abs < 0.05 would be too strict at the edge)."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    half_step = 0.5 * 10 ** -decimals
    return -half_step - 1e-9 <= value_gb - float(printed) < half_step


@pytest.mark.parametrize("n", sorted(PAPER_TABLE_1))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_reproduces_paper_table_1(n, stage):
    printed = PAPER_TABLE_1[n][stage - 1]
    got = estimate(PSI, n, stage, "fp16", "adam").total / GB
    assert _matches_printed(got, printed), (n, stage, got, printed)


def test_paper_table_helper_matches_table_1():
    rows = paper_table()
    assert [row[0] for row in rows] == sorted(PAPER_TABLE_1)
    for n, *gbs in rows:
        for got, printed in zip(gbs, PAPER_TABLE_1[n]):
            assert _matches_printed(got, printed), (n, got, printed)


def test_baseline_is_16_bytes_per_param_in_mixed_precision():
    for n in (1, 8, 1024):
        assert estimate(PSI, n, 0).total == 16 * PSI  # 2 + 2 + 12, never divided by N


def test_breakdown_per_stage_matches_the_formulas():
    psi, n = 1_000_000, 8  # divisible, so the exact formula has no rounding
    rows = {s: estimate(psi, n, s, "bf16", "adamw") for s in range(4)}
    expected = {  # (params, grads, optimizer states) from the paper's formulas with p = g = 2, K = 12
        0: (2 * psi, 2 * psi, 12 * psi),
        1: (2 * psi, 2 * psi, 12 * psi // n),
        2: (2 * psi, 2 * psi // n, 12 * psi // n),
        3: (2 * psi // n, 2 * psi // n, 12 * psi // n),
    }
    for s, (p, g, k) in expected.items():
        r = rows[s]
        assert (r.parameters, r.gradients, r.optimizer_states) == (p, g, k)
        assert r.total == p + g + k


def test_one_trillion_parameters_on_1024_ranks_needs_15_6_gb():
    got = estimate(10**12, 1024, 3, "fp16").total
    assert got == 15_625_000_000  # 16e12 / 1024 exactly
    assert _matches_printed(got / GB, "15.6")


def test_fp32_uses_4_byte_params_and_grads_and_k_8():
    psi, n = 1_000_000, 4
    assert estimate(psi, n, 0, "fp32", "adam").total == 16 * psi  # 4 + 4 + 8
    assert estimate(psi, n, 1, "fp32", "adam").total == 8 * psi + 8 * psi // n
    assert estimate(psi, n, 2, "fp32", "adam").total == 4 * psi + 12 * psi // n
    assert estimate(psi, n, 3, "fp32", "adam").total == 16 * psi // n


@pytest.mark.parametrize("optimizer, precision, k", [
    ("sgd", "fp16", 8), ("sgd", "fp32", 4),
    ("sgd_nomomentum", "bf16", 4), ("sgd-plain", "fp32", 0),
])
def test_other_optimizers_k(optimizer, precision, k):
    p = 4 if precision == "fp32" else 2
    assert estimate(1000, 1, 0, precision, optimizer).total == (2 * p + k) * 1000


def test_a_rank_holds_ceil_psi_over_n_elements():
    # 10 elements over 4 ranks: each rank holds 3 (the last one partly padding).
    r = estimate(10, 4, 3, "fp16")
    assert (r.parameters, r.gradients, r.optimizer_states) == (6, 6, 36)


def test_no_overheads_unless_requested():
    for stage in range(4):
        r = estimate(PSI, 64, stage)
        assert r.overheads == {} and r.total_with_overheads == r.total


def test_overhead_terms_when_requested():
    n, bucket, units = 64, 25_000_000, 48
    args = dict(reduce_bucket_size=bucket, prefetch_bucket_size=50_000_000,
                num_units=units, persistent_params=1_000_000, largest_unit=200_000_000)
    r = {s: estimate(PSI, n, s, "fp16", "adam", **args) for s in range(4)}
    # Two fp16 gradient buckets for stages 0-2; stage 3 reduces per gathered unit instead.
    for s in (0, 1, 2):
        assert r[s].overheads["reduce_buckets"] == 2 * bucket * 2
    assert "reduce_buckets" not in r[3].overheads
    # Padding: at most N - 1 elements per unit in all, spread over N ranks.
    assert "padding" not in r[0].overheads
    for s, partitioned_bytes in ((1, 12), (2, 14), (3, 16)):
        bound = units * (n - 1) * partitioned_bytes / n
        assert 0 < r[s].overheads["padding"] <= bound + 1
    # Stage 3: the gathered unit and the prefetched parameters, fp16 params + grads;
    # a budget below one unit still prefetches the next unit (the largest, at most).
    assert r[3].overheads["gathered_parameters"] == (200_000_000 + 200_000_000) * 4
    big = estimate(PSI, n, 3, "fp16", "adam", **dict(args, prefetch_bucket_size=500_000_000))
    assert big.overheads["gathered_parameters"] == (200_000_000 + 500_000_000) * 4
    off = estimate(PSI, n, 3, "fp16", "adam", **dict(args, prefetch_bucket_size=0))
    assert off.overheads["gathered_parameters"] == 200_000_000 * 4
    # Persistent parameters: whole instead of 1/64, for params and grads.
    assert r[3].overheads["persistent_parameters"] == 1_000_000 * 4 * 63 // 64
    for s in range(3):
        assert "gathered_parameters" not in r[s].overheads
        assert "persistent_parameters" not in r[s].overheads
    for s in range(4):
        assert r[s].total_with_overheads == r[s].total + sum(r[s].overheads.values())


def test_padding_is_zero_on_one_rank():
    assert estimate(PSI, 1, 3, num_units=10).overheads["padding"] == 0


@pytest.mark.parametrize("kwargs", [
    dict(num_params=0, world_size=4, stage=1),
    dict(num_params=-5, world_size=4, stage=1),
    dict(num_params=1.5, world_size=4, stage=1),
    dict(num_params=100, world_size=0, stage=1),
    dict(num_params=100, world_size=True, stage=1),
    dict(num_params=100, world_size=4, stage=4),
    dict(num_params=100, world_size=4, stage=1, precision="fp8"),
    dict(num_params=100, world_size=4, stage=1, optimizer="lion"),
    dict(num_params=100, world_size=4, stage=1, reduce_bucket_size=0),
    dict(num_params=100, world_size=4, stage=3, num_units=0),
    dict(num_params=100, world_size=4, stage=3, persistent_params=101),
    dict(num_params=100, world_size=4, stage=3, largest_unit=-1),
])
def test_invalid_input_raises_value_error(kwargs):
    with pytest.raises(ValueError):
        estimate(**kwargs)


@pytest.mark.parametrize("text, value", [
    ("7.5e9", 7_500_000_000), ("7.5B", 7_500_000_000), ("350M", 350_000_000),
    ("1T", 10**12), ("25_000_000", 25_000_000), ("1.5b", 1_500_000_000),
])
def test_cli_param_counts(text, value):
    assert parse_count(text) == value


def test_cli_rejects_bad_input():
    with pytest.raises(SystemExit):
        main(["estimate", "--params", "lots"])
    with pytest.raises(SystemExit):
        main(["estimate", "--params", "1B", "--optimizer", "lion"])


# -- disk offload (ZeRO-Infinity's NVMe offload) --------------------------------------------------
def test_disk_offload_moves_the_optimizer_states_term_to_disk():
    from zero_strategy.estimate import disk_offload_estimate

    n, inflight = 64, 256 * 2**20
    shard = PSI // n  # 7.5e9 / 64 is whole
    # Mixed-precision Adam: K = 12 bytes/param (fp32 master + 2 moments) leave memory for
    # disk; memory keeps the 16-bit parameters and gradients the stage keeps, plus the bound.
    for stage, params, grads in ((1, 2 * PSI, 2 * PSI), (2, 2 * PSI, 2 * shard), (3, 2 * shard, 2 * shard)):
        r = disk_offload_estimate(PSI, n, stage, "bf16", "adam", inflight_bytes=inflight)
        assert r.disk == 12 * shard
        assert r.ram == params + grads + inflight
        # What leaves memory is the formula's optimizer-states term, less the in-flight bound.
        assert estimate(PSI, n, stage, "bf16").total - r.ram == 12 * shard - inflight
    both = disk_offload_estimate(PSI, n, 3, "bf16", "adam", offload_param=True, inflight_bytes=inflight)
    assert both.disk == 14 * shard and both.ram == 2 * shard + inflight
    # fp32: K = 8 (the parameters are the masters), but the files also hold the fp32 master.
    assert disk_offload_estimate(PSI, n, 2, "fp32", "adam").disk == 12 * shard
    # A tiny model: the bound is never more than the state itself.
    small = disk_offload_estimate(1000, 1, 2, "bf16", "adam")
    assert small.ram == 2 * 1000 + 2 * 1000 + 12 * 1000 and small.disk == 12 * 1000


def test_disk_offload_estimate_refuses_what_the_config_refuses():
    from zero_strategy.estimate import disk_offload_estimate

    with pytest.raises(ValueError, match="stage 1, 2 or 3"):
        disk_offload_estimate(PSI, 8, 0)
    with pytest.raises(ValueError, match="offload_param needs stage 3"):
        disk_offload_estimate(PSI, 8, 2, offload_param=True)


# -- what fits in a memory budget ------------------------------------------------------------
def test_largest_fitting_inverts_the_closed_forms():
    from zero_strategy.estimate import disk_offload_estimate, largest_fitting

    # Stage 0 in mixed precision holds 16 bytes per parameter: the largest model in B bytes is B // 16.
    for budget in (0, 15, 16, 17, 10**9 + 7):
        assert largest_fitting(lambda p: estimate(p, 1, 0, "bf16").total, budget) == budget // 16
    # Stage 3 on N = 4: 16 * ceil(Psi / 4) <= B  <=>  Psi <= 4 * (B // 16).
    assert largest_fitting(lambda p: estimate(p, 4, 3, "bf16").total, 1600) == 400
    # Disk offload, stage 3 with the parameters on disk: RAM = 2 ceil(Psi/N) + the in-flight bound,
    # disk = 14 ceil(Psi/N); N = 2, 1 GiB in flight, 11 GiB of RAM, 30 GiB of disk.
    gib, n, inflight = 2**30, 2, 2**30
    ram = largest_fitting(lambda p: disk_offload_estimate(p, n, 3, "bf16", offload_param=True,
                                                          inflight_bytes=inflight).ram, 11 * gib)
    assert ram == n * ((11 * gib - inflight) // 2)
    disk = largest_fitting(lambda p: disk_offload_estimate(p, n, 3, "bf16", offload_param=True).disk, 30 * gib)
    assert disk == n * (30 * gib // 14)
    assert largest_fitting(lambda p: 10**20, 10**9) == 0  # nothing fits


# -- offload: device, host and disk per rank ------------------------------------------------
def test_offload_rows_follow_from_where_each_state_lives():
    """Each byte placed by hand: 16-bit parameters and gradients (p = g = 2) where the
    stage keeps them; the fp32 master (4), fp32 gradient slice (4) and Adam moments (8)
    of this rank's shard on the host with cpu; master and moments in files with nvme."""
    from zero_strategy.estimate import offload_estimate

    n, inflight = 64, 256 * 2**20
    shard = PSI // n
    expected = {  # (stage, offload, offload_param) -> (device, host, disk)
        (1, "cpu", False): (2 * PSI + 2 * PSI, (4 + 4 + 8) * shard, 0),
        (2, "cpu", False): (2 * PSI, (4 + 4 + 8) * shard, 0),  # DeepSpeed's ZeRO-2 offload: 2 bytes/param on the GPU
        (3, "cpu", False): (2 * shard, (4 + 4 + 8) * shard, 0),
        (1, "nvme", False): (2 * PSI + 2 * PSI, inflight, (4 + 8) * shard),
        (2, "nvme", False): (2 * PSI + 2 * shard, inflight, (4 + 8) * shard),
        (3, "nvme", False): (2 * shard + 2 * shard, inflight, (4 + 8) * shard),
        (3, "nvme", True): (2 * shard, inflight, (4 + 8 + 2) * shard),
    }
    for (stage, where, offload_param), (device, host, disk) in expected.items():
        r = offload_estimate(PSI, n, stage, "bf16", "adam", offload=where, offload_param=offload_param,
                             inflight_bytes=inflight)
        assert (r.device, r.host, r.disk) == (device, host, disk), (stage, where, offload_param, r)
        assert r.memory == device + host
    # fp32 training: 4-byte parameters and gradients, K = 8 (the moments); offload still keeps an fp32 master.
    r = offload_estimate(PSI, n, 2, "fp32", "adam", offload="cpu")
    assert (r.device, r.host) == (4 * PSI, (4 + 4 + 8) * shard)
    # The in-flight bound never exceeds the state itself.
    assert offload_estimate(1000, 1, 2, "bf16", offload="nvme").host == 12 * 1000


def test_offload_estimate_refuses_what_the_config_refuses():
    from zero_strategy.estimate import offload_estimate

    for kwargs in (dict(stage=0), dict(stage=2, offload="disk"), dict(stage=3, offload="cpu", offload_param=True),
                   dict(stage=2, offload="nvme", offload_param=True)):
        with pytest.raises(ValueError):
            offload_estimate(PSI, 8, **{"offload": "cpu", **kwargs})


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cpu_offload_estimate_matches_what_the_engine_holds(stage, precision):
    """The engine's own account (memory_report's device and host, between backward and
    step) of a two-matrix model with offload_optimizer cpu, one process on CPU. Stage 3
    is left out: on CPU its 16-bit shard is cast from the host master (device and host
    are one memory), unlike on a GPU, which the estimate describes."""
    import torch

    import zero_strategy
    from zero_strategy.estimate import offload_estimate

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = zero_strategy.initialize(model, optimizer, {"stage": stage, "precision": precision,
                                                         "offload_optimizer": "cpu"})
    try:
        x = torch.randn(4, 64, dtype=next(model.parameters()).dtype)
        for _ in range(2):  # the second step: Adam's moments exist
            engine.backward(model(x).float().pow(2).mean())
            got = engine.memory_report()
            engine.step()
    finally:
        engine.close()
    want = offload_estimate(2 * 64 * 64, 1, stage, precision, "adamw", offload="cpu")
    assert got["device"] == want.device
    # Adam's per-parameter step counters (one 4-byte scalar each) are the only extra host bytes.
    assert 0 <= got["host"] - want.host <= 2 * 8, (got, want)
