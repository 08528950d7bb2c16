"""RULER (Hsieh et al., 2024), offline and faithful to NVIDIA/RULER.

13 tasks at any length: retrieval (8 needle-in-a-haystack variants), multi-hop tracing (vt),
aggregation (cwe, fwe) and question answering (qa_1 SQuAD, qa_2 HotpotQA). Base-model prompts
(task template plus answer prefix, no chat wrapper), greedy decoding, RULER's metrics.

    from anchorctx.evaluation.ruler import TASKS, generate, score
    samples = generate("niah_single_1", 4096, tokenizer, num_samples=10)
    score("niah_single_1", predictions, [s["outputs"] for s in samples])
"""

from anchorctx.evaluation.ruler.constants import PAPER_EXCLUDE, TASK_SPECS, TASKS, task_spec
from anchorctx.evaluation.ruler.data import MissingDataError
from anchorctx.evaluation.ruler.generate import generate
from anchorctx.evaluation.ruler.runner import RulerLengthError, record_key, run_suite
from anchorctx.evaluation.ruler.scoring import (
    clean_prediction,
    mean_over_tasks,
    sample_score,
    score,
)

__all__ = [
    "PAPER_EXCLUDE",
    "TASKS",
    "TASK_SPECS",
    "MissingDataError",
    "RulerLengthError",
    "clean_prediction",
    "generate",
    "mean_over_tasks",
    "record_key",
    "run_suite",
    "sample_score",
    "score",
    "task_spec",
]
