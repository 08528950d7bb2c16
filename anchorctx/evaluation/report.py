"""Experiment report: compare the variants of an experiment in the paper's table shapes.

Reads each arm's ``<experiment_dir>/<variant>/eval/summary.json`` (written by
:func:`anchorctx.evaluation.averaging.summarize_run`) and writes, under the experiment dir:

- ``report.md``  — Table 5 (RULER score by length per variant), Table 7 (LongBench categories),
  Table 12 (MMLU, HellaSwag); mean ± std over each variant's last k checkpoints;
- ``report.json`` — the same tables as numbers;
- ``ruler_by_length.png`` — RULER score against context length (log2 axis), one line per variant.

A suite a variant was not evaluated on shows as "—"; a suite no variant has is left out. Nothing
is ever filled in.
"""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path
from typing import Any

from anchorctx.evaluation.averaging import (
    SUMMARY_JSON,
    fmt_stat,
    length_label,
    markdown_table,
    sorted_keys,
)
from anchorctx.io import atomic_write_json, atomic_write_text, read_json

# The one score a general-ability suite is reported by: (task, metric) in its scores.
HEADLINE = {"mmlu": ("mmlu", "acc"), "hellaswag": ("hellaswag", "acc_norm")}
GENERAL_SUITES = {"mmlu": "MMLU", "hellaswag": "HellaSwag"}


# ------------------------------------------------------------------------------ tables
def load_summaries(experiment_dir: Path, variants: list[str]) -> dict[str, dict[str, Any] | None]:
    out: dict[str, dict[str, Any] | None] = {}
    for variant in variants:
        path = experiment_dir / variant / "eval" / SUMMARY_JSON
        out[variant] = read_json(path) if path.is_file() else None
    return out


def _suite(summary: dict[str, Any] | None, suite: str) -> dict[str, Any] | None:
    return None if summary is None else summary.get("suites", {}).get(suite)


def ruler_table(summaries: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """Table 5: RULER per-length average (over tasks) for each variant."""
    rows = {v: (_suite(s, "ruler") or {}).get("average", {}) for v, s in summaries.items()}
    lengths = sorted_keys(k for row in rows.values() for k in row)
    return {"columns": lengths, "rows": {v: r for v, r in rows.items() if r}}


def longbench_table(summaries: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """Table 7: LongBench category averages for each variant."""
    rows = {v: (_suite(s, "longbench") or {}).get("categories", {}) for v, s in summaries.items()}
    columns: list[str] = []
    for row in rows.values():
        columns += [c for c in row if c not in columns]  # the suite's category order
    return {"columns": columns, "rows": {v: r for v, r in rows.items() if r}}


def headline(suite: str, s: dict[str, Any] | None) -> dict[str, Any] | None:
    """The headline score of a general-ability suite summary (MMLU acc, HellaSwag acc_norm)."""
    if s is None:
        return None
    task, metric = HEADLINE.get(suite, (suite, ""))
    by_metric = s.get("scores", {}).get(task, {})
    if metric in by_metric:
        return by_metric[metric]
    return next(iter(by_metric.values())) if len(by_metric) == 1 else None


def general_table(summaries: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """Table 12: MMLU and HellaSwag for each variant."""
    rows: dict[str, dict[str, Any]] = {}
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


def _markdown(title: str, table: dict[str, Any], variants: list[str], label=str) -> str:
    if not table["rows"]:
        return f"### {title}\n\nNo results."
    rows = [[v] + [fmt_stat(table["rows"].get(v, {}).get(c)) for c in table["columns"]] for v in variants]  # fmt: skip
    header = ["variant"] + [label(c) for c in table["columns"]]
    return f"### {title}\n\n" + markdown_table(header, rows)


# ------------------------------------------------------------------------------ plot
def _atomic_write_bytes(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def plot_ruler(table: dict[str, Any], path: Path) -> Path:
    """RULER score vs context length (log2 x axis), mean ± std band per variant."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for variant, row in table["rows"].items():
        keys = [k for k in table["columns"] if k in row]
        xs = [float(k) for k in keys]
        ys = [row[k]["mean"] for k in keys]
        sd = [row[k]["std"] for k in keys]
        ax.errorbar(xs, ys, yerr=sd, marker="o", capsize=3, label=variant)
    ax.set_xscale("log", base=2)
    ticks = [float(k) for k in table["columns"]]
    ax.set_xticks(ticks, [length_label(k) for k in table["columns"]])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("RULER score (mean over tasks)")
    ax.set_title("RULER by length (mean ± std over the last k checkpoints)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    _atomic_write_bytes(path, buf.getvalue())
    return path


# ---------------------------------------------------------------------------- report
def _numeric_columns(table: dict[str, Any]) -> bool:
    return bool(table["columns"]) and all(c.replace(".", "", 1).isdigit() for c in table["columns"])


def write_experiment_report(experiment_dir: str | Path, variants: list[str]) -> dict[str, Any]:
    """Compare ``variants`` of the experiment; write report.md/json and the RULER plot."""
    experiment_dir = Path(experiment_dir)
    experiment_dir.mkdir(parents=True, exist_ok=True)
    summaries = load_summaries(experiment_dir, variants)
    tables = {
        "ruler": ruler_table(summaries),
        "longbench": longbench_table(summaries),
        "general": general_table(summaries),
    }
    paths: dict[str, str] = {}
    if tables["ruler"]["rows"] and _numeric_columns(tables["ruler"]):
        paths["ruler_plot"] = str(
            plot_ruler(tables["ruler"], experiment_dir / "ruler_by_length.png")
        )
    markdown = _report_markdown(experiment_dir, variants, summaries, tables, paths)
    paths["markdown"] = str(atomic_write_text(experiment_dir / "report.md", markdown))
    paths["json"] = str(experiment_dir / "report.json")
    runs = {v: _run_info(s) for v, s in summaries.items()}
    atomic_write_json(experiment_dir / "report.json",
                      {"experiment_dir": str(experiment_dir.resolve()), "variants": variants,
                       "runs": runs, "tables": tables, "paths": paths})  # fmt: skip
    return {"markdown": markdown, "tables": tables, "paths": paths}


def _run_info(summary: dict[str, Any] | None) -> dict[str, Any] | None:
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
    summaries: dict[str, dict[str, Any] | None],
    tables: dict[str, Any],
    paths: dict[str, str],
) -> str:
    lines = [f"# Experiment report: {experiment_dir.name}", ""]
    lines += ["Scores are mean ± std over each variant's last k evaluated checkpoints.", ""]
    for variant, s in summaries.items():
        if s is None:
            lines.append(f"- **{variant}**: no evaluation summary (run `anchorctx evaluate`).")
        else:
            ns = ", ".join(f"{name}: {x['n']}" for name, x in s["suites"].items()) or "none"
            lines.append(f"- **{variant}**: last_k={s['last_k']}; checkpoints per suite: {ns}")
    lines += ["", _markdown("Table 5 — RULER by length", tables["ruler"], variants, length_label)]
    if "ruler_plot" in paths:
        lines += ["", f"![RULER score by length]({Path(paths['ruler_plot']).name})"]
    lines += ["", _markdown("Table 7 — LongBench categories", tables["longbench"], variants)]
    lines += ["", _markdown("Table 12 — MMLU and HellaSwag", tables["general"], variants)]
    return "\n".join(lines) + "\n"
