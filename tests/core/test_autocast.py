"""``ZeroConfig(autocast=True)``: stock autocast training's numbers at every stage.

The reference is plain torch on one process over the global batch: fp32 parameters,
the forward under ``torch.autocast`` (tests/support/parity.py), none of the engine's code.
Each rank's micro-batch is computed exactly as the reference computes it, and the
gradients are summed in fp32 on both sides, so the losses and weights agree to fp32
rounding (the engine's own 16-bit mode is only within bf16 rounding of this: it
computes from rounded weights).
"""
import pytest
import torch

from dist_harness import run_distributed
from parity import build, reference_run, zero_run

JOBS = [
    dict(stage=s, precision=p, world_size=2, accum=a, steps=3, optim=o, persist=t, with_report=True,
         config={"autocast": True})
    for s, p, a, o, t in (
        (0, "bf16", 1, "adamw", 64),
        (1, "bf16", 2, "sgd", 64),
        (2, "bf16", 1, "adamw", 64),
        (2, "fp16", 2, "sgd", 64),
        (3, "bf16", 1, "adamw", 0),  # every parameter partitioned
        (3, "bf16", 2, "sgd", 64),
        (3, "fp16", 1, "adamw", 0),
    )
]


def _worker(rank, ws, jobs):
    import transformers

    transformers.logging.set_verbosity_error()
    out = []
    for job in jobs:
        losses, sd, report = zero_run(rank, ws, job)
        out.append((losses, sd, report))
    return out


@pytest.fixture(scope="module")
def results():
    return list(zip(JOBS, run_distributed(_worker, 2, JOBS)[0]))


@pytest.mark.slow
def test_autocast_matches_stock_autocast_training(results):
    failures = []
    for job, (losses, sd, _) in results:
        ref_losses, ref_params = reference_run(job)
        tag = f"stage={job['stage']} {job['precision']} accum={job['accum']} {job['optim']} threshold={job['persist']}"
        loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses))
        weight_err = max(float((sd[n].float() - ref_params[n]).abs().max()) for n in ref_params)
        if loss_err > 1e-5 or weight_err > 1e-5:
            failures.append(f"{tag}: loss err {loss_err:.2e}, max weight err {weight_err:.2e}")
        init_model, _ = build(job)
        moved = max(float((ref_params[n] - p.detach()).abs().max()) for n, p in init_model.named_parameters())
        assert moved > 1e-3, f"{tag}: the reference did not train ({moved:.1e}), nothing was compared"
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_autocast_keeps_parameters_fp32_without_a_second_master_copy(results):
    for job, (_, sd, report) in results:
        assert all(v.dtype == torch.float32 for v in sd.values()), job
        # The fp32 shard is the master: no separate master bytes, unlike 16-bit mode.
        assert report["master_weights"] == 0, (job, report)


def test_autocast_config_dtypes():
    from zero_strategy import ZeroConfig
    from zero_strategy.policy import Policies

    def precision(**kw):
        return Policies.from_config(ZeroConfig(**kw)).precision

    plain = precision(autocast=True)  # fp32: nothing to autocast (a framework's flag may set precision later)
    assert plain.autocast_dtype is None and plain.compute_dtype == torch.float32
    cfg = precision(precision="bf16", autocast=True)
    assert cfg.compute_dtype == torch.float32 and cfg.autocast_dtype == torch.bfloat16
    assert cfg.reduce_dtype == torch.float32 and not cfg.mixed and not cfg.loss_scaling
    assert precision(precision="fp16", autocast=True).loss_scaling


def test_autocast_context_is_left_when_forward_raises(tmp_path):
    import torch.distributed as dist

    import zero_strategy

    class Boom(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            assert torch.is_autocast_enabled("cpu")
            y = self.lin(x)
            assert y.dtype == torch.bfloat16  # a matmul under autocast
            if x.shape[0] == 3:
                raise RuntimeError("boom")
            return y

    started = not dist.is_initialized()
    if started:
        # A file store: no port, and nothing left in this process's environment for the
        # processes later tests start (a MASTER_PORT set here once made every later
        # Lightning launch of this pytest worker listen on it).
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = Boom()
        engine = zero_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                          dict(stage=2, precision="bf16", autocast=True))
        assert model.lin.weight.dtype == torch.float32
        model(torch.randn(2, 4))
        assert not torch.is_autocast_enabled("cpu")
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.randn(3, 4))
        assert not torch.is_autocast_enabled("cpu")  # left, although forward raised
        engine.close()
        assert not model._forward_pre_hooks and not model._forward_hooks
    finally:
        if started:
            dist.destroy_process_group()
