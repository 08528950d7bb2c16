"""``training.deterministic``: the mode it turns on, the engines it admits, what the manifest and
the report say, and two CPU runs with identical checkpoints (the GPU side:
tests/test_determinism_gpu.py and docs/runs/2026-11-25-deterministic-training.md)."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest
import torch

from anchorctx.attention import AttentionError, attend, build_layout
from anchorctx.attention.engines import ENGINES
from anchorctx.io import read_json
from anchorctx.training import determinism


def _hashes(run_dir: Path) -> dict[str, str]:
    """sha256 of the checkpoints' weight files, by relative path (``anchorctx.json`` beside
    them records the run's own directory and time, so it differs by design)."""
    root = run_dir / "checkpoints"
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*.safetensors"))
    }


def test_two_deterministic_runs_give_identical_checkpoints(tiny_config, packed_demo, tmp_path):
    from anchorctx.training.launch import launch

    def run(name: str) -> Path:
        cfg = tiny_config.model_copy(
            update={
                "run_root": tmp_path / name,
                "training": tiny_config.training.model_copy(
                    update={"steps": 2, "deterministic": True}
                ),
                "data": tiny_config.data.model_copy(update={"output_dir": packed_demo}),
            }
        )
        assert launch(cfg) == 0
        return cfg.run_dir

    first, second = run("a"), run("b")
    hashes = _hashes(first)
    assert hashes
    assert hashes == _hashes(second)
    recorded = read_json(first / "manifest.json")["deterministic"]
    assert recorded["requested"] is True
    assert recorded["torch_deterministic_algorithms"] is True
    assert recorded["warn_only"] is False
    assert recorded["cublas_workspace_config"] in determinism.DETERMINISTIC_WORKSPACES
    # The in-process run left this process' settings as it found them.
    assert not torch.are_deterministic_algorithms_enabled()


def test_mode_is_entered_and_restored(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    cudnn = torch.backends.cudnn
    monkeypatch.setattr(cudnn, "benchmark", True)
    with determinism.deterministic_mode(True, seed=3):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert (cudnn.benchmark, cudnn.deterministic) == (False, True)
        first = torch.rand(3)
        record = determinism.record(True)
    torch.manual_seed(3)
    assert torch.equal(first, torch.rand(3))  # seeded with the run's seed
    assert not torch.are_deterministic_algorithms_enabled()
    assert cudnn.benchmark is True
    assert record["cublas_workspace_config"] == ":4096:8"
    with determinism.deterministic_mode(False, seed=3):
        assert not torch.are_deterministic_algorithms_enabled()


def test_cublas_workspace_is_set_unless_already_deterministic():
    env: dict[str, str] = {}
    assert determinism.environment(False, env) is None and env == {}
    assert "CUBLAS_WORKSPACE_CONFIG=:4096:8" in determinism.environment(True, env)
    assert env == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    env = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}  # the user's own deterministic choice stays
    assert determinism.environment(True, env) is None and env["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    env = {"CUBLAS_WORKSPACE_CONFIG": ":0:0"}  # not a deterministic value: replaced
    assert determinism.environment(True, env) is not None
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_engines_declare_determinism_only_where_they_have_a_backward():
    for name, engine in ENGINES.items():
        caps = engine.capabilities
        assert caps.deterministic_backward <= caps.backward_devices, name


def _grad_call():
    layout = build_layout([5, 7, 4], "anchor")
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    return q, k, v, layout


def test_an_engine_without_a_deterministic_backward_is_refused(monkeypatch):
    sdpa = ENGINES["sdpa"]
    caps = dataclasses.replace(sdpa.capabilities, deterministic_backward=frozenset({"cuda"}))
    monkeypatch.setattr(sdpa, "capabilities", caps)
    q, k, v, layout = _grad_call()
    attend(q, k, v, layout, engine="sdpa")  # outside the mode: runs
    with determinism.deterministic_mode(True, seed=0):
        with pytest.raises(AttentionError, match="engine 'sdpa' has no deterministic backward"):
            attend(q, k, v, layout, engine="sdpa")
        # auto skips it, and says why when nothing else can run the call
        with pytest.raises(AttentionError, match="no deterministic backward on cpu"):
            attend(q, k, v, layout, engine="auto")
        with torch.no_grad():  # no backward: determinism of the forward is all that counts
            attend(q, k, v, layout, engine="sdpa")


def test_report_says_whether_the_arms_trained_deterministically(tmp_path):
    from anchorctx.evaluation.arm_comparison import trained_deterministic
    from anchorctx.evaluation.report import determinism_line
    from anchorctx.io import atomic_write_json

    assert trained_deterministic(tmp_path) is None
    atomic_write_json(tmp_path / "manifest.json", {"deterministic": determinism.record(False)})
    assert trained_deterministic(tmp_path) is False
    arms = [{"variant": "a", "deterministic": True}, {"variant": "b", "deterministic": True}]
    assert determinism_line(arms).startswith("Training: deterministic")
    assert determinism_line([{"variant": "a", "deterministic": False}]).startswith(
        "Training: not deterministic"
    )
    mixed = determinism_line([*arms[:1], {"variant": "b", "deterministic": None}])
    assert mixed == "Training deterministic, per arm: `a` yes, `b` not recorded."
