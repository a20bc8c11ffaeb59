"""Optimizers that are not element-wise, and several optimizers per engine, against a
single-process run of the same optimizers on the same global batch.

transformers' Adafactor (factored on 2-D weights), torch's Muon on GPT-2's hidden
matrices with AdamW on the rest (two optimizers), and a LAMB-like optimizer the engine
does not know (its step scales by the whole parameter's norm).  On flat pieces each of
them computes something else (Adafactor falls back to its unfactored update, Muon
refuses 1-D tensors, the trust ratio uses a piece's norm), so every stage from 1 up
would differ from the reference by far more than the tolerances here.
"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_harness import run_distributed
from models import lm_batches, tiny_gpt2
from parity import build, reference_run, zero_run

OPTIMIZERS = ("adafactor", "muon+adamw", "trust_ratio")
# (stage, param_persistence_threshold, unit_modules): stage 3 with every parameter
# partitioned, once with attention and MLP as units, each gathered alone (their shards cut matrices: GPT-2's
# blocks are sized so that 2 or 3 ranks' boundaries fall between whole matrices) and
# once with the automatic units.
STAGES = ((0, 64, None), (1, 64, None), (2, 64, None), (3, 0, ("GPT2Attention", "GPT2MLP")), (3, 0, None))
# bf16: the reference applies the same casts but sums gradients in another order in
# 16 bits; relative error of the total weight update after 3 steps (see test_parity.py:
# AdamW, which normalises tiny noisy gradients, is allowed its 2e-1 there).
BF16_UPDATE_TOL = {"adafactor": 5e-2, "trust_ratio": 5e-2, "muon+adamw": 2e-1}


def _jobs(ws, nvme_path):
    jobs = []
    for optim in OPTIMIZERS:
        for stage, persist, units in STAGES:
            for precision in ("fp32", "bf16"):
                if precision == "bf16" and (stage in (0, 1) or units is None):
                    continue  # the 16-bit path of the step is the same at every stage; 2 and 3 cover it
                jobs.append(dict(stage=stage, persist=persist, precision=precision, world_size=ws, accum=2, steps=3,
                                 optim=optim, bucket=3000, with_comm=True, expect_cut=stage > 0 and (stage < 3 or units),
                                 config={"unit_modules": units, "min_gather_numel": 0} if units else {}))
        # The host step: optimizer state offloaded to CPU memory, and to files.
        cut = {"unit_modules": ("GPT2Attention", "GPT2MLP"), "min_gather_numel": 0}
        for stage, offload in ((3, {"offload_optimizer": "cpu"}), (2, {"offload_optimizer": "nvme", "nvme_path": nvme_path})):
            jobs.append(dict(stage=stage, persist=0, precision="fp32", world_size=ws, accum=2, steps=3, optim=optim,
                             bucket=3000, with_comm=True, expect_cut=True, config={**cut, **offload}))
    return jobs


def _worker(rank, ws, jobs):
    import transformers

    transformers.logging.set_verbosity_error()
    return [zero_run(rank, ws, job) for job in jobs]


@pytest.fixture(scope="module", params=[2, 3], ids=["ws2", "ws3"])
def results(request, tmp_path_factory):
    jobs = _jobs(request.param, str(tmp_path_factory.mktemp("nvme")))
    return list(zip(jobs, run_distributed(_worker, request.param, jobs)[0]))


def _tag(job):
    return f"{job['optim']} stage={job['stage']} {job['precision']} ws={job['world_size']} {job['config'] or ''}"


def _relative_update_error(job, sd, ref):
    init = dict(build(job)[0].named_parameters())
    num = sum(((sd[n].float() - ref[n]) ** 2).sum() for n in ref) ** 0.5
    den = sum(((ref[n] - init[n].detach()) ** 2).sum() for n in ref) ** 0.5
    return float(num / den)


@pytest.mark.slow
def test_whole_parameter_optimizers_match_single_process(results):
    failures = []
    for job, (losses, sd, _, _) in results:
        ref_losses, ref = reference_run(job)
        if job["precision"] == "fp32":
            err = max(float((sd[n].float() - ref[n]).abs().max()) for n in ref)
            loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses))
            if err > 1e-5 or loss_err > 1e-5:
                failures.append(f"{_tag(job)}: max weight error {err:.2e}, loss error {loss_err:.2e}")
        else:
            upd = _relative_update_error(job, sd, ref)
            if upd > BF16_UPDATE_TOL[job["optim"]]:
                failures.append(f"{_tag(job)}: relative update error {upd:.2e}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_cut_parameters_travel_to_their_owners_and_are_counted(results):
    """Stages 1-3 cut some parameters at shard boundaries: those go whole to one rank
    (counted as whole_param_exchange, within the 3*Psi_c/N bound per rank); stage 0
    (one shard holds everything) exchanges nothing."""
    for job, (_, sd, comm, memory) in results:
        moved = comm.get("whole_param_exchange", {}).get("elements", 0)
        if job["stage"] == 0:
            assert moved == 0, _tag(job)
        elif job["expect_cut"]:
            assert moved > 0, f"{_tag(job)}: no parameter was cut, so the test did not exercise the exchange"
            trainable = sum(v.numel() for n, v in sd.items() if n != "transformer.wpe.weight" and n != "lm_head.weight")
            assert moved <= 3 * trainable, _tag(job)
            assert memory["whole_param_step"] >= 0


# -- owners: pure arithmetic, at many ranks -------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(numels=st.lists(st.integers(0, 5000), min_size=1, max_size=12), world=st.integers(1, 1024))
def test_each_parameter_is_owned_by_a_rank_that_holds_part_of_it(numels, world):
    from zero_strategy.sharding.layout import FlatLayout
    from zero_strategy.sharding.whole_params import assign_owners, pieces_of

    layout = FlatLayout(tuple(numels), world)
    (owners,) = assign_owners([layout])
    for i, owner in enumerate(owners):
        holders = [p[0] for p in pieces_of(layout, i)]
        assert 0 <= owner < world
        if holders:
            assert owner in holders
        if len(holders) == 1:
            assert owner == holders[0]
    # Pieces tile each tensor exactly.
    for i, n in enumerate(numels):
        assert sum(p[3] for p in pieces_of(layout, i)) == n


def test_cut_parameters_are_dealt_out_by_size():
    """Four equal matrices each cut in two over 2 ranks' worth of boundaries: no rank
    owns all of them."""
    from zero_strategy.sharding.layout import FlatLayout
    from zero_strategy.sharding.whole_params import assign_owners

    layouts = [FlatLayout((10, 100, 10), 2) for _ in range(4)]  # the 100 is cut in every unit
    owners = assign_owners(layouts)
    cut_owners = [row[1] for row in owners]
    assert sorted(set(cut_owners)) == [0, 1]


# -- the rule and the errors (one process) -----------------------------------------------------
def test_the_rule_decides_which_optimizers_get_pieces():
    from transformers.optimization import Adafactor

    from models import TrustRatioSGD
    from zero_strategy.optim.optimizer_kinds import is_elementwise, steps_per_parameter

    p = [torch.nn.Parameter(torch.zeros(2, 2))]
    assert is_elementwise(torch.optim.AdamW(p))
    assert not is_elementwise(Adafactor(p, lr=1e-3, relative_step=False))
    assert not is_elementwise(torch.optim.Muon(p))
    assert not is_elementwise(TrustRatioSGD(p))  # unknown: whole parameters, correct first
    assert is_elementwise(TrustRatioSGD(p), ["TrustRatioSGD"])  # declared by the user

    class MyAdam(torch.optim.Adam):  # a subclass may change the update: not trusted
        pass

    assert not is_elementwise(MyAdam(p))
    assert steps_per_parameter(torch.optim.Muon(p)) and not steps_per_parameter(TrustRatioSGD(p))


def test_parameter_in_two_optimizers_or_in_none_is_a_clear_error():
    import zero_strategy

    model = tiny_gpt2()
    params = list(model.parameters())
    a = torch.optim.AdamW(params[:3])
    b = torch.optim.AdamW(params[2:])
    with pytest.raises(ValueError, match=r"appears twice: in param group 0 of optimizer 0 \(AdamW\) and in param group 0 of optimizer 1"):
        zero_strategy.initialize(model, [a, b], dict(stage=2))
    model = tiny_gpt2()
    params = list(model.parameters())
    with pytest.raises(ValueError, match="requires grad but is in no optimizer param group"):
        zero_strategy.initialize(model, [torch.optim.AdamW(params[:3]), torch.optim.AdamW(params[3:-1])], dict(stage=2))
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        zero_strategy.initialize(tiny_gpt2(), [torch.optim.AdamW(params), "adam"], dict(stage=2))


def test_two_optimizers_in_one_process_equal_plain_torch():
    """One process: Muon + AdamW through the engine (stage 3, every parameter
    partitioned; each optimizer stepped on its own, as Lightning's manual optimization
    does, once with a.zero_grad() between the two steps) against the same pair on an
    untouched copy; the torch-format state of each optimizer equals the plain
    optimizer's.  A backward between the two steps is an error."""
    import copy

    import zero_strategy
    from models import muon_adamw, muon_orthogonalise_in_fp32

    muon_orthogonalise_in_fp32()
    model = tiny_gpt2()
    ref = copy.deepcopy(model)
    opts, ref_opts = muon_adamw(model), muon_adamw(ref)
    engine = zero_strategy.initialize(model, opts, dict(stage=3, param_persistence_threshold=0))
    with pytest.raises(RuntimeError, match="engine.optimizer is ambiguous: this engine has 2 optimizers"):
        engine.optimizer
    for i, ids in enumerate(lm_batches(3, 4)):
        engine.backward(model(input_ids=ids, labels=ids).loss)
        engine.optimizers[0].step()
        with pytest.raises(RuntimeError, match="already stepped"):
            engine.optimizers[0].step()
        if i == 1:  # a.step(); a.zero_grad(); b.step(): b still steps on its gradients, as under DDP
            engine.optimizers[0].zero_grad()
        engine.optimizers[1].step()  # ends the round
        ref(input_ids=ids, labels=ids).loss.backward()
        for o in ref_opts:
            o.step()
            o.zero_grad()
    assert engine.global_step == 3
    sd = engine.full_state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=0, atol=1e-6)
    for k, o in enumerate(ref_opts):
        mine = engine.full_optimizer_state_dict(optimizer=k)
        theirs = o.state_dict()
        assert mine["state"].keys() == theirs["state"].keys()
        for i in theirs["state"]:
            for key, v in theirs["state"][i].items():
                torch.testing.assert_close(torch.as_tensor(mine["state"][i][key]), torch.as_tensor(v), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="pass optimizer=k"):
        engine.full_optimizer_state_dict()
    # A backward while the round is half done would add new gradients to the ones
    # optimizer 1 has not stepped on yet: an error naming it.
    ids = lm_batches(1, 4)[0]
    engine.backward(model(input_ids=ids, labels=ids).loss)
    engine.optimizers[0].step()
    with pytest.raises(RuntimeError, match=r"while a step was half done: optimizer\(s\) 1 \(AdamW\) have not stepped"):
        engine.backward(model(input_ids=ids, labels=ids).loss)
    engine.close()


