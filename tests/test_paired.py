"""RULER sampling intervals and paired differences between arms (evaluation/paired.py)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from anchorctx.evaluation.averaging import summarize_run
from anchorctx.evaluation.paired import (
    Z95,
    ruler_intervals,
    ruler_sample_scores,
    stratified_interval,
    unpaired_difference,
    wilson,
)


def _write_ruler(run_dir: Path, step: int, per_sample: dict[tuple[str, str], list[float]]) -> None:
    """A RULER result and its samples file: ``{(task, length): [score per sample index]}``."""
    folder = run_dir / "eval" / f"step-{step:06d}"
    folder.mkdir(parents=True, exist_ok=True)
    scores: dict[str, dict[str, float]] = {}
    counts: dict[str, dict[str, int]] = {}
    lines = [json.dumps({"__header__": {"checkpoint_hash": "x"}})]
    for (task, length), values in per_sample.items():
        scores.setdefault(task, {})[length] = sum(values) / len(values)
        counts.setdefault(task, {})[length] = len(values)
        for i, v in enumerate(values):
            row = {
                "key": f"{task}/{length}/{i}",
                "task": task,
                "length": int(length),
                "index": i,
                "prediction": "",
                "references": [],
                "score": v,
            }
            lines.append(json.dumps(row))
    (folder / "ruler.samples.jsonl").write_text("\n".join(lines) + "\n")
    result = {
        "suite": "ruler",
        "step": step,
        "checkpoint_name": f"step-{step:06d}",
        "scores": scores,
        "counts": counts,
    }
    (folder / "ruler.json").write_text(json.dumps(result))


def _ruler_summary(run_dir: Path, last_k: int = 1) -> dict:
    return summarize_run(run_dir, last_k)["suites"]["ruler"]


def test_stratified_interval_equal_counts_is_the_plain_mean():
    """Equal samples per task: the mean is the mean over all samples, and se^2 is the mean of
    the tasks' var/n divided by the number of tasks (written out by hand here)."""
    a, b = [0.0, 100.0, 100.0, 0.0], [100.0, 100.0, 100.0, 0.0]
    iv = stratified_interval({"a": a, "b": b})
    assert iv["mean"] == pytest.approx(statistics.mean(a + b))
    se = math.sqrt((statistics.variance(a) / 4 + statistics.variance(b) / 4) / 4)
    assert iv["se"] == pytest.approx(se)
    assert (iv["lo"], iv["hi"]) == pytest.approx((iv["mean"] - Z95 * se, iv["mean"] + Z95 * se))
    assert iv["n"] == 8


def test_stratified_interval_weights_tasks_not_samples():
    """Unequal counts: the mean is Table 5's (mean of task means), not the sample mean."""
    iv = stratified_interval({"a": [100.0, 100.0], "b": [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]})
    assert iv["mean"] == pytest.approx(50.0)
    assert iv["se"] == 0.0
    assert stratified_interval({"a": [1.0]}) is None  # no variance from one value
    assert stratified_interval({}) is None


def test_samples_are_averaged_over_the_summarised_checkpoints(tmp_path):
    """last_k = 2: each sample's score is its mean over the two newest checkpoints; an older
    checkpoint is not read; the mean of the result equals the summary's Table 5 average."""
    run = tmp_path / "arm"
    _write_ruler(run, 10, {("vt", "2048"): [0.0, 0.0, 0.0]})  # not among the last two
    _write_ruler(run, 20, {("vt", "2048"): [100.0, 0.0, 50.0]})
    _write_ruler(run, 30, {("vt", "2048"): [0.0, 0.0, 50.0]})
    summary = _ruler_summary(run, last_k=2)
    samples = ruler_sample_scores(run, summary)
    assert samples == {"2048": {"vt": {"vt/2048/0": 50.0, "vt/2048/1": 0.0, "vt/2048/2": 50.0}}}
    iv = stratified_interval({t: list(s.values()) for t, s in samples["2048"].items()})
    assert iv["mean"] == pytest.approx(summary["average"]["2048"]["mean"])


def test_missing_samples_file_gives_nothing(tmp_path):
    run = tmp_path / "arm"
    _write_ruler(run, 10, {("vt", "2048"): [0.0, 100.0]})
    summary = _ruler_summary(run)
    (run / "eval" / "step-000010" / "ruler.samples.jsonl").unlink()
    assert ruler_sample_scores(run, summary) is None
    assert ruler_intervals({"arm": None}, ["arm"]) == {
        "confidence": 0.95,
        "arms": {},
        "differences": [],
    }


