"""Average a run's evaluation results over its last k checkpoints (the paper reports RULER as
the mean over the last 5 checkpoints, saved every 10 steps over the last 50).

Reads every ``<run_dir>/eval/<checkpoint>/<suite>.json``, picks per suite the last ``k``
checkpoints by training step, and writes ``<run_dir>/eval/summary.json`` and ``summary.md``
with the mean and the population standard deviation (ddof=0, so one checkpoint gives std 0)
per task and length/split, plus:

- RULER: the per-length mean over tasks of each checkpoint (the paper's headline number),
  leaving out the tasks in that result's ``evaluation.ruler.exclude``, then mean/std over
  checkpoints;
- LongBench: the category averages the suite reports, mean/std over checkpoints.

Checkpoints without a step (e.g. a weight-averaged checkpoint) are listed separately. Results
evaluated with different settings (:func:`result_settings`: the suite's evaluation settings and
the content of its input data) are never averaged together: :class:`MixedSettingsError` names
the first difference and the checkpoints on each side.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from anchorctx.evaluation.integrity import ResultIntegrityError, check_result_file
from anchorctx.evaluation.records import (
    ResultRecord,
    RunSummary,
    Stat,
    SuiteSummary,
    is_result_record,
)
from anchorctx.io import atomic_write_json, atomic_write_text, read_json
from anchorctx.models.checkpoints import step_from_name

SUMMARY_JSON = "summary.json"
SUMMARY_MD = "summary.md"
K = TypeVar("K")


class MixedSettingsError(ValueError):
    """The results to average were evaluated with different settings or input data."""

    exit_code = 1  # the results on disk disagree, not the command line


# ------------------------------------------------------------------------------ helpers
def stats(values: Iterable[float]) -> Stat:
    """Mean, population std (ddof=0) and count of the values."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("stats of no values")
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / len(vals)
    return {"mean": mean, "std": math.sqrt(var), "n": len(vals)}


def _sort_key(key: str) -> tuple[int, float, str]:
    """Numeric keys (lengths) ascending, then names alphabetically."""
    try:
        return (0, float(key), "")
    except ValueError:
        return (1, 0.0, key)


def sorted_keys(keys: Iterable[str]) -> list[str]:
    return sorted(set(keys), key=_sort_key)


def length_label(key: str) -> str:
    """``"4096"`` -> ``"4K"``, ``"131072"`` -> ``"128K"``; other keys unchanged."""
    if key.isdigit() and int(key) >= 1024 and int(key) % 1024 == 0:
        return f"{int(key) // 1024}K"
    return key


def fmt_stat(s: Mapping[str, Any] | None, digits: int = 2) -> str:
    """``mean ± std`` (``mean`` alone for one value); "—" for no statistic."""
    if s is None:
        return "—"
    if s.get("n", 1) > 1:
        return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f}"
    return f"{s['mean']:.{digits}f}"


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


# --------------------------------------------------------------------------- collecting
def result_step(result: ResultRecord) -> int | None:
    step = result.get("step")
    if isinstance(step, int):
        return step
    return step_from_name(str(result.get("checkpoint_name", "")))


def collect_results(run_dir: str | Path, *, verify: bool = False) -> dict[str, list[ResultRecord]]:
    """Every readable result JSON under ``<run_dir>/eval/*/``, grouped by suite.

    ``verify`` (the report): each result must be the file ``evaluate`` wrote, its own digest
    and its per-sample records' hash matching (:mod:`anchorctx.evaluation.integrity`), the
    check ``evaluate`` makes before serving it; one that is not is refused with
    :class:`ResultIntegrityError` naming the file, never averaged."""
    out: dict[str, list[ResultRecord]] = {}
    eval_root = Path(run_dir) / "eval"
    for path in sorted(eval_root.glob("*/*.json")):
        if path.name.startswith("."):
            continue
        try:
            result = read_json(path)
        except (OSError, ValueError):
            if verify and path.parent.joinpath(f"{path.stem}.samples.jsonl").is_file():
                raise ResultIntegrityError(
                    f"{path}: refused: not readable JSON (torn or edited); run `anchorctx "
                    "evaluate` on its checkpoint to recompute it from the per-sample records"
                ) from None
            continue  # a foreign or torn file is not a result
        if not is_result_record(result):
            continue
        if verify:
            check_result_file(path, result)
        result.setdefault("checkpoint_name", path.parent.name)
        result["eval_key"] = path.parent.name  # where its per-sample records are
        out.setdefault(result["suite"], []).append(result)
    return out


