"""``Trainer(num_nodes=2, devices=2, strategy="zero3")`` through Lightning's own launcher
(issue #33): two launches on this host, one per "node" (NODE_RANK 0 and 1, one
MASTER_ADDR/PORT), each starting its two processes, train exactly as one node of four
processes does: every rank's per-step losses and the final weights are equal.

Lightning sets no LOCAL_WORLD_SIZE, so the strategy tells the engine how many ranks a
node holds (``ranks_per_node`` = processes per node when ``num_nodes`` > 1, unless the
user set it); the engine's start-up line says 2 nodes x 2 ranks.  The workload is the
quick-start Lightning example's model and data (examples/lightning/finetune_gpt2.py,
one layer), with the strategy's name, as the example passes it.

Run as a script (``python tests/lightning/test_lightning_multinode.py OUT NUM_NODES
DEVICES``) it is one launch's rank; Lightning re-runs it for the other local rank.
"""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
EXAMPLE = ROOT / "examples" / "lightning" / "finetune_gpt2.py"
STEPS = 4
TIMEOUT = 400


# ======================================================================================
# the pytest side
# ======================================================================================
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERO_STRATEGY_", "SLURM_", "TORCHELASTIC_"))}
    for name in ("LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "GROUP_RANK", "MASTER_PORT", "MASTER_ADDR",
                 "NODE_RANK"):
        env.pop(name, None)
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false", **extra)
    return env


def _launch(out: Path, num_nodes: int, devices: int) -> list:
    from processes import run_together

    cmd = [sys.executable, str(HERE), str(out), str(num_nodes), str(devices)]
    if num_nodes == 1:
        envs = [_env()]  # Lightning's launcher picks a free port itself
    else:
        port = str(_free_port())
        envs = [_env(NODE_RANK=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for n in range(num_nodes)]
    procs = run_together([cmd] * len(envs), cwd=str(ROOT), envs=envs, timeout=TIMEOUT)
    for p in procs:
        assert p.returncode == 0, f"launch failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return procs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lightning_nodes")
    result = {}
    for name, nodes, devices in (("2x2", 2, 2), ("1x4", 1, 4)):
        procs = _launch(tmp / name, nodes, devices)
        ranks = [json.loads((tmp / name / f"rank{r}.json").read_text()) for r in range(4)]
        import torch

        result[name] = {"ranks": ranks, "weights": torch.load(tmp / name / "weights.pt", weights_only=True),
                        "output": [p.stdout + p.stderr for p in procs]}
    return result


@pytest.mark.slow
def test_two_nodes_of_two_train_like_one_node_of_four(runs):
    import torch

    got, ref = runs["2x2"], runs["1x4"]
    for r in range(4):
        a, b = got["ranks"][r], ref["ranks"][r]
        assert a["global_rank"] == b["global_rank"] == r
        assert len(a["losses"]) == STEPS and a["losses"] == b["losses"], (r, a["losses"], b["losses"])
        assert a["train_loss"] == b["train_loss"]
    assert set(got["weights"]) == set(ref["weights"])
    for k, v in ref["weights"].items():
        torch.testing.assert_close(got["weights"][k], v, rtol=0, atol=0, msg=lambda m: f"{k}: {m}")
    # The strategy really partitioned the model (the example's matrices are above the threshold).
    assert got["ranks"][0]["param_bytes"] < 0.7 * got["ranks"][0]["full_param_bytes"]


@pytest.mark.slow
def test_the_strategy_tells_the_engine_about_the_nodes(runs):
    for r, rank in enumerate(runs["2x2"]["ranks"]):
        assert rank["node_rank"] == r // 2 and rank["ranks_per_node"] == 2
        assert rank["topology"] == "2 nodes x 2 ranks"
    for rank in runs["1x4"]["ranks"]:
        assert rank["ranks_per_node"] is None and rank["topology"] == "1 node x 4 ranks"
    # The start-up line, printed once, by global rank 0 (in the NODE_RANK=0 launch).
    node0, node1 = runs["2x2"]["output"]
    assert "ZeRO stage 3 on 4 rank(s) (2 nodes x 2 ranks" in node0 and "ZeRO stage" not in node1


def test_ranks_per_node_follows_num_nodes_unless_set():
    """Without launching: the config each strategy would give the engine."""
    import lightning.pytorch as pl
    from lightning.fabric import Fabric

    from zero_strategy.integrations.lightning import ZeroFabricStrategy, ZeroStrategy

    def trainer_config(strategy, num_nodes, devices=2):
        trainer = pl.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy, logger=False)
        return trainer.strategy._resolved_config()

    def fabric_config(strategy, num_nodes, devices=2):
        return Fabric(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy).strategy._config()

    for config in (trainer_config, fabric_config):
        assert config("zero3", 2).ranks_per_node == 2
        assert config("zero3", 3, devices=4).ranks_per_node == 4
        assert config("zero3", 1).ranks_per_node is None  # one node: the launcher's variables, if any
        kept = ZeroStrategy(stage=3, ranks_per_node=1) if config is trainer_config else \
            ZeroFabricStrategy(stage=3, ranks_per_node=1)
        assert config(kept, 2).ranks_per_node == 1  # the user's value is kept


# ======================================================================================
# the launched side
# ======================================================================================
def _example():
    spec = importlib.util.spec_from_file_location("finetune_gpt2_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _main(out: Path, num_nodes: int, devices: int) -> None:
    import lightning.pytorch as L
    import torch
    from torch.utils.data import DataLoader

    example = _example()
    out.mkdir(parents=True, exist_ok=True)

    class Losses(L.Callback):
        def __init__(self):
            self.losses = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

    L.seed_everything(0, verbose=False)
    losses = Losses()
    # As the example's main(): its data, model (one layer here), optimizer, scheduler and clipping.
    train = DataLoader(example.make_dataset(256, seed=1), batch_size=4, shuffle=True)
    trainer = L.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy="zero3", max_steps=STEPS,
                        gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[losses])
    model = example.TinyGPT2(n_layer=1)
    trainer.fit(model, train)
    engine = trainer.strategy.engine
    state = engine.full_state_dict(rank0_only=False)
    info = {"global_rank": trainer.global_rank, "node_rank": trainer.node_rank, "losses": losses.losses,
            "train_loss": float(trainer.callback_metrics["train_loss"]),
            "ranks_per_node": engine.config.ranks_per_node, "topology": engine.topology.describe(),
            "param_bytes": engine.memory_report()["parameters"],
            "full_param_bytes": sum(t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values())}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(info))
    if trainer.is_global_zero:
        torch.save({k: v.detach().clone() for k, v in state.items()}, out / "weights.pt")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    _main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
