"""The fused host optimizer step ([Note: fused host step] in zero_strategy/host_step.py).

With offload_optimizer "cpu" / "nvme" and ``host_optimizer_step="fused"`` (the default)
each unit's update is torch's fused CPU kernel over flat runs of the shard.  It must be
the optimizer's own update: the same as ``host_optimizer_step="optimizer"`` (the
optimizer's step() over one view per piece) and as a plain torch for-loop optimizer
(foreach=False) on an unsharded copy of the model, within ``assert_close``'s fp32
defaults (the fused kernel differs from the for loop by rounding only), with the state
in torch's format per piece.  The model is test_unused_parameters' routed mixture of
experts: one expert never gets a token (no state, bit-equal to its initial values),
one stops getting tokens after step 2 (frozen from then on, bit for bit), one starts at
step 3 (its own Adam step count, so one unit holds pieces at different steps: several
runs).  The state survives a state-dict round trip and a checkpoint.
"""
from __future__ import annotations

import copy

import pytest
import torch

from dist_harness import run_distributed
from test_unused_parameters import _batches, _loss, _model

import zero_strategy
from zero_strategy.optim import host_step

SPLIT = 3  # steps before the state dict round trip / checkpoint
NEVER = "moe.experts.2."
LAST_USED_AT_2 = "moe.experts.1."

OPTIMIZERS = {
    "adam": (torch.optim.Adam, dict(lr=1e-2, eps=1e-3)),
    "adam-amsgrad-wd-max": (torch.optim.Adam, dict(lr=1e-2, eps=1e-3, weight_decay=0.1, amsgrad=True, maximize=True)),
    "adamw-wd": (torch.optim.AdamW, dict(lr=1e-2, eps=1e-3, weight_decay=0.1)),
    "adamw-amsgrad": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    "adamw-tensor-lr": (torch.optim.AdamW, dict(lr=torch.tensor(1e-2), eps=1e-3)),
    "sgd-nesterov-wd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1)),
    "sgd-dampening-max": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.5, maximize=True)),
    "sgd-plain": (torch.optim.SGD, dict(lr=0.1)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.1)),
}


def _make_opt(kind, params, **extra):
    cls, kw = OPTIMIZERS[kind]
    kw = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    opt = cls(params, **kw, **extra)
    if cls is torch.optim.Adagrad:
        # Adagrad makes its state in __init__, which initialize() refuses (it must come
        # first); what step() makes lazily instead is the same (step 0, the initial sum).
        opt.state.clear()
    return opt


def _reference(kind, batches, ws=1, split_state=False):
    """Plain torch, for-loop optimizer, over each step's global batch (ws halves)."""
    model = _model()
    opt = _make_opt(kind, model.parameters(), foreach=False)
    mid = None
    for k, (ids, route) in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        for r in range(ws):
            (_loss(model, ids.chunk(ws)[r], route.chunk(ws)[r]) / ws).backward()
        opt.step()
        if split_state and k == SPLIT - 1:
            mid = copy.deepcopy(opt.state_dict())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, copy.deepcopy(opt.state_dict()), mid


class _Spy:
    """Counts the units fused_host_step stepped (returned True)."""

    def __init__(self, monkeypatch):
        self.fused = 0
        real = host_step.fused_host_step

        def spy(*args):
            done = real(*args)
            self.fused += bool(done)
            return done
        monkeypatch.setattr(host_step, "fused_host_step", spy)


def _engine(kind, how, **cfg):
    model = _model()
    config = dict(stage=2, offload_optimizer="cpu", host_optimizer_step=how, reduce_bucket_size=200)
    config.update(cfg)
    return model, zero_strategy.initialize(model, _make_opt(kind, model.parameters()), config)


def _train(model, engine, batches, rank=0, ws=1, after_step=None):
    for k, (ids, route) in enumerate(batches):
        engine.backward(_loss(model, ids.chunk(ws)[rank], route.chunk(ws)[rank]))
        engine.step()
        if after_step is not None:
            after_step(k)


def _assert_state_close(got, want, where):
    assert sorted(got["state"]) == sorted(want["state"]), where  # the same parameters have state
    for idx, st in want["state"].items():
        assert sorted(got["state"][idx]) == sorted(st), (where, idx)
        for key, v in st.items():
            g = got["state"][idx][key]
            if key == "step":
                assert float(g) == float(v), (where, idx)
            else:
                assert g.shape == v.shape and g.dtype == v.dtype, (where, idx, key)
                torch.testing.assert_close(g, v, msg=lambda m: f"{where} {idx} {key}: {m}")


def _assert_params_close(got, want, where):
    for name, v in want.items():
        torch.testing.assert_close(got[name], v, msg=lambda m: f"{where} {name}: {m}")


