"""Engine behaviour on 2 real gloo processes, each checked against an independent
reference: fp16 overflow skips, global-norm clipping, LR schedulers, unused parameters,
per-rank state round trips, evaluation-only engines, and the overlap of reductions."""
import pytest
import torch
import torch.distributed as dist

from dist_harness import run_distributed
from models import lm_batches, tiny_gpt2, two_group_optimizer
from parity import build, reference_run, zero_run


def _quiet():
    import transformers

    transformers.logging.set_verbosity_error()


# ------------------------------------------------------------------------------------------
def _overflow_worker(rank, ws):
    import zero_strategy

    _quiet()
    out = {}
    for stage in (0, 1, 2, 3):
        model, opt = build(dict(optim="sgd"))
        engine = zero_strategy.initialize(model, opt, dict(stage=stage, precision="fp16", initial_scale_power=10, hysteresis=1,
                                                           param_persistence_threshold=64, reduce_bucket_size=3000))
        ids = lm_batches(1, 4)[0][2 * rank : 2 * rank + 2]
        before = engine.full_state_dict(rank0_only=False)
        loss = model(input_ids=ids, labels=ids).loss
        # Only rank 1 overflows: its scaled loss is far beyond fp16 range.
        engine.backward(loss * (1e30 if rank == 1 else 1.0))
        scale_before = engine.scaler.scale
        stepped = engine.step()
        after = engine.full_state_dict(rank0_only=False)
        unchanged = all(torch.equal(before[k], after[k]) for k in before)
        loss = model(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        stepped_again = engine.step()
        out[stage] = dict(stepped=stepped, unchanged=unchanged, scale_before=scale_before,
                          scale_after=engine.scaler.scale, stepped_again=stepped_again,
                          skipped_flag=engine.optimizer.step_was_skipped)
        engine.close()
    return out


@pytest.mark.slow
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank():
    results = run_distributed(_overflow_worker, 2)
    for stage in (0, 1, 2, 3):
        r0, r1 = results[0][stage], results[1][stage]
        for r in (r0, r1):
            assert r["stepped"] is False and r["unchanged"], (stage, r)
            assert r["scale_after"] == r["scale_before"] / 2  # hysteresis=1: back off at once
            assert r["stepped_again"] is True and r["skipped_flag"] is False
        assert r0["scale_after"] == r1["scale_after"]


# ------------------------------------------------------------------------------------------
def _clip_worker(rank, ws, jobs):
    _quiet()
    return [zero_run(rank, ws, j) for j in jobs]


def _reference_grad_norm(job):
    """Global grad norm of the first step's averaged gradient, computed by plain torch."""
    model, _ = build(job)
    ws, accum, micro = job["world_size"], job["accum"], job.get("micro_batch", 2)
    batch = lm_batches(1, ws * accum * micro)[0]
    chunks = batch.view(ws, accum, micro, -1)
    for j in range(accum):
        for r in range(ws):
            ids = chunks[r, j]
            (model(input_ids=ids, labels=ids).loss / (accum * ws)).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]  # tied weight once
    return float(torch.norm(torch.stack([g.norm() for g in grads])))


def _norm_worker(rank, ws, stages):
    import zero_strategy

    _quiet()
    norms = {}
    for stage in stages:
        job = dict(stage=stage, precision="fp32", world_size=ws, accum=1, optim="sgd")
        model, opt = build(job)
        engine = zero_strategy.initialize(model, opt, dict(stage=stage, reduce_bucket_size=3000, param_persistence_threshold=64))
        ids = lm_batches(1, 2 * ws)[0].view(ws, 1, 2, -1)[rank, 0]
        engine.backward(model(input_ids=ids, labels=ids).loss)
        norms[stage] = (float(engine.clip_grad_norm_(1e9)), float(engine.clip_grad_norm_(1e9, norm_type=float("inf"))))
        engine.close()
    return norms


