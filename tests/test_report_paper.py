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


def test_the_demo_shows_the_paper_for_reference_at_the_papers_lengths(tmp_path):
    """The CPU demo and gpu-small reproduce the main recipe in miniature: every score table
    they print (RULER, LongBench, MMLU/HellaSwag) gets the paper's numbers beside it, marked as
    a reference; lengths the run did not evaluate show the paper's number alone."""
    exp = tmp_path / "demo"
    _summary(exp / "anchor", {"1024": 3.0, "2048": 1.0}, ["niah_single_1"], mmlu=26.0)
    md = write_experiment_report(exp, ["anchor"])["markdown"]
    beside = md[md.index("## Beside the paper") :]
    assert "for reference" in beside and "in miniature" in beside
    assert "— / 90.69" in beside  # Table 5's anchor at 4K, which this run did not evaluate
    assert "| arm | 64K | 32K | 16K | 8K | 4K |\n" in beside  # each paper length once
    general = beside[beside.index("### MMLU and HellaSwag") :]
    assert "| arm | MMLU | HellaSwag |\n" in general  # Table 7's LongBench ICL is LongBench's
    assert "26.00 / 40.32 (-14.32)" in beside  # Table 7's MMLU, the one overlapping column
    assert "1.00 /" not in beside  # our 1K/2K lengths: the paper has none
    other = tmp_path / "my-experiment"  # neither a preset nor a miniature: nothing beside
    _summary(other / "anchor", {"4096": 3.0}, TASKS_11)
    assert "Beside the paper" not in write_experiment_report(other, ["anchor"])["markdown"]
    numbers = PN.load_paper_numbers()
    assert set(numbers["miniatures"]) == {"demo", "gpu-small"}
    for name in numbers["miniatures"]:  # the names of the project's own configs
        assert f"name: {name}\n" in Path(f"configs/{name}.yaml").read_text()


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


# ------------------------------------------------------------------- the stacked Table 5
def _two_datasets(tmp_path: Path, tasks_128k: list[str] = TASKS_11) -> list[tuple[Path, list]]:
    """Two Table 5 presets' experiments: SlimPajama-64K (anchor, full) and SlimPajama-128K
    (anchor only), as `anchorctx report` leaves their arms' summaries."""
    e64 = tmp_path / "paper-table5-slimpajama-64k"
    e128 = tmp_path / "paper-table5-slimpajama-128k"
    _summary(e64 / "anchor", {"4096": 90.0, "65536": 70.0}, TASKS_11)
    _summary(e64 / "full", {"4096": 89.84, "65536": 60.0}, TASKS_11)
    _summary(e128 / "anchor", {"4096": 91.0, "131072": 60.0}, tasks_128k)
    return [(e64, ["full", "anchor"]), (e128, ["full", "anchor", "anchor_interleave"])]


def test_stacked_report_rows_are_dataset_by_arm_with_the_paper_beside(tmp_path):
    from anchorctx.evaluation.stacked_report import write_stacked_report

    out = write_stacked_report(_two_datasets(tmp_path), tmp_path / "table5")
    md = out["markdown"]
    # The paper's layout: longest length first, one block of rows per dataset.
    assert "| dataset | arm | 128K | 64K | 32K | 16K | 8K | 4K |" in md
    assert "ours / paper (arXiv 2411.13476v2, Table 5)" in md
    assert (
        "| SlimPajama-64K | anchor | — | 70.00 / 73.25 (-3.25) | — / 75.97 | — / 82.91 "
        "| — / 85.48 | 90.00 / 90.69 (-0.69) |" in md
    )
    assert "| SlimPajama-64K | full | — | 60.00 / 66.40 (-6.40) |" in md
    assert "| SlimPajama-128K | anchor | 60.00 / 66.15 (-6.15) | — / 77.69 |" in md
    assert "| SlimPajama-128K | full | — / 62.75 | — / 70.56 |" in md  # the paper's row only
    saved = json.loads((tmp_path / "table5" / "report.json").read_text())
    order = [(r["dataset"], r["arm"]) for r in saved["rows"]]
    want_64k = [("SlimPajama-64K", a) for a in ("full", "anchor")]
    assert order[:2] == want_64k  # the config's arms first, then the paper's other arms
    assert order[2][0] == "SlimPajama-64K" and order.index(("SlimPajama-128K", "full")) > 2
    assert ("SlimPajama-128K", "anchor_interleave") not in order  # neither run nor published
    assert saved["experiments"][1]["missing"] == ["full", "anchor_interleave"]
    assert saved["columns"] == ["131072", "65536", "32768", "16384", "8192", "4096"]
    cell = next(r for r in saved["rows"] if r["arm"] == "anchor")["paper"]["65536"]
    assert cell == {
        "paper": 73.25,
        "table": "5",
        "ours": 70.0,
        "compared": True,
        "difference": -3.25,
    }
    assert len(saved["task_sets"]) == 1 and "Not comparable" not in md


