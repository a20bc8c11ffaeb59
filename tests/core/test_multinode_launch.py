"""Several nodes through the launchers users already have (issue #33): torchrun, Slurm's
variables, and checkpoints across node layouts.

* torchrun: two ``torchrun --nnodes 2`` launchers on this host (each one "node") train
  the quick-start example exactly as one ``torchrun --nproc-per-node 4`` (2 nodes x 2
  ranks, c10d rendezvous) or ``--nproc-per-node 2`` (2 nodes x 1 rank, static
  rendezvous with ``--node-rank``) does: the same losses and the same saved weights, and
  the engine says it saw the nodes (its start-up line).  With hpZ on across the two
  launchers' nodes it still trains bit-for-bit like plain stage 3 on one node.  The
  one-node run is the reference; nothing is compared with numbers copied from a run.
* Slurm (no Slurm here): the variables that ``sbatch`` + ``srun`` + ``torchrun`` and
  ``srun`` alone give each process, fed to what the engine reads at start-up
  (``topology.resolve``, ``launcher_identity``, ``check_layout``, and
  ``multinode.set_up`` itself with every rank's report).
* Checkpoints: saved on 2 simulated nodes x 2 ranks (stage 3, every parameter
  partitioned, hpZ on), loaded on 1 node x 3 and on 4 nodes x 1; training then goes on
  as an uninterrupted run at the new size does.
"""
from __future__ import annotations

import os
import re
import socket
import sys
from pathlib import Path

import pytest
import torch

from processes import run_together

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "finetune_tiny_gpt2.py"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
TIMEOUT = 400


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ZERO_STRATEGY_", "SLURM_", "TORCHELASTIC_"))
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                         "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TRANSFORMERS_VERBOSITY="error")
    return env


# ======================================================================================
# torchrun: two launchers on this host against one
# ======================================================================================
EXAMPLE_ARGS = ["--steps", "10", "--log-every", "1"]  # docs/multinode.md's --steps 10 (--log-every: every step)


def _example(tmp: Path, name: str, launchers, extra=()) -> dict:
    """Run the example under ``launchers`` (torchrun argument lists, started together),
    with ``extra`` example arguments; returns what rank 0 printed, which launch printed
    it, and the saved weights."""
    save = tmp / name
    cmds = [[TORCHRUN, *args, str(EXAMPLE), *EXAMPLE_ARGS, *extra, "--save", str(save)] for args in launchers]
    procs = run_together(cmds, cwd=str(ROOT), envs=[_env()] * len(cmds), timeout=TIMEOUT)
    for p in procs:
        assert p.returncode == 0, f"{p.args} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    printed = [i for i, p in enumerate(procs) if "GPT-2:" in p.stdout]
    assert len(printed) == 1, [p.stdout[-500:] for p in procs]  # rank 0 is in exactly one launch
    out = procs[printed[0]].stdout
    from safetensors.torch import load_file

    return {"steps": re.findall(r"^step +\d+ +loss \S+ +lr \S+$", out, re.M),
            "summary": re.search(r"^loss \S+ -> \S+ in \d+ steps", out, re.M).group(0),
            "setup": next(line for line in out.splitlines() if line.startswith("ZeRO stage")),
            "probe": re.search(r"loss on a probe batch: .*$", out, re.M).group(0),
            "bytes": (re.search(r"bytes sent by rank 0: .* to other nodes", out) or [None])[0],
            "weights": load_file(str(save / "model.safetensors")), "launch": printed[0]}


