"""A model built inside plain ``zero_strategy.init_context()`` gets, at ``initialize``,
exactly the values an eager build from the same seed gives it.

Reference: the same builder run eagerly (no context, no engine) from the same seed in
the same process.  2 and 3 gloo ranks, stage 3 with every parameter partitioned
(``param_persistence_threshold: 0``) and stage 3 at the default threshold; every tensor
of the consolidated state dict must be bit-equal, PEFT LoRA's ``lora_B`` zero, the random
stream after the build the eager one's (and untouched by set-up), and a rank seeded differently still gets rank
0's model (as ddp broadcasts rank 0's values).  Before the recording moved into the
core, only Lightning's configure_model got these values; plain init_context got the
core's own re-initialisation (other values, ``lora_B`` non-zero).
"""
from __future__ import annotations

import pytest

from dist_harness import run_distributed


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=64, tie_word_embeddings=False)


def _build():
    import torch
    from peft import LoraConfig, get_peft_model
    from torch import nn
    from transformers import LlamaForCausalLM

    class Head(nn.Module):  # initialisers written in place after construction
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 8)
            nn.init.xavier_normal_(self.proj.weight)
            self.proj.weight.data[0].mul_(3.0)
            with torch.no_grad():
                self.proj.bias[1:3] = 0.5

    lm = get_peft_model(LlamaForCausalLM(_llama_config()), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    return nn.ModuleList([lm, Head()])


def _worker(rank, world_size, threshold):
    import torch

    import zero_strategy

    torch.manual_seed(0)
    eager = {k: v.detach().clone() for k, v in _build().state_dict().items()}
    eager_next, eager_second = torch.rand(4), torch.rand(4)
    torch.manual_seed(0 if rank == 0 else 100 + rank)  # other ranks seeded differently: rank 0's model wins
    with zero_strategy.init_context():
        model = _build()
    deferred_next = torch.rand(4)
    deferred = sum(p.is_meta for p in model.parameters())
    cfg = {"stage": 3, "param_persistence_threshold": threshold}
    engine = zero_strategy.initialize(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3), cfg)
    after_setup = torch.rand(4)
    full = engine.full_state_dict(rank0_only=False)
    engine.close()
    return {
        "deferred": int(deferred),
        "differing": sorted(k for k in eager if not torch.equal(eager[k], full[k])),
        "missing": sorted(set(eager) - set(full)),
        "lora_B_zero": all(torch.count_nonzero(v) == 0 for k, v in full.items() if "lora_B" in k),
        "stream_same": bool(torch.equal(eager_next, deferred_next)) if rank == 0 else None,
        "setup_drew_nothing": bool(torch.equal(after_setup, eager_second)) if rank == 0 else None,
    }


@pytest.mark.slow
@pytest.mark.parametrize("world_size,threshold", [(2, 0), (3, 0), (2, None)])
def test_init_context_model_equals_the_eager_build(world_size, threshold):
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    results = run_distributed(_worker, world_size, 0 if threshold == 0 else 100_000)
    for r, res in enumerate(results):
        assert res["deferred"] > 0, res  # the context did defer the parameters
        assert res["missing"] == [], res
        assert res["differing"] == [], (r, res["differing"][:5])
        assert res["lora_B_zero"], r
    assert results[0]["stream_same"]  # the build advanced the random stream as the eager one did
    assert results[0]["setup_drew_nothing"]  # and initialize drew nothing from it, as ddp's set-up
