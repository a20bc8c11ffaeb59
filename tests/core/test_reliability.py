"""Reliability: no silent hangs, no silent corruption, clear errors for misuse.

Every failure here is provoked on real gloo processes; each test asserts that EVERY
rank ends with the expected error (or, for a killed rank, that the survivors do) within
a bound derived from ``collective_timeout``, instead of hanging until the harness's
own deadline.
"""
import os
import signal

import pytest
import torch

from dist_harness import run_distributed, run_distributed_outcomes

TIMEOUT = 4.0  # collective_timeout in these tests (seconds)
# A failing rank waits up to one timeout for its collective and up to one more for the
# others' reports; spawning and importing take the rest.
BOUND = 2 * TIMEOUT + 45


class Blocks(torch.nn.Module):
    """Four identical blocks (equal-sized collectives: the case where mismatched calls
    could pair up silently) and a head."""

    def __init__(self, width=16, depth=4):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(depth)
        )
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).pow(2).mean()


def _engine(config, seed=0):
    import zero_strategy

    torch.manual_seed(seed)
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # One gather per block (min_gather_numel=0): equal-sized collectives of different
    # modules are the case the checks must tell apart.
    cfg = dict(stage=3, param_persistence_threshold=0, unit_modules=["Sequential"], min_gather_numel=0,
               collective_timeout=TIMEOUT)
    cfg.update(config)
    return model, zero_strategy.initialize(model, opt, cfg)


def _batch(rank, step):
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))


def _errors(result, ws):
    """Each rank's error text; fails when a rank did not end with an error."""
    ranks = result["ranks"]
    assert not result["timed_out"], result
    assert sorted(ranks) == list(range(ws)), ranks
    for r, (kind, value) in ranks.items():
        assert kind == "error", (r, kind, value)
    return {r: value for r, (_, value) in ranks.items()}


# ---------------------------------------------------------------------------------------
# a rank that catches an exception and skips a batch (issue #34 item 5)
# ---------------------------------------------------------------------------------------
def _skip_worker(rank, ws, stage, accum):
    """The loop every user writes: forward, backward (no_sync until the accumulation
    boundary), step.  First, rank 0 alone runs forwards the others do not (under
    torch.no_grad(), and in eval mode), which must change nothing; then rank 1 hits a bad
    sample after its forward at batch 2, catches the exception and goes on."""
    model, engine = _engine(dict(stage=stage))
    done = []
    for i in range(6):
        try:
            loss = model(_batch(rank, i))
            # (stage 3 gathers in every forward, so there one-rank forwards diverge anyway)
            if rank == 0 and i == 0 and stage < 3:
                with torch.no_grad():
                    model(_batch(rank, 99))  # a one-rank forward: logging, a sample
            if rank == 0 and i == 1 and stage < 3:
                model.eval()
                model(_batch(rank, 98))
                model.train()
            if rank == 1 and i == 2:
                raise ValueError("bad sample")
            if (i + 1) % accum:
                with engine.no_sync():
                    engine.backward(loss)
            else:
                engine.backward(loss)
                engine.step()
                engine.zero_grad()
            done.append(i)
        except ValueError:
            done.append(f"skipped {i}")
            continue
    return done


@pytest.mark.slow
@pytest.mark.parametrize("stage, accum", [(2, 2), (3, 1)])
def test_a_rank_that_skips_a_batch_fails_with_every_rank_at_its_next_collective(stage, accum):
    """Before, the skipping rank's collectives paired one batch off with its peers'
    (same step, same buckets): gradients of different batches were averaged, the
    skipping rank finished and exited 0, and the other failed only at its last batch
    (with accumulation, gloo aborted it on a longer message).  Now the first collective
    after the skip fails on both ranks, each naming its training-forward count."""
    result = run_distributed_outcomes(_skip_worker, 2, stage, accum, timeout=3 * BOUND)
    errors = _errors(result, 2)
    assert result["seconds"] < BOUND, result
    forwards = {0: "after training forward 3", 1: "after training forward 4"}
    for r, text in errors.items():
        assert "CollectiveError" in text and "ranks diverged" in text, (r, text)
        assert forwards[r] in text, (r, text)
        assert "a rank skipped a batch (caught an exception and went on)" in text, (r, text)
        assert "(collective #1 of step 6" not in text  # not at the end of the run


# ---------------------------------------------------------------------------------------
# ranks that run different modules (stage 3)
# ---------------------------------------------------------------------------------------
def _diverge_worker(rank, ws, config):
    model, engine = _engine(config)
    for step in range(3):
        loss = model(_batch(rank, step))
        if step == 1 and rank == 0:
            with torch.no_grad():
                model.blocks[2](torch.zeros(1, 16))  # an extra module call on rank 0 only
        engine.backward(loss)
        engine.step()
    return "finished"


