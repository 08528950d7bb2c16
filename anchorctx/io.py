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

A directory is only ever replaced by the writer that wrote it (:func:`owned_directory`): new,
empty, or carrying that writer's marker (``.anchorctx-owner.json``) and nothing it did not
record; anything else may be the user's and is refused (:class:`ForeignDirectoryError`).

:class:`WriterLock` makes sure only one process writes a run directory, a packed dataset or an
evaluation output at a time (see its docstring for the guarantees and the NFS caveats).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import io
import json
import locale
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path
from typing import Any, cast


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
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(err, OSError) and err.errno and not err.filename:
            # A failed write() names no file (a full disk: "No space left on device" alone).
            raise OSError(err.errno, err.strerror or os.strerror(err.errno), str(path)) from err
        raise
    return path


def atomic_write_png(path: str | Path, figure: Any, dpi: float | None = None) -> Path:
    """A matplotlib ``figure`` laid out, rendered to PNG in memory and written by
    :func:`atomic_write_bytes` (matplotlib's own writer opens ``path`` directly)."""
    figure.tight_layout()
    buf = io.BytesIO()
    figure.savefig(buf, format="png", **({} if dpi is None else {"dpi": dpi}))
    return atomic_write_bytes(path, buf.getvalue())


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
            # A fresh empty name for the old version: renaming a directory onto an empty one
            # is atomic, and two writers finishing together never share one ``.old``.
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".old", dir=final.parent))
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


# ---------------------------------------------------------------------- directories we own
# The one rule for every directory the project writes as a whole (checkpoints averaged,
# demo and evaluation data, paper stand-ins, packed datasets): a writer may create a new
# directory, fill an empty one, or replace one that carries this marker written by the same
# writer for the same identity, holding only the files it recorded there (unchanged). Anything
# else may be the user's (a thesis, real weights, real benchmark files) and is refused.
OWNER_FILE = ".anchorctx-owner.json"
# Hidden names the project's own writers leave behind when killed (temporary files and
# directories of atomic_write_bytes / atomic_directory, writer locks): never the user's.
_LEFTOVER_SUFFIXES = (".tmp", ".old", ".lock")


class ForeignDirectoryError(FileExistsError):
    """A writer was pointed at a directory it did not write; the message names it."""

    exit_code = 2  # a path on the command line or in the config: choose another (anchorctx.cli)


class DiskFullError(OSError):
    """The disk filled while a directory was written; the message names the file and the
    space needed. Nothing was replaced."""

    exit_code = 1


@dataclasses.dataclass(frozen=True)
class DirectoryOwner:
    """Who writes a directory: ``writer`` (the command or function, e.g. ``average-weights``),
    ``what`` (for messages: "an averaged checkpoint") and ``identity`` (what it is written
    for, e.g. the run directory; "" when any output of the writer may replace another)."""

    writer: str
    what: str
    identity: str = ""


def check_replaceable(
    final: str | Path, owner: DirectoryOwner, damaged: Collection[str] = ()
) -> None:
    """Raise :class:`ForeignDirectoryError` unless ``owner`` may replace ``final`` (absent, an
    empty directory, or ``owner``'s own unchanged output). ``damaged``: files the marker records
    that may have changed since, because the caller found them damaged in its own output (a
    truncated Arrow file of a packed dataset): replacing them is the repair."""
    final = Path(final)
    if not final.exists() and not final.is_symlink():
        return
    if final.is_symlink() or not final.is_dir():
        raise ForeignDirectoryError(
            f"{final} exists and is not a directory anchorctx {owner.writer} wrote: "
            f"choose a new or empty directory for {owner.what}"
        )
    if not any(final.iterdir()):
        return
    recorded = _read_owner(final)
    if recorded is None:
        names = sorted(p.name for p in final.iterdir())
        held = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise ForeignDirectoryError(
            f"{final} exists, is not empty ({held}) and is not {owner.what} written by "
            f"anchorctx {owner.writer} (no {OWNER_FILE}): it may hold your files, so it is "
            "left as it is; choose a new or empty directory"
        )
    if (recorded.get("writer"), recorded.get("identity")) != (owner.writer, owner.identity):
        mine = f" for {owner.identity}" if owner.identity else ""
        theirs = f" for {recorded.get('identity')}" if recorded.get("identity") else ""
        raise ForeignDirectoryError(
            f"{final} was written by anchorctx {recorded.get('writer')}{theirs}, not as "
            f"{owner.what} by anchorctx {owner.writer}{mine}: choose another directory"
        )
    stranger = _unrecorded_file(final, recorded, frozenset(damaged))
    if stranger is not None:
        raise ForeignDirectoryError(
            f"{final} holds {stranger}, which anchorctx {owner.writer} did not write (or which "
            "changed since): move it away or choose another directory"
        )


