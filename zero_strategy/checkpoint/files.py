"""Checkpoint directories on disk: what is ours, atomic replacement, the writer's lock,
and file checksums.  No torch, no process group: every function here runs on one
process (rank 0 for writes) and raises :class:`CheckpointError` naming the path.

[Note: what we may delete]
A directory is *ours* when it holds the marker file ``.zero_strategy`` (written first
into every directory we create) or, for checkpoints saved before the marker existed,
a ``manifest.json`` whose ``format`` is ``zero_strategy.checkpoint``.  A finished
directory's marker lists the files written into it.  We only ever replace or remove a
directory that is ours, of the right kind (a sharded checkpoint or a consolidated
export), and holds nothing but what we wrote; an empty directory holds nothing and may
be replaced too.  Anything else is refused with an error naming it, and nothing is
touched.  Removal deletes the marker (and manifest) last, so a removal that is
killed half-way still leaves a directory recognisably ours.

[Note: the writer's lock]
``<dir>.lock`` beside the directory is created with ``O_CREAT | O_EXCL`` and holds
the writer's pid, host, process start time and a random token; while it is held a
thread refreshes its modification time every ``HEARTBEAT_SECONDS``.  A lock is stale
(and is broken) when its holder ran on this host and is gone (no such pid, or another
process now has that pid), or when nobody refreshed it for ``STALE_AFTER_SECONDS``.
Breaking is itself guarded by ``<dir>.lock.break`` (also ``O_EXCL``) so two jobs
cannot both break and both take one lock.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import socket
import stat
import threading
import time
import zlib
from pathlib import Path
from typing import Iterable, List, Optional

MARKER = ".zero_strategy"
MANIFEST = "manifest.json"
KIND_CHECKPOINT = "zero_strategy.checkpoint"
KIND_CONSOLIDATED = "zero_strategy.consolidated"
_KIND_WORDS = {KIND_CHECKPOINT: "a sharded zero_strategy checkpoint", KIND_CONSOLIDATED: "a consolidated zero_strategy export"}
# What a checkpoint written before the marker existed (format version 1) may hold.
_V1_FILES = re.compile(r"^(manifest\.json|config\.json|client_state\.pt|shared\.safetensors|rank\d{5}\.(safetensors|json))$")

HEARTBEAT_SECONDS = 15.0
STALE_AFTER_SECONDS = 300.0
CHUNK = 16 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be used as asked; the message names the file."""


def sibling(directory: Path, suffix: str) -> Path:
    return directory.with_name(directory.name + suffix)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


fsync_dir = _fsync_dir


# ----------------------------------------------------------------------------------------
# reading files that arrived from elsewhere
# ----------------------------------------------------------------------------------------
# [Note: only regular files are read]
# Checkpoints travel in tarballs, which carry symlinks, FIFOs and device nodes.  A FIFO
# blocks open() forever (in safetensors' native code no signal handler runs), and a link
# to /dev/zero reads without end.  So every file of a checkpoint directory is lstat-ed
# first and must be a regular file itself (we never write links), its size is compared
# with the manifest's record before any byte is read, and JSON is read with a bound.
# Weight folders (from_pretrained) may be links, as the Hugging Face cache's snapshots
# are, but their targets must be regular files (``follow_links=True``).
SMALL_JSON_LIMIT = 1 << 20  # bytes: a marker or a lock's body
JSON_LIMIT = 1 << 30  # bytes: a manifest of a few million tensors; anything larger is not ours


def _kind_of(mode: int) -> str:
    for test, word in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return word
    return "not a regular file"


def require_regular(path: Path, *, follow_links: bool = False) -> os.stat_result:
    """The stat of ``path``, which must be a regular file (itself, unless
    ``follow_links``); anything else is a CheckpointError naming it."""
    try:
        st = os.stat(path) if follow_links else os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(
            f"{path} is {_kind_of(st.st_mode)}, not a regular file: a checkpoint holds only the regular files it "
            "was saved with (replace it with the file itself, e.g. extract the archive without links or special files)"
        )
    return st


