"""Prefect tasks: thin wrappers over the library, with content-addressed caching.

Only this package and :mod:`anchorctx.flows` import Prefect; the library never does.
"""

from anchorctx.tasks.data import (
    ensure_demo_corpus_task,
    ensure_eval_fixtures_task,
    prepare_data_task,
)
from anchorctx.tasks.evaluation import evaluate_task, report_task, summarize_task
from anchorctx.tasks.training import train_task

__all__ = [
    "ensure_demo_corpus_task",
    "ensure_eval_fixtures_task",
    "evaluate_task",
    "prepare_data_task",
    "report_task",
    "summarize_task",
    "train_task",
]
