"""Ranks set up differently and silent misuse, provoked on real gloo processes (issue #16
items 5 and 8): every rank ends with a clear error (or warning) naming what is wrong and
what to do, within a bound, instead of training wrongly.

Each spawn runs several cases on one process group (every case fails before any
mismatched collective, so the group stays usable); each case is timed inside the
worker, so the bound is checked per rank and per case, not only for the whole run.
"""
import time
import warnings

import pytest
import torch

from dist_harness import run_distributed
from models import Trunk

TIMEOUT = 4.0  # collective_timeout in these tests: an error that needed a timeout would take longer
WIDTH = 16




class Deeper(Trunk):
    def __init__(self, width=WIDTH):
        super().__init__(width, depth=4)


def _setup(config, seed=0, lr=0.1, model_cls=Trunk, opt_cls=torch.optim.SGD, reverse=False, **init):
    import zero_strategy

    torch.manual_seed(seed)
    model = model_cls(WIDTH)
    params = list(model.parameters())
    opt = opt_cls(params[::-1] if reverse else params, lr=lr)
    cfg = dict(stage=2, collective_timeout=TIMEOUT)
    cfg.update(config)
    return model, opt, zero_strategy.initialize(model, opt, cfg, **init)


def _batch(rank, step):
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))


def _timed(fn):
    """(exception type name or "ok", message, seconds)."""
    t = time.monotonic()
    try:
        value = fn()
        return ("ok", value, time.monotonic() - t)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return (type(exc).__name__, str(exc), time.monotonic() - t)


def _check(out, name, kind, *texts):
    got_kind, message, seconds = out[name]
    assert got_kind == kind, (name, got_kind, message)
    for text in texts:
        assert text in message, (name, text, message)
    assert seconds < TIMEOUT, (name, seconds)  # in-band: no timeout was needed


# ---------------------------------------------------------------------------------------
# item 5: ranks set up differently
# ---------------------------------------------------------------------------------------
def _warm_up():
    """Before the clocks start: the first optimizer built imports torch._dynamo (seconds
    on 2 cores), and the ranks start at different times."""
    import zero_strategy  # noqa: F401

    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    torch.distributed.barrier()


def _setups_worker(rank, ws):
    _warm_up()

    cases = {
        "lr": dict(lr=0.1 if rank == 0 else 0.01),
        "stage": dict(config={"stage": 3 if rank == 0 else 2}),
        "model": dict(model_cls=Trunk if rank == 0 else Deeper),
        "precision": dict(config={"precision": "bf16" if rank == 1 else "fp32"}),
        "optimizer": dict(opt_cls=torch.optim.SGD if rank == 0 else torch.optim.AdamW),
        # The check's own collective must pair up even when only some ranks ask for the
        # call-order exchange, or pass other initialize options.
        "check_call_order": dict(config={"check_call_order": rank == 0}),
        "sync_module_states": dict(sync_module_states=rank == 0),
    }
    out = {}
    for name, kw in cases.items():
        config = kw.pop("config", {})
        out[name] = _timed(lambda: _setup(config, **kw) and "initialized")
    # The same setup on every rank still initializes (the group survived the failures);
    # the order of the parameters within a param group does not matter.
    model, _, engine = _setup({"stage": 3, "param_persistence_threshold": 0}, reverse=rank == 1)
    engine.backward(model(_batch(rank, 0)))
    out["agreeing"] = ("ok", engine.step(), 0.0)
    engine.close()
    # Different seeds: by default every rank starts from rank 0's values, as DDP does.
    model, _, engine = _setup({"stage": 0}, seed=rank)
    out["seeded"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine.close()
    # ... and with sync_module_states=False a warning says that the replicas differ.
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _, _, engine = _setup({"stage": 0}, seed=rank, sync_module_states=False)
        engine.close()
        _, _, engine = _setup({"stage": 0}, seed=0, sync_module_states=False)  # equal values: quiet
        engine.close()
    out["unsynced_warnings"] = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    return out


@pytest.mark.slow
def test_ranks_set_up_differently_fail_at_initialize_naming_the_difference():
    results = run_distributed(_setups_worker, 2, timeout=180)
    for out in results:
        fix = "Every rank must build the same model and optimizer"
        _check(out, "lr", "SetupMismatchError", "param group 0 'lr': rank 0 has 0.1, rank 1 has 0.01", fix)
        _check(out, "stage", "SetupMismatchError", "ZeroConfig.stage: rank 0 has 3, rank 1 has 2")
        _check(out, "model", "SetupMismatchError",
               "parameter trunk.3.lin.weight: rank 0 has no parameter trunk.3.lin.weight, rank 1 has (16, 16) float32")
        _check(out, "precision", "SetupMismatchError", "ZeroConfig.precision: rank 0 has fp32, rank 1 has bf16")
        _check(out, "optimizer", "SetupMismatchError", "optimizer class: rank 0 has SGD, rank 1 has AdamW")
        _check(out, "check_call_order", "SetupMismatchError",
               "ZeroConfig.check_call_order: rank 0 has True, rank 1 has False")
        _check(out, "sync_module_states", "SetupMismatchError", "sync_module_states: rank 0 has True, rank 1 has False")
        assert out["agreeing"][1] is True
        assert len(out["unsynced_warnings"]) == 1, out["unsynced_warnings"]
        assert "values differ between ranks" in out["unsynced_warnings"][0]
        assert "sync_module_states=True (the default)" in out["unsynced_warnings"][0]
    a, b = (r["seeded"] for r in results)
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ---------------------------------------------------------------------------------------
# item 8: the inner optimizer's own step, torch's clip_grad_norm_, repeated fp16 skips
# ---------------------------------------------------------------------------------------
def _reference(steps_batches, max_norm, ws):
    """Plain torch: every rank's batch, gradients averaged as the engine does; torch's
    clip on the averaged gradients. Returns (norms, state_dict after the steps)."""
    torch.manual_seed(0)
    ref = Trunk(WIDTH)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    norms = []
    for step in steps_batches:
        opt.zero_grad()
        (sum(ref(_batch(r, step)) for r in range(ws)) / ws).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)))
        opt.step()
    return norms, {k: v.detach().clone() for k, v in ref.state_dict().items()}


