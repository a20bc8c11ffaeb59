"""TRL's SFTTrainer through TRL's own, unchanged training script (``trl/scripts/sft.py``
from the installed trl package) under ``accelerate launch`` with a ``zero_config:``
section, with and without PEFT LoRA (``--use_peft``), against the same script under a
plain DDP config, in fp32 (``--bf16 false``; TRL's default is bf16).

The model is a tiny Llama whose ``lm_head`` is not tied to the embedding
(tests/support/hf_local_assets.py; nothing comes from the hub). TRL computes the loss with a
fused LM head that multiplies the hidden states by ``lm_head.weight`` itself, without
calling the ``lm_head`` module. The stage-3 config makes every ``Linear`` its own unit
(``unit_modules: [LlamaDecoderLayer, Linear]``, ``min_gather_numel: 0``,
``param_persistence_threshold: 0``), so ``lm_head.weight`` is partitioned on its own and
no module hook gathers it before TRL reads it: the read is served by the engine's
on-demand gather inside forward and backward. It also has ``zero3_init_flag: true``:
TRL loads the model by name (``LlamaForCausalLM.from_pretrained`` with its own keywords,
``device_map`` included), so the model is built partitioned, and with ``--use_peft`` TRL
wraps it in LoRA before ``prepare`` reads each rank's slices of the checkpoint.

Compared, per optimizer step, from the ``trainer_state.json`` the Trainer writes in its
checkpoint: the loss, the gradient norm and TRL's entropy metric. The saved model (or
LoRA adapter) is loaded in a fresh interpreter with plain transformers / PEFT and
zero_strategy switched off, and equals the DDP run's.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

trl = pytest.importorskip("trl")
pytest.importorskip("peft")

from hf_local_assets import save_tiny_llama, write_sft_jsonl, write_text  # noqa: E402
from test_accelerate import PY, Launcher, _close, _write_config  # noqa: E402
from trainer_state import logged_per_step  # noqa: E402

SFT_SCRIPT = Path(trl.__file__).parent / "scripts" / "sft.py"
STEPS = 4
ZERO3_SECTION = "  unit_modules: [LlamaDecoderLayer, Linear]\n  min_gather_numel: 0\n  zero3_init_flag: true\n"
LORA = ["--use_peft", "--lora_r", "4", "--lora_alpha", "8"]  # PEFT's default targets for Llama: q_proj, v_proj


class SftRuns:
    def __init__(self, root: Path) -> None:
        self.launcher = Launcher(root)
        self.launcher.env["HF_DATASETS_CACHE"] = str(root / "datasets_cache")
        self.launcher.configs["zero3_init"] = _write_config(root / "zero3_init.yaml", 3, ZERO3_SECTION)
        assets = root / "assets"
        (assets / "data").mkdir(parents=True)
        self.model = save_tiny_llama(assets / "llama", write_text(assets / "corpus.txt"))
        write_sft_jsonl(assets / "data" / "train.jsonl")
        self.data = assets / "data"  # a local folder: load_dataset reads its JSON lines
        self.cache = {}

    def run(self, config: str, lora: bool):
        """(output folder, launch output) of one SFT launch."""
        name = f"sft_{config}{'_lora' if lora else ''}"
        if name not in self.cache:
            out = self.launcher.root / name
            args = ["--model_name_or_path", str(self.model), "--dataset_name", str(self.data), "--bf16", "false",
                    "--per_device_train_batch_size", "2", "--max_steps", str(STEPS), "--logging_steps", "1",
                    "--learning_rate", "1e-2", "--max_length", "32", "--seed", "0", "--report_to", "none",
                    "--save_strategy", "steps", "--save_steps", str(STEPS), "--output_dir", str(out),
                    *(LORA if lora else [])]
            saved = out / ("adapter_model.safetensors" if lora else "model.safetensors")
            proc = self.launcher.run(self.launcher.command(config, SFT_SCRIPT, args),
                                     reference_output=saved if config == "ddp" else None)
            self.cache[name] = (out, proc.stdout + proc.stderr)
        return self.cache[name]


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    return SftRuns(tmp_path_factory.mktemp("trl_sft"))


def _log(out: Path):
    return logged_per_step(out, STEPS, ("step", "loss", "grad_norm", "entropy"))


CASES = [("zero2", 2, False), ("zero2", 2, True), ("zero3_init", 3, False), ("zero3_init", 3, True)]


@pytest.mark.slow
@pytest.mark.parametrize("config, stage, lora", CASES, ids=[f"{c}{'-lora' if l else ''}" for c, _, l in CASES])
def test_sft_per_step_losses_match_ddp(sft, config, stage, lora):
    ref_out, ref_text = sft.run("ddp", lora)
    out, text = sft.run(config, lora)
    assert text.count(f"zero_strategy: ZeRO stage {stage} on 2 rank(s)") == 1 and "zero_strategy: ZeRO" not in ref_text
    # transformers' progress bar of its stock loader: absent where zero3_init_flag built the model partitioned
    assert "Loading weights" in ref_text and ("Loading weights" not in text) == (stage == 3)
    assert "whole in every process" not in text  # no fallback to the stock loader
    ref, got = _log(ref_out), _log(out)
    assert ref["step"] == got["step"] == list(range(1, STEPS + 1))
    assert len(set(ref["loss"])) == STEPS  # every step changes the loss
    assert _close(got["loss"], ref["loss"], rtol=1e-5), (got["loss"], ref["loss"])
    assert _close(got["grad_norm"], ref["grad_norm"], rtol=1e-4), (got["grad_norm"], ref["grad_norm"])
    assert _close(got["entropy"], ref["entropy"], rtol=1e-5), (got["entropy"], ref["entropy"])


_LOAD_WITHOUT_PACKAGE = """
import json, sys
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
base, full, adapters = json.loads(sys.argv[1])
init = AutoModelForCausalLM.from_pretrained(base).state_dict()
out = {}
for got, ref in full:
    a, b = (AutoModelForCausalLM.from_pretrained(f).state_dict() for f in (got, ref))
    assert sorted(a) == sorted(b) == sorted(init), got
    out[got] = {"diff": max(float((a[k] - b[k]).abs().max()) for k in a),
                "moved": max(float((b[k] - init[k]).abs().max()) for k in b)}
