"""The ways users change the zoo models, at full sharding, against single-process torch.

Beside tests/core/test_architectures.py (plain fp32 at every stage): a frozen embedding
(``requires_grad_(False)``, not in the optimizer), transformers' gradient checkpointing
(``activation_checkpointing_enable()``, formerly ``gradient_checkpointing_enable()``), ``torch.compile`` of the model at stages 2 and 3,
and bf16.  Each on 2 gloo processes at stage 3 with every parameter partitioned
(threshold 0; compile also at stage 2), 3 steps, against plain torch on one process
over the same global batches (the same variant applied there), fp32 to 1e-5.

bf16 is compared with a plain-torch implementation of the same mixed precision (a bf16
copy of fp32 master weights runs forward and backward, its gradients are averaged in
fp32 and AdamW updates the masters): bf16 rounding differs with the reduction order, so
the tolerance is bf16's (2e-2 on losses, 1e-2 on parameters), which a missing gradient
or a skipped update still exceeds.
"""
from __future__ import annotations

import pytest
import torch

import zoo
from dist_harness import run_distributed
from test_architectures import GLOBAL_BATCH, STEPS, _optimizer
from test_architectures import reference as single_process_reference

HF = ("gpt2", "llama", "t5", "bert")


def _embedding(model):
    return model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model.embed


def _apply(name, model, variant):
    if variant == "frozen_embedding":
        _embedding(model).weight.requires_grad_(False)
    elif variant == "grad_ckpt":
        zoo.enable_hf_gradient_checkpointing(model)
    return model


def reference(name, variant, ws=2):
    # Eager, also for the compiled variants: compiled ZeRO must equal plain torch (to the
    # tolerance of fp32 reordering), and one compile fewer saves half a minute.
    model = _apply(name, zoo.build_model(name), variant)
    return single_process_reference(name, ws, model=model, run=model)


def reference_bf16(name, ws=2):
    master = zoo.build_model(name)
    compute = zoo.build_model(name).to(torch.bfloat16)
    opt = _optimizer(master)
    losses = []
    for batch in zoo.make_batches(name, STEPS, GLOBAL_BATCH):
        with torch.no_grad():
            for c, m in zip(compute.parameters(), master.parameters()):
                c.copy_(m)
        compute.zero_grad(set_to_none=True)
        total = 0.0
        for r in range(ws):
            loss = zoo.loss_of(name, compute, zoo.shard(batch, r, ws))
            loss.backward()
            total += float(loss) / ws
        for c, m in zip(compute.parameters(), master.parameters()):
            m.grad = None if c.grad is None else c.grad.float() / ws
        opt.step()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in master.named_parameters()}


def _worker(rank, ws, cases):
    import transformers

    import zero_strategy

    transformers.logging.set_verbosity_error()
    out = {}
    for name, variant, stage in cases:
        model = _apply(name, zoo.build_model(name), variant)
        cfg = dict(stage=stage, param_persistence_threshold=0, reduce_bucket_size=20_000)
        if variant == "bf16":
            cfg["precision"] = "bf16"
        engine = zero_strategy.initialize(model, _optimizer(model), cfg)
        run = torch.compile(model) if variant.startswith("compile") else model
        losses = zoo.train_on_engine(name, run, engine, rank, ws, STEPS, GLOBAL_BATCH)
        out[(name, variant, stage)] = (losses, engine.full_state_dict())
        engine.close()
    return out


def _compare(key, got, ref, loss_tol, param_tol):
    losses, sd = got
    ref_losses, ref_params = ref
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= loss_tol * max(1.0, abs(b)), f"{key}: loss {i}: {a} vs {b}"
    for n, want in ref_params.items():
        torch.testing.assert_close(sd[n].float(), want, rtol=param_tol, atol=param_tol, msg=lambda m: f"{key} {n}: {m}")


CASES = (
    [(n, "frozen_embedding", 3) for n in ("gpt2", "llama", "t5", "moe")]
    + [(n, "grad_ckpt", 3) for n in HF]
    + [(n, "bf16", 3) for n in ("gpt2", "llama", "moe", "torch_transformer")]
)
# parent_child: a parent module uses its child's weight (gathered on demand) inside the compiled model.
# (Each compile costs about a minute on 2 cores: one model per stage.)
COMPILE_CASES = [("gpt2", "compile", 2), ("parent_child", "compile", 3)]


@pytest.mark.slow
def test_frozen_embedding_gradient_checkpointing_and_bf16_at_full_sharding():
    results = run_distributed(_worker, 2, CASES, timeout=1200)[0]
    for name, variant, stage in CASES:
        key = (name, variant, stage)
        if variant == "bf16":
            _compare(key, results[key], reference_bf16(name), 2e-2, 1e-2)
        else:
            _compare(key, results[key], reference(name, variant), 1e-5, 2e-5)
        if variant == "frozen_embedding":
            start = _embedding(zoo.build_model(name)).weight.detach()
            emb = next(n for n in results[key][1] if n.endswith("embed_tokens.weight") or n.endswith("wte.weight")
                       or n == "shared.weight" or n == "embed.weight")
            assert torch.equal(results[key][1][emb], start), key  # frozen: bit-equal to what was loaded


@pytest.mark.slow
def test_torch_compile_at_stages_2_and_3():
    results = run_distributed(_worker, 2, COMPILE_CASES, timeout=1200)[0]
    for name, variant, stage in COMPILE_CASES:
        _compare((name, variant, stage), results[(name, variant, stage)], reference(name, variant), 1e-5, 2e-5)
