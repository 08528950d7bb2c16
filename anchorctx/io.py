"""Atomic file and directory writes, content hashes, JSON lines.

Everything a run leaves behind (configs, manifests, results, checkpoints) is written to a
temporary name in the same directory and renamed into place: a reader never sees half a file,
and an interrupted run leaves either the old version or the new one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


def atomic_write_text(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


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
        yield tmp
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
