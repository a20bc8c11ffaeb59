"""transformers' own example scripts, unchanged, under ``accelerate launch`` with a
``zero_config:`` section: run_clm.py (the Trainer) and run_clm_no_trainer.py (a plain
Accelerate loop), vendored in tests/vendored/ (see its README).

The reference is the same script launched with a plain DDP config on the same local
model, tokenizer and text (tests/support/hf_local_assets.py; nothing comes from the hub). The
numbers compared are the ones the scripts themselves record: run_clm.py's
``trainer_state.json`` (the loss of every optimizer step, averaged over the processes)
and run_clm_no_trainer.py's log line ``epoch N: perplexity: P eval_loss: L`` (one epoch
is one optimizer step here, so it evaluates after every step). The final models, written
by the scripts' own ``trainer.save_model()`` / ``unwrapped_model.save_pretrained(dir)``,
are loaded in a fresh interpreter with plain transformers and zero_strategy switched off.

Launches: each script under DDP, stage 2 and stage 3 (every parameter partitioned,
``param_persistence_threshold: 0``); run_clm.py's stage-3 run also has
``zero3_init_flag: true``, so its from_pretrained (with ``from_tf=False`` and the other
keywords the script passes) builds the model partitioned: transformers' own "Loading
weights" progress bar, which every stock load prints, never appears in that launch.
Six launches, each cached for the module.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("datasets")
pytest.importorskip("evaluate")  # run_clm.py imports it

from hf_local_assets import save_tiny_gpt2, write_text  # noqa: E402
from test_accelerate import PY, Launcher, _close, _write_config  # noqa: E402

VENDORED = Path(__file__).resolve().parents[1] / "vendored"
RUN_CLM = VENDORED / "run_clm.py"
RUN_CLM_NO_TRAINER = VENDORED / "run_clm_no_trainer.py"
STEPS = 4
# learning rate high enough for every step to move the loss visibly
COMMON = ["--seed", "0", "--learning_rate", "1e-2", "--block_size", "32"]
EPOCH_LINE = re.compile(r"epoch (\d+): perplexity: (\S+) eval_loss: (\S+)")


class ClmRuns:
    def __init__(self, root: Path) -> None:
        self.launcher = Launcher(root)
        self.launcher.env["HF_DATASETS_CACHE"] = str(root / "datasets_cache")
        self.launcher.configs["zero3_init"] = _write_config(root / "zero3_init.yaml", 3, "  zero3_init_flag: true\n")
        # Adafactor declared element-wise: handed 1-D pieces of the flat shards (the old behaviour)
        self.launcher.configs["zero2_pieces"] = _write_config(root / "zero2_pieces.yaml", 2,
                                                              "  elementwise_optimizers: [Adafactor]\n")
        assets = root / "assets"
        assets.mkdir()
        self.corpus = write_text(assets / "train.txt")
        self.model = save_tiny_gpt2(assets / "gpt2", self.corpus)
        # 16 lines of 8 words: 128 tokens, 4 blocks of 32, one step of 2 processes x 2
        # blocks per epoch; the validation text gives 2 blocks.
        self.small_train = write_text(assets / "small_train.txt", lines=16, seed=2, words_per_line=8)
        self.small_valid = write_text(assets / "small_valid.txt", lines=8, seed=3, words_per_line=8)
        self.cache = {}

    def _launch(self, name, config, script, args, last_file):
        if name not in self.cache:
            out = self.launcher.root / name
            proc = self.launcher.run(self.launcher.command(config, script, ["--output_dir", str(out), *args]),
                                     reference_output=out / last_file if config == "ddp" else None)
            self.cache[name] = (out, proc.stdout + proc.stderr)
        return self.cache[name]

    def trainer(self, config, optim=None):
        """run_clm.py (with the Trainer's ``--optim`` when given): (output folder, launch output)."""
        extra = ["--optim", optim] if optim else []
        return self._launch(f"run_clm_{config}" + (f"_{optim}" if optim else ""), config, RUN_CLM, [
            "--model_name_or_path", str(self.model), "--train_file", str(self.corpus), "--do_train",
            "--per_device_train_batch_size", "2", "--max_steps", str(STEPS), "--logging_steps", "1",
            "--save_strategy", "no", "--report_to", "none", *COMMON, *extra], last_file="README.md")  # the model card

    def no_trainer(self, config):
        """run_clm_no_trainer.py: (output folder, launch output)."""
        return self._launch(f"no_trainer_{config}", config, RUN_CLM_NO_TRAINER, [
            "--model_name_or_path", str(self.model), "--train_file", str(self.small_train),
            "--validation_file", str(self.small_valid), "--per_device_train_batch_size", "2",
            "--per_device_eval_batch_size", "2", "--num_train_epochs", str(STEPS), *COMMON], last_file="all_results.json")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return ClmRuns(tmp_path_factory.mktemp("run_clm"))


def _trainer_log(out: Path):
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    steps = [h for h in history if "loss" in h]
    return [h["step"] for h in steps], [h["loss"] for h in steps], [h["grad_norm"] for h in steps]


def _epoch_lines(text: str):
    found = [(int(e), float(p), float(l.removeprefix("tensor(").rstrip(")"))) for e, p, l in EPOCH_LINE.findall(text)]
    return [e for e, _, _ in found], [p for _, p, _ in found], [l for _, _, l in found]


def _says_zero(text: str, stage: int) -> bool:
    return text.count(f"zero_strategy: ZeRO stage {stage} on 2 rank(s)") == 1


# transformers' own progress bar while its stock from_pretrained reads the weights; under
# zero3_init_flag no process runs that loader (and none falls back to it with a warning).
STOCK_LOADER = "Loading weights"
FALLBACK = "whole in every process"


@pytest.mark.slow
@pytest.mark.parametrize("config, stage", [("zero2", 2), ("zero3_init", 3)])
def test_run_clm_trainer_losses_match_ddp(runs, config, stage):
    ref_out, ref_text = runs.trainer("ddp")
    out, text = runs.trainer(config)
    assert _says_zero(text, stage) and "zero_strategy: ZeRO" not in ref_text
    assert STOCK_LOADER in ref_text and (STOCK_LOADER not in text and FALLBACK not in text) == (config == "zero3_init")
    ref_steps, ref_losses, ref_norms = _trainer_log(ref_out)
    steps, losses, norms = _trainer_log(out)
    assert ref_steps == steps == list(range(1, STEPS + 1))
    assert len(set(ref_losses)) == STEPS  # every step changes the loss
    assert _close(losses, ref_losses, rtol=1e-5), (losses, ref_losses)
    assert _close(norms, ref_norms, rtol=1e-4), (norms, ref_norms)


@pytest.mark.slow
@pytest.mark.parametrize("config, stage", [("zero2", 2), ("zero3", 3)])
def test_run_clm_trainer_with_adafactor_matches_ddp(runs, config, stage):
    """``--optim adafactor`` (transformers' Adafactor, factored over the 2-D weights):
    a whole-parameter optimizer, so the engine gives it whole parameters; the losses and
    gradient norms of every step and the saved model equal the DDP launch's."""
    ref_out, _ = runs.trainer("ddp", optim="adafactor")
    out, text = runs.trainer(config, optim="adafactor")
    assert _says_zero(text, stage)
    ref_steps, ref_losses, ref_norms = _trainer_log(ref_out)
    steps, losses, norms = _trainer_log(out)
    assert ref_steps == steps == list(range(1, STEPS + 1))
    assert len(set(ref_losses)) == STEPS
    assert _close(losses, ref_losses, rtol=1e-5), (losses, ref_losses)
    assert _close(norms, ref_norms, rtol=1e-4), (norms, ref_norms)
    if config == "zero2":
        # The comparison can fail: the same launch with Adafactor declared element-wise
        # (zero_config elementwise_optimizers) factors nothing and drifts from DDP.
        pieces_out, _ = runs.trainer("zero2_pieces", optim="adafactor")
        _, pieces_losses, _ = _trainer_log(pieces_out)
        assert pieces_losses[0] == pytest.approx(ref_losses[0], rel=1e-5)  # before any step
        assert not _close(pieces_losses, ref_losses, rtol=1e-4), (pieces_losses, ref_losses)  # 10x the tolerance above


@pytest.mark.slow
@pytest.mark.parametrize("config, stage", [("zero2", 2), ("zero3", 3)])
def test_run_clm_no_trainer_eval_losses_match_ddp(runs, config, stage):
    _, ref_text = runs.no_trainer("ddp")
    _, text = runs.no_trainer(config)
    assert _says_zero(text, stage) and "zero_strategy: ZeRO" not in ref_text
    ref_epochs, ref_ppl, ref_loss = _epoch_lines(ref_text)
    epochs, ppl, loss = _epoch_lines(text)
    assert ref_epochs == epochs == list(range(STEPS))
    assert len(set(ref_loss)) == STEPS
    assert _close(loss, ref_loss, rtol=1e-5), (loss, ref_loss)
    assert _close(ppl, ref_ppl, rtol=1e-5), (ppl, ref_ppl)


_LOAD_WITHOUT_PACKAGE = """
import json, sys
import torch
from transformers import AutoModelForCausalLM
pairs, start = json.loads(sys.argv[1]), sys.argv[2]
init = AutoModelForCausalLM.from_pretrained(start).state_dict()
out = {}
for got, ref in pairs:
    model = AutoModelForCausalLM.from_pretrained(got)
    a, b = model.state_dict(), AutoModelForCausalLM.from_pretrained(ref).state_dict()
    assert sorted(a) == sorted(b), (got, sorted(set(a) ^ set(b)))
    assert all(a[k].dtype == b[k].dtype == torch.float32 for k in a)
    width = model.config.n_embd
    diff, key_bias_diff, key_bias_moved = 0.0, 0.0, 0.0
    for k in a:
        d = (a[k] - b[k]).abs()
        if k.endswith("attn.c_attn.bias"):  # [query | key | value]
            key_bias_diff = max(key_bias_diff, float(d[width:2 * width].max()))
            key_bias_moved = max(key_bias_moved, float((b[k] - init[k])[width:2 * width].abs().max()))
            d = torch.cat([d[:width], d[2 * width:]])
        diff = max(diff, float(d.max()))
    moved = max(float((b[k] - init[k]).abs().max()) for k in b)
    out[got] = {"diff": diff, "key_bias_diff": key_bias_diff, "key_bias_moved": key_bias_moved, "moved": moved}
# the stdlib-only start-up stub is imported by its .pth; with ZERO_STRATEGY_AUTOLOAD=0 it installs nothing
leaked = sorted(m for m in sys.modules if m.split('.')[0] in ('zero_strategy', 'integrations'))
print(json.dumps({"pairs": out, "leaked": leaked}))
"""


@pytest.mark.slow
def test_final_models_load_with_plain_transformers_and_equal_ddp(runs):
    """Every weight equals the DDP run's to 1e-6, with one exception explained below."""
    pairs = [(str(runs.trainer(c)[0]), str(runs.trainer("ddp")[0])) for c in ("zero2", "zero3_init")]
    pairs += [(str(runs.no_trainer(c)[0]), str(runs.no_trainer("ddp")[0])) for c in ("zero2", "zero3")]
    env = dict(runs.launcher.env, ZERO_STRATEGY_AUTOLOAD="0")
    proc = runs.launcher.run([PY, "-c", _LOAD_WITHOUT_PACKAGE, json.dumps(pairs), str(runs.model)], env=env)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["leaked"] == []
    for folder, r in result["pairs"].items():
        assert r["moved"] > 1e-2, (folder, r)  # the scripts trained the model they saved
        assert r["diff"] <= 1e-6, (folder, r)
        # The attention key bias gets a zero gradient in exact arithmetic (softmax ignores a
        # constant added to every score), so AdamW, which divides by the gradient's own
        # magnitude, turns its rounding residue into a step of up to the learning rate. In
        # both runs it barely moves (1e-2 is one step's move of a real gradient here). The
        # two runs' residues differ only through the Trainer's clipping (max_grad_norm 1.0):
        # ZeRO sums the global norm shard by shard, DDP over whole gradients, and the last
        # bit of the clip factor differs (without clipping the weights are bit-identical).
        assert r["key_bias_moved"] < 1e-4 and r["key_bias_diff"] < 1e-4, (folder, r)
