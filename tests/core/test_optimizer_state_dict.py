"""Optimizer state in torch's own format, both directions, against plain torch.

(Also ``zero_strategy.checkpoint.load_consolidated_optimizer_state``: the same state read
offline from a checkpoint directory.)

``engine.full_optimizer_state_dict()`` must equal what the same optimizer holds after the
same steps without ZeRO (plain torch on one process over each step's global batch:
what DDP holds on every rank), key for key, including which parameters have no state
(the expert that never got a token).  And a plain torch optimizer's ``state_dict()``
(what a DDP checkpoint holds) loaded into an engine with
``load_full_optimizer_state_dict`` must continue exactly as plain torch continues.
Stages 0-3 (stage 3 with every parameter partitioned) on 2 gloo processes, AdamW.
"""
from __future__ import annotations

import copy

import pytest
import torch

from dist_harness import run_distributed
from test_unused_parameters import _batches, _loss, _model, _optimizer

SPLIT = 3  # steps before the state dict is taken / handed over


def _plain(steps, ws=2, start=None):
    model = _model()
    opt = _optimizer("adamw", model.parameters())
    if start is not None:
        model.load_state_dict(start[0])
        opt.load_state_dict(start[1])
    for ids, route in steps:
        opt.zero_grad(set_to_none=True)
        for r in range(ws):
            (_loss(model, ids.chunk(ws)[r], route.chunk(ws)[r]) / ws).backward()
        opt.step()
    return model, opt


def _worker(rank, ws, configs, handed_over, directory):
    import zero_strategy

    batches = _batches()
    out = {}
    for stage, threshold in configs:
        cfg = dict(stage=stage, **({} if threshold is None else {"param_persistence_threshold": threshold}))
        if stage == 3:
            cfg["unit_modules"] = ["MoELayer"]
        # ZeRO -> torch format.
        model = _model()
        engine = zero_strategy.initialize(model, _optimizer("adamw", model.parameters()), cfg)
        for ids, route in batches[:SPLIT]:
            engine.backward(_loss(model, ids.chunk(ws)[rank], route.chunk(ws)[rank]))
            engine.step()
        saved = engine.full_optimizer_state_dict()
        engine.save_checkpoint(f"{directory}/{stage}-{threshold}")
        everywhere = engine.full_optimizer_state_dict(rank0_only=False)
        engine.close()
        # torch format (a plain run's state) -> ZeRO, then the remaining steps.
        model2 = _model()
        engine2 = zero_strategy.initialize(model2, _optimizer("adamw", model2.parameters()), cfg)
        engine2.load_full_state_dict(handed_over[0])
        engine2.load_full_optimizer_state_dict(handed_over[1])
        for ids, route in batches[SPLIT:]:
            engine2.backward(_loss(model2, ids.chunk(ws)[rank], route.chunk(ws)[rank]))
            engine2.step()
        final = engine2.full_state_dict(rank0_only=False)
        final_opt = engine2.full_optimizer_state_dict(rank0_only=False)
        engine2.close()
        out[(stage, threshold)] = dict(saved=saved, everywhere=everywhere, final=final, final_opt=final_opt)
    return out


def _plain_json(groups):
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]


def _assert_same_optimizer_state(got, want, where, json_groups=False):
    if json_groups:  # read back from a manifest: JSON has lists where torch has tuples
        assert _plain_json(got["param_groups"]) == _plain_json(want["param_groups"]), where
    else:
        assert got["param_groups"] == want["param_groups"], where
    assert sorted(got["state"]) == sorted(want["state"]), where  # same parameters have state
    for idx, st in want["state"].items():
        assert sorted(got["state"][idx]) == sorted(st), (where, idx)
        for key, v in st.items():
            g = got["state"][idx][key]
            if isinstance(v, torch.Tensor):
                assert g.shape == v.shape and g.dtype == v.dtype, (where, idx, key)
                torch.testing.assert_close(g, v, rtol=0, atol=1e-6, msg=lambda m: f"{where} {idx} {key}: {m}")
            else:
                assert g == v, (where, idx, key)


CONFIGS = [(0, None), (1, None), (2, None), (3, 0)]


@pytest.mark.slow
def test_torch_format_optimizer_state_both_directions(tmp_path):
    from zero_strategy.checkpoint import load_consolidated_optimizer_state

    batches = _batches()
    ref_model, ref_opt = _plain(batches[:SPLIT])
    reference = copy.deepcopy(ref_opt.state_dict())  # state_dict() holds the live tensors
    never = [i for i, (n, _) in enumerate(ref_model.named_parameters()) if n.startswith("moe.experts.2.")]
    assert never and not any(i in reference["state"] for i in never)  # the scenario holds
    handed_over = ({k: v.clone() for k, v in ref_model.state_dict().items()}, copy.deepcopy(ref_opt.state_dict()))
    cont_model, cont_opt = _plain(batches[SPLIT:], start=copy.deepcopy(handed_over))
    cont_params = dict(cont_model.named_parameters())
    cont_state = cont_opt.state_dict()

    by_rank = run_distributed(_worker, 2, CONFIGS, handed_over, str(tmp_path))
    for config in CONFIGS:
        got = by_rank[0][config]
        _assert_same_optimizer_state(got["saved"], reference, (config, "saved"))
        # Offline, from the checkpoint directory (no process group): the same state.
        offline = load_consolidated_optimizer_state(tmp_path / f"{config[0]}-{config[1]}")
        _assert_same_optimizer_state(offline, reference, (config, "from the checkpoint"), json_groups=True)
        assert by_rank[1][config]["saved"] == {}  # rank0_only
        _assert_same_optimizer_state(by_rank[1][config]["everywhere"], reference, (config, "every rank"))
        for name, value in got["final"].items():
            torch.testing.assert_close(value, cont_params[name].detach(), rtol=0, atol=2e-6,
                                       msg=lambda m: f"{config} {name} after loading a plain state: {m}")
        _assert_same_optimizer_state(got["final_opt"], cont_state, (config, "continued"))
