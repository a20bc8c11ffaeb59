"""Partitioned loading (zero3_init_flag) loads exactly whatever wraps the model, or fails.

The references are independent of zero_strategy's loading: the checkpoint's own tensors
(read with safetensors), PEFT's documented initialisation (lora_B = 0), and the same
unchanged PEFT script under a plain DDP config (stock from_pretrained), launched with
the real ``accelerate launch`` on 2 CPU processes (machinery of tests/accelerate/test_accelerate.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from test_accelerate import PY, Launcher, _close, _write_config  # noqa: E402

from zero_strategy.integrations import pretrained as P  # noqa: E402

SCRIPT = Path(__file__).with_name("peft_lora_loop.py")
LORA_TARGETS = ("q_proj", "v_proj")


def _save_llama(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    if not folder.exists():
        torch.manual_seed(11)
        LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=64, tie_word_embeddings=False)).save_pretrained(folder)
    return folder


def _checkpoint(folder: Path):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _peft_name(key: str) -> str:
    """The name PEFT gives checkpoint key ``key`` once LoRA wraps q_proj / v_proj."""
    for target in LORA_TARGETS:
        key = key.replace(f".{target}.weight", f".{target}.base_layer.weight")
    return "base_model.model." + key


# ---------------------------------------------------------------------------------------
# 2 processes through accelerate launch
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    launcher = Launcher(root)
    launcher.configs["zero3_init"] = _write_config(root / "zero3_init.yaml", 3, "  zero3_init_flag: true\n")
    model = _save_llama(root / "llama")
    out = {}
    for name in ("ddp", "zero3_init"):
        folder = root / name
        launcher.run(launcher.command(name, SCRIPT, ["--model", str(model), "--out", str(folder)]),
                     reference_output=folder / "out.json" if name == "ddp" else None)
        out[name] = (json.loads((folder / "out.json").read_text()), folder)
    return model, out, launcher


def _load(folder: Path, name: str):
    from safetensors.torch import load_file

    return load_file(str(folder / name))


@pytest.mark.slow
def test_lora_over_partitioned_from_pretrained_loads_the_base_weights_exactly(runs):
    model, out, _ = runs
    (ref, ref_folder), (got, folder) = out["ddp"], out["zero3_init"]
    assert got["accelerator_class"] == "ZeroAccelerator" and got["num_processes"] == 2
    assert got["built_on_meta"] == [True, True] and ref["built_on_meta"] == [False, False]
    checkpoint = _checkpoint(model)
    for when in ("initial.safetensors", "final.safetensors"):  # the base is frozen: unchanged by training
        weights = _load(folder, when)
        for key, tensor in checkpoint.items():
            name = _peft_name(key)
            assert name in weights, (when, key, name)
            assert weights[name].dtype == tensor.dtype and torch.equal(weights[name], tensor), (when, key)
    initial, ref_initial = _load(folder, "initial.safetensors"), _load(ref_folder, "initial.safetensors")
    assert sorted(initial) == sorted(ref_initial)
    lora_b = [k for k in initial if ".lora_B." in k]
    lora_a = [k for k in initial if ".lora_A." in k]
    assert len(lora_b) == len(lora_a) == 2 * len(LORA_TARGETS)
    assert all(torch.count_nonzero(initial[k]) == 0 for k in lora_b)  # as PEFT initialises it
    for k in lora_a:  # PEFT's random init, drawn from the same seed as under DDP
        assert torch.count_nonzero(initial[k]) > 0 and torch.equal(initial[k], ref_initial[k]), k
    # first step (and the following ones) as the DDP reference, per rank
    assert _close(got["losses"][0], ref["losses"][0], rtol=1e-6), (got["losses"], ref["losses"])
    assert _close(got["losses"], ref["losses"], rtol=1e-5), (got["losses"], ref["losses"])
    assert got["losses"][-1] != got["losses"][0]  # the adapters train


_RELOAD_ADAPTERS = """
import json, sys
import torch
from safetensors.torch import load_file
from peft import PeftModel
from transformers import AutoModelForCausalLM
base, folders = json.loads(sys.argv[1])
lora = {}
for folder in folders:
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder + "/adapter")
    lora[folder] = {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}
    final = load_file(folder + "/final.safetensors")  # the weights at the end of training, in the run itself
    assert lora[folder] and all(torch.equal(t, final[n]) for n, t in lora[folder].items())
a, b = (lora[f] for f in folders)
leaked = sorted(m for m in sys.modules if m.split('.')[0] in ('zero_strategy', 'integrations'))
print(json.dumps({"diff": max(float((a[k] - b[k]).abs().max()) for k in a), "keys_equal": sorted(a) == sorted(b),
                  "lora_b_moved": min(float(a[k].abs().max()) for k in a if "lora_B" in k), "leaked": leaked}))
