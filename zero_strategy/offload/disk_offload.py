"""Disk offload (ZeRO-Infinity's NVMe offload): fp32 master shards and optimizer state
in files, brought into memory unit by unit around the optimizer step.

[Note: file-backed tensors]
Every offloaded tensor is a shared memory map of a file of its own, made with torch's
``torch.from_file(path, shared=True)``, so the rest of the engine sees an ordinary CPU
tensor: state dicts, checkpoints, resharding and pretrained loading read and write it as
before, and the kernel pages it in on access.  What this module adds is *residency*:

* after a unit's update its pages are written back (``msync``) and dropped from this
  process (``madvise(MADV_DONTNEED)``) and from the page cache
  (``posix_fadvise(POSIX_FADV_DONTNEED)``), so between steps the files hold the state
  and memory holds only the 16-bit working set;
* before a unit's update, a worker thread reads the next units' files into memory
  (``madvise(MADV_POPULATE_READ)``, blocking in that thread, with
  ``MADV_WILLNEED`` where the kernel is older than 5.14) while the current unit is
  updated: read-ahead and write-behind overlap the host step (double buffering).
* the bytes being read ahead, updated and written back never exceed
  ``nvme_inflight_bytes`` (one unit is always allowed).

The syscalls go through ``ctypes`` (which releases the GIL while they block), so the
two worker threads of a standard-library ``ThreadPoolExecutor`` do the I/O while the
main thread steps.  Files are preallocated with ``posix_fallocate``: a full disk is an
``OSError(ENOSPC)`` when a file is made, never a SIGBUS on a later page fault.

Optimizer state does not exist until a unit's first step (torch makes it lazily);
after each unit's update any state tensor shaped like its parameter is moved into the
unit's file for that state key ("adopted"), and the optimizer's state dict entry is
replaced by a view of the file.  The same happens after a load replaced the state.

[Note: the offload directory]
Each rank makes its own directory ``zero_offload-rank<r>-<pid>-<token>`` under
``nvme_path`` (creating ``nvme_path`` itself if needed), with a marker file naming what
it is, so it is never mistaken for a checkpoint (loading it as one says what it is).
On ``engine.close()``, garbage collection or interpreter exit the files this engine
created are removed, then the directory and any parents it created if they are empty;
nothing else is deleted.  A killed process leaves its directory behind (the marker
names the process).
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import secrets
import socket
import sys
import time
import warnings
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch


MARKER = "ZERO_STRATEGY_OFFLOAD.json"
"""The file naming a disk-offload directory (never a checkpoint's)."""

_MADV_WILLNEED, _MADV_DONTNEED, _MADV_POPULATE_READ = 3, 4, 22  # Linux <asm-generic/mman-common.h>
_MS_SYNC = 4


class DiskOffloadError(RuntimeError):
    """Disk offload could not create, read or write its files (raised on every rank)."""


def _libc():
    # The advice and flag values above are Linux's (macOS's MS_SYNC is another number, and
    # its 4 discards pages): elsewhere the mapping is left to the kernel entirely.
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL(None, use_errno=True)
        for name in ("madvise", "msync"):
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
        return lib
    except (OSError, AttributeError):  # not a POSIX libc: leave residency to the kernel
        return None


_LIBC = _libc()
_POPULATE = [True]  # MADV_POPULATE_READ works here (cleared on the first EINVAL)


@dataclass
class Region:
    """One offloaded tensor: its file and the whole mapped flat tensor."""

    path: Path
    tensor: torch.Tensor
    kind: str  # "master", "state" or "param"

    @property
    def nbytes(self) -> int:
        return self.tensor.untyped_storage().nbytes()

    def _call(self, name: str, advice: int) -> None:
        if _LIBC is None or self.nbytes == 0:
            return
        if getattr(_LIBC, name)(self.tensor.data_ptr(), self.nbytes, advice) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"{name} of {self.path}: {os.strerror(code)}")

    def read_in(self) -> int:
        """Blocking: bring the file's pages into this mapping (a worker thread calls it)."""
        if _POPULATE[0]:
            try:
                self._call("madvise", _MADV_POPULATE_READ)
                return self.nbytes
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                _POPULATE[0] = False  # kernel before 5.14: ask for asynchronous read-ahead instead
        self._call("madvise", _MADV_WILLNEED)
        return self.nbytes

    def drop(self) -> None:
        """Unmap the pages from this process (shared file mapping: nothing is lost)."""
        self._call("madvise", _MADV_DONTNEED)

    def write_back(self) -> int:
        """Blocking: write dirty pages to the file, then drop them from memory."""
        self._call("msync", _MS_SYNC)
        self.drop()
        if _LIBC is not None:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return self.nbytes


