"""LongBench v1 (THUDM): prompts, middle truncation, metrics, categories, suite runner.

``run_suite(model, tokenizer, cfg, *, done, on_sample, progress=True)`` evaluates the datasets
of ``cfg.evaluation.longbench`` from local ``{dataset}.jsonl`` files; the metrics live in
:mod:`anchorctx.evaluation.longbench.metrics` with LongBench's call shapes.
"""

from anchorctx.evaluation.longbench.runner import LongBenchDataError, run_suite
from anchorctx.evaluation.longbench.tasks import (
    ALL_DATASETS,
    CATEGORIES,
    DATASET2MAXLEN,
    DATASET2METRIC,
    DATASET2PROMPT,
    ENGLISH_DATASETS,
    FIRST_LINE_DATASETS,
)

__all__ = [
    "ALL_DATASETS",
    "CATEGORIES",
    "DATASET2MAXLEN",
    "DATASET2METRIC",
    "DATASET2PROMPT",
    "ENGLISH_DATASETS",
    "FIRST_LINE_DATASETS",
    "LongBenchDataError",
    "run_suite",
]
