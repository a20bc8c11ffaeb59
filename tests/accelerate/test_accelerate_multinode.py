"""``accelerate launch`` with ``num_machines: 2`` (issue #33): two launches on this host of
examples/accelerate/two_machines_zero3.yaml (``--machine_rank 0`` and ``1``, one
``main_process_ip``/``main_process_port``, 4 processes in all, a ``zero_config:``
section), as docs/multinode.md runs them, train the unchanged
examples/accelerate/train_loop.py exactly as examples/accelerate/zero3.yaml with 4
processes on one machine does: the same losses,
gradient norms, learning rates and weight checksums, step by step.  Accelerate starts
each machine's processes through torchrun, whose LOCAL_WORLD_SIZE tells the engine the
node structure (its start-up line says 2 nodes x 2 ranks).

Real launches (not the warm ones of test_accelerate.py, whose stand-in for torchrun's
agent knows one machine only): the point is accelerate's own multi-machine path.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from processes import run_together

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "accelerate"
LOOP = EXAMPLES / "train_loop.py"
PY = sys.executable
ACCELERATE = str(Path(PY).with_name("accelerate"))
TIMEOUT = 400
LOOP_ARGS = ["--steps", "6", "--accum", "2", "--clip", "1.0"]  # docs/multinode.md's
TRACK = ["--track-weights"]  # a checksum of the weights per step; changes nothing the loop prints


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ZERO_STRATEGY", "ACCELERATE_", "SLURM_", "TORCHELASTIC_"))
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                         "MASTER_ADDR", "MASTER_PORT")}
    env.update(ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    return env


def _launcher_head(env) -> list:
    """``accelerate launch`` where the start-up hook is active, else the runner's
    launch form (the same accelerate code path)."""
    probe = subprocess.run([PY, "-c", "import sys; print('zero_strategy_autoload' in sys.modules)"],
                           env=env, capture_output=True, text=True, timeout=60)
    if probe.stdout.strip() == "True":
        return [ACCELERATE, "launch"]
    return [PY, "-m", "zero_strategy.integrations.accelerate.run", "launch"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The documented configs (docs/multinode.md): examples/accelerate/two_machines_zero3.yaml
    launched twice, and examples/accelerate/zero3.yaml with 4 processes on one machine;
    free ports instead of the files' fixed one."""
    tmp = tmp_path_factory.mktemp("accelerate_nodes")
    env = _env()
    head = _launcher_head(env)
    result = {}
    launches = {"2 machines": [["--config_file", str(EXAMPLES / "two_machines_zero3.yaml"), "--machine_rank", str(k)]
                               for k in (0, 1)],
                "1 machine": [["--config_file", str(EXAMPLES / "zero3.yaml"), "--num_processes", "4"]]}
    for name, launchers in launches.items():
        folder = tmp / name.replace(" ", "_")
        folder.mkdir()
        port = str(_free_port())
        cmds = [[*head, *args, "--main_process_port", port, str(LOOP), *LOOP_ARGS, *TRACK, "--out", str(folder / "out.json")]
                for args in launchers]
        procs = run_together(cmds, cwd=str(folder), envs=[env] * len(cmds), timeout=TIMEOUT)
        for p in procs:
            assert p.returncode == 0, f"{p.args} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
        result[name] = {"out": json.loads((folder / "out.json").read_text()),
                        "output": [p.stdout + p.stderr for p in procs]}
    return result


@pytest.mark.slow
def test_two_machines_train_like_one(runs):
    got, ref = runs["2 machines"]["out"], runs["1 machine"]["out"]
    assert got["num_processes"] == ref["num_processes"] == 4
    assert got["accelerator_class"] == ref["accelerator_class"] == "ZeroAccelerator"
    assert len(got["losses"]) == 6
    for key in ("losses", "grad_norms", "lrs", "checksums", "skipped"):
        assert got[key] == ref[key], (key, got[key], ref[key])


@pytest.mark.slow
def test_the_engine_sees_the_machines(runs):
    machine0, machine1 = runs["2 machines"]["output"]
    assert "zero_strategy: ZeRO stage 3 on 4 rank(s) (2 nodes x 2 ranks (from the launcher (LOCAL_WORLD_SIZE)))" \
        in machine0
    assert "ZeRO stage 3" not in machine1  # the main process is on machine 0
    (one,) = runs["1 machine"]["output"]
    assert "zero_strategy: ZeRO stage 3 on 4 rank(s): " in one  # one node: nothing about nodes


@pytest.mark.slow
def test_docs_quote_what_the_two_machines_print(runs):
    """docs/multinode.md's Accelerate section: its commands' arguments and the lines it quotes."""
    import re

    doc = (REPO / "docs" / "multinode.md").read_text()
    section = doc.split("## Accelerate")[1].split("\n## ")[0]
    assert f"examples/accelerate/train_loop.py {' '.join(LOOP_ARGS)}" in section
    machine0 = runs["2 machines"]["output"][0]
    quoted = re.findall(r"`(step \d/6 [^`]+)`", section)
    assert len(quoted) == 2
    for line in quoted:
        assert line in machine0 and line in runs["1 machine"]["output"][0], line
    setup = re.search(r"`(zero_strategy: ZeRO stage 3 on 4 rank\(s\) \(2 nodes x 2 ranks\s+\(from [^`]*)\.\.\.`",
                      section).group(1)
    assert " ".join(setup.split()) in machine0