def test_paired_difference_is_the_difference_of_averages_and_cancels_sample_difficulty(tmp_path):
    """Arm b scores arm a's scores + 10 on every sample: the paired difference is exactly +10
    with zero width (every sample moved alike), though each arm's own interval is wide."""
    rng = [0.0, 100.0, 30.0, 80.0, 10.0, 60.0]
    a = {("niah_single_1", "2048"): rng, ("vt", "2048"): rng[::-1]}
    b = {k: [x + 10 for x in v] for k, v in a.items()}
    for name, data in (("a", a), ("b", b)):
        _write_ruler(tmp_path / name, 50, data)
    samples = {n: ruler_sample_scores(tmp_path / n, _ruler_summary(tmp_path / n)) for n in "ab"}
    result = ruler_intervals(samples, ["a", "b"])
    (diff,) = result["differences"]
    assert (diff["arm"], diff["minus"]) == ("b", "a")  # later minus earlier
    cell = diff["lengths"]["2048"]
    assert cell["mean"] == pytest.approx(10.0) and cell["se"] == pytest.approx(0.0)
    assert cell["excludes_zero"]
    own = result["arms"]["a"]["2048"]
    assert own["hi"] - own["lo"] > 40  # the samples' spread, which pairing removes
    assert result["arms"]["b"]["2048"]["mean"] - own["mean"] == pytest.approx(cell["mean"])


def test_identical_arms_do_not_differ(tmp_path):
    data = {("vt", "4096"): [0.0, 100.0, 50.0]}
    for name in ("a", "b"):
        _write_ruler(tmp_path / name, 5, data)
    samples = {n: ruler_sample_scores(tmp_path / n, _ruler_summary(tmp_path / n)) for n in "ab"}
    cell = ruler_intervals(samples, ["a", "b"])["differences"][0]["lengths"]["4096"]
    assert (cell["mean"], cell["lo"], cell["hi"], cell["excludes_zero"]) == (0.0, 0.0, 0.0, False)


def test_report_shows_intervals_and_differences(tmp_path):
    """The experiment report gains the two tables (bold where a difference excludes 0) and
    report.json the numbers; the RULER plot is drawn with the intervals."""
    from anchorctx.evaluation.report import write_experiment_report

    exp = tmp_path / "exp"
    base = [0.0, 100.0, 0.0, 100.0, 0.0, 100.0, 0.0, 100.0]
    _write_ruler(exp / "full", 50, {("vt", "2048"): base, ("vt", "4096"): base})
    better = [100.0, 100.0, 100.0, 100.0, 0.0, 100.0, 100.0, 100.0]
    _write_ruler(exp / "anchor", 50, {("vt", "2048"): base, ("vt", "4096"): better})
    for arm in ("full", "anchor"):
        summarize_run(exp / arm, 1)
    out = write_experiment_report(exp, ["full", "anchor"])
    md = out["markdown"]
    assert "### RULER: 95% intervals and paired differences" in md
    assert "| anchor − full | +0.0 [+0.0, +0.0] | **+37.5 [" in md
    report = json.loads((exp / "report.json").read_text())
    cell = report["ruler_intervals"]["differences"][0]["lengths"]["4096"]
    assert cell["mean"] == pytest.approx(37.5) and cell["excludes_zero"]
    assert (exp / "ruler_by_length.png").is_file()


def test_report_leaves_intervals_out_when_every_arm_is_at_chance(tmp_path):
    """RULER's chance level is 0: arms that never recall a value have zero-width intervals that
    say nothing; the report says why the section is missing (the CPU demo's case)."""
    from anchorctx.evaluation.report import write_experiment_report

    exp = tmp_path / "exp"
    for arm in ("full", "anchor"):
        _write_ruler(exp / arm, 20, {("vt", "1024"): [0.0] * 8})
        summarize_run(exp / arm, 1)
    md = write_experiment_report(exp, ["full", "anchor"])["markdown"]
    assert "RULER: 95% intervals" not in md
    assert "every arm's RULER score is at chance" in md


def test_unpaired_difference_matches_newcombes_worked_example():
    """Newcombe (1998), Statistics in Medicine 17:873, example (a): 56/70 against 48/80, method
    10 gives 0.0524 to 0.3339 (printed to four places)."""
    d, lo, hi = unpaired_difference(56 / 70, 70, 48 / 80, 80)
    assert d == pytest.approx(20.0)
    assert (round(lo / 100, 4), round(hi / 100, 4)) == (0.0524, 0.3339)
    # Disjoint-interval overlap is stricter than the difference's own interval: 16.1% against
    # 33.9% of 56 overlap as Wilson intervals, yet their difference excludes 0.
    assert wilson(9 / 56, 56)[1] > wilson(19 / 56, 56)[0]
    assert unpaired_difference(9 / 56, 56, 19 / 56, 56)[2] < 0
    assert wilson(0.0, 56)[0] == pytest.approx(0.0, abs=1e-9)  # rounding only
    assert wilson(1.0, 56)[1] == pytest.approx(100.0)