def _assert_flat_state(engine):
    """Each unit's per-element state of a key: views of one flat buffer, each at its slot
    (what the fused path makes; the optimizer's own step makes one tensor per piece)."""
    opt = engine.inner_optimizer
    checked = 0
    for u in engine.trainable_units:
        by_key = {}
        for t, (_, s_start, _) in zip(u.optim_params, u.optim_slices):
            for key, v in opt.state.get(t, {}).items():
                if key != "step":
                    by_key.setdefault(key, set()).add((v.untyped_storage().data_ptr(), v.storage_offset() - s_start))
        for key, bases in by_key.items():
            assert len(bases) == 1, (u.label, key, bases)
            checked += 1
    return checked


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_fused_host_step_is_the_optimizers_own(kind, tmp_path, monkeypatch):
    spy = _Spy(monkeypatch)
    batches = _batches()
    ref_params, ref_state, ref_mid = _reference(kind, batches, split_state=True)
    initial = {n: p.detach().clone() for n, p in _model().named_parameters()}

    results = {}
    for how in ("optimizer", "fused"):
        model, engine = _engine(kind, how)
        spy.fused = 0
        frozen = {}

        def after(k, model=model, engine=engine, how=how):
            if k == SPLIT - 1:
                sd = engine.full_optimizer_state_dict()
                _assert_state_close(sd, ref_mid, (kind, how, "mid-way"))
                engine.save_checkpoint(tmp_path / how)
                # Round trip on the running engine: the loaded tensors replace the views.
                engine.load_full_optimizer_state_dict(copy.deepcopy(sd))
            if k == 2:
                frozen.update({n: p.detach().clone() for n, p in model.named_parameters() if n.startswith(LAST_USED_AT_2)})

        _train(model, engine, batches, after_step=after)
        params = {n: p.detach().clone() for n, p in engine.full_state_dict().items()}
        state = engine.full_optimizer_state_dict()
        if how == "fused":
            assert spy.fused > 0, "the fused host step never ran (does the engine pass host_fused to step_units?)"
            if kind != "sgd-plain":
                assert _assert_flat_state(engine) > 0
        else:
            assert spy.fused == 0
        engine.close()
        _assert_params_close(params, ref_params, (kind, how))
        _assert_state_close(state, ref_state, (kind, how))
        for n, v in params.items():
            if n.startswith(NEVER):
                assert torch.equal(v, initial[n]), (kind, how, n)  # never stepped: not even weight decay
            if n.startswith(LAST_USED_AT_2):
                assert torch.equal(v, frozen[n]), (kind, how, n)  # left alone after its last gradient
        results[how] = params

        # The checkpoint taken mid-way continues as the reference does.
        model2, engine2 = _engine(kind, how)
        engine2.load_checkpoint(tmp_path / how)
        spy.fused = 0
        _train(model2, engine2, batches[SPLIT:])
        assert (spy.fused > 0) == (how == "fused")
        _assert_params_close(engine2.full_state_dict(), ref_params, (kind, how, "from the checkpoint"))
        _assert_state_close(engine2.full_optimizer_state_dict(), ref_state, (kind, how, "from the checkpoint"))
        engine2.close()
    _assert_params_close(results["fused"], results["optimizer"], (kind, "fused vs optimizer"))


def test_a_plain_torch_state_dict_continues_under_the_fused_step(monkeypatch):
    """torch format -> engine (new tensors, not views of any flat buffer) -> fused steps."""
    spy = _Spy(monkeypatch)
    batches = _batches()
    kind = "adamw-amsgrad"
    ref_params, ref_state, _ = _reference(kind, batches)
    model = _model()
    opt = _make_opt(kind, model.parameters(), foreach=False)
    for ids, route in batches[:SPLIT]:
        opt.zero_grad(set_to_none=True)
        _loss(model, ids, route).backward()
        opt.step()
    handed = ({k: v.clone() for k, v in model.state_dict().items()}, copy.deepcopy(opt.state_dict()))
    model2, engine = _engine(kind, "fused")
    engine.load_full_state_dict(handed[0])
    engine.load_full_optimizer_state_dict(handed[1])
    _train(model2, engine, batches[SPLIT:])
    assert spy.fused > 0
    _assert_params_close(engine.full_state_dict(), ref_params, "continued")
    _assert_state_close(engine.full_optimizer_state_dict(), ref_state, "continued")
    engine.close()


