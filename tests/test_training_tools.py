"""The training process finds its own environment's build tools (training/engine.py)."""

from __future__ import annotations

import os
import sys

from anchorctx.training.engine import environment_tools_first


def _bindir_with(tmp_path, *names):
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    for name in names:
        (bindir / name).write_text("")
    return bindir


def test_the_interpreters_ninja_comes_first(tmp_path, monkeypatch):
    """Started without its virtualenv on PATH (a Prefect task, `.venv/bin/python -m ...`), the
    process puts the interpreter's bin directory first, once, so DeepSpeed's JIT build runs the
    locked ninja that built the cached ops, not another one that would rebuild them."""
    bindir = _bindir_with(tmp_path, "python", "ninja")
    monkeypatch.setattr(sys, "executable", str(bindir / "python"))
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/local/bin", "/usr/bin"]))
    environment_tools_first()
    assert os.environ["PATH"].split(os.pathsep) == [str(bindir), "/usr/local/bin", "/usr/bin"]
    environment_tools_first()  # already first: unchanged
    assert os.environ["PATH"].split(os.pathsep) == [str(bindir), "/usr/local/bin", "/usr/bin"]


def test_path_is_left_alone_without_a_ninja_beside_the_interpreter(tmp_path, monkeypatch):
    """A system Python (no ninja of its own): PATH's ninja is the only one there is."""
    bindir = _bindir_with(tmp_path, "python")
    monkeypatch.setattr(sys, "executable", str(bindir / "python"))
    monkeypatch.setenv("PATH", "/usr/bin")
    environment_tools_first()
    assert os.environ["PATH"] == "/usr/bin"