from peft import PeftModel
for got, ref in adapters:
    models = [PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), f) for f in (got, ref)]
    a, b = ({n: p.detach() for n, p in m.named_parameters() if "lora_" in n} for m in models)
    assert a and sorted(a) == sorted(b), got
    # the adapter was really applied: the base weights are the checkpoint's, untouched
    base_equal = all(torch.equal(p, init[n.replace("base_model.model.", "").replace(".base_layer", "")])
                     for n, p in models[0].named_parameters() if "lora_" not in n)
    out[got] = {"diff": max(float((a[k] - b[k]).abs().max()) for k in a),
                "moved": max(float(b[k].abs().max()) for k in b if "lora_B" in k), "base_equal": base_equal}
leaked = sorted(m for m in sys.modules if m.split('.')[0] in ('zero_strategy', 'integrations'))
print(json.dumps({"pairs": out, "leaked": leaked}))
"""


@pytest.mark.slow
def test_saved_models_and_adapters_load_without_zero_strategy_and_equal_ddp(sft):
    full = [(str(sft.run(c, False)[0]), str(sft.run("ddp", False)[0])) for c in ("zero2", "zero3_init")]
    adapters = [(str(sft.run(c, True)[0]), str(sft.run("ddp", True)[0])) for c in ("zero2", "zero3_init")]
    env = dict(sft.launcher.env, ZERO_STRATEGY_AUTOLOAD="0")
    proc = sft.launcher.run([PY, "-c", _LOAD_WITHOUT_PACKAGE, json.dumps([str(sft.model), full, adapters])], env=env)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["leaked"] == []
    for folder, r in result["pairs"].items():
        assert r["moved"] > 1e-2, (folder, r)  # trained (lora_B starts at zero)
        assert r["diff"] <= 1e-6, (folder, r)
        assert r.get("base_equal", True), (folder, r)