@pytest.mark.parametrize("routed", [False, True])
def test_clipping_one_optimizers_parameters_clips_only_those(routed):
    """With two SGD optimizers, clipping one optimizer's gradients by norm (and the
    other's by value) equals torch's clipping of exactly those parameters in plain
    torch; through engine.clip_grad_norm_(optimizer=k) or torch.nn.utils' functions
    given that optimizer's parameters.  SGD is scale-sensitive, so the global norm
    would give other numbers (checked)."""
    import copy

    import zero_strategy

    def split(m):
        params = list(m.parameters())
        return params[: len(params) // 2], params[len(params) // 2 :]

    def optimizers(m):
        a, b = split(m)
        return [torch.optim.SGD(a, lr=0.5, momentum=0.9), torch.optim.SGD(b, lr=0.5)]

    model = tiny_gpt2()
    ref, ref_global = copy.deepcopy(model), copy.deepcopy(model)
    engine = zero_strategy.initialize(model, optimizers(model), dict(stage=3, param_persistence_threshold=0))
    refs = [(ref, optimizers(ref), False), (ref_global, optimizers(ref_global), True)]
    norms = []
    for ids in lm_batches(2, 4):
        engine.backward(model(input_ids=ids, labels=ids).loss)
        if routed:
            a, b = split(model)
            norms.append(float(torch.nn.utils.clip_grad_norm_(a, 0.05)))
            torch.nn.utils.clip_grad_value_(b, 1e-3)
        else:
            norms.append(float(engine.clip_grad_norm_(0.05, optimizer=0)))
            engine.clip_grad_value_(1e-3, optimizer=engine.optimizers[1])
        engine.step()
        for m, opts, every in refs:
            m(input_ids=ids, labels=ids).loss.backward()
            a, b = split(m)
            norm = torch.nn.utils.clip_grad_norm_(list(m.parameters()) if every else a, 0.05)
            if not every:
                norms.append(float(norm))
            torch.nn.utils.clip_grad_value_(b, 1e-3)
            for o in opts:
                o.step()
                o.zero_grad()
    assert norms[0::2] == pytest.approx(norms[1::2], rel=1e-5), norms
    assert min(norms) > 0.05  # so the norm clip changed the update
    sd = engine.full_state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=0, atol=1e-6, msg=k)
    assert max((sd[k] - v).abs().max().item() for k, v in ref_global.state_dict().items()) > 1e-4
    engine.close()