"""


@pytest.mark.slow
def test_saved_adapter_reloads_without_zero_strategy(runs):
    """PEFT's save_pretrained at stage 3 writes an adapter that plain PEFT loads over the
    stock base model, equal to the DDP run's adapter and to the run's own final weights."""
    model, out, launcher = runs
    folders = [str(out["zero3_init"][1]), str(out["ddp"][1])]
    env = dict(launcher.env, ZERO_STRATEGY_AUTOLOAD="0")
    proc = launcher.run([PY, "-c", _RELOAD_ADAPTERS, json.dumps([str(model), folders])], env=env)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["leaked"] == [] and result["keys_equal"]
    assert result["lora_b_moved"] > 1e-3  # lora_B starts at zero: the adapter saved is the trained one
    assert result["diff"] <= 1e-6, result


@pytest.mark.slow
def test_a_loading_error_on_one_rank_stops_every_rank(runs, tmp_path):
    """Rank 1 alone swaps a module after loading: rank 1 refuses to load, and rank 0,
    whose own model is fine, stops too, naming rank 1's error (rather than waiting in a
    collective for it)."""
    model, _, launcher = runs
    args = ["--model", str(model), "--out", str(tmp_path / "out"), "--replace-module-on-rank", "1"]
    proc = launcher.run(launcher.command("zero3_init", SCRIPT, args), expect_ok=False)
    assert proc.returncode != 0
    assert "model.layers.1.mlp.down_proj.weight" in proc.stderr
    assert "[rank0]" in proc.stderr and "partitioned loading failed on rank(s) [1], so every rank stops: rank 1: " \
        "ValueError: partitioned loading refused" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "out" / "out.json").exists()


# ---------------------------------------------------------------------------------------
# One process: what cannot be loaded exactly is an error, listing it
# ---------------------------------------------------------------------------------------
@pytest.fixture()
def llama(tmp_path):
    return _save_llama(tmp_path / "llama")


def _partitioned(folder):
    from transformers import LlamaForCausalLM

    with P.partitioned_loading():
        return LlamaForCausalLM.from_pretrained(folder)


def test_a_replaced_module_is_an_error_naming_its_checkpoint_tensors(llama):
    model = _partitioned(llama)
    model.model.layers[1].mlp.down_proj = nn.Linear(64, 32, bias=False)  # a wrapper swapping a module
    with pytest.raises(ValueError) as info:
        P.sources_in(model)
    message = str(info.value)
    assert "model.layers.1.mlp.down_proj.weight" in message and "no longer have their parameter" in message


def test_a_parameter_moved_to_meta_with_no_values_is_an_error(llama):
    model = _partitioned(llama)
    with torch.device("meta"):  # values that exist nowhere, unlike the guarded .to("meta")
        model.lm_head = nn.Linear(32, 64, bias=False)
    with pytest.raises(ValueError) as info:
        P.sources_in(model)
    message = str(info.value)
    assert "lm_head.weight" in message and "no values exist" in message


def test_lora_wrapped_model_resolves_every_checkpoint_tensor(llama):
    from peft import LoraConfig, get_peft_model

    checkpoint = _checkpoint(llama)
    model = get_peft_model(_partitioned(llama), LoraConfig(r=4, target_modules=list(LORA_TARGETS)))
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert lora and not any(p.is_meta for p in lora)  # PEFT's values kept (it moves them to the base's device)
    assert all(torch.count_nonzero(p) == 0 for n, p in model.named_parameters() if "lora_B" in n)
    bound = P.sources_in(model)
    names = dict(model.named_parameters())
    assert sorted(key for _, key, _ in bound.params.values()) == sorted(checkpoint)
    for pid, (_, key, _) in bound.params.items():
        assert id(names[_peft_name(key)]) == pid, key  # bound to the very parameter PEFT renamed
    assert bound.unexpected == [] and bound.initialise == set()


def test_peft_modules_to_save_copy_of_a_meta_module_is_refused(llama):
    """PEFT's modules_to_save deep-copies lm_head while it is on the meta device: the copy
    has no values anywhere, so prepare must refuse rather than invent them."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_partitioned(llama), LoraConfig(r=4, target_modules=list(LORA_TARGETS), modules_to_save=["lm_head"]))
    with pytest.raises(ValueError) as info:
        P.sources_in(model)
    assert "base_model.model.lm_head.modules_to_save.default.weight" in str(info.value)
