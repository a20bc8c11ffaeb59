"""ZeRO++ on simulated nodes: hpZ is exact, qwZ and qgZ send what the config says.

Four gloo ranks as 2 nodes x 2 ranks (``ranks_per_node=2``) and two ranks as 2 nodes x
1, one launch each for every configuration.  Stage 3 with every parameter
partitioned (threshold 0) and every block gathered alone (``min_gather_numel=0``):

* hpZ alone trains bit-for-bit like plain stage 3 (fp32 and bf16): losses and every
  weight after the steps.  Its backward gathers stay inside the node: the all-gathers'
  cross-node bytes per step are those of one no-grad forward of plain stage 3 (which
  gathers each block once), at 2x1 backward moves nothing at all.
* qwZ int8: each training all-gather moves, per rank's chunk of c elements, the
  payload of ceil(c / B) blocks of B bytes and one fp32 scale per block; the losses
  stay within quantization noise of plain stage 3's.
* qgZ int8 / int4: the gradient read after backward is plain stage 3's to within
  the quantization bound; the cross-node exchange carries bits + 32/B bits per
  element; nothing of the node-level reduce-scatter crosses a node.
* All three together cut cross-node bytes below a quarter of plain stage 3's.
* A launcher whose variables say the ranks are interleaved across nodes is refused
  on every rank, naming each rank's node.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from dist_harness import run_distributed, run_distributed_outcomes
from models import tiny_gpt2

STEPS = 3
BLOCK = 64
BASE = dict(stage=3, param_persistence_threshold=0, min_gather_numel=0, quantization_block_size=BLOCK,
            step_clears_gradients=False)


def _batches(ws: int):
    return [torch.randint(0, 96, (2 * ws, 12), generator=torch.Generator().manual_seed(s)) for s in range(STEPS)]


def _train(rank, ws, cfg):
    """Losses, weights, comm report of the steps, the reduced gradients of the last
    backward (read through .grad) and each partitioned unit's shard size."""
    import zero_strategy

    model = tiny_gpt2(seed=0)
    engine = zero_strategy.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg)
    # Every gather the steps start, with the shard size and whether it was asked to quantize.
    gathers = []
    for u in engine.units:
        store = u.params_store
        if u.keep_full:
            continue

        def recording(comm, label, quantization=None, _store=store, _orig=store.start_gather):
            from zero_strategy.sharding.param_shard import ShardState

            if _store.state is ShardState.SHARDED:
                gathers.append((_store.layout.shard_numel, quantization, _store.secondary is not None))
            return _orig(comm, label, quantization)

        store.start_gather = recording
    losses, grads = [], None
    engine.reset_comm_report()
    for i, ids in enumerate(_batches(ws)):
        mine = ids[rank * 2 : (rank + 1) * 2]
        loss = model(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        if i == 0:  # the first backward: the same weights in every configuration
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        engine.step()
        losses.append(loss.item())
    report = engine.comm_report()
    step_gathers = list(gathers)
    engine.reset_comm_report()
    with torch.no_grad():
        model(input_ids=_batches(ws)[0][:2])
    no_grad_forward = engine.comm_report()
    shards = [u.layout.shard_numel for u in engine.units if not u.keep_full]
    weights = {k: v.float().clone() for k, v in engine.full_state_dict().items()}  # a collective: every rank
    described = engine.describe()
    memory = engine.memory_report()
    engine.close()
    return dict(losses=losses, weights=weights, report=report.as_dict(), no_grad_forward=no_grad_forward.as_dict(),
                grads=grads, shards=shards, describe=described, memory=memory, gathers=step_gathers)


CONFIGS_2X2 = {
    "plain": {}, "hpz": dict(secondary_partition="node"),
    "plain_bf16": dict(precision="bf16"), "hpz_bf16": dict(precision="bf16", secondary_partition="node"),
    "qwz": dict(weight_quantization="int8"),
    "qgz8": dict(gradient_quantization="int8"), "qgz4": dict(gradient_quantization="int4"),
    "all": dict(secondary_partition="node", weight_quantization="int8", gradient_quantization="int4"),
}


def _worker_2x2(rank, ws):
    return {name: _train(rank, ws, dict(BASE, ranks_per_node=2, **extra)) for name, extra in CONFIGS_2X2.items()}


def _worker_2x1(rank, ws):
    return {name: _train(rank, ws, dict(BASE, ranks_per_node=1, **extra))
            for name, extra in {"plain": {}, "hpz": dict(secondary_partition="node")}.items()}


@pytest.fixture(scope="module")
def runs_2x2():
    return run_distributed(_worker_2x2, 4)


@pytest.fixture(scope="module")
def runs_2x1():
    return run_distributed(_worker_2x1, 2)


def _same_training(a, b):
    assert a["losses"] == b["losses"]
    assert a["weights"].keys() == b["weights"].keys()
    for k in a["weights"]:
        assert torch.equal(a["weights"][k], b["weights"][k]), k


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_hpz_trains_exactly_like_plain_stage_3(runs_2x2, precision):
    suffix = "" if precision == "fp32" else "_bf16"
    r0 = runs_2x2[0]
    _same_training(r0["hpz" + suffix], r0["plain" + suffix])
    for rank in runs_2x2:
        hpz, plain = rank["hpz" + suffix], rank["plain" + suffix]
        # Backward's gathers stay in the node: what crosses is forward's gathers only.
        per_forward = plain["no_grad_forward"]["all_gather"]["cross_node_bytes"]
        assert hpz["report"]["all_gather"]["cross_node_bytes"] == STEPS * per_forward
        assert plain["report"]["all_gather"]["cross_node_bytes"] > STEPS * per_forward
        # Same elements gathered in all: the gathers moved, none was dropped.
        assert hpz["report"]["all_gather"]["elements"] == plain["report"]["all_gather"]["elements"]
    assert "2 nodes x 2 ranks" in r0["hpz"]["describe"] and "hpZ" in r0["hpz"]["describe"]
    assert "secondary_parameters" in r0["hpz"]["memory"] and "secondary_parameters" not in r0["plain"]["memory"]


@pytest.mark.slow
def test_hpz_on_one_rank_per_node_gathers_nothing_in_backward(runs_2x1):
    r0 = runs_2x1[0]
    _same_training(r0["hpz"], r0["plain"])
    for rank in runs_2x1:
        per_forward = rank["plain"]["no_grad_forward"]["all_gather"]["cross_node_bytes"]
        assert rank["hpz"]["report"]["all_gather"]["cross_node_bytes"] == STEPS * per_forward
        assert rank["hpz"]["report"]["all_gather"]["intra_node_bytes"] == 0  # a node of one: nothing to send


def _quantized_bytes(c: int, ws: int, bits: int) -> int:
    blocks = math.ceil(c / BLOCK)
    return ws * (blocks * BLOCK * bits // 8 + 4 * blocks)


@pytest.mark.slow
def test_qwz_gathers_int8_blocks_and_trains_close_to_plain(runs_2x2):
    for rank in runs_2x2:
        qwz, plain = rank["qwz"], rank["plain"]
        # The same gathers (each one's payload and scales counted as one gather).
        assert qwz["report"]["all_gather"]["calls"] == plain["report"]["all_gather"]["calls"]
        per_step_units = plain["report"]["all_gather"]["elements"]
        assert qwz["report"]["all_gather"]["elements"] == per_step_units
        # Bytes: what the config says, gather by gather: every training gather was asked
        # to quantize, and moves 4 chunks of whole int8 blocks and their fp32 scales.
        assert qwz["gathers"] and all(q == (8, BLOCK) for _, q, _ in qwz["gathers"])
        assert qwz["report"]["all_gather"]["bytes"] == sum(_quantized_bytes(c, 4, 8) for c, _, _ in qwz["gathers"])
        bits = 8 * qwz["report"]["all_gather"]["bytes"] / per_step_units
        assert 8 + 32 / BLOCK <= bits < 8 + 32 / BLOCK + 1.5  # padding to whole blocks on small units
    r0 = runs_2x2[0]
    for q, p in zip(r0["qwz"]["losses"], r0["plain"]["losses"]):
        assert abs(q - p) < 2e-2 * abs(p)
    assert r0["qwz"]["losses"] != r0["plain"]["losses"]  # the weights really were quantized


@pytest.mark.slow
@pytest.mark.parametrize("bits,tolerance", [(8, 0.01), (4, 0.15)])
def test_qgz_reduces_gradients_within_the_quantization_error(runs_2x2, bits, tolerance):
    name = f"qgz{bits}"
    for rank in runs_2x2:
        q, plain = rank[name], rank["plain"]
        assert q["losses"][0] == plain["losses"][0]  # the forward is untouched
        rep = q["report"]
        assert rep["reduce_scatter"]["cross_node_bytes"] == 0  # the node level stays in the node
        cross = rep["reduce_scatter_cross_node"]
        assert cross["intra_node_bytes"] == 0 and cross["cross_node_bytes"] == cross["bytes"]
        bits_seen = 8 * cross["bytes"] / cross["elements"]
        assert bits + 32 / BLOCK <= bits_seen < bits + 32 / BLOCK + 1.5
        # The first backward's reduced gradient (read through .grad: the same local
        # gradients, reduced exactly by plain stage 3) differs by the rounding alone.
        diff = math.sqrt(sum(float((q["grads"][n] - plain["grads"][n]).norm()) ** 2 for n in plain["grads"]))
        norm = math.sqrt(sum(float(g.norm()) ** 2 for g in plain["grads"].values()))
        assert 0 < diff < tolerance * norm, (diff / norm)


@pytest.mark.slow
def test_all_three_cut_cross_node_bytes_below_a_quarter(runs_2x2):
    for rank in runs_2x2:
        plain = rank["plain"]["report"]["total"]["cross_node_bytes"]
        both = rank["all"]["report"]["total"]["cross_node_bytes"]
        assert 0 < both <= 0.25 * plain
    assert "qwZ int8" in runs_2x2[0]["all"]["describe"] and "qgZ int4" in runs_2x2[0]["all"]["describe"]


def _interleaved(rank, ws):
    import zero_strategy

    os.environ.update(LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank % 2), LOCAL_RANK=str(rank // 2))
    model = tiny_gpt2(seed=0)
    zero_strategy.initialize(model, torch.optim.AdamW(model.parameters()), dict(stage=3, secondary_partition="node"))


@pytest.mark.slow
def test_an_interleaved_launcher_layout_is_refused_on_every_rank():
    outcome = run_distributed_outcomes(_interleaved, 4, timeout=120)
    assert not outcome["timed_out"]
    for rank, (kind, text) in outcome["ranks"].items():
        assert kind == "error", rank
        assert "ranks must be numbered node by node" in text
        assert "rank 1: node 1, local rank 0" in text


# -- the topology and the byte model, without processes ----------------------------------

def test_topology_from_config_launcher_and_slurm():
    from zero_strategy.communication.topology import resolve

    assert resolve(8, 4, {}).describe() == "2 nodes x 4 ranks"
    assert resolve(8, None, {"LOCAL_WORLD_SIZE": "2"}).nodes == 4
    slurm = {"SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "4(x2)"}
    assert resolve(8, None, slurm).ranks_per_node == 4
    assert resolve(8, None, {}).nodes == 1
    with pytest.raises(ValueError, match="does not divide the world size"):
        resolve(6, 4, {})


def test_direct_exchange_bytes_by_hand():
    from zero_strategy.communication.topology import GroupPlacement, Topology, sent_bytes

    topo = Topology(8, 4)  # ranks 0-3 on node 0, 4-7 on node 1
    world = GroupPlacement.of(topo, range(8), 1)
    # 800 bytes gathered by 8 ranks: 100 of mine to each of 7 others, 4 of them elsewhere.
    assert sent_bytes("all_gather", 800, world) == (300, 400)
    assert sent_bytes("reduce_scatter", 800, world) == (300, 400)
    assert sent_bytes("all_reduce", 800, world) == (600, 800)
    node = GroupPlacement.of(topo, [0, 1, 2, 3], 1)
    assert sent_bytes("all_gather", 800, node) == (600, 0)
    assert sent_bytes("broadcast", 800, world, is_source=False) == (0, 0)


def test_estimated_traffic_by_hand():
    from zero_strategy.estimate_traffic import step_traffic

    psi = 1_000_000  # 2 nodes x 2 ranks, fp32: a world collective sends 3/4 of S, 2/4 across
    plain = step_traffic(psi, 4, 2, 3, "fp32")
    assert (plain.sent, plain.cross_node) == (3 * 4e6 * 3 / 4, 3 * 4e6 / 2)
    hpz = step_traffic(psi, 4, 2, 3, "fp32", secondary_partition=True)
    assert hpz.cross_node == 2 * 4e6 / 2 and hpz.extra_memory == 4e6 / 2
    both = step_traffic(psi, 4, 2, 3, "fp32", secondary_partition=True, weight_bits=8, gradient_bits=4, block=256)
    # forward gather at 1 + 4/256 bytes, half across; gradients: Ψ/2 elements, half sent across at 0.5 + 4/256
    assert both.cross_node == pytest.approx(psi * (1 + 4 / 256) / 2 + psi / 2 / 2 * (0.5 + 4 / 256))
    assert both.cross_node < 0.25 * plain.cross_node
    assert step_traffic(psi, 4, 4, 3, "fp32").cross_node == 0


def _uneven(rank, ws):
    import zero_strategy

    # torchrun agents started with different --nproc-per-node: rank 3 thinks its node holds 4.
    os.environ.update(LOCAL_WORLD_SIZE="4" if rank == 3 else "2", LOCAL_RANK=str(rank % 2))
    model = tiny_gpt2(seed=0)
    zero_strategy.initialize(model, torch.optim.AdamW(model.parameters()), dict(stage=3))


@pytest.mark.slow
def test_ranks_that_see_different_node_sizes_fail_together_at_the_setup_check():
    outcome = run_distributed_outcomes(_uneven, 4, timeout=120)
    assert not outcome["timed_out"]
    for rank, (kind, text) in outcome["ranks"].items():
        assert kind == "error", rank
        assert "set up differently" in text and "ranks per node" in text


def test_hierarchical_options_refuse_a_slurm_job_of_uneven_nodes():
    from zero_strategy import ZeroConfig
    from zero_strategy.communication import multinode
    from zero_strategy.communication.topology import from_launcher

    topology = from_launcher(4, {"SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "3,1"})
    assert topology.nodes == 1 and topology.uneven

    class _Comm:  # enough of a communicator for set_up's decisions
        world_size = 4

        def set_topology(self, t):
            self.topology = t

    with pytest.raises(ValueError, match="nodes of equal size"):
        multinode.set_up(_Comm(), ZeroConfig(stage=3, secondary_partition="node"), topology)
    assert multinode.set_up(_Comm(), ZeroConfig(stage=3), topology) is topology  # plain: accounting only
