"""Evaluation tasks: one (checkpoint, suite) pair per task run, cached by content."""

from __future__ import annotations

import threading
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run

from anchorctx.evaluation import evaluate_checkpoint, summarize_run, write_experiment_report
from anchorctx.evaluation.arm_comparison import write_arm_comparison
from anchorctx.evaluation.records import ArmComparison, Report, RunSummary
from anchorctx.evaluation.results import result_is_intact
from anchorctx.experiment import ExperimentConfig
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


# Never cached: the sample store decides what is generated (by content), not a task record.
@task(name="prefetch-ruler-samples", cache_policy=NO_CACHE, persist_result=False)
def prefetch_ruler_task(
    cfg: ExperimentConfig, tokenizer_cfg: ExperimentConfig, stop: threading.Event
) -> int:
    """Generate ``cfg``'s RULER samples, tokenised by ``tokenizer_cfg``'s tokenizer, into the
    experiment's sample store while the GPU trains (the GPUs' evaluation workers read them
    there); returns how many. ``stop``, once set, ends it between cells."""
    # Imported here: the RULER runner pulls in transformers, which light flows never need.
    from anchorctx.evaluation.ruler.runner import prefetch_samples
    from anchorctx.models.loading import load_tokenizer

    return prefetch_samples(cfg, load_tokenizer(tokenizer_cfg.model), should_stop=stop.is_set)


@task(name="summarize-run")
def summarize_task(run_dir: str, last_k: int) -> RunSummary:
    """Mean ± std over the last k checkpoints (writes ``eval/summary.json`` and ``.md``); a
    result that does not match its per-sample records is refused, as ``anchorctx report``
    refuses it."""
    return summarize_run(run_dir, last_k, verify=True)


@task(name="experiment-report")
def report_task(experiment_dir: str, variants: list[str], base: str | None = None) -> Report:
    """The variants side by side in the paper's table shapes (report.md/json, plots)."""
    return write_experiment_report(experiment_dir, variants, base=base)


@task(name="arm-comparison")
def arm_comparison_task(cfg: ExperimentConfig, datasets: dict[str, str]) -> ArmComparison:
    """What differs among the arms: loss curves, attention work, the RoPE precision study."""
    return write_arm_comparison(cfg, datasets)


def result_exists(checkpoint: str | Path, suite: str, cfg: ExperimentConfig | None = None) -> bool:
    """The result file exists and is intact (not edited since it was written): otherwise a
    cached task is refreshed, and the library recomputes it from the per-sample records.
    ``cfg``: where the result of a checkpoint outside its ``run_root`` lives."""
    return result_is_intact(checkpoint, suite, cfg)