@pytest.fixture(scope="module")
def torchrun_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torchrun")
    runs = {}
    c10d = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{_free_port()}"]
    runs["2x2"] = _example(tmp, "2x2", [c10d, c10d])
    port = _free_port()
    static = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    short = ["--steps", "4"]  # the 2 x 1 pair is not quoted by the docs: 4 steps compare as well as 10
    runs["2x1"] = _example(tmp, "2x1", [static + ["--node-rank", "0"], static + ["--node-rank", "1"]], short)
    runs["1x4"] = _example(tmp, "1x4", [["--standalone", "--nproc-per-node", "4"]])
    runs["1x2"] = _example(tmp, "1x2", [["--standalone", "--nproc-per-node", "2"]], short)
    # hpZ across the two launchers' nodes, each block gathered on its own (by default the
    # example's whole model is one gather kept from forward into backward: nothing for
    # hpZ to do), against one node running plain stage 3 the same way.
    blocks = ["--min-gather-numel", "0", "--steps", "4"]  # 4 steps: enough to compare, half the time
    c10d = c10d[:-1] + [f"127.0.0.1:{_free_port()}"]
    runs["2x2_hpz"] = _example(tmp, "2x2_hpz", [c10d, c10d], blocks + ["--secondary-partition", "node"])
    runs["1x4_blocks"] = _example(tmp, "1x4_blocks", [["--standalone", "--nproc-per-node", "4"]], blocks)
    return runs


def _same_weights(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=lambda m: f"{k}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("nodes,one_node", [("2x2", "1x4"), ("2x1", "1x2")])
def test_two_torchrun_launchers_train_like_one(torchrun_runs, nodes, one_node):
    got, ref = torchrun_runs[nodes], torchrun_runs[one_node]
    assert len(got["steps"]) == (10 if nodes == "2x2" else 4) and got["steps"] == ref["steps"]
    assert got["summary"] == ref["summary"] and got["probe"] == ref["probe"]
    _same_weights(got["weights"], ref["weights"])


@pytest.mark.slow
def test_hpz_across_two_launchers_trains_exactly_like_plain_stage_3_on_one_node(torchrun_runs):
    got, ref = torchrun_runs["2x2_hpz"], torchrun_runs["1x4_blocks"]
    assert "ZeRO++: hpZ" in got["setup"] and "2 nodes x 2 ranks" in got["setup"]
    assert len(got["steps"]) == 4 and got["steps"] == ref["steps"]
    assert got["summary"] == ref["summary"] and got["probe"] == ref["probe"]
    _same_weights(got["weights"], ref["weights"])


@pytest.mark.slow
def test_the_engine_sees_torchruns_nodes(torchrun_runs):
    assert "on 4 rank(s) (2 nodes x 2 ranks (from the launcher (LOCAL_WORLD_SIZE)))" in torchrun_runs["2x2"]["setup"]
    assert "on 2 rank(s) (2 nodes x 1 rank (from the launcher (LOCAL_WORLD_SIZE)))" in torchrun_runs["2x1"]["setup"]
    # One node: nothing about nodes in the line.
    assert "node" not in torchrun_runs["1x4"]["setup"]
    # The static rendezvous honours --node-rank: rank 0 runs in the launch with --node-rank 0.
    assert torchrun_runs["2x1"]["launch"] == 0
    # On nodes the example prints what rank 0 sent across them; on one node nothing.
    assert torchrun_runs["2x2"]["bytes"] is not None and torchrun_runs["1x4"]["bytes"] is None


@pytest.mark.slow
def test_docs_quote_what_the_two_launchers_print(torchrun_runs):
    """docs/multinode.md's torchrun section quotes the 2 x 2 run of its commands."""
    doc = (ROOT / "docs" / "multinode.md").read_text()
    assert re.search(r"`(loss \S+ -> \S+ in 10 steps)`", doc).group(1) == torchrun_runs["2x2"]["summary"]
    assert re.search(r"`(bytes sent by rank 0: [^`]+)`", doc).group(1) == torchrun_runs["2x2"]["bytes"]
    setup = re.search(r"^(ZeRO stage 3 on 4 rank\(s\) \(2 nodes .*), \.\.\.$", doc, re.M).group(1)
    assert torchrun_runs["2x2"]["setup"].startswith(setup)


# ======================================================================================
# Slurm's variables (no Slurm here)
# ======================================================================================
def _slurm_job(nodes: int, tasks_per_node: int, *, distribution: str = "block", ntasks_per_node_var: bool = True):
    """What ``srun`` gives each of its tasks in a job of ``nodes`` nodes x
    ``tasks_per_node`` tasks (SLURM_PROCID's order: block or cyclic)."""
    envs = []
    ntasks = nodes * tasks_per_node
    for node in range(nodes):
        for local in range(tasks_per_node):
            procid = node * tasks_per_node + local if distribution == "block" else local * nodes + node
            env = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": str(nodes), "SLURM_JOB_NUM_NODES": str(nodes),
                   "SLURM_NTASKS": str(ntasks), "SLURM_NPROCS": str(ntasks),
                   "SLURM_TASKS_PER_NODE": f"{tasks_per_node}(x{nodes})" if nodes > 1 else str(tasks_per_node),
                   "SLURM_NODEID": str(node), "SLURM_LOCALID": str(local), "SLURM_PROCID": str(procid),
                   "SLURMD_NODENAME": f"node{node}", "SLURM_JOB_NODELIST": f"node[0-{nodes - 1}]"}
            if ntasks_per_node_var:
                env["SLURM_NTASKS_PER_NODE"] = str(tasks_per_node)
            envs.append(env)
    return envs