# -- checkpoints: N=2 stage 3 -> N=3 stage 2 ------------------------------------------------------
# The global batch is 6 sequences at both world sizes (3 per rank, then 2 per rank).
def _train(engine, model, batches, rank, ws):
    for batch in batches:
        ids = batch.view(ws, -1, batch.shape[-1])[rank]
        engine.backward(model(input_ids=ids, labels=ids).loss)
        engine.step()


def _states(engine):
    return [engine.full_optimizer_state_dict(optimizer=k) for k in range(len(engine.optimizers))]


def _save_worker(rank, ws, optim, directory):
    import transformers

    import zero_strategy

    transformers.logging.set_verbosity_error()
    job = dict(optim=optim)
    batches = lm_batches(3, 6)
    model, opt = build(job)
    engine = zero_strategy.initialize(model, opt, dict(stage=3, param_persistence_threshold=0, reduce_bucket_size=3000))
    _train(engine, model, batches[:2], rank, ws)
    engine.save_checkpoint(directory)
    saved = _states(engine)
    _train(engine, model, batches[2:], rank, ws)  # the uninterrupted run's third step
    return saved, engine.full_state_dict(), _states(engine)


def _resume_worker(rank, ws, optim, directory):
    import transformers

    import zero_strategy

    transformers.logging.set_verbosity_error()
    job = dict(optim=optim)
    model, opt = build(dict(job, seed=7))  # other initial values: everything must come from the checkpoint
    engine = zero_strategy.initialize(model, opt, dict(stage=2, reduce_bucket_size=3000))
    engine.load_checkpoint(directory)
    loaded = _states(engine)
    _train(engine, model, lm_batches(3, 6)[2:], rank, ws)
    return loaded, engine.full_state_dict(), _states(engine)


