"""TRL's DPOTrainer through TRL's own, unchanged training script (``trl/scripts/dpo.py``
from the installed trl package) under ``accelerate launch`` with a ``zero_config:``
section, with and without PEFT LoRA, against the same script under a plain DDP config,
in fp32 (``--bf16 false``).

Without PEFT, DPOTrainer loads a second copy of the model as the reference and prepares
it with ``accelerator.prepare_model(ref, evaluation_mode=True)`` (before the policy's
``prepare(model, optimizer)`` in ``train()``): under ZeRO it gets an evaluation engine of
its own next to the policy's, in one process group.  With PEFT there is no second
model: the reference is the policy with its adapter disabled.  At stage 3 every
``Linear`` is its own unit (as in tests/transformers/test_trl_sft.py: TRL's fused LM head reads
``lm_head.weight`` directly) and every parameter is partitioned, the reference's too.

Compared per optimizer step, from the ``trainer_state.json`` of the Trainer's
checkpoint: the DPO loss, the gradient norm and the reward margin (which is computed
from the reference model's log-probabilities, so a wrong reference changes it).

The DDP reference runs get one allowance: on this machine about one stock DDP launch of
dpo.py in three left a rank waiting on a futex after the script had saved its model
(the other rank gone), so a reference launch whose saved model exists is stopped 15 s
later and accepted.  The ZeRO launches get none (ZeroAccelerator destroys the process
group at exit).
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

trl = pytest.importorskip("trl")
pytest.importorskip("peft")

from hf_local_assets import WORDS, save_tiny_llama, write_text  # noqa: E402
from test_accelerate import TIMEOUT, Launcher, _close, _process_tree, _write_config, reference_env  # noqa: E402
from warm_launch import HUNG_AFTER_FINISHING, warm_launch  # noqa: E402
from trainer_state import logged_per_step  # noqa: E402

DPO_SCRIPT = Path(trl.__file__).parent / "scripts" / "dpo.py"
STEPS = 4
LM_HEAD_OWN_UNIT = "  unit_modules: [LlamaDecoderLayer, Linear]\n  min_gather_numel: 0\n"
LORA = ["--use_peft", "--lora_r", "4", "--lora_alpha", "8"]


def write_preference_jsonl(path: Path, rows: int = 32, seed: int = 2) -> Path:
    """prompt / chosen / rejected columns in JSON lines, DPOTrainer's standard (not conversational) form."""
    rng = random.Random(seed)

    def words(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    with path.open("w") as f:
        for _ in range(rows):
            f.write(json.dumps({"prompt": words(3, 6), "chosen": " " + words(2, 6), "rejected": " " + words(2, 6)}) + "\n")
    return path


class DpoRuns:
    def __init__(self, root: Path) -> None:
        self.launcher = Launcher(root)
        self.launcher.env["HF_DATASETS_CACHE"] = str(root / "datasets_cache")
        self.launcher.configs["zero3_lm_head"] = _write_config(root / "zero3_lm_head.yaml", 3, LM_HEAD_OWN_UNIT)
        assets = root / "assets"
        (assets / "data").mkdir(parents=True)
        self.model = save_tiny_llama(assets / "llama", write_text(assets / "corpus.txt"))
        write_preference_jsonl(assets / "data" / "train.jsonl")
        self.data = assets / "data"
        self.cache = {}

    def run(self, config: str, lora: bool):
        """(output folder, launch output) of one DPO launch."""
        name = f"dpo_{config}{'_lora' if lora else ''}"
        if name not in self.cache:
            out = self.launcher.root / name
            args = ["--model_name_or_path", str(self.model), "--dataset_name", str(self.data), "--bf16", "false",
                    "--per_device_train_batch_size", "2", "--max_steps", str(STEPS), "--logging_steps", "1",
                    "--learning_rate", "1e-2", "--max_length", "32", "--seed", "0", "--report_to", "none",
                    "--save_strategy", "steps", "--save_steps", str(STEPS), "--output_dir", str(out),
                    *(LORA if lora else [])]
            saved = out / ("adapter_model.safetensors" if lora else "model.safetensors")
            text = self._launch(self.launcher.command(config, DPO_SCRIPT, args), name, saved if config == "ddp" else None)
            self.cache[name] = (out, text)
        return self.cache[name]

    def _launch(self, cmd, name: str, reference_output) -> str:
        log = self.launcher.root / f"{name}.log"
        if self.launcher.autoload:  # warm, as the Launcher runs launches (tests/support/warm_launch.py)
            proc = warm_launch(cmd[2:], env=self.launcher.env, cwd=self.launcher.root, timeout=TIMEOUT,
                               logs=self.launcher.root / name, finished=reference_output)
            text = proc.stdout + proc.stderr
            log.write_text(text)
            if proc.returncode != 0 and proc.returncode != HUNG_AFTER_FINISHING:
                raise AssertionError(f"launch failed ({proc.returncode}): {' '.join(cmd)}\n{text[-6000:]}")
            return text
        with log.open("w") as f:
            env = self.launcher.env if reference_output is None else reference_env(self.launcher.env)
            proc = subprocess.Popen(cmd, env=env, cwd=self.launcher.root, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            deadline, finished_at = time.monotonic() + TIMEOUT, None
            while proc.poll() is None and time.monotonic() < deadline:
                if reference_output is not None and finished_at is None and reference_output.exists():
                    finished_at = time.monotonic()
                if finished_at is not None and time.monotonic() - finished_at > 15:
                    break  # the stock DDP hang at exit described above
                time.sleep(0.2)
            stopped = proc.poll() is None
            if stopped:
                # torchrun starts each worker in a session of its own, so killing the
                # launcher's process group would leave the hung worker running, orphaned
                # (it was: 470 MB a suite run): end the whole tree while it is still a tree.
                for pid in _process_tree(proc.pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                proc.wait()
        text = log.read_text()
        allowed = reference_output is not None and reference_output.exists() and (
            stopped or "terminate called without an active exception" in text)
        if proc.returncode != 0 and not allowed:
            raise AssertionError(f"launch {'timed out' if stopped else f'failed ({proc.returncode})'}: {' '.join(cmd)}\n{text[-6000:]}")
        return text


@pytest.fixture(scope="module")
def dpo(tmp_path_factory):
    return DpoRuns(tmp_path_factory.mktemp("trl_dpo"))


def _log(out: Path):
    return logged_per_step(out, STEPS, ("step", "loss", "grad_norm", "rewards/margins"))


CASES = [("zero2", 2, False), ("zero2", 2, True), ("zero3_lm_head", 3, False), ("zero3_lm_head", 3, True)]


@pytest.mark.slow
@pytest.mark.parametrize("config, stage, lora", CASES, ids=[f"{c}{'-lora' if l else ''}" for c, _, l in CASES])
def test_dpo_per_step_losses_match_ddp(dpo, config, stage, lora):
    ref_out, ref_text = dpo.run("ddp", lora)
    out, text = dpo.run(config, lora)
    assert "zero_strategy: " not in ref_text
    assert text.count(f"zero_strategy: ZeRO stage {stage} on 2 rank(s)") == 1  # the policy's engine
    # the separate reference model (none with PEFT: the adapter is disabled instead)
    assert text.count(f"zero_strategy: LlamaForCausalLM for evaluation (no optimizer): ZeRO stage {stage}") == (0 if lora else 1)
    ref, got = _log(ref_out), _log(out)
    assert ref["step"] == got["step"] == list(range(1, STEPS + 1))
    assert len(set(ref["loss"])) == STEPS  # every step changes the loss
    assert _close(got["loss"], ref["loss"], rtol=1e-5), (got["loss"], ref["loss"])
    assert _close(got["grad_norm"], ref["grad_norm"], rtol=1e-4), (got["grad_norm"], ref["grad_norm"])
    assert _close(got["rewards/margins"], ref["rewards/margins"], rtol=1e-4, atol=1e-6), (got["rewards/margins"], ref["rewards/margins"])