@pytest.mark.slow
def test_clip_grad_norm_returns_global_norm_and_clipping_matches_reference():
    job0 = dict(stage=0, precision="fp32", world_size=2, accum=1, optim="sgd")
    ref_norm = _reference_grad_norm(job0)
    norms = run_distributed(_norm_worker, 2, (0, 1, 2, 3))
    for rank_norms in norms:
        for stage, (l2, _linf) in rank_norms.items():
            assert l2 == pytest.approx(ref_norm, rel=1e-5), (stage, l2, ref_norm)
    # Clipping below the norm changes the trajectory exactly as torch's clip_grad_norm_ does.
    jobs = [dict(stage=s, precision="fp32", world_size=2, accum=2, steps=3, optim="sgd", clip=0.05 * ref_norm) for s in (0, 1, 2, 3)]
    results = run_distributed(_clip_worker, 2, jobs)[0]
    for job, (losses, sd) in zip(jobs, results):
        ref_losses, ref_params = reference_run(job)
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, job
        for n in ref_params:
            torch.testing.assert_close(sd[n], ref_params[n], rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------
def _scheduler_worker(rank, ws):
    import zero_strategy

    _quiet()
    out = {}
    for stage in (1, 3):
        model = tiny_gpt2()
        opt = two_group_optimizer(model, lr=0.1, cls=torch.optim.SGD)
        before = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: [1.0, 0.5, 0.0, 0.0][min(s, 3)])
        engine = zero_strategy.initialize(model, opt, dict(stage=stage, param_persistence_threshold=64))
        after = torch.optim.lr_scheduler.MultiplicativeLR(engine.optimizer, lambda s: 1.0)
        lrs, moved = [], []
        ids = lm_batches(1, 4)[0][2 * rank : 2 * rank + 2]
        for step in range(3):
            w0 = engine.full_state_dict(rank0_only=False)["transformer.h.0.mlp.c_fc.weight"]
            engine.backward(model(input_ids=ids, labels=ids).loss)
            engine.step()
            w1 = engine.full_state_dict(rank0_only=False)["transformer.h.0.mlp.c_fc.weight"]
            moved.append(float((w1 - w0).abs().max()))
            lrs.append([g["lr"] for g in engine.optimizer.param_groups])
            before.step()
            after.step()
        out[stage] = dict(lrs=lrs, moved=moved, same_dicts=engine.optimizer.param_groups is opt.param_groups)
        engine.close()
    return out


@pytest.mark.slow
def test_lr_schedulers_built_before_and_after_initialize_drive_the_update():
    results = run_distributed(_scheduler_worker, 2)[0]
    for stage, r in results.items():
        assert r["same_dicts"]
        assert r["lrs"] == [[0.1, 0.05], [0.05, 0.025], [0.0, 0.0]], stage  # per-group lr kept
        assert r["moved"][0] > 0 and r["moved"][1] > 0 and r["moved"][2] == 0.0, (stage, r["moved"])


