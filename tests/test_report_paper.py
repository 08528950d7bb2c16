"""The report beside the paper: the published numbers (paper_numbers.json) next to a paper
preset's own, with the difference; RULER means over other task sets are never compared, and
arms scored on different task sets are shown apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_eval_core_results import assert_record_keys

from anchorctx.evaluation import paper_numbers as PN
from anchorctx.evaluation.records import BesidePaper
from anchorctx.evaluation.report import write_experiment_report
from anchorctx.evaluation.ruler import PAPER_EXCLUDE, TASKS

TASKS_13 = list(TASKS)  # RULER's 13 tasks, the project's one list
TASKS_11 = [t for t in TASKS_13 if t not in PAPER_EXCLUDE]


def _summary(run: Path, ruler: dict[str, float], tasks: list[str], mmlu: float | None = None):
    suites = {
        "ruler": {
            "n": 5,
            "steps": [1960, 1970, 1980, 1990, 2000],
            "average": {k: {"mean": v, "std": 0.5, "n": 5} for k, v in ruler.items()},
            "average_tasks": tasks,
            "scores": {},
        }
    }
    if mmlu is not None:
        acc = {"mean": mmlu, "std": 0.0, "n": 5}
        suites["mmlu"] = {"n": 5, "steps": [2000], "scores": {"mmlu": {"acc": acc}}}
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "summary.json").write_text(json.dumps({"last_k": 5, "suites": suites}))


def test_numbers_are_cited_by_table_and_never_filled_in():
    numbers = PN.load_paper_numbers()
    assert numbers["source"]["arxiv"].startswith("2411.13476v2")
    tables = numbers["tables"]
    assert set(tables) == {"2", "3", "4", "5", "6", "7", "10", "11", "12"}
    # Spot checks against the paper's text (Table 5, Table 6 = shared REFERENCE, Table 11).
    rows5 = {(r["group"], r["arm"]): r["values"] for r in tables["5"]["rows"]}
    assert rows5[("SlimPajama-64K", "anchor_tags")]["65536"] == 73.88
    assert "131072" not in rows5[("SlimPajama-64K", "full")]  # the paper's "\" cell
    rows6 = {(r["group"], r["arm"]): r["values"] for r in tables["6"]["rows"]}
    assert [rows6[("Llama-3-8B", "anchor")][k] for k in ("32768", "65536", "131072")] == [
        83.06,
        70.99,
        51.49,
    ]
    assert tables["11"]["rows"][0]["values"] == {"4000": 24.46, "4096": 76.8}
    # Table 2's Free* RoPE 4K cell is Table 10's Llama-2 row averaged over the 11 tasks.
    t10 = tables["10"]["rows"][0]["values"]
    mean11 = sum(t10[t] for t in TASKS_11) / 11
    free = next(r for r in tables["2"]["rows"] if r["label"].startswith("Free* RoPE"))
    assert free["values"]["4096"] == pytest.approx(mean11, abs=0.005)  # the paper's rounding
    for table in tables.values():
        for row in table["rows"]:
            assert set(row["values"]) <= set(table["columns"])
    for experiment, refs in numbers["presets"].items():
        assert (Path("configs/paper") / f"{experiment.removeprefix('paper-')}.yaml").is_file()
        for table, group in refs:
            assert group is None or any(r.get("group") == group for r in tables[table]["rows"])


def test_report_shows_the_paper_beside_ours_with_the_difference(tmp_path):
    exp = tmp_path / "paper-table5-slimpajama-64k"
    _summary(exp / "anchor", {"4096": 90.0, "65536": 70.0}, TASKS_11, mmlu=40.0)
    _summary(exp / "full", {"4096": 89.84, "65536": 60.0}, TASKS_11)
    out = write_experiment_report(exp, ["full", "anchor", "anchor_interleave"])
    md = out["markdown"]
    assert "## Beside the paper" in md and "Table 5" in md and "arXiv 2411.13476v2" in md
    assert "| anchor | 90.00 / 90.69 (-0.69) | 70.00 / 73.25 (-3.25) |" in md
    assert "60.00 / 66.40 (-6.40)" in md
    assert "— / 66.77" in md  # an arm the paper has and this run has not trained
    assert "40.00 / 40.32 (-0.32)" in md  # Table 7's MMLU
    saved = json.loads((exp / "report.json").read_text())
    cell = saved["paper"]["ruler"]["anchor"]["65536"]
    assert cell == {
        "paper": 73.25,
        "table": "5",
        "ours": 70.0,
        "compared": True,
        "difference": -3.25,
    }
    for cells in saved["paper"]["ruler"].values():
        for entry in cells.values():
            assert_record_keys(BesidePaper, entry)


def test_other_task_sets_are_not_compared_and_are_shown_apart(tmp_path):
    exp = tmp_path / "paper-table5-slimpajama-64k"
    _summary(exp / "anchor", {"4096": 80.0}, TASKS_13)  # cwe and mk3 in the mean: not Table 5's
    _summary(exp / "full", {"4096": 89.0}, TASKS_11)
    md = write_experiment_report(exp, ["full", "anchor"])["markdown"]
    assert "80.00 / 90.69 (not compared: our mean is over 13 tasks, the paper's 11)" in md
    assert "Table 5 — RULER by length (13 tasks:" in md
    assert "Table 5 — RULER by length (11 tasks:" in md
    assert "**Not comparable across variants**: their RULER means are over different" in md


def test_an_experiment_that_is_no_paper_preset_gets_no_paper_section(tmp_path):
    exp = tmp_path / "my-experiment"
    _summary(exp / "anchor", {"4096": 90.0}, TASKS_11)
    out = write_experiment_report(exp, ["anchor"])
    assert "Beside the paper" not in out["markdown"]
    assert json.loads((exp / "report.json").read_text())["paper"] == {}
    assert "Table 12 — LongBench categories" in out["markdown"]  # the paper's numbering
