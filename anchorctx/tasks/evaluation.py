"""Evaluation tasks: one (checkpoint, suite) pair per task run, cached by content."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.runtime import task_run

from anchorctx.config import ExperimentConfig
from anchorctx.evaluation import evaluate_checkpoint, summarize_run, write_experiment_report
from anchorctx.evaluation.arm_comparison import write_arm_comparison
from anchorctx.evaluation.results import result_is_intact
from anchorctx.tasks.caching import evaluate_cache_key


def _evaluate_run_name() -> str:
    params = task_run.parameters
    return f"evaluate-{params['suite']}-{Path(params['checkpoint']).name}"


@task(
    name="evaluate-checkpoint",
    task_run_name=_evaluate_run_name,
    cache_key_fn=evaluate_cache_key,
    persist_result=True,
    result_serializer="json",
)
def evaluate_task(cfg: ExperimentConfig, checkpoint: str, suite: str, force: bool = False) -> str:
    """Evaluate one checkpoint on one suite; returns the results JSON path."""
    return str(evaluate_checkpoint(cfg, checkpoint, suite, force=force, progress=False))


@task(name="summarize-run")
def summarize_task(run_dir: str, last_k: int) -> dict[str, Any]:
    """Mean ± std over the last k checkpoints (writes ``eval/summary.json`` and ``.md``)."""
    return summarize_run(run_dir, last_k)


@task(name="experiment-report")
def report_task(
    experiment_dir: str, variants: list[str], base: str | None = None
) -> dict[str, Any]:
    """The variants side by side in the paper's table shapes (report.md/json, plots)."""
    return write_experiment_report(experiment_dir, variants, base=base)


@task(name="arm-comparison")
def arm_comparison_task(cfg: ExperimentConfig, datasets: dict[str, str]) -> dict[str, Any]:
    """What differs among the arms: loss curves, attention work, the RoPE precision study."""
    return write_arm_comparison(cfg, datasets)


def result_exists(checkpoint: str | Path, suite: str) -> bool:
    """The result file exists and is intact (not edited since it was written): otherwise a
    cached task is refreshed, and the library recomputes it from the per-sample records."""
    return result_is_intact(checkpoint, suite)
