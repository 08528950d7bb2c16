"""Turn the evaluation library's summaries and report tables into artifact table rows."""

from __future__ import annotations

from collections.abc import Callable

from anchorctx.evaluation.averaging import fmt_stat, length_label
from anchorctx.evaluation.records import Report, RunSummary, Table
from anchorctx.evaluation.report import cell_text

# Report table -> (artifact name, description, column label function).
_REPORT_TABLES: dict[str, tuple[str, str, Callable[[str], str]]] = {
    "ruler": (
        "ruler-by-length",
        "RULER score by context length and variant (paper Table 5)",
        length_label,
    ),
    "longbench": (
        "longbench-categories",
        "LongBench category averages by variant (paper Table 7)",
        str,
    ),
    "general": (
        "mmlu-hellaswag",
        "MMLU (acc) and HellaSwag (acc_norm) by variant (paper Table 12)",
        str,
    ),
}


def variant_rows(table: Table, label: Callable[[str], str] = str) -> list[dict[str, str]]:
    """``{"columns": [...], "rows": {variant: {column: stats}}}`` as one row per variant,
    cells at chance (``table["chance"]``, see the report) labelled as in report.md."""
    return [
        {"variant": variant, **{label(c): cell_text(table, variant, c) for c in table["columns"]}}
        for variant in table["rows"]
    ]


def report_tables(report: Report) -> dict[str, tuple[list[dict[str, str]], str]]:
    """The experiment report's tables (only those with rows) keyed by artifact name."""
    out = {}
    for name, (key, description, label) in _REPORT_TABLES.items():
        table = report["tables"].get(name)
        if table and table["rows"]:
            out[key] = (variant_rows(table, label), description + ", mean ± std over last k")
    return out


def summary_tables(summary: RunSummary) -> dict[str, list[dict[str, str]]]:
    """One table per suite of a run summary: a row per task, a column per length or split."""
    out = {}
    for suite, s in summary.get("suites", {}).items():
        keys: list[str] = []
        for by_key in s["scores"].values():
            keys += [k for k in by_key if k not in keys]
        rows = [
            {"task": task, **{length_label(k): fmt_stat(by_key.get(k)) for k in keys}}
            for task, by_key in s["scores"].items()
        ]
        if "average" in s:
            rows.insert(
                0,
                {
                    "task": "average",
                    **{length_label(k): fmt_stat(v) for k, v in s["average"].items()},
                },
            )
        out[suite] = rows
    return out