def _assert_same_states(a, b, what):
    assert len(a) == len(b), what
    for k, (x, y) in enumerate(zip(a, b)):
        assert x["state"].keys() == y["state"].keys(), f"{what}: optimizer {k}"
        for i in x["state"]:
            assert x["state"][i].keys() == y["state"][i].keys(), f"{what}: optimizer {k} param {i}"
            for key, v in x["state"][i].items():
                w = y["state"][i][key]
                if isinstance(v, torch.Tensor):
                    torch.testing.assert_close(v, torch.as_tensor(w), rtol=0, atol=1e-5, msg=f"{what}: {k}/{i}/{key}")
                else:
                    assert math.isclose(float(v), float(w), rel_tol=1e-6), f"{what}: {k}/{i}/{key}"


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["adafactor", "muon+adamw"])
def test_checkpoint_at_two_ranks_stage3_resumes_at_three_ranks_stage2(optim, tmp_path):
    from zero_strategy import load_consolidated_optimizer_states

    directory = str(tmp_path / "ckpt")
    saved, final_sd, final_states = run_distributed(_save_worker, 2, optim, directory)[0]
    loaded, resumed_sd, resumed_states = run_distributed(_resume_worker, 3, optim, directory)[0]
    _assert_same_states(saved, loaded, "state after load")
    _assert_same_states(saved, load_consolidated_optimizer_states(directory), "consolidated state")
    for n, v in final_sd.items():
        torch.testing.assert_close(resumed_sd[n], v, rtol=0, atol=1e-5, msg=n)
    _assert_same_states(final_states, resumed_states, "state after the resumed step")
