"""Atomic writes never leave partial outputs behind."""

from __future__ import annotations

import pytest

from anchorctx.io import (
    append_jsonl,
    atomic_directory,
    atomic_write_json,
    hash_tree,
    read_json,
    read_jsonl,
)


def test_atomic_write_json_roundtrip(tmp_path):
    path = atomic_write_json(tmp_path / "a" / "x.json", {"k": [1, 2]})
    assert read_json(path) == {"k": [1, 2]}
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]


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