@pytest.mark.slow
def test_divergent_module_calls_end_every_rank_within_the_timeout():
    """Without the order check, the first divergent collective is caught in-band by its
    header when the sizes match; here they differ (blocks.2 against the root unit), and
    gloo itself may abort the process that receives more than it posted (SIGABRT, which
    no Python code can catch).  What is guaranteed: no rank hangs, and every rank still
    alive raises CollectiveError saying where each rank was."""
    result = run_distributed_outcomes(_diverge_worker, 2, {}, timeout=3 * BOUND)
    assert not result["timed_out"] and result["seconds"] < BOUND, result
    ranks = result["ranks"]
    assert sorted(ranks) == [0, 1]
    assert all(kind != "ok" for kind, _ in ranks.values()), ranks
    errors = [value for kind, value in ranks.values() if kind == "error"]
    assert errors, ranks
    for text in errors:
        assert "CollectiveError" in text and "Where each rank was:" in text, text
        assert " for module " in text, text  # the module a rank was gathering is named
        assert "check_call_order=True" in text, text


@pytest.mark.slow
def test_call_order_check_stops_at_the_first_divergent_call_naming_each_module():
    result = run_distributed_outcomes(_diverge_worker, 2, {"check_call_order": True}, timeout=3 * BOUND)
    errors = _errors(result, 2)
    # No timeout involved: the first mismatched call is caught by the order check itself.
    assert result["seconds"] < BOUND - TIMEOUT, result["seconds"]
    for text in errors.values():
        assert "ranks diverged (check_call_order)" in text, text
        assert "rank 0: all_gather for module blocks.2" in text, text
        # rank 1 went on to backward: the root stayed gathered from its forward (gather.py,
        # [Note: kept for backward]), so its first gather there is the last block's
        assert "rank 1: all_gather for module blocks.3" in text, text


def _agreeing_worker(rank, ws):
    model, engine = _engine({"check_call_order": True})
    losses = []
    for step in range(3):
        loss = model(_batch(rank, step))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _reference_losses(ws, steps=3):
    torch.manual_seed(0)
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        losses = [model(_batch(r, step)) for r in range(ws)]
        sum(losses).div(ws).backward()
        opt.step()
        opt.zero_grad()
        out.append([float(x) for x in losses])
    return out


@pytest.mark.slow
def test_call_order_check_changes_nothing_when_ranks_agree():
    got = run_distributed(_agreeing_worker, 2)
    ref = _reference_losses(2)
    for r in range(2):
        assert got[r] == pytest.approx([ref[s][r] for s in range(3)], rel=1e-5)


# ---------------------------------------------------------------------------------------
# a rank that dies mid-step
# ---------------------------------------------------------------------------------------
def _dying_worker(rank, ws, folder):
    model, engine = _engine({})
    for step in range(3):
        loss = model(_batch(rank, step))
        if step == 2 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # killed between forward and backward
        engine.backward(loss)
        engine.step()
        if step == 1:
            engine.save_checkpoint(folder)
    return "finished"


def _load_worker(rank, ws, folder):
    model, engine = _engine({"stage": 2})
    engine.load_checkpoint(folder)
    return engine.global_step


@pytest.mark.slow
def test_a_killed_rank_makes_the_others_fail_clearly_and_the_checkpoint_stays_loadable(tmp_path):
    folder = str(tmp_path / "ckpt")
    result = run_distributed_outcomes(_dying_worker, 2, folder, timeout=3 * BOUND)
    assert result["seconds"] < BOUND, result["seconds"]
    ranks = result["ranks"]
    assert ranks[1][0] == "dead", ranks[1]
    kind, text = ranks[0]
    assert kind == "error" and "CollectiveError" in text, text
    assert "rank(s) [1]: no answer" in text and "restart from the last checkpoint" in text, text
    # The checkpoint written before the failure loads (at another world size and stage).
    assert run_distributed(_load_worker, 1, folder) == [2]


