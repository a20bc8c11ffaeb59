"""The full architecture matrix (opt-in): every zoo model x every stage x fp32/bf16 x 2/3
ranks x the ways users change a model, each job against a single-process reference.

Run it with ``ZERO_FULL_MATRIX=1`` (it takes hours on 2 cores, so CI skips it and runs
the subsets in tests/core/test_architectures.py and tests/core/test_architecture_variants.py)::

    ZERO_FULL_MATRIX=1 .venv/bin/python -m pytest -q -s tests/core/test_architecture_matrix.py
    ZERO_FULL_MATRIX=1 .venv/bin/python -m pytest -q -s tests/core/test_architecture_matrix.py -k "llama and ws3"

The axes:

* models: all of tests/support/zoo.py (the eleven architectures plus fused_head and parent_child);
* stage configurations: test_architectures.CONFIGS - stages 0, 1, 2, 3 at the default
  ``param_persistence_threshold``, and stage 3 at threshold 0 (every parameter
  partitioned) with the default ``min_gather_numel`` (the tiny model is one gather) and
  with ``min_gather_numel=0`` (one gather per block);
* precision: fp32 and bf16 (``precision="bf16"``: a bf16 copy of fp32 masters);
* world size: 2 and 3 gloo processes;
* variant: plain; a frozen input embedding (``requires_grad_(False)``, not in the
  optimizer; ViT's patch projection, many_linear's input layer); ``torch.compile`` of the
  model at stages 2 and 3; transformers' gradient checkpointing at stage 3 (the models
  built by transformers, fused_head's inner Llama included).

One process group per (model, world size) runs all that model's jobs; a job that raises
is recorded and the next job runs, so one test reports every failing job of its model.
The reference is plain torch on one process over the same global batches, split as the
ranks split them, with the same variant (a compiled reference for compile jobs).
Tolerances are the subset tests': fp32 losses to 1e-5 relative, parameters to rtol
1e-5 / atol 2e-6 (test_architectures); bf16 is compared with a plain-torch bf16 copy of
fp32 masters to 2e-2 on losses and 1e-2 on parameters (test_architecture_variants):
bf16 keeps 8 mantissa bits (relative rounding 2^-9 = 2e-3 per operation), rounding
follows the reduction order, which differs between a rank-split and a one-process
backward, and Adam (lr 1e-2) turns such a difference in a gradient's sign into an
update of up to lr per step; a missing gradient or a skipped update is still far
beyond that.  Where bf16 alone moves a parameter further, the parameter tolerance is
1.5x that measured noise: the largest difference between the reference and plain-torch
bf16 runs of the same global batches split into other numbers of micro-batches
(torch_transformer: 1.35e-2 between 3 and 2 micro-batches, one element of 2048 beyond
1e-2).  The same holds for compiled fp32 jobs, whose noise also counts eager
plain-torch runs: inductor sums in another order, and in plain torch alone compiled and
eager many_linear (500 Linear layers, AdamW) end 2.4e-6 apart on the first layer's
weight, beyond the fixed 2e-6.  A frozen weight must come back bit-equal to what was
loaded, in bf16 too.  Each job's largest loss and parameter differences (and that noise,
where it was measured) are printed (``-s``).

test_every_model_meets_every_variant_in_ci (one job per model combining 3 ranks, bf16,
a frozen embedding and gradient checkpointing) is meant for CI but runs only with
ZERO_COVERING=1 until it is timed under 60 s on an idle machine.
"""
from __future__ import annotations

import os
import traceback

import pytest
import torch

import zoo
from dist_harness import run_distributed
from test_architectures import CONFIGS, GLOBAL_BATCH, SOME_MERGED, STEPS, _optimizer

pytestmark = pytest.mark.slow
full_matrix_only = pytest.mark.skipif(os.environ.get("ZERO_FULL_MATRIX") != "1",
                                      reason="the full architecture matrix takes hours: set ZERO_FULL_MATRIX=1 to run it")

