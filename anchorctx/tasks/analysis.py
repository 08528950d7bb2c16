"""The BF16 RoPE precision study (paper Section 2) as tasks: the study on one model, and the
study on learned weights (random init, base model, every arm's final checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from anchorctx.analysis import rope_weights
from anchorctx.analysis.rope_precision import run_study
from anchorctx.analysis.rope_weights_table import study_dir, table_rows, write_weights_study
from anchorctx.demo import ensure_demo_corpus
from anchorctx.experiment import ExperimentConfig
from anchorctx.io import read_json
from anchorctx.tasks.caching import digest

if TYPE_CHECKING:
    from prefect.context import TaskRunContext


@task(name="rope-precision")
def rope_precision_task(cfg: ExperimentConfig, out_dir: str | None = None) -> str:
    """Run the study; returns the JSON path (its PNG lies beside it)."""
    ensure_demo_corpus(cfg, progress=False)  # demo configs: the corpus provides the tokenizer
    return str(run_study(cfg, out_dir=out_dir, progress=False))


# ----------------------------------------------------------------------- on learned weights
def weights_keys(cfg: ExperimentConfig) -> list[str]:
    """The weights the study measures now: random init, base, arms with a final checkpoint."""
    return [w.key for w in rope_weights.weights_list(cfg)]


def rope_weights_cache_key(context: TaskRunContext | None, parameters: dict[str, Any]) -> str:
    """The library's identity of the result (weights content, inputs, settings, code) and the
    file it is written to."""
    cfg: ExperimentConfig = parameters["cfg"]
    key, inputs = parameters["key"], parameters["inputs"]
    ident = rope_weights.weights_identity(cfg, rope_weights.find_weights(cfg, key), inputs)
    return digest("rope-weights", str(rope_weights.result_path(cfg, key)), ident)


# Never cached: it is cheap, and its file's content is part of every measurement's key.
@task(name="rope-weights-inputs", cache_policy=NO_CACHE, persist_result=False)
def rope_inputs_task(cfg: ExperimentConfig) -> str:
    """Cut the with/without-anchor sequences every set of weights is measured on."""
    ensure_demo_corpus(cfg, progress=False)  # demo configs: the corpus provides the text
    return str(rope_weights.write_inputs(cfg))


@task(
    name="rope-weights",
    task_run_name="rope-weights-{key}",
    cache_key_fn=rope_weights_cache_key,
    persist_result=True,
    result_serializer="json",
)
def rope_weights_task(cfg: ExperimentConfig, key: str, inputs: str, force: bool = False) -> str:
    """Measure one set of weights with and without the anchor; returns its result path."""
    return str(rope_weights.run_weights(cfg, key, inputs, force=force))


@task(name="rope-weights-report", cache_policy=NO_CACHE, persist_result=False)
def rope_weights_report_task(cfg: ExperimentConfig, results: list[str]) -> str:
    """Gather the per-weights results into one (``weights`` axis) with its table and figure."""
    return str(write_weights_study(results, study_dir(cfg.experiment_dir)))


def weights_table(path: str | Path) -> list[dict[str, Any]]:
    """The gathered result's rows (weights × input, D and first-token share per mode)."""
    return table_rows(read_json(path))
