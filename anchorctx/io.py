"""Atomic file and directory writes, content hashes, JSON lines, and the one-writer lock.

Everything a run leaves behind (configs, manifests, results, reports, plots, checkpoints) is
written to a temporary name in the same directory and renamed into place: a reader never sees
half a file, and an interrupted run leaves either the old version or the new one. Files go
through the one :func:`atomic_write_bytes` (text and JSON are built on it; figures are rendered
to bytes first), whole directories such as checkpoints through :func:`atomic_directory`.
Temporary files and directories are created private (``mkstemp``/``mkdtemp`` use 0600/0700) and
given the modes the user's umask asks for just before the rename, so results on a shared cluster
are as readable as any other file the user writes. :func:`move_aside` renames an earlier output
out of the way without ever overwriting another.

:class:`WriterLock` makes sure only one process writes a run directory, a packed dataset or an
evaluation output at a time (see its docstring for the guarantees and the NFS caveats).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import locale
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows (``os.umask`` can only
    be read by setting it, which would briefly change it for every other thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def file_mode() -> int:
    """Mode of a new regular file under the current umask (what ``open`` would give)."""
    return 0o666 & ~current_umask()


def dir_mode() -> int:
    """Mode of a new directory under the current umask (what ``mkdir`` would give)."""
    return 0o777 & ~current_umask()


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically: the one implementation every writer uses.

    A private temporary file beside ``path`` gets the bytes, is flushed to disk, is given the
    mode the umask asks for and is renamed into place; on any failure it is removed and
    ``path`` keeps its earlier content. Parent directories are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), file_mode())  # mkstemp makes it 0600 whatever the umask says
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """:func:`atomic_write_bytes` of ``text``, encoded as ``open`` would (the locale's
    preferred encoding; UTF-8 in UTF-8 mode), so :func:`read_json` and ``read_text`` read it."""
    return atomic_write_bytes(path, text.encode(locale.getpreferredencoding(False)))


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


@contextlib.contextmanager
def atomic_directory(final: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success rename it to ``final``.

    An existing ``final`` is replaced only after the new one is complete (renamed aside, then
    removed), so there is never a moment without a complete version.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        os.chmod(tmp, dir_mode())  # mkdtemp makes it 0700 whatever the umask says
        yield tmp
        _apply_umask(tmp)
        if final.exists():
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _apply_umask(root: Path) -> None:
    """Give everything under ``root`` the read/write bits the umask allows. Some writers
    (safetensors) create files 0600 regardless of the umask; execute bits are kept."""
    mask = current_umask()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            _widen(Path(dirpath) / name, 0o777, mask)
        for name in filenames:
            _widen(Path(dirpath) / name, 0o666, mask)


def _widen(path: Path, allowed: int, mask: int) -> None:
    if not path.is_symlink():
        os.chmod(path, ((path.stat().st_mode & 0o777) | allowed) & ~mask)


def move_aside(
    path: str | Path, label: str = "old", *, source: str | Path | None = None
) -> Path | None:
    """Rename ``source`` (default: ``path`` itself) out of the way, to
    ``<path>.<label>-<YYYYmmdd-HHMMSS>`` beside ``path``; never deletes or overwrites anything.
    Returns the new name, or None when there is nothing to move.

    A name already taken (two moves within one second, a leftover directory or file) gets a
    counter, ``-1``, ``-2``, ... The name is reserved atomically before the move, so one that
    appears between a check and the rename is never replaced: a directory is renamed onto an
    empty directory reserved with ``mkdir`` (one atomic rename); a file is hard-linked to the
    new name (which fails when it exists) and its old name then removed."""
    path = Path(path)
    source = Path(source) if source is not None else path
    if not source.exists():
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = f"{path.name}.{label}-{stamp}"
    n = 0
    while True:
        target = path.with_name(base if n == 0 else f"{base}-{n}")
        try:
            _rename_no_replace(source, target)
        except FileExistsError:
            n += 1
            continue
        return target


def _rename_no_replace(source: Path, target: Path) -> None:
    """Rename ``source`` to ``target``; FileExistsError when ``target`` exists."""
    if source.is_dir() and not source.is_symlink():
        os.mkdir(target)  # the reservation: fails when the name is taken
        try:
            os.rename(source, target)  # a directory replaces an empty directory atomically
        except BaseException:
            with contextlib.suppress(OSError):
                os.rmdir(target)
            raise
    else:
        os.link(source, target, follow_symlinks=False)
        os.unlink(source)


def append_jsonl(path: str | Path, row: dict[str, Any]) -> None:
    """Append one JSON line and flush it (metrics, per-sample results survive a crash)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(json.dumps(row, default=str) + "\n")
        fh.flush()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read JSON lines, ignoring a torn last line left by a crash mid-write."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def hash_tree(root: str | Path, patterns: Iterable[str] = ("*",), skip_hidden: bool = True) -> str:
    """Content hash of the files under ``root`` (relative names + bytes), order-independent."""
    root = Path(root)
    h = hashlib.sha256()
    files = sorted(
        {p for pat in patterns for p in root.rglob(pat) if p.is_file()},
        key=lambda p: p.relative_to(root).as_posix(),
    )
    for p in files:
        rel = p.relative_to(root).as_posix()
        if skip_hidden and any(part.startswith(".") for part in rel.split("/")):
            continue
        h.update(rel.encode() + b"\0" + sha256_file(p).encode() + b"\n")
    return h.hexdigest()