# Built by transformers, so they have gradient checkpointing (fused_head wraps a Llama).
HF = ("gpt2", "llama", "mistral", "qwen2", "mixtral", "t5", "bert", "vit", "fused_head")
PRECISIONS = ("fp32", "bf16")
WORLD_SIZES = (2, 3)
VARIANTS = ("plain", "frozen_embedding", "compile", "grad_ckpt")
FP32_TOL = dict(loss=1e-5, rtol=1e-5, atol=2e-6)
BF16_TOL = dict(loss=2e-2, rtol=1e-2, atol=1e-2)


def variant_applies(name: str, variant: str, stage: int) -> bool:
    if variant == "compile":
        return stage >= 2
    if variant == "grad_ckpt":
        return stage == 3 and name in HF
    return True


def jobs_of(name: str, variants=VARIANTS):
    """(stage, threshold, min_gather_numel, precision, variant) of every job of one model."""
    return [(stage, thr, mg, prec, variant) for variant in variants for prec in PRECISIONS
            for stage, thr, mg in CONFIGS if variant_applies(name, variant, stage)]


def frozen_weight(name: str, model):
    if name == "vit":
        return model.vit.embeddings.patch_embeddings.projection.weight
    if name == "many_linear":
        return model.inp.weight
    if name == "fused_head":
        return model.lm.get_input_embeddings().weight
    if hasattr(model, "get_input_embeddings"):
        return model.get_input_embeddings().weight
    return model.embed.weight


def apply_variant(name: str, model, variant: str):
    """``variant``: one of VARIANTS, or several joined by "+"."""
    parts = variant.split("+")
    if "frozen_embedding" in parts:
        frozen_weight(name, model).requires_grad_(False)
    if "grad_ckpt" in parts:
        zoo.enable_hf_gradient_checkpointing(model.lm if name == "fused_head" else model)
        model.train()
    return model


def reference(name: str, precision: str, variant: str, ws: int):
    """Plain torch on one process: fp32, or a bf16 copy of fp32 masters that runs forward
    and backward, its gradients averaged in fp32, AdamW stepping the masters."""
    master = apply_variant(name, zoo.build_model(name), variant)
    compute = master if precision == "fp32" else apply_variant(name, zoo.build_model(name), variant).to(torch.bfloat16)
    run = torch.compile(compute) if "compile" in variant.split("+") else compute
    opt = _optimizer(master)
    losses = []
    for batch in zoo.make_batches(name, STEPS, GLOBAL_BATCH):
        opt.zero_grad(set_to_none=True)
        if compute is not master:
            with torch.no_grad():
                for c, m in zip(compute.parameters(), master.parameters()):
                    c.copy_(m)
            compute.zero_grad(set_to_none=True)
        total = 0.0
        for r in range(ws):
            part = zoo.shard(batch, r, ws)
            if compute is not master:  # the engine casts floating inputs to the compute dtype
                part = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in part.items()}
            loss = zoo.loss_of(name, run, part)
            (loss / ws if compute is master else loss).backward()
            total += float(loss) / ws
        if compute is not master:
            for c, m in zip(compute.parameters(), master.parameters()):
                m.grad = None if c.grad is None else c.grad.float() / ws
        opt.step()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in master.named_parameters()}


def _one_job(rank, ws, name, job):
    import zero_strategy

    stage, threshold, min_gather, precision, variant = job
    model = apply_variant(name, zoo.build_model(name), variant)
    cfg = dict(stage=stage, reduce_bucket_size=20_000, collective_timeout=120.0)
    if threshold is not None:
        cfg["param_persistence_threshold"] = threshold
    if min_gather is not None:
        cfg["min_gather_numel"] = min_gather
    if precision == "bf16":
        cfg["precision"] = "bf16"
    engine = zero_strategy.initialize(model, _optimizer(model), cfg)
    run = torch.compile(model) if "compile" in variant.split("+") else model
    losses = zoo.train_on_engine(name, run, engine, rank, ws, STEPS, GLOBAL_BATCH)
    sd = engine.full_state_dict()
    engine.close()
    return losses, sd