def _read_owner(root: Path) -> dict[str, Any] | None:
    try:
        recorded = json.loads((root / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(recorded, dict) and isinstance(recorded.get("files"), dict)
    return recorded if ok else None


def _inventory(root: Path) -> dict[str, list[int]]:
    """Size and mtime of every file under ``root`` the marker answers for: not the marker,
    not leftovers of the project's own writers, nothing inside a nested directory that has a
    marker of its own (that one answers for its files)."""
    files: dict[str, list[int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        links = [d for d in dirnames if (here / d).is_symlink()]  # walked as files: rmtree
        dirnames[:] = [  # removes the link, so the link is what the marker must answer for
            d for d in dirnames if d not in links and not _leftover(d) and not _has_owner(here / d)
        ]
        for name in [*filenames, *links]:
            if (here == root and name == OWNER_FILE) or _leftover(name):
                continue
            st = (here / name).lstat()
            files[(here / name).relative_to(root).as_posix()] = [st.st_size, st.st_mtime_ns]
    return files


def _nested_owned(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, _ in os.walk(root):
        here = Path(dirpath)
        owned = [d for d in dirnames if not (here / d).is_symlink() and _has_owner(here / d)]
        dirnames[:] = [d for d in dirnames if d not in owned and not _leftover(d)]
        yield from (here / d for d in owned)


def _has_owner(path: Path) -> bool:
    return (path / OWNER_FILE).is_file()


def _leftover(name: str) -> bool:
    return name.startswith(".") and name.endswith(_LEFTOVER_SUFFIXES)


def _unrecorded_file(
    root: Path, recorded: dict[str, Any], damaged: frozenset[str] = frozenset()
) -> str | None:
    """The first file under ``root`` its marker does not list as it is now (a file deleted
    since is fine: nothing of anyone's is lost by replacing it; a recorded file in ``damaged``
    may differ); nested owned directories are checked against their own markers."""
    want = recorded["files"]
    for rel, stat in sorted(_inventory(root).items()):
        if want.get(rel) != stat and not (rel in damaged and rel in want):
            return rel
    for nested in _nested_owned(root):
        inner = _read_owner(nested)
        found = _unrecorded_file(nested, inner) if inner is not None else OWNER_FILE
        if found is not None:
            return f"{nested.relative_to(root).as_posix()}/{found}"
    return None


def record_owner(root: str | Path, owner: DirectoryOwner) -> None:
    """Write ``root``'s marker: ``owner`` and every file under it now (see :func:`_inventory`)."""
    root = Path(root)
    info = {**dataclasses.asdict(owner), "files": _inventory(root)}
    atomic_write_json(root / OWNER_FILE, info)


def claim_directory(root: str | Path, owner: DirectoryOwner) -> Path:
    """For writers that fill a directory in place rather than replace it whole: check it is
    ``owner``'s to write (:func:`check_replaceable`), then create it with ``owner``'s marker
    when it is new or empty. Call :func:`record_owner` when done."""
    root = Path(root)
    check_replaceable(root, owner)
    if _read_owner(root) is None:
        root.mkdir(parents=True, exist_ok=True)
        record_owner(root, owner)
    return root


@contextlib.contextmanager
def owned_directory(
    final: str | Path,
    owner: DirectoryOwner,
    *,
    needs: int | None = None,
    damaged: Collection[str] = (),
) -> Iterator[Path]:
    """:func:`atomic_directory` for a directory ``owner`` may replace (checked before any
    work and again just before the swap); the new directory carries ``owner``'s marker. A full
    disk is one :class:`DiskFullError` naming the file being written and ``needs`` (bytes,
    when the caller knows them) instead of a bare "No space left on device"."""
    final = Path(final)
    check_replaceable(final, owner, damaged)
    with atomic_directory(final) as tmp:
        try:
            yield tmp
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise _disk_full(err, tmp, final, needs) from err
        record_owner(tmp, owner)
        check_replaceable(final, owner, damaged)  # the user may have put files there meanwhile


def _disk_full(err: OSError, tmp: Path, final: Path, needs: int | None) -> DiskFullError:
    """One line naming the file (the error's, else the newest under ``tmp``: the one being
    written), the space needed and the space free."""
    where = Path(err.filename) if err.filename else _newest_file(tmp)
    if where is not None and where.is_relative_to(tmp):
        where = final / where.relative_to(tmp)
    written = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
    try:
        free = f"{shutil.disk_usage(final.parent).free / 2**30:.2f} GiB free"
    except OSError:
        free = "free space unknown"
    need = (
        f"about {needs / 2**30:.2f} GiB"
        if needs
        else f"more than the {written / 2**30:.2f} GiB written"
    )
    return DiskFullError(
        f"no space left on device writing {where or final}: {final} needs {need} ({free}); "
        "its earlier version, if any, is intact"
    )


def _newest_file(root: Path) -> Path | None:
    files = [p for p in root.rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_mtime_ns) if files else None


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
                f"cannot lock {self.path} ({os.strerror(cast(int, err.errno))}): the filesystem does not "
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
