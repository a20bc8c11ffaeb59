"""Stage 0-3 on every architecture in tests/support/zoo.py, against a single-process reference.

The reference is plain torch on one process: the same model and AdamW, each step's
global batch split as the ranks split it, every rank's loss / N backpropagated, one
optimizer step.  ZeRO runs on 2 (and 3) gloo processes at every stage, at stage 3
both at the default persistence threshold and with every parameter partitioned
(threshold 0).  At threshold 0 the gathers take three shapes: on 2 ranks the whole
(tiny) model as one gather (the default ``min_gather_numel``) and one gather per block
(``min_gather_numel=0``); on 3 ranks small sibling blocks merged in pairs and threes.  Losses and final parameters must agree to fp32 summation-order noise.
"""
from __future__ import annotations

import pytest
import torch

import zoo
from dist_harness import run_distributed

STEPS = 3
GLOBAL_BATCH = 6  # divisible by 2 and 3 ranks
# (stage, param_persistence_threshold, min_gather_numel); None = the default
CONFIGS = [(0, None, None), (1, None, None), (2, None, None), (3, None, None), (3, 0, None), (3, 0, 0)]
SOME_MERGED = 10_000  # the 3-rank run: blocks of these models hold 4k-17k elements


def _optimizer(model):
    # eps=1e-3: Adam divides by sqrt(v), which turns fp32 summation-order noise in
    # gradients that are zero in exact arithmetic (an attention key bias) into updates
    # of size lr; a large eps keeps such updates linear in the gradient, so a wrong
    # gradient still shows at full size while noise stays noise.
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=1e-3, weight_decay=0.01)


def reference(name: str, ws: int, model=None, run=None):
    """``model`` (default: the zoo's) trained on one process; ``run`` is what is called
    (the model itself, or e.g. its torch.compile wrapper)."""
    model = model if model is not None else zoo.build_model(name)
    run = run if run is not None else model
    opt = _optimizer(model)
    losses = []
    for batch in zoo.make_batches(name, STEPS, GLOBAL_BATCH):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for r in range(ws):
            loss = zoo.loss_of(name, run, zoo.shard(batch, r, ws))
            (loss / ws).backward()
            total += float(loss) / ws
        opt.step()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _zero_worker(rank, ws, names, configs):
    import transformers

    import zero_strategy

    transformers.logging.set_verbosity_error()
    out = {}
    for name in names:
        for stage, threshold, min_gather in configs:
            model = zoo.build_model(name)
            cfg = dict(stage=stage, reduce_bucket_size=20_000)
            if threshold is not None:
                cfg["param_persistence_threshold"] = threshold
            if min_gather is not None:
                cfg["min_gather_numel"] = min_gather
            engine = zero_strategy.initialize(model, _optimizer(model), cfg)
            losses = zoo.train_on_engine(name, model, engine, rank, ws, STEPS, GLOBAL_BATCH)
            sd = engine.full_state_dict()
            out[(name, stage, threshold, min_gather)] = (losses, sd, engine.unit_summary())
            engine.close()
    return out


