"""Explaining a failed collective: every rank's position, and the likely cause.

[Note: failure reports]
A rank whose collective times out, fails, or receives a header that is not its own
(see collectives.py, [Note: in-band headers]) publishes a small JSON report in the
process group's store: where it was (kind, label, call number, step), the zero_strategy
API it was in (read from its own call stack: ``ZeroEngine.full_state_dict()``, the
model's forward, ...), and why it stopped.  It then collects the other ranks' reports
for up to :func:`report_window` seconds.  Ranks still waiting in a collective notice the
first report within a second (bounded.py, [Note: bounded waits]) and publish theirs, so
the error every rank raises names every rank's position.  Ranks that never answer are
named as such: dead, stopped, or blocked outside zero_strategy's collectives.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Dict, List, Optional

from .bounded import BoundedStore, StoreUnavailable

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # zero_strategy/
REPORT_WINDOW = 5.0  # seconds, at most: how long a failing rank waits for the others' reports
STORE_OP_TIMEOUT = 1.0  # seconds, at most, for one store call


class CollectiveError(RuntimeError):
    """A ZeRO collective timed out or failed; the message says where every rank was."""


def report_window(timeout: Optional[float]) -> float:
    return min(timeout, REPORT_WINDOW) if timeout else REPORT_WINDOW


# [Note: a skipped batch]
# A rank that catches an exception and goes on to its next batch (a bad sample, an OOM
# in one forward) has run one training forward more, or one backward less, than its
# peers, yet its next collectives can look exactly like theirs: same step (the optimizer
# did not step on anyone yet), same call numbers, same buckets.  They would pair one
# batch off, average gradients of different batches, and the run would fail only at the
# end, where one rank has a batch left (or gloo aborts a process when sizes differ).  So
# every header also carries how many training forwards (grad enabled, module in
# training mode) this rank has begun: the first collective after the skip differs on
# every rank.  Forwards under torch.no_grad() or in eval mode (evaluation, generate(),
# a frozen reference model) are not counted, so they may differ between ranks as under
# DDP.
def describe(position) -> str:
    if position is None:
        return "no ZeRO collective yet"
    step, call, kind, label, forwards = position
    return f"{kind} for {label} (collective #{call} of step {step}, after training forward {forwards})"


# -- which API a rank is in ---------------------------------------------------------------------
_TRAINING = {"the model's forward", "backward", "ZeroEngine.backward()", "ZeroEngine.step()", "ZeroOptimizer.step()",
             "ZeroEngine.clip_grad_norm_()", "ZeroEngine.clip_grad_value_()", "torch.nn.utils.clip_grad_norm_()"}


def _api_name(filename: str, func: str, on_engine: bool) -> str:
    """``on_engine``: the frame is a ZeroEngine method (defined in engine.py or in a file
    a mixin of it comes from, such as persistence.py); engine.py's own closures (the
    end-of-backward callback) count too."""
    module = os.path.splitext(os.path.basename(filename))[0]
    if on_engine or module == "engine":
        if func == "__init__":
            return "zero_strategy.initialize()"
        if func in ("_on_root_pre_forward", "_on_root_post_forward"):
            return "the model's forward"
        if func in ("_on_param_grad", "_on_backward_end", "_begin_backward", "<lambda>"):
            return "backward"
        return f"ZeroEngine.{func}()" if not func.startswith("_") else f"ZeroEngine.{func}"
    if module == "hooks":
        return "backward" if "grad" in func else "the model's forward"
    if module == "optimizer":
        return f"ZeroOptimizer.{func}()"
    if module == "misuse" and "clip" in func:
        return "torch.nn.utils.clip_grad_norm_()"
    if module == "__init__" and os.path.dirname(os.path.abspath(filename)) == _PACKAGE_DIR:
        return f"zero_strategy.{func}()"
    return f"zero_strategy.{module}.{func}()"


def current_api() -> Optional[str]:
    """The outermost zero_strategy function on this thread's stack: the API the user called."""
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    for frame in reversed(frames):  # outermost first
        filename = frame.f_code.co_filename
        if os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep):  # any file of the core, in any of its packages
            on_engine = any(c.__name__ == "ZeroEngine" for c in type(frame.f_locals.get("self")).__mro__)
            return _api_name(filename, frame.f_code.co_name, on_engine)
    return None


def _same_api(a: Optional[str], b: Optional[str]) -> bool:
    train = lambda x: x in _TRAINING  # noqa: E731
    return a == b or (train(a) and train(b))


# -- reports in the store ---------------------------------------------------------------------------
class Reports:
    """The failure reports of one communicator's collectives, in the store."""

    def __init__(self, store, namespace: str, timeout: Optional[float]) -> None:
        op = min(STORE_OP_TIMEOUT, timeout) if timeout else STORE_OP_TIMEOUT
        self.store = BoundedStore(store, op)
        self.namespace = namespace

    def _key(self, what: str) -> str:
        return f"{self.namespace}/{what}"

    def any_failure(self) -> bool:
        try:
            return self.store.add(self._key("failures"), 0) > 0
        except StoreUnavailable:
            return False

    def publish(self, rank: int, report: dict) -> bool:
        try:
            self.store.set(self._key(f"report/{rank}"), json.dumps(report))
            self.store.add(self._key("failures"), 1)
            return True
        except StoreUnavailable:
            return False

    def collect(self, ranks: List[int], window: float) -> Dict[int, Optional[dict]]:
        got: Dict[int, Optional[dict]] = {r: None for r in ranks}
        deadline = time.monotonic() + window
        while True:
            for r in ranks:
                if got[r] is None:
                    try:
                        raw = self.store.get_if_present(self._key(f"report/{r}"))
                    except StoreUnavailable:
                        return got
                    if raw is not None:
                        got[r] = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
            if all(v is not None for v in got.values()) or time.monotonic() >= deadline:
                return got
            time.sleep(0.1)


