"""Bounded waits: for a collective's work handle, and for the process group's store.

[Note: bounded waits]
gloo's ``Work.wait(timeout=...)`` is not a bound for every collective (under torch 2.13
a reduce-scatter's wait ignores it and returns whenever the peers arrive), so the
communicator never relies on it: :func:`wait_work` polls ``is_completed()`` against its
own deadline, sleeping in growing steps (tens of microseconds at first, at most
:data:`MAX_SLEEP`), so a wait that completes quickly costs no more than a few polls.
Once a wait has lasted :data:`WATCH_AFTER` seconds it also asks, every
:data:`WATCH_EVERY` seconds, whether another rank has already reported a failure, so
the ranks that are still waiting stop soon after the first one fails instead of each
waiting out its own timeout.

The store (hosted by rank 0's process under torchrun) is used only for those failure
reports, through a clone of it with a short timeout, and every call runs in a daemon
thread that is abandoned when it does not return in time: a frozen or dead store host
cannot hang the others' report.  A gloo operation abandoned at its deadline stays
queued in gloo; that is why a failed communicator refuses further collectives.
"""
from __future__ import annotations

import datetime
import threading
import time
from typing import Callable, Optional

SHORT_SLEEP = 0.0002  # most seconds between polls while a wait is young
SHORT_FOR = 0.05  # seconds a wait counts as young
MAX_SLEEP = 0.002  # seconds between polls of a long wait
WATCH_AFTER = 1.0  # seconds of waiting before peers' failure reports are looked for
WATCH_EVERY = 0.5


class WaitTimeout(Exception):
    """Our deadline passed before the collective completed."""


class PeerFailed(Exception):
    """Another rank reported a failure while this one was waiting."""


def wait_work(work, timeout: float, peer_failed: Optional[Callable[[], bool]] = None) -> None:
    """Wait for ``work`` at most ``timeout`` seconds; raise :class:`WaitTimeout`, or
    :class:`PeerFailed` when ``peer_failed()`` says another rank gave up, or the
    backend's own error (``work.wait()`` re-raises it once completed)."""
    if not work.is_completed():
        start = time.monotonic()
        deadline = start + timeout
        next_watch = start + WATCH_AFTER
        pause = 2e-5
        while not work.is_completed():
            now = time.monotonic()
            if now >= deadline:
                raise WaitTimeout()
            if peer_failed is not None and now >= next_watch:
                if peer_failed():
                    raise PeerFailed()
                now = time.monotonic()
                next_watch = now + WATCH_EVERY
            time.sleep(min(pause, max(deadline - now, 0.0)))
            pause = min(pause * 2, SHORT_SLEEP if now - start < SHORT_FOR else MAX_SLEEP)
    work.wait()


_UNANSWERED = object()


def call_with_deadline(fn: Callable, seconds: float):
    """``fn()`` in a daemon thread; its result, or ``_UNANSWERED`` when it did not
    return within ``seconds`` (the thread is left behind)."""
    box = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            box["error"] = exc

    t = threading.Thread(target=run, name="zero_strategy-store", daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        return _UNANSWERED
    if "error" in box:
        raise box["error"]
    return box.get("value")


class StoreUnavailable(Exception):
    """The store did not answer in time (its host may be frozen or gone)."""


class BoundedStore:
    """This communicator's own handle on the process group's store, every call bounded."""

    def __init__(self, store, op_timeout: float) -> None:
        self.op_timeout = op_timeout
        self.store = None
        self.dead = False
        if store is None:
            self.dead = True
            return
        try:
            self.store = store.clone()  # its own connection: a stuck call never blocks the group's
            self.store.set_timeout(datetime.timedelta(seconds=op_timeout))
        except Exception:  # noqa: BLE001 - a store without clone(): share it, still bounded
            self.store = store

    def _call(self, fn):
        if self.dead:
            raise StoreUnavailable()
        try:
            result = call_with_deadline(lambda: fn(self.store), self.op_timeout + 0.5)
        except Exception as exc:  # noqa: BLE001 - a store timeout or a closed connection
            raise StoreUnavailable() from exc
        if result is _UNANSWERED:
            self.dead = True  # its thread may still hold the connection
            raise StoreUnavailable()
        return result

    def set(self, key: str, value: str) -> None:
        self._call(lambda s: s.set(key, value))

    def add(self, key: str, amount: int) -> int:
        return int(self._call(lambda s: s.add(key, amount)))

    def get_if_present(self, key: str) -> Optional[bytes]:
        return self._call(lambda s: s.get(key) if s.check([key]) else None)