def _srun_alone(nodes: int, tasks_per_node: int, **kw) -> list:
    """``srun python train.py`` (one task per rank; the script or Lightning's
    SLURMEnvironment takes its rank from SLURM_PROCID): the environments in rank order."""
    envs = _slurm_job(nodes, tasks_per_node, **kw)
    return sorted(envs, key=lambda e: int(e["SLURM_PROCID"]))


def _srun_torchrun(nodes: int, nproc: int, group_of_node) -> list:
    """``srun torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d ...`` in an
    sbatch job with one task per node: each node's task is one torchrun agent, whose
    workers add torchrun's variables.  ``group_of_node[n]``: the group rank c10d gave the
    agent on Slurm node n (arrival order, not SLURM_NODEID).  In rank order."""
    ranks = {}
    for node, slurm in enumerate(_slurm_job(nodes, 1)):
        group = group_of_node[node]
        for local in range(nproc):
            rank = group * nproc + local
            ranks[rank] = dict(slurm, RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(nodes * nproc),
                               LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK=str(group), GROUP_WORLD_SIZE=str(nodes),
                               ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nodes * nproc), MASTER_ADDR="node0",
                               MASTER_PORT="29500", TORCHELASTIC_RUN_ID="4242")
    return [ranks[r] for r in range(nodes * nproc)]


def _what_the_engine_uses(envs, ranks_per_node=None):
    """Every rank's topology (they must agree) and check_layout's verdict on every
    rank's launcher_identity, as multinode.set_up computes them."""
    from zero_strategy.communication.topology import check_layout, launcher_identity, resolve

    world = len(envs)
    topologies = {resolve(world, ranks_per_node, env) for env in envs}
    assert len(topologies) == 1, topologies
    topology = topologies.pop()
    return topology, check_layout(topology, [launcher_identity(env) for env in envs])


def test_sbatch_srun_torchrun_nodes_come_from_torchrun():
    # Two nodes of 4 GPUs, c10d rendezvous: the agent on Slurm node 1 arrived first.
    envs = _srun_torchrun(2, 4, group_of_node=[1, 0])
    topology, problem = _what_the_engine_uses(envs)
    assert (topology.nodes, topology.ranks_per_node) == (2, 4)
    assert topology.source == "the launcher (LOCAL_WORLD_SIZE)"  # not Slurm's one task per node
    assert problem is None  # torchrun's GROUP_RANK, not SLURM_NODEID, numbers the nodes
    # Each rank is on the node torchrun's group rank says.
    assert [topology.node_of(int(e["RANK"])) for e in envs] == [int(e["GROUP_RANK"]) for e in envs]


