"""Every collective wait is bounded, and an error that reaches one rank reaches every
rank (issue #16 items 3 and 7), provoked on real gloo processes.

One spawn of two processes runs every case in turn (the fixture below); each case has
its own process group (``dist.new_group``), because a collective abandoned at its
deadline stays queued in gloo and would pair with the next case's.  The store is a
TCPStore hosted by rank 0's process, as under torchrun, so that stopping rank 0 freezes
the store the failure reports go through.  Each rank records ``time.monotonic()`` (one
clock for every process of the machine) at the fault and at its error, so the bound is
checked per rank, from the fault, not only for the whole run.

Bounds, with T = collective_timeout and W = the report window (diagnosis.report_window):
a rank waiting for a stalled peer raises after T (its own deadline) plus at most W
(collecting the others' reports, which a silent peer never sends); a stopped store
host costs one bounded store call instead of W; a collective API called on one rank
while the other goes on training is caught in-band by the headers, well within T.
"""
import datetime
import errno
import hashlib
import importlib
import os
import signal
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_distributed_outcomes
from models import Trunk

T = 2.0  # collective_timeout in these tests (seconds)
W = min(T, 5.0)  # diagnosis.report_window(T): how long a failing rank collects the others' reports
SLACK = 3.0  # scheduling on a busy 2-core machine, store round trips
STALL = T + W + 2.0  # a stalled rank stays away past the others' whole report
PG_TIMEOUT = 2.0  # the process group's own timeout, in the case where it fires first
SPAWN = 150.0  # the harness's deadline: reached only when something hangs
WIDTH = 16
NOTES = "the user's notes, not a checkpoint\n"




def _batch(rank, step):
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))


def _setup(config, pg_timeout=None):
    """A model and an engine on a process group of their own."""
    import zero_strategy

    kw = {} if pg_timeout is None else {"timeout": datetime.timedelta(seconds=pg_timeout)}
    group = dist.new_group(backend="gloo", **kw)
    torch.manual_seed(0)
    model = Trunk()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = dict(stage=2, collective_timeout=T)
    cfg.update(config)
    return model, zero_strategy.initialize(model, opt, cfg, process_group=group)


def _train_step(model, engine, rank, step):
    engine.backward(model(_batch(rank, step)))
    engine.step()


def _attempt(rec, fn):
    """Run ``fn``; record its value or its error, and when it ended."""
    try:
        rec["value"] = fn()
        rec["kind"] = "ok"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        rec.update(kind="error", type=type(exc).__name__, text=str(exc))
    rec["end"] = time.monotonic()
    return rec


def _stop_self():
    os.kill(os.getpid(), signal.SIGSTOP)  # resumed by the other rank once it has failed


# -- item 3: a stalled rank in the stage-2 gradient reduce-scatter --------------------------
def _stalled(rank, pids, how, stalled_rank=1, config=None, pg_timeout=None):
    """``stalled_rank`` stalls between forward and backward of step 1 (sleeping, or
    SIGSTOPped); the other rank waits in the gradient reduce-scatter."""
    model, engine = _setup(config or {}, pg_timeout)
    rec = {}

    def train():
        for step in range(3):
            loss = model(_batch(rank, step))
            if step == 1 and rank == stalled_rank:
                rec["fault"] = time.monotonic()
                if how == "stop":
                    _stop_self()
                else:
                    time.sleep(how)
                rec["resumed"] = time.monotonic()
            engine.backward(loss)
            engine.step()
        return "finished"

    _attempt(rec, train)
    if how == "stop" and rank != stalled_rank:
        os.kill(pids[stalled_rank], signal.SIGCONT)
    return rec