# -- the message ------------------------------------------------------------------------------------
_DIVERGED = (
    "ranks that run different modules or a different number of steps issue different "
    "collectives (set check_call_order=True to stop before any mismatched collective is issued, "
    "with every rank's module named)"
)


def _peer_line(rank: int, report: dict) -> str:
    api = f", in {report['api']}" if report.get("api") else ""
    why = f" [{report['why']}]" if report.get("why") else ""
    return f"  rank {rank}: {report['position']}{api}{why}"


def _likely_api_cause(mine: dict, reports: Dict[int, Optional[dict]], silent: List[int]) -> Optional[str]:
    """'a collective API called on some ranks only', naming the API, when the reports say so."""
    apis: Dict[str, List[int]] = {}
    for r, rep in reports.items():
        if rep is not None:
            apis.setdefault(rep.get("api") or "?", []).append(r)
    distinct = list(apis)
    culprits = [a for a in distinct if a not in _TRAINING and a != "?"]
    if len(distinct) > 1 and not all(_same_api(distinct[0], a) for a in distinct[1:]):
        api = culprits[0] if culprits else min(distinct, key=lambda a: len(apis[a]))
        others = sorted(r for a, rs in apis.items() if not _same_api(a, api) for r in rs)
        return (
            f"likely cause: a collective API called on some ranks only: rank(s) {sorted(apis[api])} are in {api}, "
            f"rank(s) {others} are not. {api} is collective: every rank must call it (not under `if rank == 0:`)"
            + (" - with rank0_only=True, the default, only rank 0 gets the weights" if "full_state_dict" in api else "")
        )
    if silent and mine.get("api") and mine["api"] not in _TRAINING:
        return (
            f"likely cause: a collective API called on some ranks only: this rank is in {mine['api']} and rank(s) "
            f"{silent} never joined it. {mine['api']} is collective: every rank must call it (not under `if rank == 0:`)"
        )
    return None


def build_error(*, me: int, ranks: List[int], mine: dict, reason: str, position, timeout: Optional[float],
                pg_timeout: Optional[float], reports: Dict[int, Optional[dict]], store_ok: bool,
                exc: Optional[BaseException] = None, mismatch_lines: Optional[List[str]] = None) -> CollectiveError:
    here = describe(position) + (f", in {mine['api']}" if mine.get("api") else "")
    if reason == "timeout":
        what = f"timed out after {timeout:g} s (ZeroConfig.collective_timeout)"
    elif reason == "pg_timeout":
        pg = f"{pg_timeout:g} s" if pg_timeout else "its timeout"
        what = (
            f"timed out: the process group's own timeout fired ({pg}, the timeout given to init_process_group) "
            f"before ZeroConfig.collective_timeout ({timeout:g} s)" if timeout else
            f"timed out: the process group's own timeout fired ({pg}, the timeout given to init_process_group)"
        )
    elif reason == "mismatch":
        what = "found that the ranks diverged"
    elif reason == "peer":
        first = sorted(r for r, rep in reports.items() if rep is not None and r != me and rep.get("why") != "stopped: another rank failed")
        what = f"stopped: rank(s) {first or 'another rank'} reported a failure first"
    else:
        what = "failed"
    silent = [r for r in ranks if reports.get(r) is None]
    lines = [_peer_line(r, rep) for r, rep in reports.items() if rep is not None]
    if silent:
        lines.append(
            f"  rank(s) {silent}: no answer - exited (killed, crashed), stopped, or blocked outside "
            "zero_strategy's collectives"
        )
    if not store_ok:
        lines.append("  (the process group's store did not answer in time: its host, rank 0's process under torchrun, may be stopped or gone)")
    if reason == "mismatch":
        hint = (
            "ranks diverged: they issued different collectives at the same point (detected in-band, from the "
            "header every collective carries), so the modules they run differ (a branch taken on some ranks "
            "only, a different number of forward passes or generate() steps) or a collective API was called on "
            "some ranks only. Where the ranks name the same collective after a different training forward, a rank "
            "skipped a batch (caught an exception and went on) or ran a training forward the others did not: run "
            "one-rank forwards under torch.no_grad(), and let an exception on one rank stop every rank. Every rank "
            "must call the same modules in the same order under ZeRO stage 3 "
            "(check_call_order=True stops at the first module call that differs, before its collective is "
            "issued, and names it on every rank)"
        )
    elif silent:
        hint = (
            f"rank(s) {silent} did not answer: killed or crashed (gloo also aborts a process whose collectives do "
            "not match its peers' in size), stopped, or busy outside zero_strategy. If a rank died, restart from "
            f"the last checkpoint; else {_DIVERGED}"
        )
    else:
        hint = f"the ranks are out of step: {_DIVERGED}"
    cause = _likely_api_cause(mine, reports, silent)
    if cause:
        hint += f". {cause}"
    detail = ""
    if mismatch_lines:
        detail = "\nWhat the headers received said:\n" + "\n".join(mismatch_lines)
    underlying = f"\n(underlying error: {exc})" if exc is not None else ""
    return CollectiveError(
        f"ZeRO collective {what} on rank {me} while waiting in {here}: {hint}.\nWhere each rank was:\n"
        + "\n".join(lines) + detail + underlying
    )