def _remove_created(files: List[Path], dirs: List[Path]) -> None:
    """Cleanup: only what we made, and a directory only once it is empty."""
    for path in files:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError:
            pass  # nothing to raise into at garbage collection; the directory stays
    files.clear()
    for d in dirs:  # innermost first
        try:
            d.rmdir()
        except OSError:
            break  # not empty (someone else's files) or gone: leave it and its parents
    dirs.clear()


@dataclass
class IOStats:
    bytes_read: int = 0
    bytes_written: int = 0
    wait_seconds: float = 0.0  # the step waited for reads or writes
    steps: int = 0
    last_step: dict = field(default_factory=dict)


class DiskOffload:
    """The engine's disk-offload files and the read-ahead / write-behind around step()."""

    def __init__(self, root: str, rank: int, world_size: int, comm, inflight_bytes: int) -> None:
        self.comm = comm
        self.inflight_bytes = int(inflight_bytes)
        self.error: Optional[BaseException] = None  # the first failure, agreed on at the next check
        self.regions: Dict[int, List[Region]] = {}  # unit index -> its files
        self._placed: Dict[int, Dict[str, torch.Tensor]] = {}  # id(optimizer tensor) -> key -> file view
        self._files: List[Path] = []
        self._dirs: List[Path] = []  # created by us, innermost first
        self.stats = IOStats()
        self._constructed = False  # the engine's first check (after its files were made) passed
        self._dirty: set = set()  # units written outside step() since the last write-back
        self._dirty_bytes = 0
        self.directory: Optional[Path] = None
        self.root = Path(root).expanduser()
        self._pool: Optional[ThreadPoolExecutor] = None
        self._finalizer = weakref.finalize(self, _remove_created, self._files, self._dirs)
        try:
            self.directory = self._make_directory(rank, world_size)
        except (OSError, DiskOffloadError) as e:
            self.error = e if isinstance(e, DiskOffloadError) else DiskOffloadError(
                f"disk offload cannot use nvme_path {str(self.root)!r}: {_describe(e)}; point nvme_path at a "
                "writable directory on a local disk")

    # -- the directory -------------------------------------------------------------------
    def _make_directory(self, rank: int, world_size: int) -> Path:
        root = self.root
        if root.exists() and not root.is_dir():
            raise DiskOffloadError(f"nvme_path {str(root)!r} is a file, not a directory: point nvme_path at a directory")
        if (root / "manifest.json").is_file():
            raise DiskOffloadError(
                f"nvme_path {str(root)!r} is a checkpoint directory (it has a manifest.json): offload files must not be "
                "mixed with a checkpoint; use a directory of its own")
        missing = []
        p = root
        while not p.exists():
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            try:
                d.mkdir()
            except FileExistsError:  # another rank made it first
                continue
            self._dirs.insert(0, d)
        if not os.access(root, os.W_OK | os.X_OK):
            raise DiskOffloadError(f"nvme_path {str(root)!r} is not writable by this process: choose a directory "
                                   "it may write to, or fix the permissions")
        if rank == 0:
            _warn_about_leftovers(root)
        name = f"zero_offload-rank{rank}-{os.getpid()}-{secrets.token_hex(4)}"
        d = root / name
        d.mkdir(mode=0o700)
        self._dirs.insert(0, d)
        marker = d / MARKER
        marker.write_text(json.dumps({
            "what": "zero_strategy disk-offload files of one running engine (not a checkpoint); removed when the "
                    "engine is closed. A directory left behind by a killed run can be deleted.",
            "rank": rank, "world_size": world_size, "pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }, indent=1))
        self._files.append(marker)
        return d

    def _new_file(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled tensor backed by a preallocated file of its own."""
        path = self.directory / name
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._files.append(path)
        try:
            if nbytes and hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, nbytes)  # ENOSPC now, not SIGBUS at a page fault later
            elif nbytes:
                os.ftruncate(fd, nbytes)  # no fallocate here (macOS): a sparse file
        finally:
            os.close(fd)
        if numel == 0:
            return torch.zeros(0, dtype=dtype)
        return torch.from_file(str(path), shared=True, size=numel, dtype=dtype)

    def allocate(self, unit_index: int, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A file-backed tensor for ``kind`` ("master", "param" or "state.<key>") of a
        unit.  After a failure (here or earlier) a meta tensor stands in, so construction
        reaches the agreement (:meth:`check`) on every rank instead of one rank raising alone."""
        if self.error is None:
            try:
                name = f"unit{unit_index}.{kind}.{str(dtype).replace('torch.', '')}"
                t = self._new_file(name, numel, dtype)
                self.regions.setdefault(unit_index, []).append(Region(self.directory / name, t, kind.split(".")[0]))
                return t
            except OSError as e:
                self.error = DiskOffloadError(f"disk offload could not create its files in {self.directory}: {_describe(e)}"
                                              f"{_hint(e)}")
        return torch.zeros(numel, dtype=dtype, device="meta")

    def allocator(self, unit_index: int, kind: str) -> Callable[[int, torch.dtype], torch.Tensor]:
        return lambda numel, dtype: self.allocate(unit_index, kind, numel, dtype)

    def dropper(self, unit_index: int, kind: str) -> Callable[[], None]:
        """A callable dropping the pages of one unit's ``kind`` files (after a gather read
        them); weak, so that parameters do not keep the offload alive."""
        ref = weakref.ref(self)

        def drop() -> None:
            disk = ref()
            if disk is None:
                return
            for r in disk.regions.get(unit_index, ()):
                if r.kind == kind:
                    try:
                        r.drop()
                    except OSError as e:
                        disk._fail(e, "release")
        return drop

    def writer(self, unit_index: int) -> Callable[[int], None]:
        """A callable told the bytes written into a unit's files outside step() (building,
        loading, deferred initialisation): past ``inflight_bytes`` of them, the units
        written to are written back and dropped, so a model bigger than memory can be
        built and loaded (weak, like :meth:`dropper`)."""
        ref = weakref.ref(self)

        def written(nbytes: int) -> None:
            disk = ref()
            if disk is None:
                return
            disk._dirty.add(unit_index)
            disk._dirty_bytes += nbytes
            if disk._dirty_bytes > disk.inflight_bytes:
                disk._write_back_dirty()
        return written

    def _write_back_dirty(self) -> None:
        dirty, self._dirty, self._dirty_bytes = self._dirty, set(), 0
        for i in sorted(dirty):
            for r in self.regions.get(i, ()):
                try:
                    r.write_back()
                except OSError as e:
                    self._fail(e, "write")
                    return

    # -- agreement -------------------------------------------------------------------------
    def check(self, what: str) -> None:
        """Collective (with world size > 1): raise DiskOffloadError on every rank if any
        rank's disk offload failed since the last check ([Note: every rank fails together])."""
        error, self.error = self.error, None
        try:
            self.comm.agree(what, error, error_type=DiskOffloadError, own="never")
        except DiskOffloadError:
            self.error = error  # stays failed: later steps must not pretend the state is on disk
            if not self._constructed:
                self.close()  # the engine is not built: nothing of it may stay on disk
            raise
        self._constructed = True

    # -- residency -------------------------------------------------------------------------
    def unit_bytes(self, unit_index: int) -> int:
        return sum(r.nbytes for r in self.regions.get(unit_index, ()))

    def evict_all(self) -> None:
        """Write every file back and drop it from memory (after construction, loads, saves)."""
        self._dirty, self._dirty_bytes = set(), 0
        for regions in self.regions.values():
            for r in regions:
                try:
                    r.write_back()
                except OSError as e:
                    self._fail(e, "write")
                    return

    def adopt_state(self, unit, optimizer) -> None:
        """Move the optimizer's state tensors of ``unit`` (those shaped like their
        parameter) into the unit's state files, replacing the state dict's entries."""
        if self.error is not None:
            return
        if unit.whole_params is not None:
            # A whole-parameter optimizer's state is whole on each owner, in its own shapes
            # (not one value per shard element): it stays in host memory.
            return
        n = unit.layout.shard_numel
        flats: Dict[str, torch.Tensor] = {r.path.name: r.tensor for r in self.regions.get(unit.index, ()) if r.kind == "state"}
        for t, (_, s_start, length) in zip(unit.optim_params, unit.optim_slices):
            state = optimizer.state.get(t)
            if not state:
                continue
            placed = self._placed.setdefault(id(t), {})
            for key, value in list(state.items()):
                if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == t.shape
                        and value.dim() > 0 and value.device.type == "cpu"):
                    continue
                if placed.get(key) is value:
                    continue
                name = f"unit{unit.index}.state.{key}.{str(value.dtype).replace('torch.', '')}"
                flat = flats.get(name)
                if flat is None:
                    flat = flats[name] = self.allocate(unit.index, f"state.{key}", n, value.dtype)
                    if self.error is not None:
                        return
                view = flat[s_start : s_start + length].view(t.shape)
                view.copy_(value)
                state[key] = placed[key] = view

    def adopt_all(self, units, optimizer) -> None:
        for u in units:
            self.adopt_state(u, optimizer)
        self.evict_all()

    def _fail(self, exc: BaseException, doing: str) -> None:
        if self.error is None:
            self.error = DiskOffloadError(f"disk offload could not {doing} its files in {self.directory}: "
                                          f"{_describe(exc)}{_hint(exc)}")

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:  # one thread reads ahead while another writes behind
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="zero-disk-offload")
        return self._pool

    def stepping(self, units, optimizer) -> "StepIO":
        return StepIO(self, units, optimizer)

    def report(self) -> dict:
        """Bytes on disk now, bytes read and written (in all, and in the last step)."""
        s = self.stats
        return {"directory": str(self.directory), "disk_bytes": sum(self.unit_bytes(i) for i in self.regions),
                "bytes_read": s.bytes_read, "bytes_written": s.bytes_written, "steps": s.steps,
                "wait_seconds": s.wait_seconds, "last_step": dict(s.last_step)}

    # -- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        """Remove what we created (the mapped tensors stay readable until dropped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._finalizer()


class StepIO:
    """One step's read-ahead and write-behind over ``units``, in their order; see
    [Note: file-backed tensors].  ``before(u)`` / ``after(u)`` bracket each unit's update."""

    def __init__(self, disk: DiskOffload, units, optimizer) -> None:
        self.disk, self.units, self.optimizer = disk, list(units), optimizer
        self._next = 0  # the first unit not yet read ahead
        self._ahead: Dict[int, tuple] = {}  # unit index -> (future, bytes)
        self._writes: deque = deque()  # (future, bytes), oldest first
        self._current = 0
        self._read = self._written = 0
        self._wait = 0.0
        self._fill()

    def _in_flight(self) -> int:
        while self._writes and self._writes[0][0].done():
            self._collect(self._writes.popleft())
        return self._current + sum(b for _, b in self._ahead.values()) + sum(b for _, b in self._writes)

    def _collect(self, item) -> None:
        fut, _ = item
        try:
            self._written += fut.result()
        except OSError as e:
            self.disk._fail(e, "write")

    def _fill(self) -> None:
        """Read ahead as many of the next units as the in-flight bound allows."""
        if self.disk.error is not None:
            return
        pool = self.disk._executor()
        while self._next < len(self.units):
            u = self.units[self._next]
            need = sum(r.nbytes for r in self.disk.regions.get(u.index, ()) if r.kind != "param")
            busy = self._in_flight()
            if busy and busy + need > self.disk.inflight_bytes:
                return
            regions = [r for r in self.disk.regions.get(u.index, ()) if r.kind != "param"]  # param: overwritten
            self._ahead[u.index] = (pool.submit(lambda rs=regions: sum(r.read_in() for r in rs)), need)
            self._next += 1

    def _wait_for(self, fut: Future):
        start = time.perf_counter()
        try:
            return fut.result()
        finally:
            self._wait += time.perf_counter() - start

    def before(self, unit) -> None:
        while unit.index not in self._ahead and self._writes:
            self._collect_oldest()  # the bound is full of writes: let one finish
            self._fill()
        if unit.index not in self._ahead:
            self._fill()
        item = self._ahead.pop(unit.index, None)
        if item is not None:
            fut, self._current = item
            try:
                self._read += self._wait_for(fut)
            except OSError as e:
                self.disk._fail(e, "read")
        self._fill()

    def _collect_oldest(self) -> None:
        fut, b = self._writes.popleft()
        start = time.perf_counter()
        fut.exception()  # wait
        self._wait += time.perf_counter() - start
        self._collect((fut, b))

    def after(self, unit) -> None:
        self.disk.adopt_state(unit, self.optimizer)
        regions = list(self.disk.regions.get(unit.index, ()))
        nbytes = sum(r.nbytes for r in regions)
        self._current = 0
        if self.disk.error is None:
            self._writes.append((self.disk._executor().submit(lambda: sum(r.write_back() for r in regions)), nbytes))
        self._fill()

    def finish(self) -> None:
        """Wait for every write; then (collective) agree on success."""
        for _, (fut, _) in list(self._ahead.items()):
            fut.exception()
        self._ahead.clear()
        while self._writes:
            self._collect_oldest()
        s = self.disk.stats
        s.bytes_read += self._read
        s.bytes_written += self._written
        s.wait_seconds += self._wait
        s.steps += 1
        s.last_step = {"bytes_read": self._read, "bytes_written": self._written, "wait_seconds": self._wait}
        self.disk.check("the optimizer step (disk offload)")


def _warn_about_leftovers(root: Path) -> None:
    """Say (never delete) when an offload directory of a process that is gone from this
    host sits in ``root``: a killed run's files, still taking disk space."""
    host = socket.gethostname()
    for marker in root.glob(f"zero_offload-rank*/{MARKER}"):
        try:
            info = json.loads(marker.read_text())
            if info.get("host") != host:
                continue
            os.kill(int(info["pid"]), 0)
        except ProcessLookupError:
            size = sum(p.stat().st_size for p in marker.parent.iterdir() if p.is_file())
            warnings.warn(f"{marker.parent} holds the disk-offload files of a process that no longer runs (pid "
                          f"{info['pid']}, {size / 2**20:,.0f} MiB); it was not removed (a killed run leaves its "
                          "files): delete it when no job uses it", stacklevel=4)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable, or a live process of someone else's: none of our business


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror} [errno {exc.errno}]{where}"
    return f"{type(exc).__name__}: {exc}"


def _hint(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ("; the disk is full: free space there or point nvme_path at a larger disk (zero-strategy estimate "
                "prints the disk bytes per rank)")
    return ""


def is_offload_directory(path) -> bool:
    """Whether ``path`` is a disk-offload directory (it holds the marker file)."""
    return (Path(path) / MARKER).is_file()




def make_disk_offload(offload, comm) -> Optional[DiskOffload]:
    """The engine's DiskOffload for an OffloadPolicy, or None (no disk offload, or a
    planning dry run on the fake process group, which allocates nothing)."""
    if not offload.to_disk:
        return None
    group = comm.group
    if group is not None and torch.distributed.get_backend(group) == "fake":
        return None
    return DiskOffload(offload.disk_path, comm.rank, comm.world_size, comm, offload.inflight_bytes)


__all__ = ["DiskOffload", "DiskOffloadError", "MARKER", "is_offload_directory", "make_disk_offload"]
