"""Experiment report: compare the variants of an experiment in the paper's table shapes.

Reads each arm's ``<experiment_dir>/<variant>/eval/summary.json`` (written by
:func:`anchorctx.evaluation.averaging.summarize_run`) and writes, under the experiment dir:

- ``report.md``  — Table 5 (RULER score by length per variant), Table 12 (LongBench categories),
  Table 7 (MMLU, HellaSwag), lm-eval's long-context tasks (suites ``lm_eval:<task>``); mean ±
  std over each variant's last k checkpoints; where the experiment is a paper preset, the paper's
  published numbers beside them (:mod:`anchorctx.evaluation.paper_numbers`);
- ``report.json`` — the same tables as numbers;
- ``ruler_by_length.png`` — RULER score against context length (log2 axis), one line per variant;
- ``training_curves.png`` — Figure 4: RULER and perplexity against training step, every
  evaluated checkpoint of each arm (:mod:`anchorctx.evaluation.curves`).

A suite a variant was not evaluated on shows as "—"; a suite no variant has is left out. Nothing
is ever filled in. Variants whose results of one suite were evaluated with different settings or
input data are flagged under the scores, naming the first difference
(:func:`settings_differences`): their cells are not comparable. Arms whose RULER means are over
different task sets (e.g. 11 and 13 tasks) are shown in separate tables, never side by side.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from anchorctx.analysis import rope_weights_table as rope_table
from anchorctx.evaluation import curves as training_curves
from anchorctx.evaluation.arm_comparison import (
    CHANCE,
    COMPARISON_JSON,
    at_chance,
    chance_interval,
    suite_sample_counts,
)
from anchorctx.evaluation.averaging import (
    SUMMARY_JSON,
    fmt_stat,
    length_label,
    markdown_table,
    settings_difference,
    sorted_keys,
    suite_markdown,
)
from anchorctx.evaluation.paired import (
    intervals_markdown,
    ruler_intervals,
    ruler_sample_identity,
    ruler_sample_scores,
)
from anchorctx.evaluation.paper_numbers import (
    beside,
    beside_markdown,
    is_miniature,
    load_paper_numbers,
    paper_cells,
    references,
)
from anchorctx.evaluation.records import (
    ArmComparison,
    ArmProvenance,
    BaseCheck,
    ChanceFlag,
    Interval,
    PaperComparison,
    Provenance,
    Report,
    ReportRecord,
    RulerIntervals,
    RunInfo,
    RunSummary,
    SampleScores,
    SeedCost,
    Stat,
    SuiteSummary,
    Table,
    Tables,
)
from anchorctx.evaluation.seed_pairs import (
    seed_cost,
    seed_differences,
    seed_differences_markdown,
    with_costs,
)
from anchorctx.io import atomic_write_json, atomic_write_png, atomic_write_text, read_json

# The one score a general-ability suite is reported by: (task, metric) in its scores.
HEADLINE = {"mmlu": ("mmlu", "acc"), "hellaswag": ("hellaswag", "acc_norm")}
GENERAL_SUITES = {"mmlu": "MMLU", "hellaswag": "HellaSwag"}


K = TypeVar("K")  # a table's row key: an arm's name, or a stacked report's row

# ------------------------------------------------------------------------------ tables
# Each variant's eval/summary.json; None: the variant has none.
Summaries = Mapping[str, RunSummary | None]


def load_summaries(experiment_dir: Path, variants: list[str]) -> dict[str, RunSummary | None]:
    out: dict[str, RunSummary | None] = {}
    for variant in variants:
        path = experiment_dir / variant / "eval" / SUMMARY_JSON
        out[variant] = read_json(path) if path.is_file() else None
    return out


def _suite(summary: RunSummary | None, suite: str) -> SuiteSummary | None:
    return None if summary is None else summary.get("suites", {}).get(suite)


def settings_differences(summaries: Summaries) -> dict[str, str]:
    """Per suite, the first setting in which the variants' results differ (see
    :func:`~anchorctx.evaluation.averaging.settings_difference`): their scores are not
    comparable. Summaries written before they recorded settings are left out."""
    out: dict[str, str] = {}
    suites = sorted({suite for s in summaries.values() if s for suite in s.get("suites", {})})
    for suite in suites:
        have = {
            v: x["settings"]
            for v, s in summaries.items()
            if (x := _suite(s, suite)) and "settings" in x
        }
        if diff := settings_difference(list(have.values()), list(have)):
            out[suite] = diff
    return out


def ruler_table(summaries: Summaries) -> Table:
    """Table 5: RULER per-length average (over tasks) for each variant."""
    rows = {
        v: ruler.get("average", {}) if (ruler := _suite(s, "ruler")) else {}
        for v, s in summaries.items()
    }
    lengths = sorted_keys(k for row in rows.values() for k in row)
    return {"columns": lengths, "rows": {v: r for v, r in rows.items() if r}}


def longbench_table(summaries: Summaries) -> Table:
    """Table 12: LongBench category averages for each variant."""
    rows = {
        v: lb.get("categories", {}) if (lb := _suite(s, "longbench")) else {}
        for v, s in summaries.items()
    }
    columns: list[str] = []
    for row in rows.values():
        columns += [c for c in row if c not in columns]  # the suite's category order
    return {"columns": columns, "rows": {v: r for v, r in rows.items() if r}}


def perplexity_table(summaries: Summaries) -> Table:
    """Held-out perplexity by row length for each variant (suite ``perplexity``)."""
    rows = {
        v: ppl["scores"].get("perplexity", {}) if (ppl := _suite(s, "perplexity")) else {}
        for v, s in summaries.items()
    }
    lengths = sorted_keys(k for row in rows.values() for k in row)
    return {"columns": lengths, "rows": {v: r for v, r in rows.items() if r}}


def headline(suite: str, s: SuiteSummary | None) -> Stat | None:
    """The headline score of a general-ability suite summary (MMLU acc, HellaSwag acc_norm)."""
    if s is None:
        return None
    task, metric = HEADLINE.get(suite, (suite, ""))
    by_metric = s.get("scores", {}).get(task, {})
    if metric in by_metric:
        return by_metric[metric]
    return next(iter(by_metric.values())) if len(by_metric) == 1 else None


def general_table(summaries: Summaries) -> Table:
    """Table 7: MMLU and HellaSwag for each variant."""
    rows: dict[str, dict[str, Stat]] = {}
    for variant, summary in summaries.items():
        row = {
            label: value
            for suite, label in GENERAL_SUITES.items()
            if (value := headline(suite, _suite(summary, suite))) is not None
        }
        if row:
            rows[variant] = row
    columns = [label for label in GENERAL_SUITES.values() if any(label in r for r in rows.values())]
    return {"columns": columns, "rows": rows}


LM_EVAL_SUITE_PREFIX = "lm_eval:"


def lm_eval_table(summaries: Summaries) -> Table:
    """lm-eval's long-context tasks (suites ``lm_eval:<task>``): per variant, the named task's
    score per length or metric (a group: lm-eval's aggregate); a group lm-eval gives no
    aggregate (InfiniteBench) shows each of its tasks. Columns ``<task>/<length or metric>``."""
    rows: dict[str, dict[str, Stat]] = {}
    columns: list[str] = []
    for variant, summary in summaries.items():
        for suite, s in sorted((summary["suites"] if summary else {}).items()):
            if not suite.startswith(LM_EVAL_SUITE_PREFIX):
                continue
            task = suite.removeprefix(LM_EVAL_SUITE_PREFIX)
            scores = s.get("scores", {})
            shown = {task: scores[task]} if task in scores else scores
            for name, by_key in shown.items():
                for key in sorted_keys(by_key):
                    column = f"{name}/{key}"
                    columns += [column] if column not in columns else []
                    rows.setdefault(variant, {})[column] = by_key[key]
    return {"columns": columns, "rows": rows}


def _lm_eval_label(column: str) -> str:
    task, _, key = column.rpartition("/")
    return f"{task} {length_label(key)}"


# ------------------------------------------------------------------------------ chance
# Table -> (column -> suite whose chance level applies, sample-count key in that suite).
def _chance_source(table_name: str, column: str) -> tuple[str, str] | None:
    if table_name == "ruler":
        return "ruler", column  # counts per length, summed over tasks
    if table_name == "general":
        suite = {label: suite for suite, label in GENERAL_SUITES.items()}.get(column)
        return (suite, HEADLINE[suite][0]) if suite else None
    return None


def chance_flags(
    table_name: str, table: Table, counts: dict[str, dict[str, dict[str, int]]]
) -> dict[str, dict[str, ChanceFlag]]:
    """Per variant and column: chance level, sample count, its 95% interval and the verdict.

    Only cells whose suite has a chance level (:data:`CHANCE`) and a known sample count.
    """
    out: dict[str, dict[str, ChanceFlag]] = {}
    for variant, row in table["rows"].items():
        for column, stat in row.items():
            source = _chance_source(table_name, column)
            if source is None or source[0] not in CHANCE:
                continue
            n = counts.get(variant, {}).get(source[0], {}).get(source[1])
            if not n:
                continue
            chance = CHANCE[source[0]][0]
            lo, hi = chance_interval(chance, n)
            out.setdefault(variant, {})[column] = {
                "chance": chance,
                "n": n,
                "interval": [round(lo, 2), round(hi, 2)],
                "at_chance": at_chance(stat["mean"], chance, n),
            }
    return out


def cell_text(table: Table, variant: str, column: str) -> str:
    """A table cell: mean ± std, with "(at chance)" where :func:`chance_flags` says so."""
    text = fmt_stat(table["rows"].get(variant, {}).get(column))
    flag = table.get("chance", {}).get(variant, {}).get(column)
    return f"{text} (at chance)" if flag and flag["at_chance"] else text


def chance_rule_markdown(tables: Tables) -> str:
    """The stated rule behind every "(at chance)" label, with the levels and intervals used."""
    lines = [
        "A score is marked **(at chance)** when its mean lies inside the central 95% region of "
        "a chance-level guesser's accuracy: Binomial(n, chance) with n the scored samples per "
        "checkpoint, exact, at most 2.5% in each tail. Chance levels: "
        + "; ".join(f"{suite} {level:g}% ({why})" for suite, (level, why) in CHANCE.items())
        + ". LongBench has no single chance level (its F1/ROUGE/similarity metrics give any "
        "output some credit) and is not labelled.",
    ]
    seen: dict[tuple[str, str, int], list[float]] = {}
    for name, table in tables.items():
        for row in table.get("chance", {}).values():
            for column, flag in row.items():
                seen[(name, column, flag["n"])] = flag["interval"]
    if seen:
        parts = [
            f"{'RULER ' + length_label(c) if t == 'ruler' else c}: n={n}, [{lo:.2f}, {hi:.2f}]"
            for (t, c, n), (lo, hi) in sorted(seen.items())
        ]
        lines += ["", "Intervals used: " + "; ".join(parts) + "."]
    return "\n".join(lines)


def _markdown(
    title: str, table: Table, variants: list[str], label: Callable[[str], str] = str
) -> str:
    if not table["rows"]:
        return f"### {title}\n\nNo results."
    rows = [[v] + [cell_text(table, v, c) for c in table["columns"]] for v in variants]
    header = ["variant"] + [label(c) for c in table["columns"]]
    return f"### {title}\n\n" + markdown_table(header, rows)


# ------------------------------------------------------------------------------ plot
def plot_ruler(
    table: Table,
    path: Path,
    intervals: dict[str, dict[str, Interval]] | None = None,
) -> Path:
    """RULER score vs context length (log2 x axis), one line per variant.

    Error bars: the 95% sampling interval where ``intervals`` (:func:`ruler_intervals`'s
    ``arms``) has the cell, else ± std over the last k checkpoints."""
    # Imported here: matplotlib loads only when a figure is drawn.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for variant, row in table["rows"].items():
        keys = [k for k in table["columns"] if k in row]
        xs = [float(k) for k in keys]
        ys = [row[k]["mean"] for k in keys]
        cells = (intervals or {}).get(variant, {})
        low = [ys[i] - cells[k]["lo"] if k in cells else row[k]["std"] for i, k in enumerate(keys)]
        high = [cells[k]["hi"] - ys[i] if k in cells else row[k]["std"] for i, k in enumerate(keys)]
        ax.errorbar(xs, ys, yerr=[low, high], marker="o", capsize=3, label=variant)
    ax.set_xscale("log", base=2)
    ticks = [float(k) for k in table["columns"]]
    ax.set_xticks(ticks, [length_label(k) for k in table["columns"]])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("RULER score (mean over tasks)")
    bars = "95% sampling interval" if intervals else "± std over the last k checkpoints"
    ax.set_title(f"RULER by length (bars: {bars})")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return atomic_write_png(path, fig)


# ---------------------------------------------------------------------------- report
def _numeric_columns(table: Table) -> bool:
    return bool(table["columns"]) and all(c.replace(".", "", 1).isdigit() for c in table["columns"])


def write_experiment_report(
    experiment_dir: str | Path, variants: list[str], base: str | None = None
) -> Report:
    """Compare ``variants`` of the experiment; write report.md/json and the RULER plot.

    ``base``: the run directory name of the pretrained base model every arm starts from
    (``pretrain-<hash>``); when it has an evaluation summary it is the tables' first row and
    gets a section of its own (per-task RULER at its pretraining length)."""
    experiment_dir = Path(experiment_dir)
    experiment_dir.mkdir(parents=True, exist_ok=True)
    arms = list(variants)
    if base is not None and (experiment_dir / base / "eval" / SUMMARY_JSON).is_file():
        variants = [base, *arms]
    else:
        base = None
    summaries = load_summaries(experiment_dir, variants)
    tables: Tables = {
        "ruler": ruler_table(summaries),
        "longbench": longbench_table(summaries),
        "general": general_table(summaries),
        "lm_eval": lm_eval_table(summaries),
        "perplexity": perplexity_table(summaries),
    }
    counts = {v: suite_sample_counts(experiment_dir / v) for v in variants}
    for name in ("ruler", "general"):
        tables[name]["chance"] = chance_flags(name, tables[name], counts)
    # Sampling intervals and paired differences of the arms' RULER averages (not the base model's:
    # it is evaluated at its pretraining length only).
    samples, identity = arm_ruler_samples(experiment_dir, arms, summaries)
    intervals = ruler_intervals(samples, arms, identity)
    # Arms trained under several seeds (runs <arm>-s<seed>): their differences over the seeds.
    diffs = seed_differences(samples, arms, identity)
    costs: dict[str, SeedCost | None] = {
        f"{d['arm']} − {d['minus']}": seed_cost(experiment_dir, d) for d in diffs
    }
    # The seeds needed, planned by what these runs' training and evaluation cost.
    intervals["seed_differences"] = [
        with_costs(d, costs[f"{d['arm']} − {d['minus']}"]) for d in diffs
    ]
    intervals["seed_costs"] = costs
    comparison_path = experiment_dir / COMPARISON_JSON
    comparison: ArmComparison | None = (
        read_json(comparison_path) if comparison_path.is_file() else None
    )
    # Plots of the arm comparison, as long as they are still there.
    plots = comparison["paths"] if comparison else {}
    paths = {k: p for k, p in plots.items() if Path(p).is_file()}
    # The RoPE study on learned weights (base model, arms' final checkpoints), when measured.
    rope_dir = rope_table.study_dir(experiment_dir)
    if comparison is not None and (
        found := rope_table.read_weights_study(rope_dir / rope_table.JSON_NAME)
    ):
        comparison["rope_weights"] = rope_table.without_curves(found)
        if (rope_dir / rope_table.PNG_NAME).is_file():
            paths["rope_weights_plot"] = str(rope_dir / rope_table.PNG_NAME)
    if tables["ruler"]["rows"] and _numeric_columns(tables["ruler"]):
        paths["ruler_plot"] = str(
            plot_ruler(tables["ruler"], experiment_dir / "ruler_by_length.png", intervals["arms"])
        )
    curves, curve_problems = training_curves.experiment_curves(experiment_dir, arms)
    if curves:
        png = experiment_dir / training_curves.PNG_NAME
        paths["curves_plot"] = str(training_curves.plot_curves(curves, png))
    check = base_retrieval_check(_suite(summaries[base], "ruler")) if base is not None else None
    paper = paper_comparison(experiment_dir.name, tables, summaries, intervals)
    markdown = _report_markdown(
        experiment_dir, variants, summaries, tables, paths, comparison, base, check, intervals
    )
    if curves or curve_problems:
        figure = Path(paths["curves_plot"]).name if curves else None
        markdown += "\n" + training_curves.curves_markdown(curves, figure, curve_problems) + "\n"
    if paper:
        miniature = is_miniature(experiment_dir.name)
        markdown += "\n" + paper_markdown(paper, tables, arms, miniature) + "\n"
    paths["markdown"] = str(atomic_write_text(experiment_dir / "report.md", markdown))
    paths["json"] = str(experiment_dir / "report.json")
    record: ReportRecord = {
        "experiment_dir": str(experiment_dir.resolve()),
        "variants": arms,
        "base": base,
        "base_check": check,
        "ruler_intervals": intervals,
        "runs": {v: _run_info(s) for v, s in summaries.items()},
        "settings_differences": settings_differences({v: summaries[v] for v in arms}),
        "paper": paper,
        "tables": tables,
        "curves": curves,
        "paths": paths,
        "comparison": comparison,
    }
    atomic_write_json(experiment_dir / "report.json", record)
    return {"markdown": markdown, "tables": tables, "paths": paths}


def arm_ruler_samples(
    experiment_dir: Path, arms: list[str], summaries: Summaries
) -> tuple[dict[str, SampleScores | None], dict[str, str | None]]:
    """Per arm, the RULER sample scores its summary averages and the identity they were
    answered under (:mod:`~anchorctx.evaluation.paired`), for :func:`ruler_intervals`."""
    samples: dict[str, SampleScores | None] = {
        arm: ruler_sample_scores(experiment_dir / arm, ruler)
        if (ruler := _suite(summaries.get(arm), "ruler"))
        else None
        for arm in arms
    }
    # Pairs only among arms that answered the same samples (equal evaluation fingerprints).
    identity = {
        arm: ruler_sample_identity(experiment_dir / arm, ruler)
        for arm in arms
        if samples[arm] and (ruler := _suite(summaries.get(arm), "ruler"))  # samples: it has one
    }
    return samples, identity


# The base model's retrieval check: RULER's single-needle tasks at the base model's own lengths.
# A base model that finds one needle in its own context less often than this leaves continual
# training little retrieval to keep or lose at longer lengths, so the arms' RULER differences
# then say little about their attention (run 6 in
# docs/runs/2026-11-23-runs-1-6-pretraining-recipe.md: a base model at 16% gave four arms within
# 10-14 of each other). The bar is the one the GPU-small comparison was set.
BASE_RETRIEVAL_TASKS = ("niah_single_1", "niah_single_2")
BASE_RETRIEVAL_BAR = 80.0


def base_retrieval_check(ruler: SuiteSummary | None) -> BaseCheck | None:
    """``{"passed", "bar", "scores": {task: {length: mean}}}`` of the base model's RULER summary;
    None when it scored none of ``BASE_RETRIEVAL_TASKS``."""
    scores = {
        task: {length: stat["mean"] for length, stat in by_len.items() if stat}
        for task, by_len in (ruler["scores"] if ruler else {}).items()
        if task in BASE_RETRIEVAL_TASKS
    }
    scores = {task: by_len for task, by_len in scores.items() if by_len}
    if not scores:
        return None
    passed = all(v >= BASE_RETRIEVAL_BAR for by_len in scores.values() for v in by_len.values())
    return {"passed": passed, "bar": BASE_RETRIEVAL_BAR, "scores": scores}


def base_check_markdown(check: BaseCheck) -> str:
    cells = ", ".join(
        f"{task} {v:.1f} at {length_label(length)}"
        for task, by_len in check["scores"].items()
        for length, v in by_len.items()
    )
    if check["passed"]:
        return f"**Retrieval check: met** ({cells}; the bar is {check['bar']:.0f} on each)."
    return (
        f"**Retrieval check: not met** ({cells}; the bar is {check['bar']:.0f} on each). "
        "The arms start from a model that does not reliably find a single needle even at "
        "its own length, so their RULER scores say little about the attention variants."
    )


def _run_info(summary: RunSummary | None) -> RunInfo | None:
    if summary is None:
        return None
    return {
        "run_dir": summary.get("run_dir"),
        "last_k": summary.get("last_k"),
        "suites": {
            name: {"n": s["n"], "steps": s["steps"]} for name, s in summary["suites"].items()
        },
    }


def _report_markdown(
    experiment_dir: Path,
    variants: list[str],
    summaries: Summaries,
    tables: Tables,
    paths: dict[str, str],
    comparison: ArmComparison | None = None,
    base: str | None = None,
    check: BaseCheck | None = None,
    intervals: RulerIntervals | None = None,
) -> str:
    arms = [v for v in variants if v != base]
    lines = [f"# Experiment report: {experiment_dir.name}", ""]
    if comparison:
        lines += [provenance_markdown(comparison["provenance"]), ""]
        lines += [comparison_markdown(comparison, arms, paths), ""]
    if base is not None and (ruler := _suite(summaries[base], "ruler")):
        lines += [
            f"## Base model: `{base}`",
            "",
            "The pretrained model every arm starts from (`model.path` of each arm), "
            "evaluated at the lengths it was pretrained for; it is the first row of "
            "the tables below.",
            "",
        ]
        if check is not None:
            lines += [base_check_markdown(check), ""]
        lines += [suite_markdown("ruler", ruler), ""]
    lines += ["## Scores", ""]
    lines += ["Scores are mean ± std over each variant's last k evaluated checkpoints.", ""]
    lines += [chance_rule_markdown(tables), ""]
    for variant, s in summaries.items():
        if s is None:
            lines.append(f"- **{variant}**: no evaluation summary (run `anchorctx evaluate`).")
        else:
            ns = ", ".join(f"{name}: {x['n']}" for name, x in s["suites"].items()) or "none"
            lines.append(f"- **{variant}**: last_k={s['last_k']}; checkpoints per suite: {ns}")
    # The base model is evaluated at its own pretraining lengths: only the arms must agree.
    differences = settings_differences({v: summaries[v] for v in arms})
    if differences:
        lines += ["", "**Not comparable across variants** (evaluated with different settings):"]
        lines += [f"- {suite}: {diff}" for suite, diff in differences.items()]
    lines += ["", ruler_markdown(tables["ruler"], variants, summaries)]
    if "ruler_plot" in paths:
        lines += ["", f"![RULER score by length]({Path(paths['ruler_plot']).name})"]
    if intervals and intervals["arms"]:
        flags = tables["ruler"].get("chance", {})
        cells = [f["at_chance"] for arm in arms for f in flags.get(arm, {}).values()]
        if cells and all(cells):  # intervals of guessers' zeros say nothing about the arms
            lines += [
                "",
                "RULER intervals and paired differences are left out: every arm's "
                "RULER score is at chance.",
            ]
        else:
            lines += ["", intervals_markdown(intervals, arms)]
            if intervals.get("seed_differences"):
                lines += [
                    "",
                    seed_differences_markdown(
                        intervals["seed_differences"], intervals.get("seed_costs")
                    ).rstrip(),
                ]
    lines += ["", _markdown("Table 12 — LongBench categories", tables["longbench"], variants)]
    lines += ["", _markdown("Table 7 — MMLU and HellaSwag", tables["general"], variants)]
    if tables["perplexity"]["rows"]:
        title = (
            "Perplexity by length (held-out rows, the arm's training attention; lower is better)"
        )
        lines += ["", _markdown(title, tables["perplexity"], variants, length_label)]
    if tables["lm_eval"]["rows"]:
        title = "lm-eval long-context tasks (lm-eval's task definitions, model anchorctx)"
        lines += ["", _markdown(title, tables["lm_eval"], variants, _lm_eval_label)]
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------- RULER task sets
def ruler_task_sets(
    summaries: Summaries, variants: list[str]
) -> list[tuple[tuple[str, ...] | None, list[str]]]:
    """Variants grouped by the tasks their RULER mean is over (``average_tasks``), in order of
    first appearance; None: a summary written before it recorded them."""
    return group_by_task_set(
        {
            v: ruler.get("average_tasks")
            for v in variants
            if (ruler := _suite(summaries.get(v), "ruler")) is not None
        }
    )


def group_by_task_set(
    tasks: Mapping[K, Sequence[str] | None],
) -> list[tuple[tuple[str, ...] | None, list[K]]]:
    """Keys grouped by the task set their mean is over, in order of first appearance: the one
    rule that keeps means over different task sets apart (this report's and the stacked one)."""
    groups: dict[tuple[str, ...] | None, list[K]] = {}
    for key, over in tasks.items():
        groups.setdefault(tuple(over) if over is not None else None, []).append(key)
    return list(groups.items())


def ruler_markdown(table: Table, variants: list[str], summaries: Summaries) -> str:
    """Table 5; arms whose RULER means are over different task sets are shown apart, one table
    per set: a 13-task mean beside an 11-task mean would read as a difference between arms."""
    groups = ruler_task_sets(summaries, variants)
    if len(groups) <= 1:
        return _markdown("Table 5 — RULER by length", table, variants, length_label)
    parts = [TASK_SETS_APART]
    for tasks, members in groups:
        rows = {v: r for v, r in table["rows"].items() if v in members}
        sub: Table = {**table, "rows": rows}
        title = f"Table 5 — RULER by length ({task_set_label(tasks)})"
        parts.append(_markdown(title, sub, members, length_label))
    return "\n\n".join(parts)


TASK_SETS_APART = (
    "**Not comparable across variants**: their RULER means are over different task sets, "
    "so each set has its own table."
)


def task_set_label(tasks: tuple[str, ...] | None) -> str:
    """``"11 tasks: niah_single_1, …"``: the title of one task set's table."""
    return f"{len(tasks)} tasks: {', '.join(tasks)}" if tasks is not None else "tasks unknown"


# ------------------------------------------------------------------- the paper's numbers
def paper_comparison(
    experiment: str,
    tables: Tables,
    summaries: Summaries,
    intervals: RulerIntervals | None,
) -> PaperComparison:
    """Per report table, the paper's cells beside ours (:func:`paper_numbers.beside`) for the
    paper tables the experiment ``experiment`` reproduces; {} when it reproduces none."""
    numbers = load_paper_numbers()
    refs = references(experiment, numbers)
    if not refs:
        return {}
    tasks = {
        v: (ruler or {}).get("average_tasks")
        for v, s in summaries.items()
        if (ruler := _suite(s, "ruler")) is not None
    }
    out: PaperComparison = {}
    for name in ("ruler", "longbench", "general"):
        cells = paper_cells(numbers, refs, name)
        if cells:
            ivs = intervals["arms"] if intervals and name == "ruler" else None
            out[name] = beside(tables[name], cells, tasks if name == "ruler" else {}, ivs)
    return out


PAPER_TITLES = {
    "ruler": "RULER by length",
    "longbench": "LongBench categories",
    "general": "MMLU and HellaSwag",
}


def paper_markdown(
    paper: PaperComparison, tables: Tables, arms: list[str], miniature: bool = False
) -> str:
    source = (
        "The paper's published numbers (anchorctx/evaluation/paper_numbers.json, read from "
        "arXiv 2411.13476v2) beside ours"
    )
    if miniature:
        what = (
            f"{source}, for reference: this experiment runs the paper's recipe in miniature "
            "(its arms on a small model at short rows), whose scores are not expected to reach "
            "a 7B model's at 64K tokens; the paper's lengths this run did not evaluate show "
            "only the paper's number."
        )
    else:
        what = f"{source} for the arms this preset reproduces."
    lines = [
        "## Beside the paper",
        "",
        f"{what} A RULER cell is compared only where our mean is over the paper's task set.",
    ]
    for name, compared in paper.items():
        columns = list(tables[name]["columns"])
        lines += ["", beside_markdown(PAPER_TITLES[name], compared, columns, arms)]
    return "\n".join(lines)


# ------------------------------------------------------------------- arm comparison
def provenance_markdown(provenance: Provenance) -> str:
    """The experiment and every arm it compares (attention, overrides, run dir, dataset)."""
    rows = [
        [
            f"`{a['variant']}`",
            a["attention"],
            ", ".join(f"{k}={v}" for k, v in a["overrides"].items()) or "—",
            f"`{a['run_dir']}`",
            f"`{a['dataset']}`" if a.get("dataset") else "—",
        ]
        for a in provenance["arms"]
    ]
    return "\n".join(
        [
            "## Experiment",
            "",
            f"Experiment `{provenance['experiment']}` ({len(provenance['arms'])} arms, seed "
            f"{provenance['seed']}, config fingerprint `{provenance['config_fingerprint']}`), "
            f"outputs in `{provenance['experiment_dir']}`.",
            "",
            markdown_table(["arm", "attention", "overrides", "run dir", "packed dataset"], rows),
            "",
            determinism_line(provenance["arms"]),
        ]
    )


def determinism_line(arms: list[ArmProvenance]) -> str:
    """Whether the arms trained deterministically (their run manifests): a rerun of a
    deterministic arm gives the same checkpoint on the same GPU kind; one that is not can
    differ by more than the differences between arms."""
    flags = {a["variant"]: a.get("deterministic") for a in arms}
    if flags and all(flags.values()):
        return (
            "Training: deterministic (`training.deterministic: true`): a rerun of this config "
            "with the same seed on the same GPU kind gives bit-identical checkpoints."
        )
    if flags and all(f is False for f in flags.values()):
        return (
            "Training: not deterministic (`training.deterministic: false`): on a GPU a rerun of "
            "this config with the same seed can give different checkpoints and scores."
        )
    listed = ", ".join(
        f"`{v}` {'yes' if f else 'no' if f is False else 'not recorded'}" for v, f in flags.items()
    )
    return f"Training deterministic, per arm: {listed or 'no arms'}."


def comparison_markdown(
    comparison: ArmComparison, variants: list[str], paths: dict[str, str]
) -> str:
    """Training loss, attention work and the RoPE precision study: what differs among arms.

    ``paths``: the plots that exist (report.md links them relative to itself)."""
    lines = ["## What differs among the arms", ""]
    loss = comparison.get("loss") or {}
    if any(loss.values()):
        lines += ["### Training loss", ""]
        if "loss_plot" in paths:
            lines += [f"![Training loss by arm]({Path(paths['loss_plot']).name})", ""]
        rows = [
            [v, str(arm["steps"]), f"{arm['first']:.4f}", f"{arm['last']:.4f}"]
            for v in variants
            if (arm := loss.get(v))
        ]
        lines += [markdown_table(["arm", "steps", "first loss", "last loss"], rows), ""]
    work = comparison.get("attention_work") or {}
    if work:
        lines += [
            "### Attention work",
            "",
            "Attended query–key pairs on the packed rows each arm trained on (its training "
            "order, cut to `data.seq_len`), relative to full causal attention on the same rows: "
            "the share of the attention kernel's work the arm's mask leaves.",
            "",
        ]
        rows = [
            [
                v,
                str(w["rows"]),
                f"{w['mean_documents_per_row']:.1f}",
                f"{w['pairs']:,}",
                f"{w['full_pairs']:,}",
                f"{100 * w['fraction']:.2f}%",
            ]
            for v in variants
            if (w := work.get(v))
        ]
        header = ["arm", "rows trained", "docs per row", "attended pairs", "full pairs", "share"]
        lines += [markdown_table(header, rows), ""]
    rope = comparison.get("rope_precision")
    if rope:
        lines += [
            "### BF16 vs FP32 RoPE (paper Section 2)",
            "",
            f"Attention difference under shifted position ids on the experiment's model "
            f"({rope['weights']}; {rope['sequences']} sequence(s) × {rope['seq_len']} tokens"
            + (f"; measured in {rope['seconds']:.0f} s" if rope.get("seconds") else "")
            + f"). D: Eq. 4 at Δ1 = {rope['compare_shift']}, Δ2 = {rope['delta2']}; "
            "first-token share of D; D_logit: Eq. 5.",
            "",
        ]
        if "rope_plot" in paths:
            png = Path(paths["rope_plot"])
            lines += [f"![BF16 vs FP32 RoPE discrepancy]({png.parent.name}/{png.name})", ""]
        modes = rope["modes"]
        logit_key = next((k for m in modes.values() for k in m if k.startswith("D_logit")), None)
        rows = [
            [
                mode,
                f"{m['D']:.3e}" if m["D"] is not None else "—",
                f"{100 * m['first_token_share']:.1f}%",
                f"{m[logit_key]:.3e}" if logit_key else "—",
            ]
            for mode, m in modes.items()
        ]
        logit_label = logit_key.replace("D_logit_", "D_logit at T=") if logit_key else "D_logit"
        header = ["precision", "D", "first-token share", logit_label]
        lines += [markdown_table(header, rows), ""]
    if learned := comparison.get("rope_weights"):
        lines += [rope_weights_markdown(learned, paths), ""]
    if len(lines) == 2:
        lines.append("Nothing measured yet: no arm has training metrics or a packed dataset.")
    return "\n".join(lines).rstrip()


def rope_weights_markdown(result: dict[str, Any], paths: dict[str, str]) -> str:
    """The RoPE study on learned weights: random init, base model and every arm's final
    checkpoint, with and without the anchor token, side by side."""
    lines = [
        "### BF16 vs FP32 RoPE on learned weights (paper Figure 1 setting)",
        "",
        rope_table.describe(result)
        + ". Weights: "
        + "; ".join(f"**{w['name']}**: {w['label']}" for w in result["weights"])
        + ". Modes: "
        + ", ".join(rope_table.MODE_LABELS.get(m, m) for m in result["settings"]["modes"])
        + ".",
        "",
    ]
    if "rope_weights_plot" in paths:
        png = Path(paths["rope_weights_plot"])
        lines += [f"![BF16 vs FP32 RoPE on learned weights]({png.parent.name}/{png.name})", ""]
    lines.append(rope_table.markdown_rows(result))
    return "\n".join(lines)