def test_stacked_report_shows_other_task_sets_apart(tmp_path):
    from anchorctx.evaluation.stacked_report import write_stacked_report

    md = write_stacked_report(_two_datasets(tmp_path, TASKS_13), tmp_path / "t5")["markdown"]
    assert "**Not comparable across variants**: their RULER means are over different" in md
    thirteen = md.split("(13 tasks:")[1]
    eleven = md.split("(11 tasks:")[1].split("(13 tasks:")[0]
    assert "| SlimPajama-128K | anchor | 60.00 / 66.15 (not compared: our mean is over 13" in (
        thirteen
    )
    assert "| SlimPajama-64K | anchor |" in eleven and "SlimPajama-64K" not in thirteen
    # The paper's rows of the 128K dataset are means over its 11 tasks: they stay with those.
    assert "| SlimPajama-128K | full | — / 62.75 |" in eleven


def test_stacked_report_of_the_table6_families_rows_family_by_arm(tmp_path):
    """Table 6 stacked: the three families' presets give family × arm rows beside the paper's
    13-task means."""
    from anchorctx.evaluation.stacked_report import write_stacked_report

    experiments = []
    for name in ("llama3-8b", "qwen1.5-1.8b"):
        exp = tmp_path / f"paper-{name}-128k"
        _summary(exp / "anchor", {"131072": 50.0, "4096": 88.0}, TASKS_13)
        _summary(exp / "full", {"131072": 30.0, "4096": 84.0}, TASKS_13)
        experiments.append((exp, ["full", "anchor"]))
    out = write_stacked_report(experiments, tmp_path / "table6")
    md = out["markdown"]
    assert "ours / paper (arXiv 2411.13476v2, Table 6)" in md
    assert "| Llama-3-8B | anchor | 50.00 / 51.49 (-1.49) |" in md
    assert "| Llama-3-8B | full | 30.00 / 34.02 (-4.02) |" in md
    rows = [(r["dataset"], r["arm"]) for r in out["record"]["rows"]]
    assert rows[:2] == [("Llama-3-8B", "full"), ("Llama-3-8B", "anchor")]
    assert ("Qwen-1.5-1.8B", "anchor") in rows and "Not comparable" not in md


def test_stacked_report_replaces_only_its_own_directory(tmp_path):
    from anchorctx.evaluation.stacked_report import StackedReportError, write_stacked_report
    from anchorctx.io import ForeignDirectoryError

    experiments = _two_datasets(tmp_path)
    out = tmp_path / "t5"
    write_stacked_report(experiments, out)
    write_stacked_report(experiments, out)  # its own earlier output: replaced
    foreign = tmp_path / "mine"
    (foreign / "notes.txt").parent.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(ForeignDirectoryError, match="mine"):
        write_stacked_report(experiments, foreign)
    assert (foreign / "notes.txt").read_text() == "keep" and not (foreign / "report.md").exists()
    with pytest.raises(StackedReportError, match="named twice"):
        write_stacked_report([experiments[0], experiments[0]], out)


def test_report_command_stacks_configs_only_with_stacked(tmp_path, capsys):
    from anchorctx.cli import main

    presets = [
        "configs/paper/table5-slimpajama-64k.yaml",
        "configs/paper/table5-upsampledmix-128k.yaml",
    ]
    root = ["--set", f"run_root={tmp_path}"]
    assert main(["report", *presets, *root]) == 2
    assert "only with --stacked DIR" in capsys.readouterr().err
    out = tmp_path / "stacked"
    assert main(["report", *presets, *root, "--stacked", str(out)]) == 0
    md = (out / "report.md").read_text()
    # No arm evaluated yet: the paper's rows of both datasets, "—" for ours.
    assert "| SlimPajama-64K | anchor | — | — / 73.25 |" in md
    assert "| UpSampledMix-128K | anchor | — / 65.24 |" in md
    assert f"markdown: {out / 'report.md'}" in capsys.readouterr().out