def _compare(name, key, got, ref):
    losses, sd, _ = got
    ref_losses, ref_params = ref
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"{name} {key}: loss {i}: {a} vs {b}"
    for n, want in ref_params.items():
        assert n in sd, f"{name} {key}: {n} missing from full_state_dict"
        torch.testing.assert_close(sd[n], want, rtol=1e-5, atol=2e-6, msg=lambda m: f"{name} {key} {n}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("group", [zoo.NAMES[:7], zoo.NAMES[7:]], ids=["hf-decoders", "others"])
def test_every_architecture_matches_single_process_at_every_stage(group):
    results = run_distributed(_zero_worker, 2, group, CONFIGS, timeout=1200)[0]
    for name in group:
        ref = reference(name, 2)
        for key in CONFIGS:
            _compare(name, key, results[(name, *key)], ref)
        if name in ("fused_head", "parent_child"):
            # These use a parameter outside its module's forward: gathered on demand.
            assert results[(name, 3, 0, 0)][2]["on_demand_gathers"] > 0
        # The whole tiny model is one gather by default; one per block with 0.
        assert [g["module"] for g in results[(name, 3, 0, None)][2]["groups"]] == ["<root>"]
        assert all(len(g["modules"]) == 1 for g in results[(name, 3, 0, 0)][2]["groups"])


@pytest.mark.slow
def test_three_ranks_full_sharding():
    names = ("t5", "torch_transformer", "moe", "fused_head", "parent_child")
    key = (3, 0, SOME_MERGED)
    results = run_distributed(_zero_worker, 3, names, [key], timeout=900)[0]
    merged = 0
    for name in names:
        _compare(name, key, results[(name, *key)], reference(name, 3))
        merged += sum(len(g["modules"]) > 1 for g in results[(name, *key)][2]["groups"])
    assert merged >= 2, "no gather of several blocks was exercised"


def test_auto_units_follow_the_models_blocks():
    """Unit modules are the blocks a model runs (never a ModuleList, which has no forward),
    and the 7B Llama shape gets its decoder layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from zero_strategy.sharding.planner import auto_unit_module_classes

    with torch.device("meta"):
        llama = LlamaForCausalLM(LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                             num_attention_heads=32, num_key_value_heads=32, vocab_size=32000))
    assert auto_unit_module_classes(llama) == ["LlamaDecoderLayer"]
    assert auto_unit_module_classes(zoo.build_model("t5")) == ["T5Block"]
    assert auto_unit_module_classes(zoo.build_model("torch_transformer")) == ["TransformerDecoderLayer", "TransformerEncoderLayer"]
    assert auto_unit_module_classes(zoo.build_model("moe")) == ["MoEBlock"]
    assert auto_unit_module_classes(zoo.build_model("many_linear")) == ["Linear"]


def test_llama_7b_plan_on_the_fake_process_group_has_decoder_layer_units():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import LlamaConfig, LlamaForCausalLM

    import zero_strategy

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=1024)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                                 num_attention_heads=32, num_key_value_heads=32, vocab_size=32000))
        engine = zero_strategy.initialize(model, torch.optim.AdamW(model.parameters()), dict(stage=3))
        summary = engine.unit_summary()
        assert summary["unit_modules"] == ["LlamaDecoderLayer"]
        layers = [g for g in summary["groups"] if g["module"].startswith("model.layers.")]
        assert len(layers) == 32 and all(g["class"] == "LlamaDecoderLayer" for g in layers)
        engine.close()
    finally:
        dist.destroy_process_group()


def test_small_sibling_blocks_share_one_gather_and_cut_the_collectives():
    """500 Linear layers of 72 elements: by default the whole model (36k elements, under
    ``min_gather_numel``) is one gather, so a step issues two all-gathers (forward,
    backward); with a budget of 20k elements the layers (siblings in one ModuleList)
    form runs of consecutive layers holding at least 20k elements each (but the last)
    and at most one layer more; ``min_gather_numel=0`` gives one gather per layer.
    T5's encoder and decoder blocks (different parents) are never merged."""
    import zero_strategy

    def build(name, **cfg):
        model = zoo.build_model(name)
        engine = zero_strategy.initialize(model, _optimizer(model), dict(stage=3, param_persistence_threshold=0, **cfg))
        return model, engine

    def one_step(name, **cfg):
        model, engine = build(name, **cfg)
        batch = zoo.make_batches(name, 1, 2)[0]
        engine.backward(zoo.loss_of(name, model, batch))
        engine.step()
        groups = engine.unit_summary()["groups"]
        calls = engine.comm_report().kinds["all_gather"].calls
        engine.close()
        return calls, groups

    calls, groups = one_step("many_linear")
    assert [g["module"] for g in groups] == ["<root>"] and calls == 2

    budget = 20_000
    calls, groups = one_step("many_linear", min_gather_numel=budget)
    runs = [g for g in groups if g["modules"][0].startswith("layers.")]
    assert [m for g in runs for m in g["modules"]] == [f"layers.{i}" for i in range(500)]
    assert len(runs) == 2 and all(budget <= g["numel"] < budget + 72 for g in runs[:-1])
    assert calls == 2 * len(groups)

    calls, groups = one_step("many_linear", min_gather_numel=0)
    assert len(groups) == 502 and calls == 2 * 502

    _, t5 = build("t5", min_gather_numel=20_000)
    for g in t5.unit_summary()["groups"]:
        stacks = {m.split(".block.")[0] for m in g["modules"]}
        assert len(stacks) == 1, f"a gather spans two stacks: {g['modules']}"
    assert any(len(g["modules"]) > 1 for g in t5.unit_summary()["groups"])
    t5.close()