def _worker(rank, ws, name, jobs):
    import time

    import transformers

    _compile_limits()
    transformers.logging.set_verbosity_error()
    out = {}
    for job in jobs:
        start = time.monotonic()
        try:
            result = _one_job(rank, ws, name, job)
        except Exception:  # noqa: BLE001 - recorded; the test reports every failing job
            result = traceback.format_exc()
        # Every rank finishes the job before the next starts (a rank that failed early
        # does not run ahead into the next job's collectives).
        torch.distributed.barrier()
        out[job] = result if rank == 0 else None
        if rank == 0:  # progress, for a run of hours
            print(f"MATRIX-JOB {name} ws{ws} {job} {'raised' if isinstance(result, str) else 'ran'} "
                  f"{time.monotonic() - start:.1f}s", flush=True)
    return out


def reference_noise(name, precision, variant, ws, ref):
    """The largest parameter difference between ``ref`` and other plain-torch runs of the
    same training that are just as right: the same global batches split into other
    numbers of micro-batches, and for a compiled fp32 job also run eagerly.  That is
    what rounding alone moves a parameter here.  bf16: eager runs only (there
    compilation does not change it).  fp32 with torch.compile: inductor's fused
    kernels sum in another order, which on a deep stack (500 Linear layers) moves the
    first layer's weights by a few 1e-6 in plain torch already."""
    eager = "+".join(v for v in variant.split("+") if v != "compile") or "plain"
    others = [(eager, split) for split in (1, 2, 3, 6) if split != ws]
    if precision == "fp32":
        others = [(eager, split) for split in (1, 2, 3, 6)] + [(variant, split) for split in (1, 2, 3, 6) if split != ws]
    noise = 0.0
    for other_variant, split in others:
        other = reference(name, precision, other_variant, split)[1]
        noise = max(noise, max(float((other[n] - want).abs().max()) for n, want in ref[1].items()))
    return noise


def check_job(name, ws, job, got, ref, start_frozen, noise=0.0):
    """None if ``got`` matches ``ref``, else why not; also the largest differences.
    ``noise``: see reference_noise; a parameter may be off by 1.5x that."""
    if isinstance(got, str):
        return f"raised:\n{got}", None
    _, _, _, precision, variant = job
    base = FP32_TOL if precision == "fp32" else BF16_TOL
    tol = dict(base, atol=max(base["atol"], 1.5 * noise))
    losses, sd = got
    ref_losses, ref_params = ref
    loss_diff = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(losses, ref_losses))
    param_diff, problems = 0.0, []
    if loss_diff > tol["loss"]:
        problems.append(f"losses {losses} vs {ref_losses}")
    for n, want in ref_params.items():
        if n not in sd:
            problems.append(f"{n} missing from full_state_dict")
            continue
        have = sd[n].float()
        param_diff = max(param_diff, float((have - want).abs().max()))
        bad = (have - want).abs() > tol["atol"] + tol["rtol"] * want.abs()
        if bad.any():
            problems.append(f"{n}: {int(bad.sum())}/{bad.numel()} elements off, largest "
                            f"{float((have - want).abs().max()):.3g} (atol {tol['atol']:.3g})")
    if "frozen_embedding" in variant.split("+"):
        n = next(k for k, v in ref_params.items() if v.shape == start_frozen.shape and torch.equal(v, start_frozen))
        if not torch.equal(sd[n], start_frozen):
            problems.append(f"frozen {n} ({sd[n].dtype}) is not bit-equal to what was loaded: "
                            f"{float((sd[n].float() - start_frozen).abs().max()):.3g} off")
    return ("; ".join(problems) or None), (loss_diff, param_diff)


def _compile_limits():
    # Every compile job of a model runs in one process: without a higher limit dynamo
    # would, after 8 recompilations of a frame, silently run it eagerly.
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 4096