def _misuse_worker(rank, ws):
    import zero_strategy
    from zero_strategy.reliability.misuse import SKIPPED_STEPS_WARNING

    _warm_up()
    out = {}
    # (a) the user's optimizer.step() instead of engine.step(), at every stage.
    for stage in (0, 1, 2, 3):
        model, opt, engine = _setup({"stage": stage, "param_persistence_threshold": 0}, opt_cls=torch.optim.AdamW, lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # made after initialize
        engine.backward(model(_batch(rank, 0)))
        out[f"inner_step_{stage}"] = _timed(lambda: opt.step())
        stepped = engine.step()  # the engine's own call goes through
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
            sched.step()
        out[f"after_{stage}"] = (stepped, opt.param_groups[0]["lr"])
        engine.close()
        opt.step()  # closed: the optimizer is the user's again, no error

    # (b) torch.nn.utils.clip_grad_norm_(model.parameters()) is the global norm, clipped.
    ref_norms, ref_state = _reference([0, 1], 0.01, ws)
    for stage in (0, 1, 2, 3):
        model, _, engine = _setup({"stage": stage, "param_persistence_threshold": 0})
        norms = []
        for step in (0, 1):
            engine.backward(model(_batch(rank, step)))
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)))
            engine.step()
        got = engine.full_state_dict(rank0_only=False)
        out[f"clip_{stage}"] = (norms, max(float((got[k] - v).abs().max()) for k, v in ref_state.items()))
        engine.backward(model(_batch(rank, 2)))
        out[f"clip_subset_{stage}"] = _timed(lambda: torch.nn.utils.clip_grad_norm_(model.head.parameters(), 1.0))
        # A model's parameters with a tensor no engine manages: clipping only the model's would
        # leave the other unclipped, silently (Accelerate's own lookup once did).
        stray = torch.nn.Parameter(torch.ones(3))
        stray.grad = torch.full((3,), 100.0)
        out[f"clip_mixed_{stage}"] = _timed(lambda: torch.nn.utils.clip_grad_norm_([*model.parameters(), stray], 1.0))
        torch.nn.utils.clip_grad_value_(model.parameters(), 1e-4)
        engine.step()
        engine.close()
    out["ref_norms"] = ref_norms
    # fp16 with a static loss scale: the norm torch's function returns is unscaled.
    model, _, engine = _setup({"stage": 2, "precision": "fp16", "loss_scale": 1024.0})
    engine.backward(model(_batch(rank, 0)))
    out["clip_fp16"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    engine.step()
    engine.close()

    # (c) a static fp16 loss scale that overflows every step: a warning after N skips.
    model, _, engine = _setup({"stage": 2, "precision": "fp16", "loss_scale": 2.0 ** 40})
    results = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        t = time.monotonic()
        for step in range(SKIPPED_STEPS_WARNING + 3):
            engine.backward(model(_batch(rank, step)))
            results.append(engine.step())
            if step == SKIPPED_STEPS_WARNING - 2:
                before = [w for w in seen if "were all skipped" in str(w.message)]
        seconds = time.monotonic() - t
    out["skips"] = (results, len(before), [str(w.message) for w in seen if "were all skipped" in str(w.message)], seconds)
    engine.close()

    # (d) already refused before this change (kept provoked here): step() after backward
    # passes that all ran inside no_sync(), and step() inside no_sync(), at stages 0-1.
    for stage in (0, 1):
        model, _, engine = _setup({"stage": stage})
        with engine.no_sync():
            engine.backward(model(_batch(rank, 0)))
        out[f"no_sync_only_{stage}"] = _timed(engine.step)
        engine.zero_grad()
        with engine.no_sync():
            engine.backward(model(_batch(rank, 0)))
            engine.backward(model(_batch(rank, 1)))
        engine.backward(model(_batch(rank, 2)))
        with engine.no_sync():
            out[f"inside_no_sync_{stage}"] = _timed(engine.step)
        assert engine.step() is True  # outside: fine
        engine.close()
    assert zero_strategy.engine_of(model) is None
    return out


@pytest.mark.slow
def test_misuse_that_gave_silent_wrong_numbers_is_an_error_or_made_right_on_every_rank():
    from zero_strategy.reliability.misuse import SKIPPED_STEPS_WARNING

    for out in run_distributed(_misuse_worker, 2, timeout=180):
        for stage in (0, 1, 2, 3):
            _check(out, f"inner_step_{stage}", "RuntimeError",
                   "optimizer.step() was called on the AdamW given to zero_strategy.initialize",
                   "would silently do nothing", "Call engine.step() instead")
            assert out[f"after_{stage}"] == (True, pytest.approx(5e-4)), out[f"after_{stage}"]

            norms, max_diff = out[f"clip_{stage}"]
            assert norms == pytest.approx(out["ref_norms"], rel=1e-5), (stage, norms, out["ref_norms"])
            assert min(norms) > 0.01  # so the clip did change the update
            assert max_diff < 1e-6, (stage, max_diff)
            _check(out, f"clip_subset_{stage}", "RuntimeError", "was given 2 of the 8 trainable parameters",
                   "call engine.clip_grad_norm_")
            _check(out, f"clip_mixed_{stage}", "RuntimeError", "together with other tensors",
                   "engine.clip_grad_norm_")
        assert out["clip_fp16"] == pytest.approx(out["ref_norms"][0], rel=2e-2)  # unscaled

        results, warned_early, skips, seconds = out["skips"]
        assert results == [False] * (SKIPPED_STEPS_WARNING + 3)
        assert warned_early == 0 and len(skips) == 1, skips  # once, after N skips
        assert f"the last {SKIPPED_STEPS_WARNING} optimizer steps were all skipped" in skips[0], skips
        assert "static loss_scale=1.09951e+12" in skips[0] and "Set loss_scale=0 (dynamic scaling" in skips[0], skips
        assert seconds < 2 * TIMEOUT

        for stage in (0, 1):
            _check(out, f"no_sync_only_{stage}", "RuntimeError", "after backward passes that all ran inside no_sync()",
                   "Run the last micro-batch's backward outside no_sync()")
            _check(out, f"inside_no_sync_{stage}", "RuntimeError", "was called inside no_sync()",
                   "call step() after leaving the no_sync() block")


def test_tiny_collective_timeouts_are_rejected():
    from zero_strategy import ZeroConfig

    for value in (1e-9, 0.05):
        with pytest.raises(ValueError, match="collective_timeout") as err:
            ZeroConfig(collective_timeout=value)
        assert "0.1" in str(err.value), str(err.value)
    assert ZeroConfig(collective_timeout=0.1).collective_timeout == 0.1
