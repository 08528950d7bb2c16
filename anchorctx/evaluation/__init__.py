"""Evaluation: RULER, LongBench, MMLU and HellaSwag on checkpoints; averaging; reports.

Public entry points (docs/ARCHITECTURE.md, evaluation results contract)::

    evaluate_checkpoint(cfg, checkpoint, suite, *, force=False, progress=True) -> Path
    checkpoint_hash(checkpoint) -> str
    summarize_run(run_dir, last_k) -> RunSummary          (records.py: the typed records)
    write_experiment_report(experiment_dir, variants) -> Report
    average_weights(checkpoints, out) -> Path

Nothing here imports torch at module import time. The names above load on first use (PEP 562):
the config reads :mod:`anchorctx.evaluation.settings`, and importing that must not import the
evaluation code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from anchorctx import lazy

if TYPE_CHECKING:
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

# public name -> the module that defines it
_EXPORTS = {
    "summarize_run": "anchorctx.evaluation.averaging",
    "write_experiment_report": "anchorctx.evaluation.report",
    **dict.fromkeys(
        (
            "SUITES",
            "EvaluationError",
            "Suite",
            "checkpoint_hash",
            "eval_dir",
            "evaluate_checkpoint",
            "evaluation_code_version",
            "evaluation_fingerprint",
            "identity",
            "load_result",
            "result_path",
        ),
        "anchorctx.evaluation.results",
    ),
    "average_weights": "anchorctx.evaluation.weights",
}

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


__getattr__, __dir__ = lazy.exports(__name__, _EXPORTS)