# ---------------------------------------------------------------------------------------
# parameters outside forward (stage 3)
# ---------------------------------------------------------------------------------------
def _gathered_worker(rank, ws):
    import zero_strategy
    from zero_strategy import PartitionedParameterError

    torch.manual_seed(0)
    initial = {k: v.clone() for k, v in Blocks().state_dict().items()}
    model, engine = _engine({})
    out = {}
    # Reading outside forward: a clear error, not a crash or an empty tensor.
    try:
        model.blocks[1][0].weight.sum()
        out["read"] = "no error"
    except PartitionedParameterError as exc:
        out["read"] = str(exc)
    # Metadata stays readable.
    out["shape"] = tuple(model.blocks[1][0].weight.shape)
    with engine.gathered_parameters(model.blocks[1]):
        out["inside"] = model.blocks[1][0].weight.detach().clone()
        model.blocks[1][0].weight.data.zero_()  # discarded: no modifier_rank
    with zero_strategy.gathered_parameters(model, model.blocks[2], modifier_rank=1):
        if rank == 1:
            model.blocks[2][0].bias.data.fill_(0.5)  # kept: rank 1 is the modifier
    sd = engine.full_state_dict(rank0_only=False)
    out["after_discard"] = sd["blocks.1.0.weight"]
    out["after_modify"] = sd["blocks.2.0.bias"]
    out["initial"] = initial
    # The modified values are what the next forward uses.
    with torch.no_grad():
        x = torch.ones(2, 16)
        out["forward"] = float(model(x))
    reference = Blocks()
    reference.load_state_dict(initial)
    with torch.no_grad():
        reference.blocks[2][0].bias.fill_(0.5)
        out["reference_forward"] = float(reference(x))
    # After close (without unshard) the model's values are gone: clear error naming it.
    engine.close()
    try:
        model(x)
        out["after_close"] = "no error"
    except PartitionedParameterError as exc:
        out["after_close"] = str(exc)
    # Whole values given back to such a parameter make it an ordinary one again.
    w = model.blocks[0][0].weight
    w.data = torch.ones(16, 16)
    out["refilled"] = float(w.sum())
    return out


@pytest.mark.slow
def test_partitioned_parameters_are_read_and_changed_through_the_gather_context():
    for r in run_distributed(_gathered_worker, 2):
        assert "blocks.1.0.weight is partitioned by ZeRO stage 3" in r["read"], r["read"]
        assert "gathered_parameters" in r["read"]
        assert r["shape"] == (16, 16)
        torch.testing.assert_close(r["inside"], r["initial"]["blocks.1.0.weight"], rtol=0, atol=0)
        torch.testing.assert_close(r["after_discard"], r["initial"]["blocks.1.0.weight"], rtol=0, atol=0)
        assert torch.equal(r["after_modify"], torch.full((16,), 0.5))
        assert r["forward"] == pytest.approx(r["reference_forward"], rel=1e-6)
        assert "has been closed" in r["after_close"] and "unshard=True" in r["after_close"], r["after_close"]
        assert r["refilled"] == 256.0


# ---------------------------------------------------------------------------------------
# numerical faults
# ---------------------------------------------------------------------------------------
def _min_scale_worker(rank, ws, policy):
    import zero_strategy

    torch.manual_seed(0)
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = zero_strategy.initialize(model, opt, dict(stage=2, precision="fp16", initial_scale_power=1, min_loss_scale=1.0,
                                                       hysteresis=1, on_min_loss_scale=policy, collective_timeout=TIMEOUT))
    results = []
    for step in range(4):
        loss = model(_batch(rank, step).half())
        if step >= 1 and rank == 0:
            loss = loss * float("inf")  # overflow on one rank: every rank must agree to skip
        engine.backward(loss)
        results.append((engine.step(), engine.scaler.scale))
    return results


@pytest.mark.slow
def test_fp16_overflow_at_the_minimum_loss_scale_raises_naming_the_parameters():
    errors = _errors(run_distributed_outcomes(_min_scale_worker, 2, "raise", timeout=3 * BOUND), 2)
    for text in errors.values():
        assert "FloatingPointError" in text and "min_loss_scale=1" in text, text
        assert "blocks.0.0.weight" in text or "head.weight" in text, text
        assert "at step 1" in text, text  # step 1: scale 2 -> 1; step 2 overflows at the minimum


@pytest.mark.slow
def test_fp16_overflow_at_the_minimum_loss_scale_keeps_skipping_when_asked():
    for r in run_distributed(_min_scale_worker, 2, "skip"):
        assert r == [(True, 2.0), (False, 1.0), (False, 1.0), (False, 1.0)], r


def _nan_loss_worker(rank, ws):
    model, engine = _engine({"check_finite_loss": True})
    for step in range(3):
        loss = model(_batch(rank, step))
        if step == 2 and rank == 1:
            loss = loss * float("nan")
        engine.backward(loss)
        engine.step()


@pytest.mark.slow
def test_nan_loss_check_stops_every_rank_naming_the_step_and_rank():
    result = run_distributed_outcomes(_nan_loss_worker, 2, timeout=3 * BOUND)
    for text in _errors(result, 2).values():
        assert "FloatingPointError: the loss is not finite (NaN or inf) at step 2 on rank(s) [1]" in text, text