def read_bounded(path: Path, limit: int, *, follow_links: bool = False) -> bytes:
    """The bytes of the regular file ``path``, refused above ``limit`` bytes.  The
    file is opened without blocking and without following a final link, then checked
    on its descriptor, so a FIFO or a link swapped in after a check is refused too."""
    require_regular(path, follow_links=follow_links)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow_links else getattr(os, "O_NOFOLLOW", 0))
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({e})") from None
    with os.fdopen(fd, "rb", buffering=0) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path} is {_kind_of(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise CheckpointError(f"{path} has {st.st_size} bytes, more than the {limit} this file may have")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{path} grew past {limit} bytes while it was read")
    return data


def read_json(path: Path, limit: int = JSON_LIMIT, *, follow_links: bool = False):
    """``path`` parsed as JSON (see read_bounded); malformed or too deeply nested
    JSON is a CheckpointError naming the file."""
    data = read_bounded(path, limit, follow_links=follow_links)
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({str(e)[:200]})") from None
    except RecursionError:
        raise CheckpointError(f"{path} is not a valid checkpoint file: its JSON nests too deeply") from None


# ----------------------------------------------------------------------------------------
# checksums
# ----------------------------------------------------------------------------------------
class ChecksumFile:
    """A write-only binary file that computes the CRC-32 and size of what is written."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._f = open(self.path, "wb")
        self.crc32 = 0
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.crc32 = zlib.crc32(view, self.crc32)
        self.size += view.nbytes
        return self._f.write(view)

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()

    def record(self) -> dict:
        return {"size": self.size, "crc32": self.crc32}

    def __enter__(self) -> "ChecksumFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_bytes(path: Path, data: bytes) -> dict:
    """Write ``data`` durably; return its ``{"size", "crc32"}`` record."""
    with ChecksumFile(path) as f:
        f.write(data)
    return f.record()


def write_json(path: Path, obj) -> dict:
    return write_bytes(path, json.dumps(obj).encode())


def file_crc32(path: Path) -> int:
    crc = 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                return crc
            crc = zlib.crc32(view[:n], crc)


def verify_file(path: Path, record: dict, identity=None) -> None:
    """That ``path`` is a regular file of the recorded size (before any byte is read),
    then ``identity()`` (cheap header checks, if given: they explain a renamed, swapped
    or mixed-in file better than a checksum), then its CRC-32, against the manifest's
    record for ``path``."""
    if not os.path.lexists(path):
        raise CheckpointError(f"{path} is missing from the checkpoint")
    size = require_regular(path).st_size  # [Note: only regular files are read]
    if size != record["size"]:
        raise CheckpointError(
            f"{path} has {size} bytes but the manifest records {record['size']}: the file is truncated or was "
            "replaced; the checkpoint is damaged"
        )
    if identity is not None:
        identity()
    try:
        crc = file_crc32(path)
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({e})") from None
    if crc != record["crc32"]:
        raise CheckpointError(
            f"{path} is corrupted: its CRC-32 is {crc:08x} but the manifest records {record['crc32']:08x} "
            "(bytes changed on disk or in transfer); the checkpoint cannot be trusted"
        )


# ----------------------------------------------------------------------------------------
# what is ours
# ----------------------------------------------------------------------------------------
def read_marker(directory: Path) -> Optional[dict]:
    """The marker of ``directory``, or None when it has none (or an unreadable one)."""
    try:
        m = read_json(directory / MARKER, SMALL_JSON_LIMIT)
    except CheckpointError:
        return None
    if not isinstance(m, dict) or m.get("format") not in _KIND_WORDS:
        return None
    return m


def write_marker(directory: Path, kind: str, files: Optional[Iterable[str]] = None) -> None:
    """First file of a new directory (``files=None``: in progress), rewritten with the
    list of files when the directory is complete (atomically: a temporary and a rename)."""
    body = {"format": kind, "note": "written by zero_strategy; this directory may be replaced by its next save"}
    if files is not None:
        body["files"] = sorted(files)
    part = directory / (MARKER + ".part")
    write_json(part, body)
    os.replace(part, directory / MARKER)


def _v1_manifest(directory: Path) -> bool:
    try:
        m = read_json(directory / MANIFEST)
    except CheckpointError:
        return False
    return isinstance(m, dict) and m.get("format") == KIND_CHECKPOINT


def _entries(directory: Path) -> List[str]:
    return sorted(os.listdir(directory))


def _show(names: List[str], directory: Path) -> str:
    shown = [n + ("/" if (directory / n).is_dir() and not (directory / n).is_symlink() else "") for n in names[:6]]
    return ", ".join(shown) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def ownership_problem(directory: Path, kind: str, *, in_progress_ok: bool = False) -> Optional[str]:
    """None when ``directory`` may be replaced or removed by a writer of ``kind``
    (absent, empty, or ours and holding only what we wrote); else why not."""
    if not os.path.lexists(directory):
        return None
    if not directory.is_dir():  # (a link is judged by what it points to; only the link is ever removed)
        return f"{directory} exists and is a file, not a directory"
    names = _entries(directory)
    if not names:
        return None
    marker = read_marker(directory)
    if marker is None and in_progress_ok and names == [MARKER + ".part"]:
        return None  # a directory we created, killed (or out of space) while writing its marker
    if marker is None and kind == KIND_CHECKPOINT and _v1_manifest(directory):
        extra = [n for n in names if not _V1_FILES.match(n)]
    elif marker is None:
        return f"{directory} exists and is not {_KIND_WORDS[kind]} (it holds {_show(names, directory)})"
    elif marker["format"] != kind:
        return f"{directory} is {_KIND_WORDS[marker['format']]}, not {_KIND_WORDS[kind]}"
    elif marker.get("files") is None:
        if not in_progress_ok:
            return f"{directory} is an unfinished {_KIND_WORDS[kind].split(' ', 1)[1]}"
        extra = [n for n in names if (directory / n).is_dir() and not (directory / n).is_symlink()]
    else:
        ours = set(marker["files"]) | {MARKER, MARKER + ".part"}
        extra = [n for n in names if n not in ours]
    if extra:
        return (
            f"{directory} is {_KIND_WORDS[kind]} but also holds files it did not write ({_show(extra, directory)}), "
            "which replacing it would delete"
        )
    return None


def remove_ours(directory: Path) -> None:
    """Delete a directory that :func:`ownership_problem` accepted: its files, then the
    manifest and the marker, then the directory itself (a link: only the link)."""
    if os.path.islink(directory):
        os.unlink(directory)
        return
    if not os.path.lexists(directory):
        return
    last = [MANIFEST, MARKER]
    for name in _entries(directory):
        if name not in last:
            p = directory / name
            if p.is_dir() and not p.is_symlink():
                raise CheckpointError(f"{p} is a directory; zero_strategy writes none, so it is left alone")
            os.unlink(p)
    for name in last:
        try:
            os.unlink(directory / name)
        except FileNotFoundError:
            pass
    os.rmdir(directory)


def prepare_target(directory: Path, kind: str, what: str) -> None:
    """Before writing ``<directory>.tmp``: the target, ``.old`` and ``.tmp`` must each
    be absent or ours (else a CheckpointError saying what to do); a leftover ``.tmp`` of
    ours is removed (the caller holds the lock, so no other writer is using it)."""
    problem = ownership_problem(directory, kind)
    if problem is not None:
        hint = (f"choose a new path (for example {directory / 'checkpoint'}) or move the existing directory away"
                if directory.is_dir() else "choose another path or move the file away")
        raise CheckpointError(
            f"{what} refused: {problem}. Only a directory written by zero_strategy is ever replaced, and nothing "
            f"was changed; {hint}"
        )
    for suffix in (".old", ".tmp"):
        aside = sibling(directory, suffix)
        problem = ownership_problem(aside, kind, in_progress_ok=True)
        if problem is not None:
            raise CheckpointError(
                f"{what} refused: {problem}, and zero_strategy needs that path while it replaces {directory.name}. "
                "Move or rename it; nothing was changed"
            )
    remove_ours(sibling(directory, ".tmp"))


def new_tmp(directory: Path, kind: str) -> Path:
    tmp = sibling(directory, ".tmp")
    tmp.mkdir(parents=True)
    write_marker(tmp, kind)
    return tmp


def discard_tmp(directory: Path) -> None:
    """After a failed write: remove ``<directory>.tmp`` if it is ours (never raises)."""
    tmp = sibling(directory, ".tmp")
    try:
        marker = read_marker(tmp)
        kind = marker["format"] if marker is not None else KIND_CHECKPOINT  # no marker: removed only if empty
        if ownership_problem(tmp, kind, in_progress_ok=True) is None:
            remove_ours(tmp)
    except Exception:  # noqa: BLE001 - cleanup after an error must not hide the error
        pass


def finish_and_swap(tmp: Path, directory: Path, kind: str) -> None:
    """Make ``tmp`` complete (its marker lists its files) and put it at ``directory``.

    The previous directory (already checked to be ours) is renamed to ``.old`` first and
    removed only once the new one is in place, so at every instant a complete
    checkpoint exists at ``directory`` or at ``directory.old`` (which loading falls back
    to)."""
    write_marker(tmp, kind, [n for n in _entries(tmp) if n != MARKER])
    _fsync_dir(tmp)
    old = sibling(directory, ".old")
    moved_aside = False
    if os.path.lexists(directory):
        remove_ours(old)  # a leftover of an earlier save, checked to be ours
        os.rename(directory, old)
        moved_aside = True
    try:
        os.rename(tmp, directory)
    except OSError:
        if moved_aside:
            os.rename(old, directory)  # put the previous checkpoint back
        raise
    _fsync_dir(directory.parent)
    try:
        remove_ours(old)
    except OSError:
        pass  # the new checkpoint is in place; the next save retries the removal


def existing(directory) -> Optional[Path]:
    """Where the checkpoint ``directory`` is: itself, or ``directory.old`` when a save
    was interrupted between its two renames; None when neither holds a manifest."""
    directory = Path(directory)
    if directory.is_dir():
        return directory
    old = sibling(directory, ".old")
    if (old / MANIFEST).is_file():
        return old
    return None


def clean_leftover_tmp(directory: Path) -> None:
    """At load: remove ``<directory>.tmp`` if it is ours and no writer holds the lock
    (a save that was killed leaves it, and it may be as large as the checkpoint).
    Never raises: loading does not depend on it."""
    tmp = sibling(directory, ".tmp")
    if read_marker(tmp) is None:
        return
    try:
        lock = DirectoryLock.try_take(directory)
    except Exception:  # noqa: BLE001
        return
    if lock is None:
        return
    try:
        discard_tmp(directory)
    finally:
        lock.release()


# ----------------------------------------------------------------------------------------
# the writer's lock
# ----------------------------------------------------------------------------------------
def _start_time(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return True
    return True


def _create_exclusive(path: Path, body: dict) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, json.dumps(body).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _read_json(path: Path) -> Optional[dict]:
    try:
        v = read_json(path, SMALL_JSON_LIMIT)
    except CheckpointError:
        return None
    return v if isinstance(v, dict) else None


class DirectoryLock:
    """``<directory>.lock``: one writer at a time (see [Note: the writer's lock])."""

    def __init__(self, directory: Path, path: Path, token: str) -> None:
        self.directory, self.path, self.token = directory, path, token
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="zero_strategy-lock-heartbeat", daemon=True)
        self._thread.start()

    @staticmethod
    def _body(token: str) -> dict:
        pid = os.getpid()
        return {"pid": pid, "host": socket.gethostname(), "start": _start_time(pid), "token": token,
                "since": time.strftime("%Y-%m-%d %H:%M:%S %z")}

    @classmethod
    def try_take(cls, directory: Path) -> Optional["DirectoryLock"]:
        """The lock, or None when a live writer holds it."""
        directory = Path(directory)
        path = sibling(directory, ".lock")
        token = secrets.token_hex(8)
        for _ in range(3):
            if _create_exclusive(path, cls._body(token)):
                return cls(directory, path, token)
            holder = _read_json(path)
            if not _stale(path, holder):
                return None
            _break(path, holder)
        return None

    @classmethod
    def take(cls, directory: Path, what: str) -> "DirectoryLock":
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        lock = cls.try_take(directory)
        if lock is not None:
            return lock
        path = sibling(directory, ".lock")
        holder = _read_json(path) or {}
        who = (f"pid {holder.get('pid')} on host {holder.get('host')} since {holder.get('since')}"
               if holder else "another writer")
        raise CheckpointError(
            f"{what} refused: {directory} is being written by another job ({path} is held by {who}). Two jobs must "
            f"not save into one directory: save elsewhere or wait for it to finish. If that job is gone, delete {path} "
            f"(it is also treated as stale once nobody has refreshed it for {STALE_AFTER_SECONDS:g} s)"
        )

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        self._stop.set()
        holder = _read_json(self.path)
        if holder is not None and holder.get("token") == self.token:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def _stale(path: Path, holder: Optional[dict]) -> bool:
    try:
        age = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return True  # released meanwhile: try again
    if holder is None:
        return age > 10.0  # unreadable: being written, or garbage left for a while
    if age > STALE_AFTER_SECONDS:
        return True
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        pid = holder["pid"]
        if not _pid_alive(pid):
            return True
        if holder.get("start") is not None and _start_time(pid) not in (None, holder["start"]):
            return True  # the pid now belongs to another process
    return False


def _break(path: Path, holder: Optional[dict]) -> None:
    guard = Path(str(path) + ".break")
    if not _create_exclusive(guard, {"pid": os.getpid(), "host": socket.gethostname()}):
        try:
            if time.time() - os.stat(guard).st_mtime > 60.0:
                os.unlink(guard)  # a breaker that died
        except OSError:
            pass
        time.sleep(0.05)
        return
    try:
        now = _read_json(path)
        same = (now or {}).get("token") == (holder or {}).get("token")
        if same and _stale(path, now):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    finally:
        try:
            os.unlink(guard)
        except OSError:
            pass
