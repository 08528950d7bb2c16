"""Atomic writes never leave partial outputs behind; moving an output aside never overwrites."""

from __future__ import annotations

import os
import time

import pytest

from anchorctx.io import (
    append_jsonl,
    atomic_directory,
    atomic_write_bytes,
    atomic_write_json,
    hash_tree,
    move_aside,
    read_json,
    read_jsonl,
)


def test_atomic_write_json_roundtrip(tmp_path):
    path = atomic_write_json(tmp_path / "a" / "x.json", {"k": [1, 2]})
    assert read_json(path) == {"k": [1, 2]}
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]


def test_atomic_write_bytes_failure_keeps_old_version(tmp_path, monkeypatch):
    path = atomic_write_bytes(tmp_path / "plot.png", b"old")

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]  # no temporary file left


def test_atomic_directory_failure_keeps_old_version(tmp_path):
    final = tmp_path / "ckpt"
    with atomic_directory(final) as tmp:
        (tmp / "w").write_text("old")
    with pytest.raises(RuntimeError), atomic_directory(final) as tmp:
        (tmp / "w").write_text("new")
        raise RuntimeError("crash mid-write")
    assert (final / "w").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_atomic_directory_replaces_complete(tmp_path):
    final = tmp_path / "ckpt"
    for text in ("one", "two"):
        with atomic_directory(final) as tmp:
            (tmp / "w").write_text(text)
    assert (final / "w").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_read_jsonl_skips_torn_last_line(tmp_path):
    path = tmp_path / "m.jsonl"
    append_jsonl(path, {"step": 1})
    with path.open("a") as fh:
        fh.write('{"step": 2, "lo')
    assert read_jsonl(path) == [{"step": 1}]


def test_hash_tree_changes_with_content(tmp_path):
    (tmp_path / "a").write_text("1")
    h1 = hash_tree(tmp_path)
    (tmp_path / "a").write_text("2")
    assert hash_tree(tmp_path) != h1


def test_manifest_records_the_dependency_lock():
    """Every run manifest names the lock file's hash, so a result can be traced to the exact
    package set it was produced with (scripts/setup.sh installs from that lock)."""
    import hashlib
    from pathlib import Path

    from anchorctx.manifest import LOCK_FILE, base_manifest

    lock = Path(__file__).resolve().parents[1] / LOCK_FILE
    recorded = base_manifest()["lock"]
    assert recorded["file"] == LOCK_FILE
    assert recorded["sha256"] == hashlib.sha256(lock.read_bytes()).hexdigest()


# ------------------------------------------------------------------------- move aside
STAMP = "20260101-000000"


@pytest.fixture
def frozen_clock(monkeypatch):
    """Every move happens within the same second."""
    monkeypatch.setattr(time, "strftime", lambda fmt, *args: STAMP)


def test_move_aside_renames_and_never_overwrites(tmp_path, frozen_clock):
    run = tmp_path / "anchor"
    assert move_aside(run) is None  # nothing to move
    # A leftover empty directory and a file already hold the first two names: a plain rename
    # would silently replace the empty directory.
    (tmp_path / f"anchor.old-{STAMP}").mkdir()
    (tmp_path / f"anchor.old-{STAMP}-1").write_text("leftover")
    moved = []
    for text in ("first", "second"):
        run.mkdir()
        (run / "metrics.jsonl").write_text(text)
        moved.append(move_aside(run))
        assert not run.exists()
    assert [p.name for p in moved] == [f"anchor.old-{STAMP}-2", f"anchor.old-{STAMP}-3"]
    assert [(p / "metrics.jsonl").read_text() for p in moved] == ["first", "second"]
    assert not any((tmp_path / f"anchor.old-{STAMP}").iterdir())
    assert (tmp_path / f"anchor.old-{STAMP}-1").read_text() == "leftover"


def test_move_aside_source_label_and_files(tmp_path, frozen_clock):
    run = tmp_path / "anchor"
    previous = tmp_path / "anchor.previous"
    previous.mkdir()
    (previous / "w").write_text("previous run")
    # The source gets the run directory's name with the label; the run directory stays.
    run.mkdir()
    old = move_aside(run, source=previous)
    assert old == tmp_path / f"anchor.old-{STAMP}" and (old / "w").read_text() == "previous run"
    assert run.is_dir() and not previous.exists()
    assert move_aside(run, "failed") == tmp_path / f"anchor.failed-{STAMP}"
    # A file moves the same way, without replacing a file of the new name.
    log = tmp_path / "train.log"
    for text in ("one", "two"):
        log.write_text(text)
        move_aside(log)
    assert (tmp_path / f"train.log.old-{STAMP}").read_text() == "one"
    assert (tmp_path / f"train.log.old-{STAMP}-1").read_text() == "two"
    assert not log.exists()