# ------------------------------------------------------------------------ per-checkpoint
def ruler_average(result: ResultRecord) -> tuple[dict[str, float], list[str]]:
    """Per-length unweighted mean over the RULER tasks of one result, honouring ``exclude``."""
    exclude = set((result.get("evaluation", {}).get("ruler") or {}).get("exclude") or [])
    tasks = [
        t for t, by_len in result["scores"].items() if t not in exclude and isinstance(by_len, dict)
    ]
    per_len: dict[str, list[float]] = {}
    for task in tasks:
        for length, value in result["scores"][task].items():
            if _is_number(value):
                per_len.setdefault(str(length), []).append(float(value))
    return {k: sum(v) / len(v) for k, v in per_len.items()}, sorted(tasks)


def _flat_scores(result: ResultRecord) -> dict[tuple[str, str], float]:
    return {
        (task, str(key)): float(value)
        for task, by_key in result["scores"].items()
        if isinstance(by_key, dict)
        for key, value in by_key.items()
        if _is_number(value)
    }


def _stats_by_key(rows: list[dict[K, float]]) -> dict[K, Stat]:
    keys = dict.fromkeys(k for row in rows for k in row)  # first-seen order, deterministic
    return {k: stats(row[k] for row in rows if k in row) for k in keys}


# ------------------------------------------------------------------------------ settings
def _flatten(obj: Any, prefix: str) -> dict[str, Any]:
    if isinstance(obj, dict):
        return {
            k: v for key, val in obj.items() for k, v in _flatten(val, f"{prefix}.{key}").items()
        }
    return {prefix: obj}


def result_settings(result: ResultRecord) -> dict[str, str]:
    """What decides a result's scores besides its checkpoint, as ``dotted key -> JSON``: the
    suite's evaluation settings (``evaluation``) and its input data's content hashes
    (``inputs``). A setting that names an input file is compared by that content, not by its
    spelling: one path written relative or absolute gives the same scores."""
    inputs = result.get("inputs") or {}
    flat = _flatten(result.get("evaluation") or {}, "evaluation")
    out = {k: json.dumps(v, sort_keys=True) for k, v in flat.items() if k not in inputs}
    return out | {f"{k} (content)": json.dumps(v) for k, v in inputs.items()}


def settings_difference(settings: list[dict[str, str]], names: list[str]) -> str | None:
    """The first setting in which ``settings`` (:func:`result_settings`, one per name) differ,
    with each value and the names that have it; None when they are all equal."""
    keys = sorted({k for s in settings for k in s})
    differing = [k for k in keys if len({s.get(k) for s in settings}) > 1]
    if not differing:
        return None
    key = differing[0]
    sides: dict[str | None, list[str]] = {}
    for name, s in zip(names, settings, strict=True):
        sides.setdefault(s.get(key), []).append(name)
    shown = "; ".join(
        f"{'unset' if value is None else value} at {', '.join(at)}" for value, at in sides.items()
    )
    more = f" (and {len(differing) - 1} more)" if len(differing) > 1 else ""
    return f"{key}: {shown}{more}"


def check_same_settings(where: str, suite: str, results: list[ResultRecord]) -> None:
    """Raise :class:`MixedSettingsError` when ``results`` differ in :func:`result_settings`:
    their mean would mix two evaluations (e.g. 4 and 8 samples a task) into one number."""
    names = [str(r.get("checkpoint_name")) for r in results]
    if diff := settings_difference([result_settings(r) for r in results], names):
        raise MixedSettingsError(
            f"{where}: suite {suite!r}: not averaged: its results were evaluated with "
            f"different settings: {diff}; evaluate these checkpoints again with one config "
            "(`anchorctx evaluate --force`)"
        )


# --------------------------------------------------------------------------- summaries
def summarize_results(suite: str, results: list[ResultRecord]) -> SuiteSummary:
    """Mean/std over the given results of one suite (already chosen: the last k)."""
    scores: dict[str, dict[str, Stat]] = {}
    for (task, key), s in _stats_by_key([_flat_scores(r) for r in results]).items():
        scores.setdefault(task, {})[key] = s
    out: SuiteSummary = {
        "checkpoints": [r["checkpoint_name"] for r in results],
        "eval_keys": [r["eval_key"] for r in results],
        "steps": [result_step(r) for r in results],
        "n": len(results),
        "scores": {t: {k: scores[t][k] for k in sorted_keys(scores[t])} for t in sorted(scores)},
        "not_run": {t: why for r in results for t, why in (r.get("not_run") or {}).items()},
        # What they were evaluated with (all equal: summarize_run checks), for the report to
        # compare arms by.
        "settings": result_settings(results[0]),
    }
    if suite == "ruler":
        averages = [ruler_average(r) for r in results]
        avg = _stats_by_key([a for a, _ in averages])
        out["average"] = {k: avg[k] for k in sorted_keys(avg)}
        out["average_tasks"] = sorted({t for _, tasks in averages for t in tasks})
        out["excluded"] = sorted(
            {
                t
                for r in results
                for t in (r.get("evaluation", {}).get("ruler") or {}).get("exclude") or []
            }
        )
    categories = [
        {c: float(v) for c, v in (r.get("categories") or {}).items() if _is_number(v)}
        for r in results
    ]
    if any(categories):
        cat = _stats_by_key(categories)
        out["categories"] = {c: cat[c] for c in cat}  # keep the suite's category order
    return out


