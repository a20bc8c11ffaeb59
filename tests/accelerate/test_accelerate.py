"""Accelerate and transformers Trainer integration (integrations/accelerate).

Every multi-process check runs ``accelerate launch`` with two CPU processes
(``ACCELERATE_USE_CPU=true``, ``distributed_type: MULTI_GPU``: with ``MULTI_CPU`` the
launcher silently starts a single process unless mpirun is used) on the unchanged
example scripts in examples/accelerate/, which do not import zero_strategy.  The
reference for every number is the same script launched with a plain DDP config;
checkpoint resumption is compared with the uninterrupted run.  Each launch runs once
per session (cached) and serves several tests.

Comparison launches run warm ([Note: warm launches] in tests/support/warm_launch.py):
accelerate's own launch command from a process that has already imported torch,
transformers and accelerate, with the ranks forked instead of started by torchrun.
The tests of the launcher itself (the start-up hook, the CLI, a process's teardown)
pass ``real=True`` and run the real command.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from processes import process_tree
from warm_launch import HUNG_AFTER_FINISHING, warm_launch
from zero_strategy.integrations.accelerate import settings

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "accelerate"
LOOP = EXAMPLES / "train_loop.py"
TRAINER = EXAMPLES / "train_trainer.py"
PY = sys.executable
ACCELERATE = str(Path(PY).with_name("accelerate"))
TIMEOUT = 300  # seconds per launch; a stage-3 generate() that hangs fails here

LOOP_ARGS = ["--steps", "6", "--accum", "2", "--clip", "0.5"]


# ---------------------------------------------------------------------------------------
# The config section (no processes)
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "section, message",
    [
        ({"zero_stag": 3}, "unknown zero_config key 'zero_stag'; did you mean 'zero_stage'?"),
        ({"overlap_com": True}, "did you mean 'overlap_comm'?"),
        ({"zero_stage": 5}, "zero_stage (ZeroConfig.stage) must be between 0 and 3"),
        ({"reduce_bucket_size": "lots"}, "reduce_bucket_size must be an integer"),
        ({"offload_optimizer_device": "nvme"}, "offload_optimizer='nvme' needs nvme_path"),
        ({"offload_param_device": "cpu"}, "zero_config.offload_param_device: parameter offload to host memory is not implemented"),
        ({"zero_stage": 2, "offload_optimizer_device": "nvme", "offload_param_device": "nvme",
          "offload_optimizer_nvme_path": "/nvme"}, "offload_param='nvme' needs stage 3"),
        ({"zero_stage": 3, "offload_optimizer_device": "nvme", "offload_optimizer_nvme_path": "/a",
          "offload_param_nvme_path": "/b"}, "names several (offload_optimizer_nvme_path: '/a', offload_param_nvme_path: '/b')"),
        ({"offload_param_device": "disk"}, "must be one of none, cpu, nvme"),
        ({"stage": 3, "zero_stage": 2}, "zero_config.zero_stage: 2 disagrees with stage: 3"),
        ({"offload_optimizer_device": "cpu", "offload_optimizer": "none"}, "disagrees with offload_optimizer"),
        ({"precision": "bf16"}, "top-level 'mixed_precision'"),
        ({"zero3_init_flag": "maybe"}, "zero_config.zero3_init_flag: must be true or false"),
        ({"zero_stage": 2, "stage": 3}, "disagrees with stage"),
        ([3], "must be a mapping"),
    ],
)
def test_section_errors_name_the_key(section, message):
    with pytest.raises(ValueError) as info:
        settings.parse_section(section)
    assert message in str(info.value)


def test_nvme_keys_map_to_disk_offload():
    """Accelerate's DeepSpeed-plugin keys for ZeRO-Infinity: devices and paths."""
    s = settings.parse_section({"zero_stage": 3, "offload_optimizer_device": "nvme", "offload_param_device": "nvme",
                                "offload_optimizer_nvme_path": "/local_nvme", "offload_param_nvme_path": "/local_nvme"})
    cfg = s.zero_config("bf16")
    assert (cfg.offload_optimizer, cfg.offload_param, cfg.nvme_path) == ("nvme", "nvme", "/local_nvme")
    # Accelerate writes its path keys whatever the device: with nothing on disk they are ignored.
    cfg = settings.parse_section({"zero_stage": 2, "offload_optimizer_device": "cpu",
                                  "offload_optimizer_nvme_path": "/nvme"}).zero_config("no")
    assert (cfg.offload_optimizer, cfg.nvme_path) == ("cpu", None)


