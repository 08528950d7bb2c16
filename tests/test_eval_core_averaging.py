"""Averaging over the last k checkpoints and the experiment report, on hand-written result
JSONs whose means and standard deviations are worked out by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from anchorctx.evaluation.averaging import stats, summarize_run
from anchorctx.evaluation.report import write_experiment_report

STEPS = [10, 20, 30, 40, 50, 60]


def write_result(
    run_dir: Path, name: str, suite: str, scores: dict, step: int | None, **extra: Any
):
    path = run_dir / "eval" / name / f"{suite}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "suite": suite,
        "checkpoint_name": name,
        "step": step,
        "scores": scores,
        "counts": {},
        "not_run": {},
        **extra,
    }
    path.write_text(json.dumps(record))


def ruler_scores(niah_4k: float, niah_8k: float | None, vt: float) -> dict[str, dict[str, float]]:
    scores = {"niah_single_1": {"4096": niah_4k}, "vt": {"4096": vt}, "cwe": {"4096": 0.0}}
    if niah_8k is not None:
        scores["niah_single_1"]["8192"] = niah_8k
        scores["vt"]["8192"] = vt / 2
    return scores


@pytest.fixture
def experiment(tmp_path: Path) -> Path:
    """Variant 'anchor': RULER at 6 steps (step 10 is an outlier outside the last 5),
    LongBench at 2 steps, MMLU at 1; a weight-averaged checkpoint; a stray file.
    Variant 'full': RULER (4K only) and HellaSwag at one step. Variant 'intra_doc': nothing."""
    anchor = tmp_path / "exp" / "anchor"
    ruler_cfg = {"ruler": {"exclude": ["cwe"]}}
    for step in STEPS:
        niah = 1000.0 if step == 10 else float(step)
        write_result(
            anchor,
            f"step-{step:06d}",
            "ruler",
            ruler_scores(niah, niah / 2, 100.0),
            step,
            evaluation=ruler_cfg,
        )
    for step, (sd, code) in zip([50, 60], [(10.0, 30.0), (20.0, 50.0)]):
        write_result(
            anchor,
            f"step-{step:06d}",
            "longbench",
            {"qasper": {"score": sd}},
            step,
            categories={"Single-Doc QA": sd, "Code": code},
        )
    write_result(anchor, "step-000060", "mmlu", {"mmlu": {"acc": 0.5}}, 60)
    write_result(
        anchor,
        "averaged-last-5",
        "ruler",
        ruler_scores(77.0, None, 100.0),
        None,
        evaluation=ruler_cfg,
    )
    (anchor / "eval" / "step-000060" / "notes.json").write_text("[1, 2]")

    full = tmp_path / "exp" / "full"
    write_result(
        full, "step-000060", "ruler", {"niah_single_1": {"4096": 30.0}, "vt": {"4096": 50.0}}, 60
    )
    write_result(full, "step-000060", "hellaswag", {"hellaswag": {"acc_norm": 0.4, "acc": 0.3}}, 60)
    return tmp_path / "exp"


def test_stats_population_std():
    s = stats([20, 30, 40, 50, 60])
    assert s == {"mean": 40.0, "std": math.sqrt(200.0), "n": 5}
    assert stats([3.0])["std"] == 0.0
    with pytest.raises(ValueError):
        stats([])


def test_summarize_run_last_k(experiment: Path):
    run = experiment / "anchor"
    summary = summarize_run(run, last_k=5)
    ruler = summary["suites"]["ruler"]
    assert ruler["steps"] == [20, 30, 40, 50, 60] and ruler["n"] == 5
    niah = ruler["scores"]["niah_single_1"]
    assert niah["4096"] == pytest.approx({"mean": 40.0, "std": math.sqrt(200.0), "n": 5})
    assert niah["8192"] == pytest.approx({"mean": 20.0, "std": math.sqrt(50.0), "n": 5})
    # Per-checkpoint mean over tasks without cwe: (s + 100) / 2 at 4K, (s/2 + 50) / 2 at 8K.
    assert ruler["average"]["4096"] == pytest.approx(
        {"mean": 70.0, "std": math.sqrt(200.0) / 2, "n": 5}
    )
    assert ruler["average"]["8192"] == pytest.approx(
        {"mean": 35.0, "std": math.sqrt(50.0) / 2, "n": 5}
    )
    assert list(ruler["average"]) == ["4096", "8192"]
    assert ruler["average_tasks"] == ["niah_single_1", "vt"] and ruler["excluded"] == ["cwe"]

    lb = summary["suites"]["longbench"]
    assert lb["steps"] == [50, 60]
    assert lb["categories"] == {
        "Single-Doc QA": {"mean": 15.0, "std": 5.0, "n": 2},
        "Code": {"mean": 40.0, "std": 10.0, "n": 2},
    }
    assert summary["suites"]["mmlu"]["scores"]["mmlu"]["acc"] == {"mean": 0.5, "std": 0.0, "n": 1}
    other = summary["other_checkpoints"]["averaged-last-5"]["ruler"]
    assert other["average"]["4096"]["mean"] == pytest.approx(88.5)

    on_disk = json.loads((run / "eval" / "summary.json").read_text())
    assert on_disk["suites"]["ruler"]["average"]["4096"]["mean"] == pytest.approx(70.0)
    md = (run / "eval" / "summary.md").read_text()
    assert "| RULER | 4K | 8K |" in md and "| **average** | 70.00 ± 7.07 | 35.00 ± 3.54 |" in md
    assert "| Single-Doc QA | 15.00 ± 5.00 |" in md and "Excluded from the average: cwe." in md


def test_summarize_run_k_larger_than_available(experiment: Path):
    summary = summarize_run(experiment / "anchor", last_k=10)
    ruler = summary["suites"]["ruler"]
    assert ruler["n"] == 6 and ruler["scores"]["niah_single_1"]["4096"]["mean"] == pytest.approx(
        (1000 + 20 + 30 + 40 + 50 + 60) / 6
    )
    with pytest.raises(ValueError, match="last_k"):
        summarize_run(experiment / "anchor", last_k=0)


def test_experiment_report(experiment: Path):
    for variant in ("anchor", "full"):
        summarize_run(experiment / variant, last_k=5)
    out = write_experiment_report(experiment, ["full", "intra_doc", "anchor"])
    tables = out["tables"]
    assert tables["ruler"]["columns"] == ["4096", "8192"]
    assert tables["ruler"]["rows"]["anchor"]["4096"]["mean"] == pytest.approx(70.0)
    assert tables["ruler"]["rows"]["full"] == {"4096": {"mean": 40.0, "std": 0.0, "n": 1}}
    assert "intra_doc" not in tables["ruler"]["rows"]
    assert tables["longbench"]["columns"] == ["Single-Doc QA", "Code"]
    assert set(tables["longbench"]["rows"]) == {"anchor"}
    assert tables["general"]["columns"] == ["MMLU", "HellaSwag"]
    assert tables["general"]["rows"] == {
        "anchor": {"MMLU": {"mean": 0.5, "std": 0.0, "n": 1}},
        "full": {"HellaSwag": {"mean": 0.4, "std": 0.0, "n": 1}},
    }

    md = out["markdown"]
    assert "| variant | 4K | 8K |" in md
    assert "| full | 40.00 | — |" in md and "| intra_doc | — | — |" in md
    assert "| anchor | 70.00 ± 7.07 | 35.00 ± 3.54 |" in md
    assert "| anchor | 0.50 | — |" in md and "| full | — | 0.40 |" in md
    assert "**intra_doc**: no evaluation summary" in md
    assert (experiment / "report.md").read_text() == md
    png = Path(out["paths"]["ruler_plot"])
    assert png == experiment / "ruler_by_length.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    saved = json.loads((experiment / "report.json").read_text())
    assert saved["tables"] == json.loads(json.dumps(tables))
    assert (
        saved["runs"]["intra_doc"] is None and saved["runs"]["anchor"]["suites"]["ruler"]["n"] == 5
    )


def test_report_without_any_results(tmp_path: Path):
    out = write_experiment_report(tmp_path / "exp", ["anchor"])
    assert (
        "ruler_plot" not in out["paths"] and not (tmp_path / "exp" / "ruler_by_length.png").exists()
    )
    assert out["markdown"].count("No results.") == 3


def _ruler_at(run: Path, step: int, score: float, ruler: dict, inputs: dict) -> None:
    write_result(
        run,
        f"step-{step:06d}",
        "ruler",
        {"niah_single_1": {"4096": score}},
        step,
        evaluation={"dtype": "float32", "ruler": ruler},
        inputs=inputs,
    )


def test_results_of_different_settings_are_not_averaged(tmp_path: Path):
    """Step 15 evaluated with 4 samples a task, step 20 with 8: no `12.50 ± 12.50` over
    both; one line naming the setting, both values and the checkpoints."""
    from anchorctx.evaluation.averaging import MixedSettingsError

    run = tmp_path / "exp" / "anchor"
    data = {"evaluation.ruler.essay_path": "ab12"}
    _ruler_at(run, 15, 0.0, {"num_samples": 4, "essay_path": "e.json"}, data)
    _ruler_at(run, 20, 25.0, {"num_samples": 8, "essay_path": "e.json"}, data)
    with pytest.raises(MixedSettingsError) as err:
        summarize_run(run, last_k=2)
    msg = str(err.value)
    assert "\n" not in msg and err.value.exit_code == 1
    assert "suite 'ruler'" in msg
    assert "evaluation.ruler.num_samples: 4 at step-000015; 8 at step-000020" in msg
    assert not (run / "eval" / "summary.json").exists()
    assert summarize_run(run, last_k=1)["suites"]["ruler"]["n"] == 1  # the newest alone


def test_input_paths_compare_by_content_not_spelling(tmp_path: Path):
    """The same data file named relative at one step and absolute at the next (a pool
    evaluation hands shards absolute paths) averages; other content under one name does not."""
    from anchorctx.evaluation.averaging import MixedSettingsError

    run = tmp_path / "exp" / "anchor"
    _ruler_at(run, 15, 0.0, {"essay_path": "e.json"}, {"evaluation.ruler.essay_path": "ab12"})
    _ruler_at(run, 20, 25.0, {"essay_path": "/d/e.json"}, {"evaluation.ruler.essay_path": "ab12"})
    assert summarize_run(run, last_k=2)["suites"]["ruler"]["n"] == 2
    _ruler_at(run, 20, 25.0, {"essay_path": "/d/e.json"}, {"evaluation.ruler.essay_path": "cd34"})
    with pytest.raises(MixedSettingsError, match=r"evaluation\.ruler\.essay_path \(content\)"):
        summarize_run(run, last_k=2)


def test_report_flags_arms_evaluated_with_different_settings(tmp_path: Path):
    """Two arms, each consistent in itself, one with 4 samples a task and one with 8: the
    report shows both, under a line naming the difference and each side."""
    exp = tmp_path / "exp"
    data = {"evaluation.ruler.essay_path": "ab12"}
    for arm, n in (("anchor", 4), ("full", 8)):
        for step in (15, 20):
            _ruler_at(exp / arm, step, 10.0, {"num_samples": n, "essay_path": "e.json"}, data)
        summarize_run(exp / arm, last_k=2)
    out = write_experiment_report(exp, ["anchor", "full"])
    assert "**Not comparable across variants**" in out["markdown"]
    assert "- ruler: evaluation.ruler.num_samples: 4 at anchor; 8 at full" in out["markdown"]
    report = json.loads((exp / "report.json").read_text())
    assert report["settings_differences"] == {
        "ruler": "evaluation.ruler.num_samples: 4 at anchor; 8 at full"
    }
