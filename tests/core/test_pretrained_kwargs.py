"""zero3_init_flag's from_pretrained (integrations/pretrained.py) against the stock one.

The reference is transformers' own ``from_pretrained`` in this process, with the
partitioned loader switched off: its signature (every keyword it takes must be handled),
what it accepts, and the loading info it returns.  One process; no launch.
"""
from __future__ import annotations

import inspect
import re

import pytest
import torch

from zero_strategy.integrations import pretrained as P

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(3)
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, pad_token_id=0)).save_pretrained(root / "gpt2")
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=64, tie_word_embeddings=False)).save_pretrained(root / "llama")
    return root


def _stock_keywords():
    """Every keyword the installed from_pretrained reads (its signature and the
    ``kwargs.pop("name"...)`` calls in its body), and its signature."""
    from transformers.modeling_utils import PreTrainedModel

    fn = PreTrainedModel.from_pretrained
    return set(P.stock_keywords(fn)), inspect.signature(fn)


def test_every_stock_keyword_is_classified():
    names, _ = _stock_keywords()
    known = set(P._HUB_KWARGS) | set(P._IGNORED) | set(P._DEFAULT_ONLY) | set(P._HANDLED)
    assert names - known == set(), f"keywords of the installed from_pretrained with no rule in pretrained.py: {sorted(names - known)}"
    assert {"device_map", "from_tf", "output_loading_info", "low_cpu_mem_usage", "torch_dtype", "trust_remote_code"} <= names


def _stock_pop_defaults():
    """``name -> value`` for every ``kwargs.pop("name", <literal>)`` in the installed
    from_pretrained's body: the defaults the stock loader itself falls back to."""
    import ast

    from transformers.modeling_utils import PreTrainedModel

    source = inspect.getsource(PreTrainedModel.from_pretrained)
    found = {}
    for name, literal in re.findall(r'kwargs\.pop\("(\w+)",\s*([^)]*)\)', source):
        try:
            found[name] = ast.literal_eval(literal)
        except (ValueError, SyntaxError):
            continue  # not a literal: nothing to compare
    return found


def test_the_stock_loader_s_own_defaults_are_accepted():
    # The reference is the installed loader's body, not pretrained.py's table: a keyword
    # whose stock default moved (use_kernels went from False to None) must still pass.
    stock = {k: v for k, v in _stock_pop_defaults().items() if k in P._DEFAULT_ONLY}
    assert {"state_dict", "offload_buffers", "use_kernels"} <= set(stock)
    P.check_arguments(stock)  # raises UnsupportedArgument naming the keyword otherwise


@pytest.fixture
def kernels_mode_unclassified(monkeypatch):
    """pretrained.py as it was before transformers added ``kernels_mode`` (5.25): the
    keyword the installed loader reads has no rule here, as a newer release's would."""
    monkeypatch.setattr(P, "_DEFAULT_ONLY", {k: v for k, v in P._DEFAULT_ONLY.items() if k != "kernels_mode"})
    P._unclassified_keywords.cache_clear()
    yield
    P._unclassified_keywords.cache_clear()


def test_a_keyword_of_a_newer_transformers_loads_when_off(checkpoints, kernels_mode_unclassified):
    from transformers import AutoModelForCausalLM

    assert "kernels_mode" in _stock_keywords()[0]  # the installed loader reads it
    with P.partitioned_loading():
        model = AutoModelForCausalLM.from_pretrained(checkpoints / "llama", kernels_mode=None)
    assert all(p.is_meta for p in model.parameters())
    assert not hasattr(model.config, "kernels_mode")  # not taken for a config attribute


def test_a_keyword_of_a_newer_transformers_that_asks_for_something_is_refused(checkpoints, kernels_mode_unclassified):
    from transformers import AutoModelForCausalLM

    with P.partitioned_loading(), pytest.raises(P.UnsupportedArgument, match=r"kernels_mode='training'.*no rule for"):
        AutoModelForCausalLM.from_pretrained(checkpoints / "llama", kernels_mode="training")


def _defaults():
    """Each classified keyword at the stock default value (from the signature, else the
    value the stock body pops it with)."""
    names, sig = _stock_keywords()
    values = {n: p.default for n, p in sig.parameters.items() if n in names and p.default is not inspect.Parameter.empty}
    values.update({k: v for k, v in P._DEFAULT_ONLY.items() if k in names})
    # As run_clm.py / run_clm_no_trainer.py / TRL pass them.
    values.update(device_map=None, from_tf=False, output_loading_info=False, low_cpu_mem_usage=True, trust_remote_code=False,
                  torch_dtype=None, dtype=None, token=None, revision="main", cache_dir=None, attn_implementation="eager",
                  use_safetensors=None, ignore_mismatched_sizes=False, generation_config=None)
    values.pop("config", None)
    return values


@pytest.mark.parametrize("with_config", [False, True])  # run_clm.py passes config=AutoConfig.from_pretrained(...)
def test_default_keywords_accepted_as_stock_does(checkpoints, with_config):
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = _defaults()
    if with_config:
        kwargs["config"] = AutoConfig.from_pretrained(checkpoints / "llama")
    stock = AutoModelForCausalLM.from_pretrained(checkpoints / "llama", **kwargs)  # the reference accepts them
    assert not any(p.is_meta for p in stock.parameters())
    with P.partitioned_loading():
        model = AutoModelForCausalLM.from_pretrained(checkpoints / "llama", **kwargs)
    assert all(p.is_meta for p in model.parameters())  # partitioned, not the stock fallback
    assert sorted(n for n, _ in model.named_parameters()) == sorted(n for n, _ in stock.named_parameters())
    assert model.config.to_dict() == stock.config.to_dict()