def test_section_maps_to_zero_config():
    s = settings.parse_section(
        {"zero_stage": 3, "gradient_clipping": 1.0, "offload_optimizer_device": "CPU", "offload_param_device": "none",
         "zero3_init_flag": True, "zero3_save_16bit_model": "true", "param_persistence_threshold": 0,
         "unit_modules": ["GPT2Block"], "activation_checkpointing": ["auto"]}
    )
    assert s.zero3_init_flag and s.zero3_save_16bit_model
    cfg = s.zero_config("bf16")
    assert (cfg.stage, cfg.precision, cfg.gradient_clipping, cfg.param_persistence_threshold, cfg.unit_modules,
            cfg.offload_optimizer, cfg.activation_checkpointing) == (3, "bf16", 1.0, 0, ("GPT2Block",), "cpu", ("auto",))
    assert settings.parse_section({}).zero_config("no").precision == "fp32"
    assert settings.parse_section(None).zero_config("fp16").precision == "fp16"
    with pytest.raises(ValueError, match="mixed_precision"):
        s.zero_config("fp8")
    with pytest.raises(ValueError, match="cannot be combined with distributed_type: DEEPSPEED"):
        settings.check_distributed_type("DEEPSPEED")


def test_launcher_hook_strips_and_exports_the_section(tmp_path, monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file

    from zero_strategy.integrations.accelerate import hooks

    # set, then deleted: monkeypatch records it and removes what the loads below export
    # (a leftover here made every later Accelerator of this pytest process a ZeroAccelerator)
    monkeypatch.setenv(settings.ENV_VAR, "{}")
    monkeypatch.delenv(settings.ENV_VAR)
    hooks.install_config_section()
    hooks.install_config_section()  # idempotent
    for example in sorted(EXAMPLES.glob("zero*.yaml")):
        config = load_config_from_file(str(example))  # stock accelerate rejects unknown top-level keys
        assert not hasattr(config, "zero_config")
        stage = int(example.stem[-1])
        assert settings.from_environment().zero_config("no").stage == stage
    plain = load_config_from_file(str(EXAMPLES / "ddp.yaml"))
    assert plain.distributed_type.value == "MULTI_GPU"

    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\nzero_config:\n  zero_stag: 3\n")
    with pytest.raises(ValueError, match="did you mean 'zero_stage'"):
        load_config_from_file(str(bad))


def test_runner_reads_both_file_shapes(tmp_path):
    standalone = tmp_path / "z.yaml"
    standalone.write_text("zero_stage: 1\n")
    assert settings.read_file(str(standalone)) == {"zero_stage": 1}
    assert settings.read_file(str(EXAMPLES / "zero2.yaml")) == {"zero_stage": 2}
    with pytest.raises(ValueError, match="without a 'zero_config:' section"):
        settings.read_file(str(EXAMPLES / "ddp.yaml"))


# ---------------------------------------------------------------------------------------
# Launch helpers
# ---------------------------------------------------------------------------------------
def _autoload_active(env) -> bool:
    probe = subprocess.run([PY, "-c", "import sys; print('zero_strategy_autoload' in sys.modules)"],
                           env=env, capture_output=True, text=True, timeout=60)
    return probe.stdout.strip() == "True"


def _base_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERO_STRATEGY", "ACCELERATE_"))}
    env.update(ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    return env


def _free_port() -> int:
    # Other test runs on this machine may hold torchrun's default port 29500.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_config(path: Path, stage=None, extra: str = "") -> Path:
    text = "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_machines: 1\nnum_processes: 2\n" \
           "mixed_precision: 'no'\nuse_cpu: false\n"
    if stage is not None:
        # Every parameter of the tiny model is partitioned at stage 3 (the default
        # threshold keeps tensors under 100k elements whole); small buckets, several calls.
        text += f"zero_config:\n  zero_stage: {stage}\n  param_persistence_threshold: 0\n  reduce_bucket_size: 4096\n{extra}"
    path.write_text(text)
    return path


_HUNG_AT_EXIT = HUNG_AFTER_FINISHING
EXIT_GRACE = 30  # seconds a reference launch gets to exit once its last output exists


_process_tree = process_tree  # test_trl_dpo.py imports it from here


REFERENCE_EXIT = Path(__file__).resolve().parents[1] / "support" / "reference_exit"


def reference_env(env: dict) -> dict:
    """``env`` for a plain DDP reference launch: its processes load
    tests/support/reference_exit/sitecustomize.py, which keeps them from hanging at exit."""
    return dict(env, PYTHONPATH=os.pathsep.join([str(REFERENCE_EXIT), env.get("PYTHONPATH", "")]))


def _run_reference(cmd, env, cwd, output: Path) -> subprocess.CompletedProcess:
    """A plain DDP reference launch. After the script has finished, a process can hang in
    interpreter shutdown: DDP's Reducer, freed last, destroys its gloo process group,
    whose destructor joins worker threads that never return (seen with TRL's sft.py,
    which destroys the default group in trainer.end(), under load). Once ``output`` (the
    script's last file) exists and the launch has not exited EXIT_GRACE seconds later,
    it is ended and reported with returncode _HUNG_AT_EXIT; a launch that hangs before
    writing it still fails at TIMEOUT."""
    import signal
    import time

    start = time.monotonic()
    seen = None
    with subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as p:
        while True:
            try:
                out, err = p.communicate(timeout=2)
                return subprocess.CompletedProcess(cmd, p.returncode, out, err)
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if seen is None and output.exists():
                    seen = now
                hung = seen is not None and now - seen > EXIT_GRACE
                if hung or now - start > TIMEOUT:
                    # torchrun starts each worker in a session of its own: end the whole tree,
                    # or an orphaned worker keeps the pipes open.
                    for pid in _process_tree(p.pid):
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    out, err = p.communicate(timeout=60)
                    if not hung:
                        raise subprocess.TimeoutExpired(cmd, TIMEOUT, out, err)
                    note = f"\n[test harness] ended {EXIT_GRACE} s after {output.name} was written: hung at exit\n"
                    return subprocess.CompletedProcess(cmd, _HUNG_AT_EXIT, out, err + note)


class Launcher:
    """Runs and caches launches; the route is `accelerate launch` with the start-up hook
    when it is installed, else the runner's launch form (same accelerate code path)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.env = _base_env()
        self.autoload = _autoload_active(self.env)
        self.configs = {"ddp": _write_config(root / "ddp.yaml")}
        for s in (1, 2, 3):
            self.configs[f"zero{s}"] = _write_config(root / f"zero{s}.yaml", s)
        self.cache = {}
        self.launches = 0

    def command(self, config: str, script: Path, args, mixed_precision="no"):
        head = [ACCELERATE, "launch"] if (self.autoload or config == "ddp") else [PY, "-m", "zero_strategy.integrations.accelerate.run", "launch"]
        return head + ["--config_file", str(self.configs[config]), "--main_process_port", str(_free_port()),
                       "--mixed_precision", mixed_precision, str(script), *args]

    def run(self, cmd, env=None, expect_ok=True, reference_output=None, real=False):
        """Run ``cmd``; an ``accelerate launch`` runs warm ([Note: warm launches] in
        tests/support/warm_launch.py) unless ``real`` or the start-up hook is switched off."""
        env = env or self.env
        warm = (not real and list(cmd[:2]) == [ACCELERATE, "launch"] and env.get("ZERO_STRATEGY_AUTOLOAD") != "0"
                and self.autoload)
        if warm:
            proc = warm_launch(cmd[2:], env=env, cwd=self.root, timeout=TIMEOUT,
                               logs=self.root / f"warm{self.launches + 1:02d}", finished=reference_output)
            proc.args = cmd
        elif reference_output is None:
            proc = subprocess.run(cmd, env=env, cwd=self.root, capture_output=True, text=True, timeout=TIMEOUT)
        else:
            proc = _run_reference(cmd, reference_env(env), self.root, reference_output)
        self.launches += 1  # kept for post-mortems
        (self.root / f"launch{self.launches:02d}.log").write_text(f"{cmd}\n{proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        if reference_output is not None and proc.returncode != 0 and reference_output.exists() \
                and ("terminate called without an active exception" in proc.stderr or proc.returncode == _HUNG_AT_EXIT):
            # Plain DDP reference runs only: torch's gloo worker threads can abort the
            # process at interpreter exit, after the script finished (seen in about one
            # Trainer run in 30), or hang there (see _run_reference).  ZeroAccelerator
            # prevents both for ZeRO runs, which get no such allowance.
            return proc
        if expect_ok and proc.returncode != 0:
            raise AssertionError(f"launch failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        return proc

    def loop(self, name, config, mixed_precision="no", extra=(), env=None):
        """The plain-loop example; returns (results dict, run folder)."""
        if name not in self.cache:
            folder = self.root / name
            folder.mkdir()
            env = dict(env or self.env, ZERO_STRATEGY_COMM_TRACE=str(folder / "trace"))
            args = [*LOOP_ARGS, "--save-model", str(folder / "model"), "--out", str(folder / "out.json"), *extra]
            self.run(self.command(config, LOOP, args, mixed_precision), env=env,
                     reference_output=folder / "out.json" if config == "ddp" else None)
            self.cache[name] = (json.loads((folder / "out.json").read_text()), folder)
        return self.cache[name]

    def trainer(self, name, config, extra=(), output_dir=None):
        if name not in self.cache:
            folder = self.root / name
            folder.mkdir()
            out_dir = output_dir or folder / "run"
            args = ["--output-dir", str(out_dir), "--out", str(folder / "out.json"), "--reload-first-checkpoint", *extra]
            self.run(self.command(config, TRAINER, args), reference_output=folder / "out.json" if config == "ddp" else None)
            self.cache[name] = (json.loads((folder / "out.json").read_text()), folder)
        return self.cache[name]


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    return Launcher(tmp_path_factory.mktemp("accelerate"))


def _close(a, b, rtol, atol=0.0):
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return a.shape == b.shape and torch.allclose(a, b, rtol=rtol, atol=atol)


def _trace(folder: Path, rank: int):
    path = folder / "trace" / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------------------
# Plain Accelerate loop
# ---------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_loop_matches_ddp_fp32(launcher, stage):
    ref, _ = launcher.loop("ddp_fp32", "ddp")
    # stage 2 prepares the model first and the optimizer in a second call
    extra = ["--prepare-separately"] if stage == 2 else []
    got, folder = launcher.loop(f"zero{stage}_fp32", f"zero{stage}", extra=extra)
    assert got["accelerator_class"] == "ZeroAccelerator" and ref["accelerator_class"] == "Accelerator"
    assert got["num_processes"] == 2 and got["distributed_type"] == "DistributedType.MULTI_CPU"
    assert _close(got["losses"], ref["losses"], rtol=1e-5), (got["losses"], ref["losses"])
    # clip_grad_norm_ returns the global norm (DDP's, over all-reduced gradients) ...
    assert _close(got["grad_norms"], ref["grad_norms"], rtol=1e-4), (got["grad_norms"], ref["grad_norms"])
    # ... and clips: every norm exceeds --clip 0.5, so unclipped steps would change the losses.
    assert min(ref["grad_norms"]) > 0.5
    assert got["lrs"] == ref["lrs"] and got["skipped"] == [False] * 6
    assert got["unwrap_is_model"] == [True, True]
    # Rank 0 says once that ZeRO is on, and what it partitioned; a plain DDP run says nothing.
    logs = {p.read_text().splitlines()[0]: p.read_text() for p in launcher.root.glob("launch*.log")}
    mine = [t for cmd, t in logs.items() if f"zero{stage}.yaml" in cmd and "train_loop" in cmd and str(folder) in cmd]
    ddp_logs = [t for cmd, t in logs.items() if "ddp.yaml" in cmd and "ddp_fp32" in cmd]
    assert len(mine) == 1 and mine[0].count(f"zero_strategy: ZeRO stage {stage} on 2 rank(s)") == 1, mine
    assert "the ZeRO paper's formula" in mine[0]
    assert ddp_logs and all("zero_strategy: ZeRO stage" not in t for t in ddp_logs)


@pytest.mark.slow
def test_loop_matches_ddp_bf16(launcher):
    """--mixed_precision bf16 reaches the engine as bf16 compute on fp32 masters.  One
    stage is enough here: the section's precision is mapped the same way at every stage
    (settings.zero_config), and the engine's bf16 arithmetic at stages 0-3 is compared
    with a single-process reference in tests/core/test_parity.py."""
    ref, _ = launcher.loop("ddp_bf16", "ddp", "bf16")
    got, _ = launcher.loop("zero3_bf16", "zero3", "bf16",
                           extra=["--save-state-at", "3", "--state-dir", str(launcher.root / "state_zero3_bf16")])
    assert got["mixed_precision"] == "bf16" and got["accelerator_class"] == "ZeroAccelerator"
    # DDP autocasts an fp32 model; ZeRO computes in bf16 parameters with fp32 masters.
    assert _close(got["losses"], ref["losses"], rtol=2e-2), (got["losses"], ref["losses"])
    assert got["losses"][-1] < got["losses"][0] - 0.2  # it trains


@pytest.mark.slow
def test_accumulation_stage1_skips_gradient_communication(launcher):
    _, folder = launcher.loop("zero1_fp32", "zero1")
    for rank in (0, 1):
        records = _trace(folder, rank)
        assert [r["sync"] for r in records] == [False, True] * 6
        assert all(r["gradient_elements"] == 0 for r in records if not r["sync"])
        assert all(r["gradient_elements"] > 0 for r in records if r["sync"])
    # Stage 2 reduce-scatters every micro-batch (its gradients are partitioned), so the
    # trace does see communication on non-boundary micro-batches when there is some.
    _, folder2 = launcher.loop("zero2_fp32", "zero2", extra=["--prepare-separately"])
    assert all(r["gradient_elements"] > 0 for r in _trace(folder2, 0))


def _weights(folder: Path):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_get_state_dict_and_save_model_write_consolidated_weights(launcher, stage):
    _, ref_folder = launcher.loop("ddp_fp32", "ddp")
    _, folder = launcher.loop(f"zero{stage}_fp32", f"zero{stage}")
    for kind in ("save_model", "save_pretrained"):
        ref, got = _weights(ref_folder / "model" / kind), _weights(folder / "model" / kind)
        assert sorted(got) == sorted(ref)
        for name in ref:
            assert got[name].dtype == ref[name].dtype == torch.float32
            # AdamW turns fp32 summation-order noise in near-zero gradients into ~1e-5
            # weight differences after 6 steps; one missed or stale update is ~1e-2.
            torch.testing.assert_close(got[name], ref[name], rtol=0, atol=1e-4, msg=f"{kind}: {name}")


@pytest.mark.slow
def test_save_state_then_load_state_in_a_fresh_process(launcher):
    full, _ = launcher.loop("zero3_bf16", "zero3", "bf16",
                            extra=["--save-state-at", "3", "--state-dir", str(launcher.root / "state_zero3_bf16")])
    state = launcher.root / "state_zero3_bf16"
    assert (state / "zero_checkpoint").is_dir()
    resumed, _ = launcher.loop("zero3_bf16_resumed", "zero3", "bf16",
                               extra=["--resume-from", str(state), "--start-step", "3"])
    # Same losses, bit for bit: fp32 masters, optimizer state, scheduler and data position restored.
    assert resumed["losses"] == full["losses"][3:], (resumed["losses"], full["losses"])
    assert resumed["lrs"] == full["lrs"][3:]


@pytest.mark.slow
def test_load_state_refuses_a_planted_client_state(launcher):
    """A client_state.pt planted in the engine's sub-folder (the integration never writes
    one) is refused on load_state, on both ranks, and runs nothing."""
    import shutil

    from test_untrusted_files import plant_client_state

    launcher.loop("zero3_bf16", "zero3", "bf16", extra=["--save-state-at", "3", "--state-dir", str(launcher.root / "state_zero3_bf16")])
    planted = launcher.root / "state_planted"
    shutil.copytree(launcher.root / "state_zero3_bf16", planted)
    marker = launcher.root / "planted_marker"
    plant_client_state(planted / "zero_checkpoint", marker)
    folder = launcher.root / "planted_run"
    folder.mkdir()
    args = [*LOOP_ARGS, "--out", str(folder / "out.json"), "--resume-from", str(planted), "--start-step", "3"]
    proc = launcher.run(launcher.command("zero3", LOOP, args, "bf16"), expect_ok=False)
    assert proc.returncode != 0
    assert proc.stderr.count("weights_only=False") >= 2, proc.stderr[-4000:]  # one CheckpointError per rank
    assert not marker.exists() and not (folder / "out.json").exists()


@pytest.mark.slow
def test_fp16_overflow_skips_the_step(launcher):
    got, _ = launcher.loop("zero2_fp16", "zero2", "fp16",
                           extra=["--steps", "5", "--accum", "1", "--inf-at", "2", "--track-weights"])
    assert got["mixed_precision"] == "fp16"
    assert got["skipped"] == [False, False, True, False, False]
    sums = got["checksums"]
    assert sums[2] == sums[1]  # the overflowing step changed no weight
    assert all(sums[i] != sums[i - 1] for i in (1, 3, 4))
    assert got["lrs"][2] == got["lrs"][1]  # and the scheduler did not step either
    assert all(x == x and abs(x) != float("inf") for i, x in enumerate(got["losses"]) if i != 2)


@pytest.mark.slow
def test_runner_forms_without_the_startup_hook(launcher, tmp_path):
    """`accelerate launch -m zero_strategy.integrations.accelerate.run --zero_config ...` and
    `python -m zero_strategy.integrations.accelerate.run launch ...`, with the .pth hook switched off."""
    ref, _ = launcher.loop("ddp_fp32", "ddp")
    env = dict(launcher.env, ZERO_STRATEGY_AUTOLOAD="0")
    section = tmp_path / "section.yaml"
    section.write_text("zero_stage: 2\noffload_optimizer_device: cpu\n")  # ZeRO-Offload, Accelerate's key
    out1 = tmp_path / "worker_form.json"
    launcher.run([ACCELERATE, "launch", "--config_file", str(launcher.configs["ddp"]), "--main_process_port", str(_free_port()),
                  "-m", "zero_strategy.integrations.accelerate.run",
                  "--zero_config", str(section), str(LOOP), *LOOP_ARGS, "--out", str(out1)], env=env)
    out2 = tmp_path / "launch_form.json"
    launcher.run([PY, "-m", "zero_strategy.integrations.accelerate.run", "launch", "--config_file", str(launcher.configs["zero3"]),
                  "--main_process_port", str(_free_port()), str(LOOP), *LOOP_ARGS, "--out", str(out2)], env=env)
    for out in (out1, out2):
        got = json.loads(out.read_text())
        assert got["accelerator_class"] == "ZeroAccelerator"
        assert _close(got["losses"], ref["losses"], rtol=1e-5), (out.name, got["losses"], ref["losses"])


@pytest.mark.slow
def test_bad_section_fails_in_the_launcher(launcher, tmp_path):
    bad = _write_config(tmp_path / "bad.yaml", 3, extra="  offload_optimizer_devic: none\n")
    route = [ACCELERATE, "launch"] if launcher.autoload else [PY, "-m", "zero_strategy.integrations.accelerate.run", "launch"]
    proc = launcher.run([*route, "--config_file", str(bad), str(LOOP)], expect_ok=False)
    assert proc.returncode != 0
    assert "unknown zero_config key 'offload_optimizer_devic'; did you mean 'offload_optimizer_device'?" in proc.stderr
    assert "ChildFailedError" not in proc.stderr  # it failed before starting any worker


# ---------------------------------------------------------------------------------------
# transformers Trainer
# ---------------------------------------------------------------------------------------
def _steps(d: dict, first=1):
    return [d[k] for k in sorted(d, key=int) if int(k) >= first]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_trainer_matches_ddp(launcher, stage):
    ref, _ = launcher.trainer("trainer_ddp", "ddp", extra=["--final-model", str(launcher.root / "trainer_ddp_final")])
    extra = ["--final-model", str(launcher.root / "trainer_zero3_final")] if stage == 3 else []
    got, _ = launcher.trainer(f"trainer_zero{stage}", f"zero{stage}", extra=extra)
    assert got["accelerator_class"] == "ZeroAccelerator" and got["num_processes"] == 2
    assert len(ref["losses"]) == 8
    assert _close(_steps(got["losses"]), _steps(ref["losses"]), rtol=1e-5), (got["losses"], ref["losses"])
    # max_grad_norm=0.5 with gradient accumulation 2: the logged norm is the global one
    assert _close(_steps(got["grad_norms"]), _steps(ref["grad_norms"]), rtol=1e-4)
    assert _close(_steps(got["eval_losses"]), _steps(ref["eval_losses"]), rtol=1e-5)
    # load_best_model_at_end put checkpoint-4's weights back into the partitioned model
    assert got["final_eval_loss"] == pytest.approx(got["eval_losses"]["4"], rel=1e-6)
    assert got["final_eval_loss"] > got["eval_losses"]["8"] + 0.05
    # generate(): each rank its own prompt and length; stage 3 must not hang (TIMEOUT)
    assert got["generations"] == ref["generations"]
    assert len(got["generations"][1]["tokens"]) - len(got["generations"][1]["prompt"]) == 7


@pytest.mark.slow
def test_trainer_resume_from_checkpoint(launcher):
    full, folder = launcher.trainer("trainer_zero3", "zero3", extra=["--final-model", str(launcher.root / "trainer_zero3_final")])
    run = folder / "run"
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-4", "checkpoint-8"]
    assert (run / "checkpoint-4" / "zero_checkpoint").is_dir()
    resumed, _ = launcher.trainer("trainer_zero3_resumed", "zero3", extra=["--resume", "checkpoint-4"], output_dir=run)
    assert _steps(resumed["losses"], first=5) == _steps(full["losses"], first=5)
    assert resumed["final_eval_loss"] == full["final_eval_loss"]


@pytest.mark.slow
def test_trainer_checkpoints_resume_across_ddp_and_zero(launcher):
    """A checkpoint written under zero_config resumes under a plain DDP config with its
    optimizer state, and a DDP checkpoint resumes under zero_config: the losses after the
    resume follow the uninterrupted DDP run (the stock Trainer drops a missing
    optimizer.pt without a word, which would show as a loss difference of about 0.1)."""
    ddp, ddp_folder = launcher.trainer("trainer_ddp", "ddp", extra=["--final-model", str(launcher.root / "trainer_ddp_final")])
    zero, zero_folder = launcher.trainer("trainer_zero3", "zero3", extra=["--final-model", str(launcher.root / "trainer_zero3_final")])
    assert (zero_folder / "run" / "checkpoint-4" / "optimizer.pt").is_file()
    runs = {}
    for name, source in (("trainer_zero3_resumed_by_ddp", zero_folder), ("trainer_ddp_resumed_by_zero3", ddp_folder)):
        # A copy of checkpoint-4 in a run folder of its own: the original runs' later
        # checkpoints are compared by other tests.
        run = launcher.root / f"{name}_run"
        shutil.copytree(source / "run" / "checkpoint-4", run / "checkpoint-4")
        runs[name] = run
    to_ddp, _ = launcher.trainer("trainer_zero3_resumed_by_ddp", "ddp", extra=["--resume", "checkpoint-4"],
                                 output_dir=runs["trainer_zero3_resumed_by_ddp"])
    to_zero, _ = launcher.trainer("trainer_ddp_resumed_by_zero3", "zero3", extra=["--resume", "checkpoint-4"],
                                  output_dir=runs["trainer_ddp_resumed_by_zero3"])
    want = _steps(ddp["losses"], first=5)
    for got in (to_ddp, to_zero):
        steps = _steps(got["losses"], first=5)
        assert len(steps) == len(want) and _close(steps, want, rtol=1e-5), (steps, want)
        assert abs(got["final_eval_loss"] - ddp["final_eval_loss"]) <= 1e-5 * abs(ddp["final_eval_loss"])


_LOAD_WITHOUT_PACKAGE = """
import json, sys
from transformers import GPT2LMHeadModel
pairs = json.loads(sys.argv[1])
diffs = {}
for got, ref in pairs:
    a = GPT2LMHeadModel.from_pretrained(got).state_dict()
    b = GPT2LMHeadModel.from_pretrained(ref).state_dict()
    assert sorted(a) == sorted(b), (got, sorted(set(a) ^ set(b)))
    diffs[got] = max(float((a[k] - b[k]).abs().max()) for k in a)
# (the stdlib-only start-up stub zero_strategy_autoload is imported by its .pth; with
# ZERO_STRATEGY_AUTOLOAD=0 it installs nothing)
leaked = sorted(m for m in sys.modules if m.split('.')[0] in ('zero_strategy', 'integrations'))
print(json.dumps({"diffs": diffs, "leaked": leaked}))
"""


@pytest.mark.slow
def test_saved_models_load_with_plain_from_pretrained(launcher):
    _, loop_ref = launcher.loop("ddp_fp32", "ddp")
    _, loop_z3 = launcher.loop("zero3_fp32", "zero3")
    launcher.trainer("trainer_ddp", "ddp", extra=["--final-model", str(launcher.root / "trainer_ddp_final")])
    launcher.trainer("trainer_zero3", "zero3", extra=["--final-model", str(launcher.root / "trainer_zero3_final")])
    pairs = [
        (str(loop_z3 / "model" / "save_model"), str(loop_ref / "model" / "save_model")),
        (str(loop_z3 / "model" / "save_pretrained"), str(loop_ref / "model" / "save_pretrained")),
        (str(launcher.root / "trainer_zero3_final"), str(launcher.root / "trainer_ddp_final")),
        # the final model is checkpoint-4's (reloaded at the end); checkpoint-8 is the trained one
        (str(launcher.root / "trainer_zero3" / "run" / "checkpoint-8"), str(launcher.root / "trainer_ddp" / "run" / "checkpoint-8")),
    ]
    env = dict(launcher.env, ZERO_STRATEGY_AUTOLOAD="0")
    proc = launcher.run([PY, "-c", _LOAD_WITHOUT_PACKAGE, json.dumps(pairs)], env=env)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["leaked"] == []
    assert all(d < 1e-4 for d in result["diffs"].values()), result["diffs"]


# ---------------------------------------------------------------------------------------
# zero3_init_flag: from_pretrained builds partitioned, prepare loads each rank's slices
# ---------------------------------------------------------------------------------------
def _save_pretrained_gpt2(folder: Path, n_positions: int) -> Path:
    """A tiny GPT-2 saved the way a hub checkpoint is (safetensors, tied lm_head), with
    weights from a different seed than the examples' fresh model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if not folder.exists():
        torch.manual_seed(123)
        config = GPT2Config(vocab_size=64, n_positions=n_positions, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_zero3_init_flag_loop_matches_ddp_from_pretrained(launcher):
    pretrained = _save_pretrained_gpt2(launcher.root / "pretrained16", 16)
    launcher.configs["zero3_init"] = _write_config(launcher.root / "zero3_init.yaml", 3, "  zero3_init_flag: true\n")
    args = ["--from-pretrained", str(pretrained)]
    ref, _ = launcher.loop("ddp_pretrained", "ddp", extra=args)
    got, _ = launcher.loop("zero3_init_pretrained", "zero3_init", extra=args)
    # The DDP run loads whole models; the flag left every rank's parameters unallocated.
    assert ref["built_on_meta"] == [False, False] and got["built_on_meta"] == [True, True]
    fresh, _ = launcher.loop("ddp_fp32", "ddp")
    assert abs(fresh["losses"][0] - ref["losses"][0]) > 1e-3  # the checkpoint's weights are really used
    assert _close(got["losses"], ref["losses"], rtol=1e-5), (got["losses"], ref["losses"])
    assert _close(got["grad_norms"], ref["grad_norms"], rtol=1e-4)