def summarize_run(run_dir: str | Path, last_k: int, *, verify: bool = False) -> RunSummary:
    """Average every suite over the last ``last_k`` evaluated checkpoints of a run.

    Writes ``eval/summary.json`` and ``eval/summary.md`` atomically and returns the summary.
    Results of one suite evaluated with different settings are refused
    (:class:`MixedSettingsError`), not averaged. ``verify``: refuse (:class:`ResultIntegrityError`) a result that does not match its
    per-sample records instead of averaging it (``anchorctx report`` and the flows' summary).
    """
    if last_k < 1:
        raise ValueError(f"last_k must be >= 1, got {last_k}")
    run_dir = Path(run_dir)
    grouped = collect_results(run_dir, verify=verify)
    summary: RunSummary = {
        "run_dir": str(run_dir.resolve()),
        "last_k": last_k,
        "std": "population standard deviation (ddof=0) over checkpoints",
        "suites": {},
        "other_checkpoints": {},
    }
    for suite in sorted(grouped):
        stepped = sorted(
            (r for r in grouped[suite] if result_step(r) is not None),
            key=lambda r: result_step(r) or 0,  # every one has a step: filtered above
        )
        if stepped:
            check_same_settings(str(run_dir / "eval"), suite, stepped[-last_k:])
            summary["suites"][suite] = summarize_results(suite, stepped[-last_k:])
        for r in grouped[suite]:
            if result_step(r) is None:
                summary["other_checkpoints"].setdefault(r["checkpoint_name"], {})[suite] = (
                    summarize_results(suite, [r])
                )
    eval_root = run_dir / "eval"
    atomic_write_json(eval_root / SUMMARY_JSON, summary)
    atomic_write_text(eval_root / SUMMARY_MD, summary_markdown(summary))
    return summary


# ---------------------------------------------------------------------------- markdown
def suite_markdown(suite: str, s: SuiteSummary) -> str:
    """Markdown tables of one suite's summary (tasks as rows, lengths/splits as columns)."""
    parts = []
    if "average" in s:
        lengths = list(s["average"])
        parts.append(
            markdown_table(
                ["RULER"] + [length_label(k) for k in lengths],
                [["**average**"] + [fmt_stat(s["average"][k]) for k in lengths]],
            )
        )
    if "categories" in s:
        cats = list(s["categories"])
        parts.append(
            markdown_table(["category", "score"], [[c, fmt_stat(s["categories"][c])] for c in cats])
        )
    keys = sorted_keys(k for by_key in s["scores"].values() for k in by_key)
    if keys:
        rows = [[task] + [fmt_stat(s["scores"][task].get(k)) for k in keys] for task in s["scores"]]
        parts.append(markdown_table(["task"] + [length_label(k) for k in keys], rows))
    if s.get("excluded"):
        parts.append(f"Excluded from the average: {', '.join(s['excluded'])}.")
    if s.get("not_run"):
        parts.append("Not run: " + "; ".join(f"{t} ({why})" for t, why in s["not_run"].items()))
    return "\n\n".join(parts)


def summary_markdown(summary: RunSummary) -> str:
    lines = [
        f"# Evaluation summary: {summary['run_dir']}",
        "",
        f"Mean ± std over the last {summary['last_k']} evaluated checkpoints "
        "(std: population, ddof=0; no ± when one checkpoint).",
    ]
    for suite, s in summary["suites"].items():
        steps = ", ".join(str(x) for x in s["steps"])
        lines += ["", f"## {suite}", "", f"{s['n']} checkpoint(s), steps {steps}.", ""]
        lines.append(suite_markdown(suite, s))
    for name, suites in summary["other_checkpoints"].items():
        for suite, s in suites.items():
            lines += ["", f"## {suite} — {name}", "", suite_markdown(suite, s)]
    return "\n".join(lines) + "\n"