def test_torchrun_on_one_node_of_a_bigger_allocation_is_one_node():
    # `salloc -N 2 --ntasks-per-node 4`, then `torchrun --standalone --nproc-per-node 4`
    # in its shell, on the first node only: Slurm's job has 8 tasks, this run 4 ranks.
    allocation = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4",
                  "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "0"}
    envs = [dict(allocation, LOCAL_WORLD_SIZE="4", LOCAL_RANK=str(r), RANK=str(r), GROUP_RANK="0", WORLD_SIZE="4")
            for r in range(4)]
    topology, problem = _what_the_engine_uses(envs)
    assert (topology.nodes, topology.ranks_per_node, problem) == (1, 4, None)
    # Even without torchrun's LOCAL_WORLD_SIZE, Slurm's numbers describe another job (8 tasks, not 4 ranks).
    topology, _ = _what_the_engine_uses([{k: v for k, v in e.items() if k != "LOCAL_WORLD_SIZE"} for e in envs])
    assert topology.nodes == 1


@pytest.mark.parametrize("ntasks_per_node_var", [True, False], ids=["SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"])
def test_srun_alone_nodes_come_from_slurm(ntasks_per_node_var):
    envs = _srun_alone(2, 4, ntasks_per_node_var=ntasks_per_node_var)
    topology, problem = _what_the_engine_uses(envs)
    assert (topology.nodes, topology.ranks_per_node) == (2, 4)
    assert topology.source == "Slurm (SLURM_NTASKS_PER_NODE)"
    assert problem is None


def test_srun_cyclic_distribution_is_refused_naming_each_ranks_node():
    # srun --distribution=cyclic: SLURM_PROCID goes round the nodes, so consecutive
    # ranks are on different nodes.
    envs = _srun_alone(2, 2, distribution="cyclic")
    topology, problem = _what_the_engine_uses(envs)
    assert (topology.nodes, topology.ranks_per_node) == (2, 2)
    assert problem is not None and "ranks must be numbered node by node" in problem
    assert "rank 1: node 1, local rank 0" in problem


def test_ranks_per_node_in_the_config_wins_over_slurm():
    # e.g. Lightning's strategy passes Trainer(num_nodes=2, devices=4) as ranks_per_node=4.
    topology, _ = _what_the_engine_uses(_srun_alone(2, 4), ranks_per_node=4)
    assert topology.source == "ranks_per_node" and topology.nodes == 2
    topology, _ = _what_the_engine_uses(_srun_alone(2, 4), ranks_per_node=2)
    assert topology.nodes == 4


class _Reports:
    """A communicator stand-in for multinode.set_up: all_gather_object returns what each
    rank's launcher_identity reads in that rank's environment."""

    def __init__(self, envs):
        self.envs, self.world_size, self.topology = envs, len(envs), None

    def all_gather_object(self, obj, label=""):
        from zero_strategy.communication.topology import launcher_identity

        return [launcher_identity(env) for env in self.envs]

    def set_topology(self, topology):
        self.topology = topology