def test_disk_offload_state_is_stepped_in_its_files(tmp_path, monkeypatch):
    """nvme: from the second step on the fused step runs on disk offload's own per-unit
    files (the state views it adopted), with no in-memory copy of the state."""
    spy = _Spy(monkeypatch)
    batches = _batches()
    kind = "adamw-wd"
    ref_params, ref_state, _ = _reference(kind, batches)
    model, engine = _engine(kind, "fused", offload_optimizer="nvme", nvme_path=str(tmp_path / "off"))
    _train(model, engine, batches)
    assert spy.fused > 0
    files = {r.tensor.untyped_storage().data_ptr() for rs in engine.disk_offload.regions.values() for r in rs
             if r.kind == "state"}
    opt = engine.inner_optimizer
    for u in engine.trainable_units:
        for t in u.optim_params:
            for key, v in opt.state.get(t, {}).items():
                if key != "step":
                    assert v.untyped_storage().data_ptr() in files, (u.label, key)
    assert _assert_flat_state(engine) > 0
    _assert_params_close(engine.full_state_dict(), ref_params, "nvme")
    _assert_state_close(engine.full_optimizer_state_dict(), ref_state, "nvme")
    engine.close()


# -- eligibility ------------------------------------------------------------------------------


class _MyAdamW(torch.optim.AdamW):
    pass


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=False),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, differentiable=True),
    lambda ps: _MyAdamW(ps, lr=1e-2),
    lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=torch.tensor(0.1)),
], ids=["fused=False", "differentiable", "subclass", "adamax", "sgd-tensor-weight-decay"])
def test_not_eligible_falls_back_untouched(make):
    model = _model()
    engine = zero_strategy.initialize(model, make(list(model.parameters())), dict(stage=2, offload_optimizer="cpu"))
    ids, route = _batches()[0]
    engine.backward(_loss(model, ids, route))
    opt = engine.inner_optimizer
    u = engine.trainable_units[0]
    for gi, g in enumerate(opt.param_groups):
        g["params"] = u.optim_params if gi == u.group_index else []
    before = u.params_store.optimizer_target.clone()
    grad = torch.ones_like(before)
    assert host_step.fused_host_step(opt, u, grad, None) is False
    assert torch.equal(u.params_store.optimizer_target, before) and not opt.state
    engine.close()


def test_state_in_another_format_falls_back():
    """A piece whose state torch itself would not accept for this group (amsgrad switched
    on after the state was made): the optimizer's own step() decides, so nothing moves."""
    model = _model()
    engine = zero_strategy.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-2),
                                      dict(stage=2, offload_optimizer="cpu"))
    ids, route = _batches()[0]
    engine.backward(_loss(model, ids, route))
    engine.step()
    opt = engine.inner_optimizer
    u = engine.trainable_units[0]
    for gi, g in enumerate(opt.param_groups):
        g["params"] = u.optim_params if gi == u.group_index else []
    opt.param_groups[u.group_index]["amsgrad"] = True
    before = u.params_store.optimizer_target.clone()
    assert host_step.fused_host_step(opt, u, torch.ones_like(before), None) is False
    assert torch.equal(u.params_store.optimizer_target, before)
    engine.close()


# -- 2 processes, cut pieces ---------------------------------------------------------------------


def _dist_worker(rank, ws, kinds, configs):
    import zero_strategy as zs
    from zero_strategy.optim import host_step as hs

    real, count = hs.fused_host_step, [0]

    def spy(*args):
        done = real(*args)
        count[0] += bool(done)
        return done
    hs.fused_host_step = spy
    batches = _batches()
    out = {}
    for kind in kinds:
        for cfg in configs:
            model = _model()
            config = dict(offload_optimizer="cpu", host_optimizer_step="fused", reduce_bucket_size=200, **cfg)
            if cfg["stage"] == 3:
                config["unit_modules"] = ["MoELayer"]
            engine = zs.initialize(model, _make_opt(kind, model.parameters()), config)
            count[0] = 0
            cut = sum(1 for u in engine.trainable_units for t, (i, _, n) in zip(u.optim_params, u.optim_slices)
                      if n != u.layout.numels[i])
            _train(model, engine, batches, rank=rank, ws=ws)
            out[kind, cfg["stage"]] = dict(params=engine.full_state_dict(rank0_only=False),
                                           state=engine.full_optimizer_state_dict(rank0_only=False),
                                           fused=count[0], cut=cut)
            engine.close()
    return out


def test_two_ranks_stage_2_and_3_match_a_single_process_reference():
    kinds = ["adamw-wd", "sgd-nesterov-wd"]
    configs = [dict(stage=2), dict(stage=3, param_persistence_threshold=0)]
    by_rank = run_distributed(_dist_worker, 2, kinds, configs)
    for kind in kinds:
        ref_params, ref_state, _ = _reference(kind, _batches(), ws=2)
        for cfg in configs:
            for rank in (0, 1):
                got = by_rank[rank][kind, cfg["stage"]]
                assert got["fused"] > 0, (kind, cfg, rank)
                _assert_params_close(got["params"], ref_params, (kind, cfg, rank))
                _assert_state_close(got["state"], ref_state, (kind, cfg, rank))
            # Some parameter is cut between the ranks (1-D pieces on each side).
            assert by_rank[0][kind, cfg["stage"]]["cut"] + by_rank[1][kind, cfg["stage"]]["cut"] > 0, (kind, cfg)
