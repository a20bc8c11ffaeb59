"""The one cross-rank primitive: run, then agree (zero_strategy/agreement.py).

Real gloo processes.  What must hold whatever the caller: when the work raises on one
rank only, every rank raises (none waits in a later collective for the peer that gave
up), within a bounded time, naming the failing rank and its message; values that must
be equal are compared; rank 0's object reaches every rank.  Also the deferred
initialisation of Lightning's configure_model, whose mismatch used to raise on the
differing rank only (rank 0 went on into the next collective).
"""
from __future__ import annotations

import time

import pytest
import torch.nn as nn

from dist_harness import run_distributed_outcomes

BOUND = 60.0  # seconds: far above an agreement's cost, far below a hang


def _outcomes(result, world_size):
    assert not result["timed_out"], result
    return [result["ranks"][r] for r in range(world_size)]


def _work_fails_on_rank_1(rank, world_size):
    import zero_strategy

    def work():
        if rank == 1:
            raise OSError("disk on fire")
        return rank * 10

    start = time.monotonic()
    try:
        zero_strategy.run_on_every_rank("reading the weights", work, timeout=BOUND)
    except Exception as exc:  # noqa: BLE001 - the test looks at what each rank raised
        return {"type": type(exc).__name__, "text": str(exc), "seconds": time.monotonic() - start}
    # The same callable succeeding everywhere returns each rank's own value.
    return {"type": None, "text": "", "seconds": time.monotonic() - start}


@pytest.mark.parametrize("world_size", [2, 3])
def test_work_failing_on_one_rank_raises_on_every_rank_naming_it(world_size):
    got = _outcomes(run_distributed_outcomes(_work_fails_on_rank_1, world_size, timeout=3 * BOUND), world_size)
    for r, (kind, value) in enumerate(got):
        assert kind == "ok", value
        assert value["seconds"] < BOUND, value  # agreed, not timed out
        if r == 1:
            assert value["type"] == "OSError" and value["text"] == "disk on fire"  # its own error, unchanged
        else:
            assert value["type"] == "RuntimeError", value
            assert "reading the weights failed on rank(s) [1], so every rank stops: rank 1: OSError: disk on fire" in value["text"]


def _primitives(rank, world_size):
    import zero_strategy
    from zero_strategy.agreement import communicator

    comm = communicator(timeout=BOUND)
    out = {"value": zero_strategy.run_on_every_rank("a read", lambda: rank + 1, timeout=BOUND)}
    out["object"] = comm.broadcast_object({"seed": [1, 2, 3], "from": rank} if rank == 0 else None)
    out["proposed"] = comm.agree("an id", None, proposed=[rank * 7, 5])
    try:
        comm.agree("saving", None, same={"path": "/ckpt" if rank == 0 else f"/ckpt{rank}"}, error_type=ValueError)
        out["same"] = None
    except ValueError as exc:
        out["same"] = str(exc)
    # Several ranks fail: each names all of them.
    try:
        comm.agree("a phase", None if rank == 0 else KeyError(f"k{rank}"), own="never")
        out["several"] = None
    except RuntimeError as exc:
        out["several"] = str(exc)
    return out


def test_agreement_returns_values_compares_and_broadcasts():
    ws = 3
    got = _outcomes(run_distributed_outcomes(_primitives, ws, timeout=3 * BOUND), ws)
    for r, (kind, value) in enumerate(got):
        assert kind == "ok", value
        assert value["value"] == r + 1
        assert value["object"] == {"seed": [1, 2, 3], "from": 0}
        assert value["proposed"] == [7 * (ws - 1), 5]
        assert value["same"] is not None and "different paths" in value["same"] and "rank 2: '/ckpt2'" in value["same"]
        assert "a phase failed on rank(s) [1, 2]" in value["several"]
        assert "rank 1: KeyError: 'k1'" in value["several"] and "rank 2: KeyError: 'k2'" in value["several"]


def _deferred_with_a_different_model_on_rank_1(rank, world_size):
    import zero_strategy
    from zero_strategy.agreement import communicator
    from zero_strategy.materialize import recording as _deferred

    with zero_strategy.init_context():
        layers = [nn.Linear(4, 3), nn.Linear(3, 2)] + ([nn.Linear(2, 2)] if rank == 1 else [])
        model = nn.Sequential(*layers)
    start = time.monotonic()
    try:
        _deferred._use_rank0_random_states(model, communicator(timeout=BOUND))
    except ValueError as exc:
        return {"text": str(exc), "seconds": time.monotonic() - start}
    return {"text": None, "seconds": time.monotonic() - start}


def test_deferred_models_that_differ_between_ranks_stop_every_rank():
    got = _outcomes(run_distributed_outcomes(_deferred_with_a_different_model_on_rank_1, 2, timeout=3 * BOUND), 2)
    for r, (kind, value) in enumerate(got):
        assert kind == "ok", value
        assert value["text"] is not None, f"rank {r} went on"
        assert "built different parameters on rank 1 than on rank 0" in value["text"], value
        assert value["seconds"] < BOUND