def check_against_noise(name, ws, job, got, ref, start_frozen):
    """check_job; a bf16 or compiled fp32 job that fails at the fixed tolerance is
    checked again against the measured rounding noise (returned, else None)."""
    why, diffs = check_job(name, ws, job, got, ref, start_frozen)
    precision, variant = job[3], job[4]
    if why is None or diffs is None or not (precision == "bf16" or "compile" in variant.split("+")):
        return why, diffs, None
    noise = reference_noise(name, precision, variant, ws, ref)
    return (*check_job(name, ws, job, got, ref, start_frozen, noise), noise)


@full_matrix_only
@pytest.mark.parametrize("ws", WORLD_SIZES, ids=lambda w: f"ws{w}")
@pytest.mark.parametrize("name", zoo.NAMES)
def test_full_matrix(name, ws):
    _run_jobs(name, ws, jobs_of(name, [v for v in VARIANTS if v != "compile"]))


# Last: each compilation costs tens of seconds on 2 cores (most of the matrix's time).
@full_matrix_only
@pytest.mark.parametrize("ws", WORLD_SIZES, ids=lambda w: f"ws{w}")
@pytest.mark.parametrize("name", zoo.NAMES)
def test_full_matrix_compiled(name, ws):
    _compile_limits()
    _run_jobs(name, ws, jobs_of(name, ["compile"]))


def _run_jobs(name, ws, jobs):
    results = run_distributed(_worker, ws, name, jobs, timeout=3 * 3600)[0]
    start_frozen = frozen_weight(name, zoo.build_model(name)).detach().clone()
    refs, failures = {}, []
    for job in jobs:
        _, _, _, precision, variant = job
        if (precision, variant) not in refs:
            refs[precision, variant] = reference(name, precision, variant, ws)
        why, diffs, noise = check_against_noise(name, ws, job, results[job], refs[precision, variant], start_frozen)
        figures = "" if diffs is None else f"loss {diffs[0]:.2e} param {diffs[1]:.2e}"
        if noise is not None:
            figures += f" noise {noise:.2e}"
        print(f"MATRIX {name} ws{ws} {job} {'FAIL' if why else 'ok'} {figures}", flush=True)
        if why:
            failures.append(f"{name} ws{ws} {job}: {why}")
    assert not failures, f"{len(failures)}/{len(jobs)} jobs failed:\n" + "\n".join(failures)


def _covering_worker(rank, ws, cases):
    return {(name, job): _worker(rank, ws, name, [job])[job] for name, job in cases}


# Not yet in CI: it took 122 s wall on 2 busy cores (the budget for widening CI is 60 s);
# ZERO_COVERING=1 runs it (the full matrix includes its parts, though not combined).
@pytest.mark.skipif(os.environ.get("ZERO_COVERING") != "1" and os.environ.get("ZERO_FULL_MATRIX") != "1",
                    reason="the covering job set is not timed on an idle machine yet: set ZERO_COVERING=1")
def test_every_model_meets_every_variant_in_ci():
    """CI's share of the matrix (the full one is opt-in): one job per model that puts
    the variants the subset tests give only some models together - 3 ranks, bf16, a
    frozen embedding, gradient checkpointing (the transformers models) - at full
    sharding with small blocks partly merged, against the same bf16 reference.  torch.compile
    stays with test_architecture_variants (gpt2, parent_child): each compilation costs
    tens of seconds here."""
    cases = [(name, (3, 0, SOME_MERGED, "bf16", "frozen_embedding+grad_ckpt" if name in HF else "frozen_embedding"))
             for name in zoo.NAMES]
    results = run_distributed(_covering_worker, 3, cases, timeout=900)[0]
    failures = []
    for name, job in cases:
        start_frozen = frozen_weight(name, zoo.build_model(name)).detach().clone()
        why, _, _ = check_against_noise(name, 3, job, results[name, job], reference(name, "bf16", job[4], 3), start_frozen)
        if why:
            failures.append(f"{name} {job}: {why}")
    assert not failures, "\n".join(failures)
