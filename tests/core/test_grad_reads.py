"""``.grad`` under ZeRO reads and writes what a single process (DDP's numbers) shows.

Two gloo ranks, one launch for every configuration.  The reference is plain torch on
one process over the whole global batch (each rank's micro-batch loss, averaged over
ranks, as the engine averages gradients), with the same edits made to its ``.grad``:

* after a synchronised backward, every ``p.grad`` equals the reference gradient, and
  ``torch.nn.utils.get_total_norm`` over them the reference norm;
* edits through ``.grad`` (zeroing rows in place, ``clip_grads_with_norm_``, assigning
  a tensor, ``= None``) are what the step applies: weights equal the reference's after it;
* with ``step_clears_gradients=False`` the gradients stay readable after step() until
  zero_grad(); with the default they are gone after step();
* inside ``no_sync`` at stage 1 (and at stages 2-3 with ``no_sync_reduces=False``)
  ``.grad`` is this rank's local gradient; at stages 2-3 by default it is the gradient
  reduced so far;
* a read on one rank only meets the other rank's next collective: both fail, naming it.

Stage 3 runs with every parameter partitioned (threshold 0) and at the default
threshold (nothing partitioned in a model this small).
"""
from __future__ import annotations

import copy

import pytest
import torch

from dist_harness import run_distributed, run_distributed_outcomes
from models import tiny_gpt2

LR = 1e-2
EDITED_ROWS = 10


def batches(n: int, ws: int, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (2 * ws, 12), generator=g) for _ in range(n)]


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss


def edit(model, grads_of):
    """The same gradient surgery on the engine's model and on the reference: zero some
    embedding rows in place, clip by the total norm, replace one gradient, drop one; then
    clip again through torch's clip_grad_norm_ (the engine's, for an engine's model) and
    halve one gradient after that.  Returns the norms seen and the gradients read after
    the second clip."""
    named = dict(model.named_parameters())
    grads_of(named["transformer.wte.weight"])[:EDITED_ROWS] = 0
    params = [p for p in model.parameters() if p.requires_grad]
    total = torch.nn.utils.get_total_norm([grads_of(p) for p in params])
    torch.nn.utils.clip_grads_with_norm_(params, max_norm=0.05, total_norm=total)
    replaced = named["transformer.h.0.mlp.c_fc.bias"]
    replaced.grad = torch.full_like(replaced, 0.01)
    named["transformer.h.1.attn.c_proj.bias"].grad = None  # no gradient: the optimizer skips it
    second = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.02)
    clipped = {n: None if p.grad is None else p.grad.clone() for n, p in named.items()}
    grads_of(named["transformer.ln_f.weight"]).mul_(0.5)  # an edit after clipping: not clipped again
    return float(total), float(second), clipped


