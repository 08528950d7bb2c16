"""RULER scoring: ``string_match_all`` and ``string_match_part`` on cleaned predictions.

scripts/eval/evaluate.py cleans a prediction by stripping it, turning every control character
(``\\x00``-``\\x1f``) into a newline and stripping again; scripts/eval/synthetic/constants.py then
scores a sample as the share of references found in it (``all``: NIAH, VT, CWE, FWE) or as
whether any reference is found (``part``: QA, where references are answer aliases), each
case-insensitive substring matching, times 100.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from anchorctx.evaluation.ruler.constants import PAPER_EXCLUDE, task_spec

_CONTROL = re.compile(r"[\x00-\x1f]")


def clean_prediction(text: str) -> str:
    """scripts/eval/evaluate.py: postprocess_pred."""
    return _CONTROL.sub("\n", text.strip()).strip()


def match_all(prediction: str, references: Sequence[str]) -> float:
    """Share of references contained in the prediction, in [0, 1]."""
    if not references:
        raise ValueError("a RULER sample needs at least one reference")
    pred = prediction.lower()
    return sum(r.lower() in pred for r in references) / len(references)


def match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 when any reference (answer alias) is contained in the prediction, else 0.0."""
    if not references:
        raise ValueError("a RULER sample needs at least one reference")
    pred = prediction.lower()
    return float(any(r.lower() in pred for r in references))


def sample_score(task: str, prediction: str, references: Sequence[str]) -> float:
    """One sample's score on the 0-100 scale (the task score is the mean of these)."""
    match = match_part if task_spec(task).metric == "string_match_part" else match_all
    return 100.0 * match(clean_prediction(prediction), references)


def score(task: str, predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Task score, 0-100: the mean over samples of :func:`sample_score`."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} reference lists")
    if not predictions:
        raise ValueError(f"no predictions to score for {task}")
    return sum(sample_score(task, p, r) for p, r in zip(predictions, references)) / len(predictions)


def mean_over_tasks(
    scores: Mapping[str, Mapping[str, float]], exclude: Iterable[str] = ()
) -> dict[str, float]:
    """Per-length RULER score: the unweighted mean over tasks (``{task: {length: score}}``).

    ``exclude`` leaves tasks out (:data:`PAPER_EXCLUDE` for the paper's Llama-2 numbers). A
    length is reported only when every remaining task has a score at it, so that averages over
    different task sets never sit in one column.
    """
    kept = {t: s for t, s in scores.items() if t not in set(exclude)}
    if not kept:
        return {}
    lengths = sorted(set.intersection(*(set(s) for s in kept.values())), key=int)
    return {n: sum(s[n] for s in kept.values()) / len(kept) for n in lengths}


__all__ = [
    "PAPER_EXCLUDE",
    "clean_prediction",
    "match_all",
    "match_part",
    "mean_over_tasks",
    "sample_score",
    "score",
]