# ------------------------------------------------------------------------------------------
class _Branchy(torch.nn.Module):
    """rank 1 skips ``extra``: its parameters get no gradient there."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.extra = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 1)

    def forward(self, x, use_extra=True):
        h = torch.tanh(self.a(x))
        if use_extra:
            h = h + self.extra(h)
        return self.b(h).pow(2).mean()


def _branch_worker(rank, ws, stage):
    import zero_strategy

    torch.manual_seed(0)
    model = _Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = zero_strategy.initialize(model, opt, dict(stage=stage, reduce_bucket_size=70))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    engine.backward(model(x, use_extra=(rank == 0)))
    engine.step()
    return engine.full_state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_parameter_unused_on_one_rank_neither_hangs_nor_corrupts(stage):
    sd = run_distributed(_branch_worker, 2, stage, timeout=120)[0]
    torch.manual_seed(0)
    ref = _Branchy()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for rank in (0, 1):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        (ref(x, use_extra=(rank == 0)) / 2).backward()
    opt.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=1e-5, atol=1e-6)


# Per step, the ranks that skip ``extra``: none, rank 1 only, none, both.
SKIPPING = [(), (1,), (), (0, 1)]


def _rider_worker(rank, ws, stage):
    import zero_strategy

    torch.manual_seed(0)
    model = _Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = zero_strategy.initialize(model, opt, dict(stage=stage, reduce_bucket_size=70, param_persistence_threshold=0))
    controls = []
    for step, skipping in enumerate(SKIPPING):
        before = engine.comm.report()["control"].calls
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        engine.backward(model(x, use_extra=rank not in skipping))
        engine.step()
        engine.zero_grad()
        controls.append(engine.comm.report()["control"].calls - before)
    return controls, engine.full_state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_usage_agreement_rides_the_last_gradient_collective(stage):
    """[Note: usage rider]: on gloo a step in which every rank got every gradient runs no
    control collective; one in which a rank missed one runs exactly the agreement.  The
    result is plain torch's: ``extra`` used on rank 0 only is updated with rank 1's zero
    contribution, and in the last step, used nowhere, momentum must leave it alone."""
    results = run_distributed(_rider_worker, 2, stage, timeout=120)
    torch.manual_seed(0)
    ref = _Branchy()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step, skipping in enumerate(SKIPPING):
        for rank in (0, 1):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            (ref(x, use_extra=rank not in skipping) / 2).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert [controls for controls, _ in results] == [[0, 1, 0, 1]] * 2
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(results[0][1][k], v, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------
def _state_roundtrip_worker(rank, ws, stage, precision):
    import zero_strategy

    _quiet()
    job = dict(optim="adamw")
    batches = lm_batches(4, 2 * ws)

    def run_steps(engine, model, steps):
        losses = []
        for b in steps:
            ids = b.view(ws, 2, -1)[rank]
            loss = model(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        return losses

    cfg = dict(stage=stage, precision=precision, initial_scale_power=8, param_persistence_threshold=64, reduce_bucket_size=3000)
    model, opt = build(job)
    engine = zero_strategy.initialize(model, opt, cfg)
    run_steps(engine, model, batches[:2])
    state = engine.state_dict()
    full = engine.full_state_dict(rank0_only=False)
    uninterrupted = run_steps(engine, model, batches[2:])

    model2, opt2 = build(dict(job, seed=99))  # different init: everything must come from the state
    engine2 = zero_strategy.initialize(model2, opt2, cfg)
    engine2.load_state_dict(state)
    resumed = run_steps(engine2, model2, batches[2:])

    model3, opt3 = build(dict(job, seed=98))
    engine3 = zero_strategy.initialize(model3, opt3, cfg)
    engine3.load_full_state_dict(full)
    reloaded = engine3.full_state_dict(rank0_only=False)
    same_full = all(torch.equal(reloaded[k], full[k]) for k in full)
    return dict(uninterrupted=uninterrupted, resumed=resumed, same_full=same_full, step=engine2.global_step)


@pytest.mark.slow
@pytest.mark.parametrize("stage,precision", [(1, "bf16"), (2, "fp16"), (3, "fp32"), (3, "bf16")])
def test_rank_state_dict_resumes_exactly_and_full_state_dict_round_trips(stage, precision):
    for r in run_distributed(_state_roundtrip_worker, 2, stage, precision):
        assert r["resumed"] == r["uninterrupted"]
        assert r["same_full"]
        assert r["step"] == 4


# ------------------------------------------------------------------------------------------
def _eval_worker(rank, ws):
    import zero_strategy
    from transformers import PreTrainedModel

    _quiet()
    model = tiny_gpt2()
    ref = tiny_gpt2()
    ids = lm_batches(1, 2)[0]
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
    engine = zero_strategy.initialize(model, None, dict(stage=3, param_persistence_threshold=64))
    with torch.no_grad():
        got = model(input_ids=ids).logits
    generated = model.generate(ids[:1, :4], max_new_tokens=5, do_sample=False)
    ref_generated = ref.generate(ids[:1, :4], max_new_tokens=5, do_sample=False)
    return dict(same_class=type(model).__name__, is_pretrained=isinstance(model, PreTrainedModel),
                max_diff=float((got - expected).abs().max()), gen_equal=torch.equal(generated, ref_generated),
                params_sharded=engine.memory_report()["parameters"] < sum(p.numel() * 4 for p in ref.parameters()) * 0.75)


@pytest.mark.slow
def test_evaluation_only_stage3_engine_matches_the_unsharded_model():
    for r in run_distributed(_eval_worker, 2):
        assert r["same_class"] == "GPT2LMHeadModel" and r["is_pretrained"]
        assert r["max_diff"] < 1e-5
        assert r["gen_equal"]
        assert r["params_sharded"]


# ------------------------------------------------------------------------------------------
def _overlap_worker(rank, ws):
    import zero_strategy

    _quiet()
    model, opt = build(dict(optim="sgd"))
    engine = zero_strategy.initialize(model, opt, dict(stage=2, reduce_bucket_size=2000))
    launched_inside_backward = []
    original = engine.reducer._launch

    def spy(i, *rest):
        # The end-of-backward callback moves the phase on before it flushes what is
        # left; launches in phase BACKWARD happened while autograd was still
        # producing gradients.
        launched_inside_backward.append(engine.phase.value == "backward")
        return original(i, *rest)

    engine.reducer._launch = spy
    ids = lm_batches(1, 4)[0][2 * rank : 2 * rank + 2]
    engine.backward(model(input_ids=ids, labels=ids).loss)
    return launched_inside_backward, len(engine.trainable_units)


@pytest.mark.slow
def test_buckets_are_reduced_while_backward_is_still_running():
    flags, n_units = run_distributed(_overlap_worker, 2)[0]
    assert n_units > 3 and len(flags) == n_units
    assert sum(flags) >= n_units - 2, flags  # all but the last buckets overlap backward


# ------------------------------------------------------------------------------------------
def test_single_process_without_a_process_group_matches_plain_torch():
    import zero_strategy

    assert not dist.is_initialized()
    for stage in (0, 3):
        model, opt = build(dict(optim="sgd"))
        ref, ref_opt = build(dict(optim="sgd"))
        engine = zero_strategy.initialize(model, opt, dict(stage=stage, param_persistence_threshold=64))
        for ids in lm_batches(2, 2):
            engine.backward(model(input_ids=ids, labels=ids).loss)
            engine.step()
            ref(input_ids=ids, labels=ids).loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
        sd = engine.full_state_dict()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(sd[k], v, rtol=1e-5, atol=1e-6)
        engine.close()


def test_misconfigured_optimizer_is_rejected_with_a_clear_message():
    import zero_strategy

    model = tiny_gpt2()
    opt = torch.optim.SGD([model.transformer.wte.weight], lr=0.1)
    with pytest.raises(ValueError, match="requires grad but is in no optimizer param group"):
        zero_strategy.initialize(model, opt, dict(stage=2))
    model = tiny_gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ids = lm_batches(1, 2)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    with pytest.raises(ValueError, match="already holds state"):
        zero_strategy.initialize(model, opt, dict(stage=2))


# ------------------------------------------------------------------------------------------
def _lifecycle_worker(rank, ws):
    import zero_strategy

    _quiet()
    torch.manual_seed(rank)  # different on purpose: sync_module_states must fix it
    model = tiny_gpt2(seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = zero_strategy.initialize(model, opt, dict(stage=3, param_persistence_threshold=0), sync_module_states=True)
    assert zero_strategy.engine_of(model) is engine
    try:
        zero_strategy.initialize(model, opt, dict(stage=3))
        raised = False
    except ValueError as e:
        raised = "already managed" in str(e)
    ids = lm_batches(1, 4)[0][2 * rank : 2 * rank + 2]
    engine.backward(model(input_ids=ids, labels=ids).loss)
    engine.step()
    expected = engine.full_state_dict(rank0_only=False)
    engine.close(unshard=True)
    whole = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        out = model(input_ids=ids).logits  # an ordinary module again
    return dict(raised=raised, closed=zero_strategy.engine_of(model) is None,
                same=all(torch.equal(whole[k], expected[k]) for k in expected), finite=bool(torch.isfinite(out).all()),
                rank0_start=tiny_gpt2(seed=0).state_dict()["transformer.h.0.attn.c_attn.weight"][:2, :2].tolist())


@pytest.mark.slow
def test_sync_module_states_engine_registry_and_unshard_on_close():
    r0, r1 = run_distributed(_lifecycle_worker, 2)
    for r in (r0, r1):
        assert r["raised"] and r["closed"] and r["same"] and r["finite"]


def test_stage3_prefetch_holds_at_most_the_budget_or_the_next_block_ahead():
    """Peak memory of gathered parameters: with the default budget (smaller than two of
    these blocks) at most the running block and the next one are gathered at any time;
    a budget of 0 gathers one at a time; a huge budget gathers everything ahead."""
    import zero_strategy
    from zero_strategy.sharding.gather import ModuleGroup

    def max_gathered(prefetch):
        model = tiny_gpt2(n_layer=4, n_embd=64)
        engine = zero_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                          dict(stage=3, param_persistence_threshold=0, prefetch_bucket_size=prefetch,
                                               min_gather_numel=0))  # one gather per block
        blocks = [g for g in engine.gatherer.groups if g.module is not model]
        seen = []
        original = ModuleGroup.start_gather

        def spy(group, comm, *rest):
            original(group, comm, *rest)
            seen.append(sum(g.gathered for g in blocks))

        ModuleGroup.start_gather = spy
        try:
            ids = torch.randint(0, 96, (2, 8))
            for _ in range(2):  # the first step records the order; the second prefetches
                engine.backward(model(input_ids=ids, labels=ids).loss)
                engine.step()
        finally:
            ModuleGroup.start_gather = original
        block = max(g.numel for g in blocks)
        engine.close()
        return max(seen), block, len(blocks)

    most, block, n = max_gathered(5_000_000 // 100)  # ~1 block of this tiny model
    assert block < 5_000_000 // 100 < 2 * block
    assert most <= 2, most
    assert max_gathered(0)[0] == 1
    assert max_gathered(10**9)[0] == n  # everything ahead
