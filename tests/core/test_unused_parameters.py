"""A parameter that got no gradient in a step is left exactly alone, as plain torch and DDP do.

A routed mixture of experts whose routing is fixed per step and per sample:

* expert 0 gets tokens every step;
* expert 1 gets tokens in steps 0-2 only (afterwards momentum and weight decay must not move it);
* expert 2 never gets a token (its values stay bit-equal to the initial ones, no optimizer state);
* expert 3 gets tokens from step 3 on (Adam's bias correction must use its own step count);
* in step 2 expert 1 gets only samples of rank 0's half of the batch: used on one rank is
  used (DDP averages in the other rank's zero contribution), so it must be updated.

The reference is plain torch on one process over each step's global batch (each rank's
half backpropagated with loss / N, then one step), with ``zero_grad(set_to_none=True)``,
so unused parameters have ``grad is None`` and torch's optimizers skip them.  ZeRO runs
on 2 gloo processes at stages 0-3 (stage 3 with every parameter partitioned), with SGD
(momentum, weight decay) and AdamW (weight decay); it also saves a checkpoint mid-way
and resumes it at another stage, which must continue identically.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dist_harness import run_distributed

D, VOCAB, SEQ, BATCH, STEPS, SAVE_AT = 8, 13, 4, 4, 6, 3
# ROUTES[step] = expert for each of the BATCH samples (rank r gets samples [2r, 2r+2)).
ROUTES = [
    [0, 1, 0, 1],
    [1, 0, 1, 0],
    [1, 0, 0, 0],  # expert 1: rank 0's samples only
    [0, 3, 3, 0],
    [3, 0, 0, 3],
    [0, 0, 3, 3],
]
NEVER_USED = "moe.experts.2."
LAST_USED_IN_STEP_2 = "moe.experts.1."


class MoELayer(nn.Module):
    """Top-1 routing given by the batch; an expert without tokens is not called (as in
    transformers' Mixtral), so its parameters get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D)) for _ in range(4))

    def forward(self, x, route):
        out = torch.zeros_like(x)
        for e in sorted(set(route.tolist())):
            rows = (route == e).nonzero().reshape(-1)
            out = out.index_add(0, rows, self.experts[e](x[rows]))
        return x + out


class RoutedMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.moe = MoELayer()
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids, route):
        return self.head(self.moe(self.embed(ids), route))


def _batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.tensor(r)) for r in ROUTES]


def _loss(model, ids, route):
    logits = model(ids, route).float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _model():
    torch.manual_seed(0)
    return RoutedMoE()


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3, weight_decay=0.1)


def _reference(kind, ws=2):
    model = _model()
    opt = _optimizer(kind, model.parameters())
    for ids, route in _batches():
        opt.zero_grad(set_to_none=True)
        for r in range(ws):
            (_loss(model, ids.chunk(ws)[r], route.chunk(ws)[r]) / ws).backward()
        opt.step()
    steps = {n: int(opt.state[p]["step"]) if "step" in opt.state.get(p, {}) else 0 for n, p in model.named_parameters()}
    has_state = {n: bool(opt.state.get(p)) for n, p in model.named_parameters()}
    return {n: p.detach().clone() for n, p in model.named_parameters()}, has_state, steps


def _local_state(engine):
    """name -> (has optimizer state, Adam step or 0) for every parameter piece on this rank."""
    out = {}
    state = engine.inner_optimizer.state
    for u in engine.trainable_units:
        for t, (i, _, _) in zip(u.optim_params, u.optim_slices):
            st = state.get(t, {})
            out[u.names[i][0]] = (bool(st), int(st["step"]) if "step" in st else 0)
    return out


def _worker(rank, ws, kind, configs, directory):
    import zero_strategy

    results = {}
    batches = _batches()
    # At stage 3 the MoE layer is the gather unit (as a decoder layer is for Mixtral): the
    # ranks route differently, and every rank must run the same units.
    unit = {"unit_modules": ["MoELayer"]}
    for stage, threshold in configs:
        cfg = dict(stage=stage, **({} if threshold is None else {"param_persistence_threshold": threshold}))
        if stage == 3:
            cfg.update(unit)
        model = _model()
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        engine = zero_strategy.initialize(model, _optimizer(kind, model.parameters()), cfg)
        after_step_2 = None
        ckpt = f"{directory}/{kind}-{stage}-{threshold}"
        for step, (ids, route) in enumerate(batches):
            engine.backward(_loss(model, ids.chunk(ws)[rank], route.chunk(ws)[rank]))
            engine.step()
            if step == 2:
                after_step_2 = engine.full_state_dict(rank0_only=False)
            if step == SAVE_AT - 1:
                engine.save_checkpoint(ckpt)
        final = engine.full_state_dict(rank0_only=False)
        local = _local_state(engine)
        engine.close()

        # Resume the mid-way checkpoint at another stage and run the remaining steps.
        other = dict(stage=1, param_persistence_threshold=0) if stage != 1 else dict(stage=3, param_persistence_threshold=0, **unit)
        model2 = _model()
        engine2 = zero_strategy.initialize(model2, _optimizer(kind, model2.parameters()), other)
        engine2.load_checkpoint(ckpt)
        hyper = {k: v for k, v in engine2.inner_optimizer.param_groups[0].items() if k != "params"}
        for ids, route in batches[SAVE_AT:]:
            engine2.backward(_loss(model2, ids.chunk(ws)[rank], route.chunk(ws)[rank]))
            engine2.step()
        resumed = engine2.full_state_dict(rank0_only=False)
        engine2.close()
        results[(stage, threshold)] = dict(initial=initial, after_step_2=after_step_2, final=final, local=local,
                                           resumed=resumed, hyper=hyper)
    return results


CONFIGS = [(0, None), (1, None), (2, None), (3, 0)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_parameters_without_gradients_are_left_alone_at_every_stage(kind, tmp_path):
    ref, ref_has_state, ref_steps = _reference(kind)
    plain_hyper = {k: v for k, v in _optimizer(kind, _model().parameters()).param_groups[0].items() if k != "params"}
    assert not ref_has_state["moe.experts.2.0.weight"] and ref_has_state["moe.experts.3.0.weight"]  # the scenario holds
    by_rank = run_distributed(_worker, 2, kind, CONFIGS, str(tmp_path))
    for config in CONFIGS:
        got = by_rank[0][config]
        for name, value in got["final"].items():
            if name.startswith(NEVER_USED):
                assert torch.equal(value, got["initial"][name]), (config, name)  # not moved at all
            elif name.startswith(LAST_USED_IN_STEP_2):
                # Used in steps 0-2 (step 2: rank 0's samples only), then never: not moved since.
                assert torch.equal(value, got["after_step_2"][name]), (config, name)
            torch.testing.assert_close(value, ref[name], rtol=0, atol=2e-6, msg=lambda m: f"{config} {name}: {m}")
            torch.testing.assert_close(got["resumed"][name], ref[name], rtol=0, atol=2e-6,
                                       msg=lambda m: f"{config} resumed {name}: {m}")
        # Hyperparameters come back from the checkpoint as the optimizer had them (types too:
        # Adam's betas are a tuple, which JSON does not have).
        assert by_rank[0][config]["hyper"] == plain_hyper, config
        assert all(type(v) is type(plain_hyper[k]) for k, v in by_rank[0][config]["hyper"].items()), config
        for r in (0, 1):
            for name, (has_state, step) in by_rank[r][config]["local"].items():
                assert has_state == ref_has_state[name], (config, r, name)
                if kind == "adamw":
                    assert step == ref_steps[name], (config, r, name, step, ref_steps[name])