@pytest.mark.parametrize("job", ["srun+torchrun", "srun", "srun cyclic"])
def test_set_up_on_every_rank_of_a_slurm_job(job, monkeypatch):
    """multinode.set_up, as the engine calls it on each rank (its process group stubbed:
    the world size, and every rank's report)."""
    from zero_strategy import ZeroConfig
    from zero_strategy.communication import multinode

    envs = {"srun+torchrun": lambda: _srun_torchrun(2, 2, group_of_node=[0, 1]),
            "srun": lambda: _srun_alone(2, 2), "srun cyclic": lambda: _srun_alone(2, 2, distribution="cyclic")}[job]()
    monkeypatch.setattr(multinode.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(multinode.dist, "get_world_size", lambda *a, **k: len(envs))
    for name in [k for k in os.environ if k.startswith("SLURM_")] + ["LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                                                                      "LOCAL_RANK"]:
        monkeypatch.delenv(name, raising=False)
    for rank, env in enumerate(envs):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        comm = _Reports(envs)
        if job == "srun cyclic":
            with pytest.raises(ValueError, match="numbered node by node"):
                multinode.set_up(comm, ZeroConfig(stage=3), multinode.resolve_topology(ZeroConfig(stage=3)))
            continue
        topology = multinode.set_up(comm, ZeroConfig(stage=3), multinode.resolve_topology(ZeroConfig(stage=3)))
        assert comm.topology is topology and (topology.nodes, topology.ranks_per_node) == (2, 2)
        assert topology.node_of(rank) == int(env.get("GROUP_RANK", env["SLURM_NODEID"]))
        for k in env:
            monkeypatch.delenv(k)


# ======================================================================================
# checkpoints across node layouts
# ======================================================================================
# test_checkpoint.py's global batch (12: divisible by 3 and 4 ranks) and training loop
from test_checkpoint import GLOBAL_BATCH, STEPS, _train  # noqa: E402

SAVED_AT = 2


def _ckpt_worker(rank, ws, mode, path, layout):
    import transformers

    import zero_strategy
    from models import lm_batches
    from parity import build

    transformers.logging.set_verbosity_error()
    batches = lm_batches(STEPS, GLOBAL_BATCH)
    cfg = dict(stage=3, param_persistence_threshold=0, reduce_bucket_size=3000, **layout)

    def run(what, seed):
        model, opt = build(dict(optim="adamw", seed=seed))
        engine = zero_strategy.initialize(model, opt, cfg if what != "uninterrupted" else dict(cfg, ranks_per_node=None,
                                                                                                secondary_partition=None))
        where = engine.topology.describe()
        if what == "uninterrupted":
            return where, _train(engine, model, rank, ws, batches)
        if what == "save":
            losses = _train(engine, model, rank, ws, batches[:SAVED_AT])
            engine.save_checkpoint(path)
            return where, losses
        engine.load_checkpoint(path)
        assert engine.global_step == SAVED_AT
        return where, _train(engine, model, rank, ws, batches[SAVED_AT:])

    # One process group for both runs; each gets its own model and engine (a different
    # seed for the resumed one: its weights must come from the checkpoint).
    return run(mode, 0 if mode == "save" else 7), run("uninterrupted", 0)


@pytest.fixture(scope="module")
def checkpoint_runs(tmp_path_factory):
    from dist_harness import run_distributed

    path = str(tmp_path_factory.mktemp("ckpt") / "ckpt")
    runs = {"save 2x2": run_distributed(_ckpt_worker, 4, "save", path,
                                        dict(ranks_per_node=2, secondary_partition="node"))[0]}
    runs["load 1x3"] = run_distributed(_ckpt_worker, 3, "resume", path, dict(ranks_per_node=None))[0]
    runs["load 4x1"] = run_distributed(_ckpt_worker, 4, "resume", path, dict(ranks_per_node=1))[0]
    return runs


@pytest.mark.slow
def test_checkpoint_from_2_nodes_x_2_resumes_on_1x3_and_4x1(checkpoint_runs):
    (where, saved), (_, reference4) = checkpoint_runs["save 2x2"]
    assert where == "2 nodes x 2 ranks"
    # The two steps before the save are those of one node of 4 ranks (hpZ is exact).
    assert max(abs(a - b) for a, b in zip(saved, reference4[:SAVED_AT])) < 2e-5, (saved, reference4)
    for name, layout in (("load 1x3", "1 node x 3 ranks"), ("load 4x1", "4 nodes x 1 rank")):
        (where, resumed), (_, uninterrupted) = checkpoint_runs[name]
        assert where == layout
        reference = uninterrupted[SAVED_AT:]
        assert len(resumed) == len(reference) == STEPS - SAVED_AT
        assert max(abs(a - b) for a, b in zip(resumed, reference)) < 2e-5, (name, resumed, reference)
