"""What evaluation and the experiment report log to the configured trackers.

- ``log_evaluation``: every score of every checkpoint under ``eval/<suite>/<task>/<key>`` (step =
  the checkpoint's training step; RULER also ``eval/ruler/average/<length>``, LongBench
  ``eval/longbench/category/<name>``; an lm-eval suite ``lm_eval:<task>`` logs under
  ``eval/lm_eval/<task>/...``) and the averages over the last k checkpoints under
  ``eval_mean/...`` and ``eval_std/...`` at the newest averaged step;
- ``log_report``: each comparison table (variants × columns, mean ± std; lm-eval's long-context
  tasks as table ``lm_eval``), its means as numbers,
  the RULER plot and report.md, in one ``report`` run per experiment.

Nothing is written outside ``run_root``: a run directory outside it (``anchorctx evaluate
--run-dir DIR``, whose results go under the experiment's ``external/``) is not logged, with
one warning line saying so.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from anchorctx.evaluation.averaging import (
    SUMMARY_JSON,
    collect_results,
    fmt_stat,
    result_step,
    ruler_average,
)
from anchorctx.evaluation.records import Report, ResultRecord, RunSummary, SuiteSummary
from anchorctx.io import read_json
from anchorctx.tracking import Tracker

if TYPE_CHECKING:
    from anchorctx.experiment import ExperimentConfig

log = logging.getLogger(__name__)
STATS: tuple[Literal["mean", "std"], ...] = ("mean", "std")  # of a summary, each logged


def _inside_run_root(path: Path, cfg: ExperimentConfig) -> bool:
    """Resolved, as ``results.is_external`` decides where a checkpoint's results go."""
    root, full = Path(cfg.run_root).resolve(), path.resolve()
    return full == root or root in full.parents


def log_evaluation(cfg: ExperimentConfig, run_dir: str | Path | None = None) -> None:
    """Log every result under ``<run_dir>/eval`` (per checkpoint) and, when
    ``eval/summary.json`` exists, its averages over the last k checkpoints."""
    if not cfg.tracking.backends:
        return
    run_dir = Path(run_dir) if run_dir else cfg.run_dir
    if not _inside_run_root(run_dir, cfg):
        log.warning(
            "note: %s is outside run_root %s: its scores are not logged to the trackers "
            "(tracking writes nothing outside run_root)",
            run_dir,
            cfg.run_root,
        )
        return
    grouped = collect_results(run_dir)
    summary_path = run_dir / "eval" / SUMMARY_JSON
    summary: RunSummary | None = read_json(summary_path) if summary_path.is_file() else None
    # One row per step across suites, logged in step order: W&B drops rows whose step is below
    # one it has seen. Results of checkpoints without a step (e.g. averaged weights) go to 0.
    rows: dict[int, dict[str, Any]] = {}
    for suite, results in grouped.items():
        for result in results:
            rows.setdefault(result_step(result) or 0, {}).update(
                _score_metrics("eval", suite, result)
            )
    for suite, s in (summary["suites"] if summary else {}).items():
        step = max((x for x in s.get("steps", []) if isinstance(x, int)), default=0)
        for stat in STATS:
            rows.setdefault(step, {}).update(_summary_metrics(f"eval_{stat}", suite, s, stat))
    with Tracker(cfg, "evaluate", log_dir=run_dir / "tensorboard") as tracker:
        for step in sorted(rows):
            tracker.metrics(rows[step], step=step)


def metric_suite(suite: str) -> str:
    """A suite's name in metric keys: ``lm_eval:babilong`` -> ``lm_eval/babilong`` (MLflow
    allows no colon in a metric name)."""
    return suite.replace(":", "/")


def _score_metrics(prefix: str, suite: str, result: ResultRecord) -> dict[str, Any]:
    name = metric_suite(suite)
    out = {
        f"{prefix}/{name}/{task}/{key}": value
        for task, by_key in result["scores"].items()
        if isinstance(by_key, dict)
        for key, value in by_key.items()
    }
    if suite == "ruler":
        out |= {f"{prefix}/ruler/average/{k}": v for k, v in ruler_average(result)[0].items()}
    out |= {f"{prefix}/{name}/category/{c}": v for c, v in (result.get("categories") or {}).items()}
    return out


def _summary_metrics(
    prefix: str, suite: str, s: SuiteSummary, stat: Literal["mean", "std"]
) -> dict[str, Any]:
    name = metric_suite(suite)
    out = {
        f"{prefix}/{name}/{task}/{key}": st[stat]
        for task, by_key in s.get("scores", {}).items()
        for key, st in by_key.items()
    }
    out |= {f"{prefix}/ruler/average/{k}": st[stat] for k, st in s.get("average", {}).items()}
    out |= {f"{prefix}/{name}/category/{c}": st[stat] for c, st in s.get("categories", {}).items()}
    return out


def log_report(cfg: ExperimentConfig, report: Report) -> None:
    """The experiment report (``write_experiment_report``'s return value): each comparison
    table (variant rows, mean ± std cells), the RULER plot, and report.md."""
    if not cfg.tracking.backends:
        return
    with Tracker(cfg, "report", log_dir=cfg.experiment_dir / "tensorboard") as tracker:
        for name, table in report["tables"].items():
            if not table["rows"]:
                continue
            columns = [str(c) for c in table["columns"]]
            rows = [
                [variant] + [fmt_stat(row.get(c)) for c in columns]
                for variant, row in table["rows"].items()
            ]
            tracker.table(f"report/{name}", ["variant", *columns], rows)
            for variant, row in table["rows"].items():
                tracker.metrics(
                    {
                        f"report/{name}/{variant}/{c}": stat["mean"]
                        if (stat := row.get(c))
                        else None
                        for c in columns
                    }
                )
        if plot := report["paths"].get("ruler_plot"):
            tracker.image("report/ruler_by_length", plot)
        tracker.text("report/markdown", report["markdown"])