@pytest.mark.parametrize("cls_name", ["AutoModelForCausalLM", "LlamaForCausalLM"])  # TRL calls the concrete class
def test_config_and_name_or_path_as_stock(checkpoints, cls_name):
    """TRL loads the tokenizer from ``model.config._name_or_path`` of a model it loaded by name."""
    import transformers

    cls = getattr(transformers, cls_name)
    stock = cls.from_pretrained(checkpoints / "llama")
    with P.partitioned_loading():
        model = cls.from_pretrained(checkpoints / "llama")
    assert all(p.is_meta for p in model.parameters())
    assert model.config.to_dict() == stock.config.to_dict()
    assert model.name_or_path == stock.name_or_path == str(checkpoints / "llama")


@pytest.mark.parametrize("key, value", [
    ("state_dict", {}), ("quantization_config", object()), ("variant", "fp16"), ("tp_plan", "auto"),
    ("key_mapping", {"^a": "b"}), ("max_memory", {0: "1GB"}), ("offload_folder", "/tmp/x"), ("gguf_file", "m.gguf"),
    ("device_map", {"model": "cpu", "lm_head": "disk"}), ("device_map", {"model": 0, "lm_head": 1}), ("use_kernels", True),
])
def test_values_that_cannot_be_honoured_raise_naming_the_keyword(checkpoints, key, value):
    from transformers import LlamaForCausalLM  # (the Auto classes read gguf_file themselves first)

    with P.partitioned_loading(), pytest.raises(P.UnsupportedArgument) as info:
        LlamaForCausalLM.from_pretrained(checkpoints / "llama", **{key: value})
    assert f"from_pretrained({key}=" in str(info.value) and "zero3_init_flag" in str(info.value)


@pytest.mark.parametrize("device_map", ["cpu", {"": "cpu"}, torch.device("cpu"), 0, {"": "cuda:1"}, "auto"])
def test_device_maps_that_keep_the_model_whole_are_accepted(checkpoints, device_map):
    if torch.cuda.is_available() and device_map == "auto":
        pytest.skip("'auto' spreads the model over the GPUs here")
    from transformers import AutoModelForCausalLM

    with P.partitioned_loading():
        model = AutoModelForCausalLM.from_pretrained(checkpoints / "llama", device_map=device_map)
    assert all(p.is_meta for p in model.parameters())


def _info(cls, folder, **kwargs):
    model, info = cls.from_pretrained(folder, output_loading_info=True, **kwargs)
    if P._active:  # the partitioned loader served it (not the stock fallback)
        assert all(p.is_meta for p in model.parameters())
    return {k: sorted(map(str, v)) if isinstance(v, set) else v for k, v in info.items()}


@pytest.mark.parametrize("cls_name, folder, extra", [
    ("GPT2LMHeadModel", "gpt2", {}),
    ("GPT2ForSequenceClassification", "gpt2", {}),  # a new head: missing score.weight
    ("LlamaModel", "llama", {}),  # the head model's checkpoint into the base model: unexpected lm_head.weight
    ("LlamaForCausalLM", "llama", {"vocab_size": 80, "ignore_mismatched_sizes": True}),  # mismatched, re-initialised
])
def test_output_loading_info_matches_stock(checkpoints, cls_name, folder, extra):
    cls = getattr(transformers, cls_name)
    want = _info(cls, checkpoints / folder, **extra)
    with P.partitioned_loading():
        got = _info(cls, checkpoints / folder, **extra)
    assert got == want
    if cls_name != "GPT2LMHeadModel":
        assert any(want[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))  # a case with content


def test_mismatched_shapes_are_an_error_unless_ignored(checkpoints):
    from transformers import LlamaForCausalLM

    with pytest.raises(Exception):
        LlamaForCausalLM.from_pretrained(checkpoints / "llama", vocab_size=80)  # stock refuses too
    with P.partitioned_loading(), pytest.raises(ValueError, match="ignore_mismatched_sizes=True"):
        LlamaForCausalLM.from_pretrained(checkpoints / "llama", vocab_size=80)


@pytest.mark.parametrize("dtype", [None, "auto", torch.float32, "float32", "bfloat16"])
def test_dtype_as_stock_for_a_bf16_checkpoint(checkpoints, tmp_path, dtype):
    """transformers 5.x loads in the checkpoint's dtype unless told otherwise."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(checkpoints / "llama").to(torch.bfloat16).save_pretrained(folder)
    kwargs = {} if dtype is None else {"dtype": dtype}
    want = {n: p.dtype for n, p in AutoModelForCausalLM.from_pretrained(folder, **kwargs).named_parameters()}
    with P.partitioned_loading():
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    assert {n: p.dtype for n, p in model.named_parameters()} == want
    assert set(want.values()) == {torch.float32 if dtype in (torch.float32, "float32") else torch.bfloat16}
