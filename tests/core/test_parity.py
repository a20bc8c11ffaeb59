"""Numerics gate: every stage x precision x world size x accumulation matches a
single-process reference (plain autograd + torch.optim) on the same global batch."""
import pytest
import torch

from dist_harness import run_distributed
from parity import build, reference_run, zero_run

STAGES = (0, 1, 2, 3)
PRECISIONS = ("fp32", "bf16", "fp16")
# fp32: reduction order is the only difference.  16-bit: the reference applies the same
# casts, but sums gradients in a different order in 16 bits, which Adam amplifies.
LOSS_TOL = {"fp32": 1e-5, "bf16": 3e-3, "fp16": 3e-3}
# Relative error of the total weight update after 3 steps (measured: fp32 ~1e-5;
# 16-bit SGD ~6e-3, 16-bit AdamW ~6e-2 since Adam normalises tiny, noisy gradients).
UPDATE_TOL = {("fp32", "adamw"): 1e-3, ("fp32", "sgd"): 1e-3, ("bf16", "sgd"): 3e-2, ("fp16", "sgd"): 3e-2,
              ("bf16", "adamw"): 2e-1, ("fp16", "adamw"): 2e-1}


def _worker(rank, ws, jobs):
    import transformers

    transformers.logging.set_verbosity_error()
    return [zero_run(rank, ws, job) for job in jobs]


def _jobs(ws):
    return [
        dict(stage=s, precision=p, world_size=ws, accum=a, steps=3, optim=o)
        for s in STAGES
        for p in PRECISIONS
        for a in (1, 2)
        for o in ("adamw", "sgd")
    ]


@pytest.fixture(scope="module", params=[2, 3], ids=["ws2", "ws3-uneven-padding"])
def zero_results(request):
    ws = request.param
    jobs = _jobs(ws)
    results = run_distributed(_worker, ws, jobs)[0]
    return list(zip(jobs, results))


def _relative_update_error(job, zero_sd, ref_params):
    init_model, _ = build(job)
    init = dict(init_model.named_parameters())
    num = sum(((zero_sd[n].float() - ref_params[n]) ** 2).sum() for n in ref_params) ** 0.5
    den = sum(((ref_params[n] - init[n].detach()) ** 2).sum() for n in ref_params) ** 0.5
    return float(num / den)


@pytest.mark.slow
def test_losses_and_weights_match_single_process_reference(zero_results):
    failures = []
    for job, (losses, sd) in zero_results:
        ref_losses, ref_params = reference_run(job)
        tag = f"stage={job['stage']} {job['precision']} ws={job['world_size']} accum={job['accum']} {job['optim']}"
        loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses))
        upd_err = _relative_update_error(job, sd, ref_params)
        if loss_err > LOSS_TOL[job["precision"]] or upd_err > UPDATE_TOL[job["precision"], job["optim"]]:
            failures.append(f"{tag}: loss err {loss_err:.2e}, relative update err {upd_err:.2e}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_frozen_parameter_unchanged_and_tied_weights_stay_tied(zero_results):
    for job, (_, sd) in zero_results:
        init_model, _ = build(job)
        # The frozen weight comes back exactly as it was loaded (not rounded to the
        # compute dtype), in its original dtype.
        wpe0 = init_model.transformer.wpe.weight.detach()
        assert sd["transformer.wpe.weight"].dtype == wpe0.dtype
        assert torch.equal(sd["transformer.wpe.weight"], wpe0), job
        assert sd["transformer.wte.weight"].dtype == torch.float32  # original dtype restored
        if "lm_head.weight" in sd:
            assert torch.equal(sd["lm_head.weight"], sd["transformer.wte.weight"]), job
        # The tied weight moved exactly once per step (not twice): compared with the
        # reference above; here check it did move.
        assert not torch.equal(sd["transformer.wte.weight"], init_model.transformer.wte.weight.detach())