# ---------------------------------------------------------------------------- writer lock
class LockHeldError(RuntimeError):
    """Another process holds the writer lock; the message names its pid and host."""


class WriterLock:
    """One writer per output: an advisory ``fcntl.flock`` on a lock file beside the output.

    ``WriterLock(path, what).acquire()`` either takes the lock at once or raises
    :class:`LockHeldError` naming the holder (pid, host, command, since when: the holder writes
    them into the lock file). The OS releases the lock when the holding process dies, however
    it dies, so a crashed run never leaves a stale lock behind; the file itself stays (removing
    it would let two processes lock two different files of the same name).

    The lock belongs to the open file description: a child started with the descriptor in
    ``pass_fds`` (see :attr:`fd`) keeps the output locked until it exits too, which is how a
    launcher covers its whole process group. Use it as a context manager or call
    :meth:`release`; acquiring twice in one process fails like any second writer.

    Shared filesystems (docs/RELIABILITY.md): on Linux, ``flock`` on NFSv4 (and NFSv3 with
    lockd) becomes a whole-file POSIX lock held by the server, so it excludes writers on other
    nodes too; an NFS mount with ``nolock`` or ``local_lock=flock``/``all`` (and Lustre mounted
    with ``localflock``) keeps locks local to one node; where locking is unsupported (Lustre
    ``noflock``, NFSv3 without lockd) acquiring fails with an error that says so.
    """

    def __init__(self, path: str | Path, what: str) -> None:
        self.path = Path(path)
        self.what = what
        self.fd: int | None = None

    @classmethod
    def beside(cls, target: str | Path, what: str) -> WriterLock:
        """The lock of ``target`` (a directory or file): ``.<name>.lock`` in its parent, so
        it survives ``target`` being replaced or renamed aside."""
        target = Path(target)
        return cls(target.parent / f".{target.name}.lock", what)

    def acquire(self) -> WriterLock:
        if self.fd is not None:
            raise LockHeldError(f"{self.path}: already held by this process")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, file_mode())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _read_holder(fd)
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise LockHeldError(
                    f"{self.what} is being written by another process ({holder}); "
                    f"wait for it or stop it (lock file {self.path})"
                ) from None
            raise LockHeldError(
                f"cannot lock {self.path} ({os.strerror(err.errno)}): the filesystem does not "
                "support flock here (NFS needs lockd, Lustre the flock mount option)"
            ) from None
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join(sys.argv)[:300],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # the holder's details are stale from now on
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def __enter__(self) -> WriterLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or "pid" not in info:
        return "holder unknown: it has not written its details yet"
    text = f"pid {info['pid']} on host {info.get('host', '?')} since {info.get('since', '?')}"
    if info.get("host") == socket.gethostname() and not _alive(info["pid"]):
        text += "; it has exited, but processes it launched still hold the lock"
    return text


def _alive(pid: object) -> bool:
    if not isinstance(pid, int):
        return True  # unknown: do not claim it exited
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True
