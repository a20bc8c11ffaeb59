"""Stage 3's gather schedule across the forward/backward boundary (gather.py,
[Note: kept for backward]): the group released last by a training forward (GPT-2's
root: embeddings, tied head, final norm) is not released and gathered again as
backward's first collective, backward prefetch leaves the head's backward alone, and
nothing stays gathered when no backward comes.  Every parameter is partitioned
(threshold 0) and each block is its own gather (min_gather_numel=0)."""
from __future__ import annotations

import torch

from models import tiny_gpt2
from zero_strategy.sharding.param_shard import ShardState

N_LAYER = 4


def _engine():
    import zero_strategy

    model = tiny_gpt2(n_layer=N_LAYER, n_embd=64)
    engine = zero_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      dict(stage=3, param_persistence_threshold=0, min_gather_numel=0))
    return model, engine


def _all_sharded(engine) -> bool:
    return all(u.state is ShardState.SHARDED for g in engine.gatherer.groups for u in g.units)


def _gathers(engine) -> int:
    return engine.comm_report().kinds["all_gather"].calls


def test_one_gather_per_group_and_pass_except_the_group_backward_starts_with():
    model, engine = _engine()
    groups = len(engine.gatherer.groups)
    assert groups == N_LAYER + 1  # the blocks and the root
    ids = torch.randint(0, 96, (2, 8))
    per_step = []
    for _ in range(3):
        engine.reset_comm_report()
        loss = model(input_ids=ids, labels=ids).loss
        if len(per_step) > 0:  # after the recording step: the root is still gathered for backward
            assert engine.gatherer.root_group.gathered
        engine.backward(loss)
        engine.step()
        assert _all_sharded(engine)
        per_step.append(_gathers(engine))
    engine.close()
    # The first step records the orders (a gather per group in forward and in backward);
    # afterwards the root's backward gather is saved.
    assert per_step == [2 * groups, 2 * groups - 1, 2 * groups - 1], per_step


def test_backward_prefetches_each_block_from_the_one_after_it_not_from_the_head():
    """Backward starts at the root (the head), then runs the blocks last to first.  The
    head's backward prefetches nothing (a block gathered then would sit beside the
    logits' gradient at the step's peak); from the last block on, each block's backward
    prefetches the one before it, so every other block's gather is under way when its
    backward starts."""
    model, engine = _engine()
    gatherer = engine.gatherer
    blocks = {id(m): f"h.{i}" for i, m in enumerate(model.transformer.h)}
    seen = []
    original = gatherer.pre_backward

    def spy(group):
        seen.append((blocks.get(id(group.module), "root"), group.gathered))
        original(group)

    gatherer.pre_backward = spy
    ids = torch.randint(0, 96, (2, 8))
    for _ in range(2):  # the first step records the orders; the second uses them
        seen.clear()
        engine.backward(model(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.close()
    last = f"h.{N_LAYER - 1}"
    assert [name for name, _ in seen] == ["root"] + [f"h.{i}" for i in reversed(range(N_LAYER))], seen
    assert dict(seen) == {"root": True, last: False, **{f"h.{i}": True for i in range(N_LAYER - 1)}}, seen


def test_a_forward_without_backward_leaves_nothing_gathered():
    model, engine = _engine()
    ids = torch.randint(0, 96, (2, 8))
    engine.backward(model(input_ids=ids, labels=ids).loss)  # records the orders
    engine.step()
    model(input_ids=ids, labels=ids)  # a grad-enabled forward whose backward never comes
    assert engine.gatherer.root_group.gathered
    engine.zero_grad()
    assert _all_sharded(engine)
    model(input_ids=ids, labels=ids)
    with torch.no_grad():  # an evaluation forward in between releases it too
        model(input_ids=ids)
    assert _all_sharded(engine)
    # and training goes on: backward gathers the root again
    engine.backward(model(input_ids=ids, labels=ids).loss)
    engine.step()
    assert _all_sharded(engine)
    engine.close()