# -- item 7: a collective API called on rank 0 only ----------------------------------------
def _rank0_only_full_state_dict(rank, pids, others):
    """After step 0, ``if rank == 0: engine.full_state_dict()``; rank 1 meanwhile goes
    on training (``"train"``) or is busy outside zero_strategy (``"away"``)."""
    model, engine = _setup({"stage": 3, "param_persistence_threshold": 0})
    rec = {}
    _train_step(model, engine, rank, 0)

    def after():
        rec["fault"] = time.monotonic()
        if rank == 0:
            engine.full_state_dict()
            return "gathered"
        if others == "away":
            time.sleep(STALL)  # evaluating, say, without the engine
            return "away"
        for step in (1, 2):
            _train_step(model, engine, rank, step)
        return "trained"

    return _attempt(rec, after)


# -- item 7: an exception on one rank inside save_checkpoint --------------------------------
def _digest(folder):
    h = hashlib.sha256()
    for root, dirs, names in sorted(os.walk(folder)):
        dirs.sort()
        for name in sorted(names):
            p = os.path.join(root, name)
            h.update(os.path.relpath(p, folder).encode())
            with open(p, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def _failed_saves(rank, pids, folder):
    model, engine = _setup({"stage": 2})
    ckpt = os.path.join(folder, "ckpt")
    rec = {}
    _train_step(model, engine, rank, 0)
    engine.save_checkpoint(ckpt)
    saved = engine.full_state_dict(rank0_only=False)
    rec["digest_before"] = _digest(ckpt)
    _train_step(model, engine, rank, 1)

    # The target is the user's plain file: only rank 0 checks it.
    rec["plain"] = {"fault": time.monotonic()}
    _attempt(rec["plain"], lambda: engine.save_checkpoint(os.path.join(folder, "notes.txt")))

    # The disk is full on rank 1 while it writes its shard.
    real_fsync = os.fsync

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    rec["enospc"] = {"fault": time.monotonic()}
    if rank == 1:
        os.fsync = full_disk
    try:
        _attempt(rec["enospc"], lambda: engine.save_checkpoint(ckpt))
    finally:
        os.fsync = real_fsync
    rec["digest_after"] = _digest(ckpt)

    # The previous checkpoint loads, and training and saving go on together.
    def resume():
        engine.load_checkpoint(ckpt)
        loaded = engine.full_state_dict(rank0_only=False)
        same = sorted(saved) == sorted(loaded) and all(torch.equal(saved[k], loaded[k]) for k in saved)
        step = engine.global_step
        _train_step(model, engine, rank, 2)
        engine.save_checkpoint(ckpt)
        return {"same_as_saved": same, "step_loaded": step}

    rec["resume"] = _attempt({}, resume)
    return rec


# -- the spawn -----------------------------------------------------------------------------
CASES = [
    # name, function, args
    ("sleeping", _stalled, (STALL,)),
    ("stopped", _stalled, ("stop",)),
    ("store_host_stopped", _stalled, ("stop", 0)),
    ("pg_timeout_first", _stalled, (PG_TIMEOUT + 1.5, 1, {"collective_timeout": 30.0}, PG_TIMEOUT)),
    ("full_state_dict_away", _rank0_only_full_state_dict, ("away",)),
    ("full_state_dict_train", _rank0_only_full_state_dict, ("train",)),
    ("saves", _failed_saves, None),
]


def _store_on_rank0(rank, ws, port):
    """Replace the harness's FileStore group by one whose TCPStore rank 0 hosts."""
    dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", port, ws, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ws)


def _worker(rank, ws, port, folder):
    importlib.import_module("zero_strategy")  # imported before any clock starts
    _store_on_rank0(rank, ws, port)
    pids = [None] * ws
    dist.all_gather_object(pids, os.getpid())
    for name, fn, args in CASES:
        dist.barrier()  # the default group: no case's collective is left on it
        start = time.monotonic()
        try:
            rec = fn(rank, pids, *(args if args is not None else (folder,)))
        except Exception:  # noqa: BLE001 - the case's test reports it
            rec = {"kind": "crash", "text": traceback.format_exc()}
        rec["case_seconds"] = time.monotonic() - start
        # Each case's records are kept as soon as it ends: a process that dies later
        # (gloo aborts one that receives more than it posted) fails its own case only.
        torch.save(rec, os.path.join(folder, f"{name}.rank{rank}.pt"))
    dist.barrier()
    return "done"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fault_bounds")
    (folder / "notes.txt").write_text(NOTES)
    result = run_distributed_outcomes(_worker, 2, _free_port(), str(folder), timeout=SPAWN)
    print(f"\n[test_fault_bounds] one spawn, all cases: {result['seconds']:.1f} s")
    got = {}
    for name, _, _ in CASES:
        files = [folder / f"{name}.rank{r}.pt" for r in range(2)]
        if all(f.exists() for f in files):
            got[name] = [torch.load(f, weights_only=False) for f in files]
    print("[test_fault_bounds] each case (rank 0): "
          + ", ".join(f"{n} {r[0]['case_seconds']:.1f} s" for n, r in got.items()))
    return got, folder, result


def _case(cases, name):
    """Both ranks' records of case ``name``; fails naming how the spawn ended when a
    rank did not get to the end of the case."""
    got, _, result = cases
    assert name in got, f"case {name!r} did not end on every rank: {result}"
    return got[name]


def _error(rec, kind="CollectiveError"):
    assert rec["kind"] == "error" and rec["type"] == kind, rec
    return rec["text"]


def _seconds(rec, since):
    return rec["end"] - since


def _report(name, **seconds):
    print(f"[test_fault_bounds] {name}: " + ", ".join(f"{k} {v:.2f} s" for k, v in seconds.items()))


# -- item 3 --------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["sleeping", "stopped"])
def test_a_stalled_rank_in_the_gradient_reduce_scatter_ends_the_other_within_the_timeout(cases, name):
    """gloo's reduce-scatter does not honour wait(timeout=); a rank sleeping (or
    SIGSTOPped) between forward and backward must not hold the other rank past T + W."""
    waiting, stalled = _case(cases, name)
    fault = stalled["fault"]
    text = _error(waiting)
    took = _seconds(waiting, fault)
    _report(name, rank0_from_fault=took, rank1_from_resume=_seconds(stalled, stalled["resumed"]))
    assert T - 0.5 < took < T + W + SLACK, (took, text)
    assert f"timed out after {T:g} s (ZeroConfig.collective_timeout)" in text, text
    assert "reduce_scatter for the gradients of" in text, text
    # The report did not wait for the silent rank: it was still away when rank 0 raised.
    assert waiting["end"] < stalled["resumed"], (waiting["end"] - fault, stalled["resumed"] - fault)
    assert "rank(s) [1]: no answer" in text, text
    # The stalled rank, once back, fails too (it does not train on alone), within a bound.
    text1 = _error(stalled)
    assert _seconds(stalled, stalled["resumed"]) < T + W + SLACK, (_seconds(stalled, stalled["resumed"]), text1)


@pytest.mark.slow
def test_a_stopped_store_host_does_not_block_the_others_report(cases):
    """Rank 0 hosts the TCPStore; SIGSTOPped, it answers no store call: rank 1's report
    gives up after one bounded store call instead of blocking on it."""
    stopped, waiting = _case(cases, "store_host_stopped")
    fault = stopped["fault"]
    text = _error(waiting)
    took = _seconds(waiting, fault)
    _report("store_host_stopped", rank1_from_fault=took, rank0_from_resume=_seconds(stopped, stopped["resumed"]))
    assert T - 0.5 < took < T + W + SLACK, (took, text)
    assert waiting["end"] < stopped["resumed"], (waiting["end"] - fault, stopped["resumed"] - fault)
    assert f"timed out after {T:g} s (ZeroConfig.collective_timeout)" in text, text
    assert "store did not answer in time" in text, text
    assert "rank(s) [0]: no answer" in text, text
    _error(stopped)  # resumed, rank 0 fails too
    assert _seconds(stopped, stopped["resumed"]) < 2 * T + W + SLACK


@pytest.mark.slow
def test_the_error_names_the_process_groups_timeout_when_it_fires_first(cases):
    waiting, stalled = _case(cases, "pg_timeout_first")
    text = _error(waiting)
    took = _seconds(waiting, stalled["fault"])
    _report("pg_timeout_first", rank0_from_fault=took, rank1_from_resume=_seconds(stalled, stalled["resumed"]))
    assert PG_TIMEOUT - 0.5 < took < PG_TIMEOUT + 5.0 + SLACK, (took, text)  # W is 5 s at a 30 s timeout
    assert f"the process group's own timeout fired ({PG_TIMEOUT:g} s" in text, text
    assert "before ZeroConfig.collective_timeout (30 s)" in text, text
    assert "timed out after 30" not in text, text
    _error(stalled)


# -- item 7 --------------------------------------------------------------------------------
@pytest.mark.slow
def test_full_state_dict_on_rank_0_only_names_the_api_on_every_rank_in_band(cases):
    """The other rank trains on: its forward all-gathers pair with rank 0's state-dict
    gathers; the headers catch it at once on both ranks (not 2 x collective_timeout)."""
    recs = _case(cases, "full_state_dict_train")
    fault = max(r["fault"] for r in recs)
    _report("full_state_dict_train", **{f"rank{r}_from_fault": _seconds(rec, fault) for r, rec in enumerate(recs)})
    for rec in recs:
        text = _error(rec)
        assert _seconds(rec, fault) < T, (_seconds(rec, fault), text)
        assert "timed out" not in text, text
        assert "likely cause: a collective API called on some ranks only" in text, text
        assert "rank(s) [0] are in ZeroEngine.full_state_dict()" in text, text
        assert "not under `if rank == 0:`" in text, text


@pytest.mark.slow
def test_full_state_dict_on_rank_0_only_while_the_other_is_away_names_the_api(cases):
    waiting, away = _case(cases, "full_state_dict_away")
    text = _error(waiting)
    took = _seconds(waiting, away["fault"])
    _report("full_state_dict_away", rank0_from_fault=took)
    assert T - 0.5 < took < T + W + SLACK, (took, text)
    assert f"timed out after {T:g} s (ZeroConfig.collective_timeout)" in text, text
    assert "this rank is in ZeroEngine.full_state_dict() and rank(s) [1] never joined it" in text, text
    assert "not under `if rank == 0:`" in text, text
    assert away["kind"] == "ok" and away["value"] == "away", away


@pytest.mark.slow
def test_an_exception_on_one_rank_during_save_is_raised_on_every_rank(cases):
    recs = _case(cases, "saves")
    folder = cases[1]
    for case, culprit, says in [("plain", 0, "notes.txt"), ("enospc", 1, "No space left on device")]:
        times = {f"rank{r}": _seconds(rec[case], rec[case]["fault"]) for r, rec in enumerate(recs)}
        _report(f"save {case}", **times)
        for r, rec in enumerate(recs):
            text = _error(rec[case], "CheckpointError")
            assert says in text, (case, r, text)
            if r != culprit:
                assert f"failed on rank(s) [{culprit}], so every rank stops" in text, (case, r, text)
            assert times[f"rank{r}"] < T, (case, r, times)  # agreed in-band, no timeout
    assert (folder / "notes.txt").read_text() == NOTES  # the user's file is untouched
    for rec in recs:
        assert rec["digest_after"] == rec["digest_before"]  # the previous checkpoint, byte for byte
        assert rec["resume"]["kind"] == "ok", rec["resume"]
        assert rec["resume"]["value"] == {"same_as_saved": True, "step_loaded": 1}, rec["resume"]


@pytest.mark.slow
def test_every_rank_ends_the_run_cleanly(cases):
    """After all those faults, no rank is left hanging, stopped or dead."""
    result = cases[2]
    assert not result["timed_out"], result
    assert result["ranks"] == {0: ("ok", "done"), 1: ("ok", "done")}, result