def _worker(rank, ws):
    import zero_strategy

    out = {}
    data = batches(2, ws)
    configs = {
        "s0": dict(stage=0), "s1": dict(stage=1), "s2": dict(stage=2), "s3t0": dict(stage=3, param_persistence_threshold=0),
        "s3": dict(stage=3), "s2_offload": dict(stage=2, offload_optimizer="cpu"),
    }
    for name, cfg in configs.items():
        ref = tiny_gpt2(seed=0)
        model = copy.deepcopy(ref)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
        engine = zero_strategy.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR),
                                          dict(cfg, step_clears_gradients=False, reduce_bucket_size=2000))
        got = {}
        # Reference: the global batch, each rank's micro-batch loss averaged over ranks.
        loss = sum(loss_of(ref, b) for b in data[0].chunk(ws)) / ws
        loss.backward()
        want = {n: p.grad.clone() for n, p in ref.named_parameters()}
        engine.backward(loss_of(model, data[0].chunk(ws)[rank]))
        read = {n: p.grad for n, p in model.named_parameters()}
        got["read_types"] = sorted({type(g).__name__ for g in read.values()})
        got["read_diff"] = max(float((read[n] - want[n]).abs().max()) for n in want)
        got["norm"] = float(torch.nn.utils.get_total_norm(list(read.values())))
        got["ref_norm"] = float(torch.nn.utils.get_total_norm(list(want.values())))
        got["edit_norm"], got["clip_norm"], clipped = edit(model, lambda p: p.grad)
        got["ref_edit_norm"], got["ref_clip_norm"], ref_clipped = edit(ref, lambda p: p.grad)
        got["clipped_read_diff"] = max(float((clipped[n] - ref_clipped[n]).abs().max()) for n in clipped
                                       if ref_clipped[n] is not None)
        got["clipped_none"] = [n for n in clipped if clipped[n] is None] == [n for n in ref_clipped if ref_clipped[n] is None]
        after_edit = {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
        engine.step()
        ref_opt.step()
        got["kept_after_step"] = all(
            (after_edit[n] is None and p.grad is None) or (p.grad is not None and torch.equal(p.grad, after_edit[n]))
            for n, p in model.named_parameters())
        got["grad_dtypes"] = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
        engine.zero_grad()
        got["none_after_zero_grad"] = all(p.grad is None for p in model.parameters())
        full = engine.full_state_dict(rank0_only=False)
        got["weights_diff"] = max(float((full[n] - t).abs().max()) for n, t in ref.state_dict().items() if n in full)
        skipped = "transformer.h.1.attn.c_proj.bias"
        got["skipped_unchanged"] = torch.equal(full[skipped], tiny_gpt2(seed=0).state_dict()[skipped])
        # The default: step() clears, and .grad says so.
        engine.close()
        model = tiny_gpt2(seed=0)
        engine = zero_strategy.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), dict(cfg))
        engine.backward(loss_of(model, data[0].chunk(ws)[rank]))
        got["read_before_default_step"] = all(p.grad is not None for p in model.parameters())
        engine.step()
        got["none_after_default_step"] = all(p.grad is None for p in model.parameters())
        engine.close()
        out[name] = got

    # Accumulation: what .grad shows inside no_sync, and after the synchronised backward.
    for name, cfg in {"s1": dict(stage=1), "s2_local": dict(stage=2, no_sync_reduces=False),
                      "s3t0_local": dict(stage=3, param_persistence_threshold=0, no_sync_reduces=False),
                      "s2_reducing": dict(stage=2)}.items():
        ref = tiny_gpt2(seed=0)
        model = copy.deepcopy(ref)
        engine = zero_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=LR), dict(cfg))
        mine = [b.chunk(ws)[rank] for b in data]
        local = {}
        loss_of(ref, mine[0]).backward()  # this rank's own first micro-batch
        local = {n: p.grad.clone() for n, p in ref.named_parameters()}
        ref.zero_grad()
        (sum(loss_of(ref, b) for b in data[0].chunk(ws)) / ws).backward()
        partial = {n: p.grad.clone() for n, p in ref.named_parameters()}
        (sum(loss_of(ref, b) for b in data[1].chunk(ws)) / ws).backward()
        total = {n: p.grad.clone() for n, p in ref.named_parameters()}
        with engine.no_sync():
            engine.backward(loss_of(model, mine[0]))
        inside = {n: p.grad for n, p in model.named_parameters()}
        got = {"local_diff": max(float((inside[n] - local[n]).abs().max()) for n in local),
               "partial_diff": max(float((inside[n] - partial[n]).abs().max()) for n in partial)}
        engine.backward(loss_of(model, mine[1]))
        got["total_diff"] = max(float((p.grad - total[n]).abs().max()) for n, p in model.named_parameters())
        engine.close()
        out["accumulate_" + name] = got
    return out


@pytest.mark.slow
def test_grad_reads_and_edits_match_a_single_process():
    results = run_distributed(_worker, 2)
    for rank, r in enumerate(results):
        for name in ("s0", "s1", "s2", "s3t0", "s3", "s2_offload"):
            got = r[name]
            assert got["read_types"] == ["Tensor"], (name, got)
            assert got["read_diff"] < 1e-6, (name, rank, got)
            assert abs(got["norm"] - got["ref_norm"]) < 1e-5 * got["ref_norm"], (name, got)
            assert abs(got["edit_norm"] - got["ref_edit_norm"]) < 1e-5 * got["ref_edit_norm"], (name, got)
            assert abs(got["clip_norm"] - got["ref_clip_norm"]) < 1e-5 * got["ref_clip_norm"], (name, got)
            assert got["clipped_read_diff"] < 1e-7 and got["clipped_none"], (name, got)  # .grad after clipping
            assert got["kept_after_step"] and got["none_after_zero_grad"], (name, got)
            assert got["grad_dtypes"] == ["torch.float32"], (name, got)
            assert got["weights_diff"] < 1e-6, (name, rank, got)
            assert got["skipped_unchanged"], name
            assert got["read_before_default_step"] and got["none_after_default_step"], (name, got)
        for name in ("s1", "s2_local", "s3t0_local"):
            got = r["accumulate_" + name]
            assert got["local_diff"] < 1e-6 < got["partial_diff"], (name, got)  # local, not reduced
            assert got["total_diff"] < 1e-6, (name, got)
        got = r["accumulate_s2_reducing"]
        assert got["partial_diff"] < 1e-6 < got["local_diff"], got  # reduced as produced (the default)
        assert got["total_diff"] < 1e-6, got


def _one_sided(rank, ws):
    import zero_strategy

    model = tiny_gpt2(seed=0)
    engine = zero_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=LR),
                                      dict(stage=2, collective_timeout=20))
    ids = batches(1, ws)[0].chunk(ws)[rank]
    engine.backward(loss_of(model, ids))
    if rank == 0:
        print(model.transformer.wte.weight.grad.norm())  # rank 0 alone reads a gradient
    engine.step()
    return "done"


@pytest.mark.slow
def test_a_read_on_one_rank_fails_on_every_rank_naming_it():
    outcome = run_distributed_outcomes(_one_sided, 2, timeout=120)
    assert not outcome["timed_out"], outcome
    for rank, (kind, value) in outcome["ranks"].items():
        assert kind == "error", (rank, kind, value)
        assert "read through .grad" in value, (rank, value[-2000:])