# ---------------------------------------------------------------------------------------
# misuse
# ---------------------------------------------------------------------------------------
def _misuse_worker(rank, ws, case, folder):
    model, engine = _engine({"stage": 2})
    x = _batch(rank, 0)
    if case == "step_without_backward":
        engine.step()
    elif case == "backward_twice_in_no_sync":
        with engine.no_sync():
            engine.backward(model(x))
        engine.backward(model(x))
        return engine.step()
    elif case == "use_after_close":
        engine.close()
        engine.backward(model(x))
    elif case == "world_size_mismatch":
        if ws == 2:
            engine.backward(model(x))
            engine.step()
            engine.save_checkpoint(folder)
            return "saved"
        engine.load_checkpoint(folder, allow_reshard=False)
    return "no error"


MISUSE = {
    "step_without_backward": "no backward reached the model since the last step() or zero_grad()",
    "use_after_close": "this ZeroEngine was closed",
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(MISUSE))
def test_misuse_is_a_clear_error_on_every_rank(case, tmp_path):
    result = run_distributed_outcomes(_misuse_worker, 2, case, str(tmp_path), timeout=3 * BOUND)
    assert result["seconds"] < BOUND
    for text in _errors(result, 2).values():
        assert MISUSE[case] in text, text


@pytest.mark.slow
def test_accumulation_inside_no_sync_is_not_misuse(tmp_path):
    assert run_distributed(_misuse_worker, 2, "backward_twice_in_no_sync", str(tmp_path)) == [True, True]


@pytest.mark.slow
def test_checkpoint_from_another_world_size_needs_resharding_allowed(tmp_path):
    folder = str(tmp_path / "ckpt")
    assert run_distributed(_misuse_worker, 2, "world_size_mismatch", folder) == ["saved", "saved"]
    result = run_distributed_outcomes(_misuse_worker, 1, "world_size_mismatch", folder, timeout=3 * BOUND)
    text = _errors(result, 1)[0]
    assert "world size 2" in text and "allow_reshard=True" in text, text


def _kept_gather_diverge_worker(rank, ws):
    from zero_strategy.communication.comm import Communicator

    comm = Communicator(None)
    comm.configure(TIMEOUT, False)
    n = 64 * (rank + 1)  # ranks disagree on the size: gloo would abort the rank receiving more
    full = torch.zeros(ws * n)
    comm.all_gather_kept([(full, full[rank * n:(rank + 1) * n], f"a buffer of {n}")])
    return "finished"


@pytest.mark.slow
def test_kept_buffer_gathers_of_different_sizes_fail_on_every_rank_before_any_payload():
    """Announced gathers ([Note: announced gathers] in collectives.py): when the ranks'
    batches differ, even in size, every rank raises CollectiveError at the header-only
    announcement; no rank is aborted by gloo and none hangs."""
    result = run_distributed_outcomes(_kept_gather_diverge_worker, 2, timeout=3 * BOUND)
    errors = _errors(result, 2)
    assert result["seconds"] < BOUND, result["seconds"]
    for text in errors.values():
        assert "CollectiveError" in text and "diverged" in text, text
        # each rank's own gather is named, from the reports the ranks exchange
        assert "rank 0: all_gather for a buffer of 64" in text and "rank 1: all_gather for a buffer of 128" in text, text


def _in_place_gather_diverge_worker(rank, ws):
    from zero_strategy.communication.comm import Communicator

    comm = Communicator(None)
    comm.configure(TIMEOUT, False)
    n = 64 if rank == 0 else 300_000  # ranks gather units of different sizes at the same point
    full = torch.zeros(ws * n)
    comm.all_gather(full, full[rank * n:(rank + 1) * n], async_op=False, label=f"a unit of {n}")
    return "finished"


@pytest.mark.slow
def test_in_place_gathers_that_differ_end_every_rank_within_the_timeout():
    """[Note: headers beside in-place gathers]: ranks gathering different units at the
    same point fail at the header beside the payload.  As with any size mismatch, gloo
    itself may abort the process that receives more than it posted; what is guaranteed
    is that no rank hangs or finishes, and every rank still alive raises CollectiveError
    naming where each rank was."""
    result = run_distributed_outcomes(_in_place_gather_diverge_worker, 2, timeout=3 * BOUND)
    assert not result["timed_out"] and result["seconds"] < BOUND, result
    ranks = result["ranks"]
    assert sorted(ranks) == [0, 1] and all(kind != "ok" for kind, _ in ranks.values()), ranks
    errors = [value for kind, value in ranks.values() if kind == "error"]
    assert errors, ranks
    for text in errors:
        assert "CollectiveError" in text and "diverged" in text and "timed out" not in text, text
        assert "all_gather for a unit of" in text, text
