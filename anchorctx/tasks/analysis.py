"""The BF16 RoPE precision study (paper Section 2) as a task."""

from __future__ import annotations

from prefect import task

from anchorctx.analysis.rope_precision import run_study
from anchorctx.demo import ensure_demo_corpus
from anchorctx.experiment import ExperimentConfig


@task(name="rope-precision")
def rope_precision_task(cfg: ExperimentConfig, out_dir: str | None = None) -> str:
    """Run the study; returns the JSON path (its PNG lies beside it)."""
    ensure_demo_corpus(cfg, progress=False)  # demo configs: the corpus provides the tokenizer
    return str(run_study(cfg, out_dir=out_dir, progress=False))
