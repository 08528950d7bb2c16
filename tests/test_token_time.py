"""`anchorctx plan --per-billion-tokens DIR` (paper Figure 6): each arm's training time per 1B
tokens on each GPU kind, from the same step-time plan `anchorctx plan` prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from anchorctx.cli import main

REPO = Path(__file__).resolve().parents[1]
PRESET = REPO / "configs" / "paper" / "llama2-7b-64k.yaml"


def test_hours_per_billion_tokens_follow_the_plans_step_time(tmp_path, capsys):
    assert main(["plan", str(PRESET), "--gpus", "8", "--per-billion-tokens", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "Figure 6" in printed and "8 × A100-80G (estimate)" in printed
    rows = json.loads((tmp_path / "time_per_1b_tokens.json").read_text())["rows"]
    assert {r["gpu"] for r in rows} == {"A100-80G", "H100", "H200"}
    assert (tmp_path / "time_per_1b_tokens.png").stat().st_size > 0
    assert (tmp_path / "time_per_1b_tokens.md").read_text().startswith("### Figure 6")
    # The same step times `anchorctx plan --json` gives on H100 (8 rows of 64K tokens a step).
    assert main(["plan", str(PRESET), "--gpu", "h100", "--gpus", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    h100 = {r["arm"]: r for r in rows if r["gpu"] == "H100"}
    for arm in plan["training"]["arms"]:
        row = h100[arm["name"]]
        assert row["step_s"] == arm["step_s"]
        assert row["tokens_per_step"] == 8 * 65536
        assert row["hours_per_billion"] == pytest.approx(arm["step_s"] * 1e9 / 8 / 65536 / 3600)
        assert row["days_per_billion"] == pytest.approx(row["hours_per_billion"] / 24)
    # Document masking halves the attention work, so the anchor arm trains faster than full.
    assert h100["anchor"]["hours_per_billion"] < h100["full"]["hours_per_billion"]


def test_a_gpu_kind_the_run_does_not_fit_is_a_row_saying_why(tmp_path, capsys, monkeypatch):
    from anchorctx.evaluation import cost_plan, token_time
    from anchorctx.training.cost_plan import PlanError

    real = cost_plan.plan_experiment

    def refuse_a100(cfg, gpu, *args, **kw):
        if gpu == "a100-80g":
            raise PlanError("does not fit in 75.6 GiB: set training.memory.tiled_mlp=true")
        return real(cfg, gpu, *args, **kw)

    monkeypatch.setattr(cost_plan, "plan_experiment", refuse_a100)
    from anchorctx.experiment import load_config

    rows = token_time.token_times(load_config(PRESET), gpus=8)
    a100 = [r for r in rows if r["gpu"] == "A100-80G"]
    assert a100 and all("tiled_mlp" in r["problem"] for r in a100)
    assert "does not fit" in token_time.token_time_markdown(rows)
    token_time.plot_token_time(rows, tmp_path / "f.png")  # drawn from the rows that fit
