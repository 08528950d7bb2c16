"""Evaluation: RULER, LongBench, MMLU and HellaSwag on checkpoints; averaging; reports.

Public entry points (docs/ARCHITECTURE.md, evaluation results contract)::

    evaluate_checkpoint(cfg, checkpoint, suite, *, force=False, progress=True) -> Path
    checkpoint_hash(checkpoint) -> str
    summarize_run(run_dir, last_k) -> dict
    write_experiment_report(experiment_dir, variants) -> dict
    average_weights(checkpoints, out) -> Path

Nothing here imports torch at module import time.
"""

from anchorctx.evaluation.averaging import summarize_run
from anchorctx.evaluation.report import write_experiment_report
from anchorctx.evaluation.results import (
    SUITES,
    EvaluationError,
    Suite,
    checkpoint_hash,
    eval_dir,
    evaluate_checkpoint,
    evaluation_code_version,
    evaluation_fingerprint,
    identity,
    load_result,
    result_path,
)
from anchorctx.evaluation.weights import average_weights

__all__ = [
    "SUITES",
    "EvaluationError",
    "Suite",
    "average_weights",
    "checkpoint_hash",
    "eval_dir",
    "evaluate_checkpoint",
    "evaluation_code_version",
    "evaluation_fingerprint",
    "identity",
    "load_result",
    "result_path",
    "summarize_run",
    "write_experiment_report",
]
