"""LongBench v1 metrics, with LongBench's call shapes ``(prediction, ground_truth, **kwargs)``.

Re-implemented from THUDM/LongBench ``LongBench/metrics.py`` so that scores are comparable with
published LongBench numbers, including its quirks (documented where they matter). Every metric
returns a float in [0, 1]; the per-sample max over answers and the 100x dataset mean are in
:mod:`anchorctx.evaluation.longbench.tasks`.

The Chinese variants need ``jieba`` (imported only when they are called).
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from collections.abc import Sequence
from typing import Any

from rouge import Rouge

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NUMBER = re.compile(r"\d+")
_PUNCTUATION = frozenset(string.punctuation)
# The Chinese punctuation set of LongBench's normalize_zh_answer.
_ZH_PUNCTUATION = _PUNCTUATION | frozenset(
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)


# ----------------------------------------------------------------------------- normalisers
def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation, articles and extra whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", s).split())


def normalize_zh_answer(s: str) -> str:
    """Lower case, drop ASCII and Chinese punctuation and all whitespace."""
    return "".join("".join(ch for ch in s.lower() if ch not in _ZH_PUNCTUATION).split())


# ------------------------------------------------------------------------------------- F1
def f1_score(prediction: Sequence[str], ground_truth: Sequence[str], **kwargs: Any) -> float:
    """Token-multiset F1 of two token lists."""
    common = Counter(prediction) & Counter(ground_truth)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction)
    recall = num_same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def _jieba_tokens(text: str) -> list[str]:
    try:
        # Imported here: jieba is optional (only the Chinese datasets need it).
        import jieba
    except ImportError as err:
        raise ImportError(
            "the Chinese LongBench metrics need the 'jieba' package (pip install jieba); "
            "or evaluate the English datasets only (evaluation.longbench.datasets)"
        ) from err
    return list(jieba.cut(text, cut_all=False))


def qa_f1_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    pred = [t for t in map(normalize_zh_answer, _jieba_tokens(prediction)) if t]
    gold = [t for t in map(normalize_zh_answer, _jieba_tokens(ground_truth)) if t]
    return f1_score(pred, gold)


# ---------------------------------------------------------------------------------- ROUGE
def rouge_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """ROUGE-L F of the ``rouge`` package (not ``rouge-score``: the numbers differ).

    Like LongBench, any failure of the scorer (an empty prediction, which ``rouge`` rejects,
    or a recursion limit on very long inputs) scores 0.
    """
    try:
        scores = Rouge().get_scores([prediction], [ground_truth], avg=True)
    except Exception:  # LongBench: bare ``except: return 0.0``
        return 0.0
    return float(scores["rouge-l"]["f"])


def rouge_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    return rouge_score(" ".join(_jieba_tokens(prediction)), " ".join(_jieba_tokens(ground_truth)))


# ------------------------------------------------------------------------ classification
def classification_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """1/len(matches) when the gold class is among the class names found in the prediction.

    As LongBench's ``metrics.py`` at the pinned revision, whose function has no fallback: a
    prediction naming no class scores 0. One quirk is kept on purpose (it changes scores):
    class names that are substrings of the gold class are dropped while iterating over the same
    list, so the element after a dropped one is not examined.
    """
    all_classes: Sequence[str] = kwargs["all_classes"]
    matches = [name for name in all_classes if name in prediction]
    for name in matches:
        if name in ground_truth and name != ground_truth:
            matches.remove(name)
    return 1.0 / len(matches) if ground_truth in matches else 0.0


# ----------------------------------------------------------------- retrieval and counting
def _share_equal(prediction: str, target: str) -> float:
    """Share of the numbers in the prediction that equal ``target`` (0 if it has none)."""
    numbers = _NUMBER.findall(prediction)
    if not numbers:
        return 0.0
    return sum(n == target for n in numbers) / len(numbers)


def count_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    return _share_equal(prediction, str(ground_truth))


def retrieval_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Ground truth looks like "Paragraph 7"; the prediction's numbers are compared with 7."""
    found = re.findall(r"Paragraph (\d+)", ground_truth)
    if not found:
        raise ValueError(f"retrieval ground truth must contain 'Paragraph N', got {ground_truth!r}")
    return _share_equal(prediction, found[0])


def retrieval_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    found = re.findall(r"段落(\d+)", ground_truth)
    if not found:
        raise ValueError(f"retrieval ground truth must contain '段落N', got {ground_truth!r}")
    return _share_equal(prediction, found[0])


# ------------------------------------------------------------------------------------ code
def _fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy's ``fuzz.ratio`` on its pure-Python path (difflib), as LongBench ran it.

    Equal strings score 100 (checked before emptiness), an empty side scores 0, otherwise
    ``round(100 * SequenceMatcher(None, a, b).ratio())``.
    """
    if a == b:
        return 100
    if not a or not b:
        return 0
    return round(100 * difflib.SequenceMatcher(None, a, b).ratio())


def code_sim_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Similarity of the first prediction line that has no ```, # or // (comments, fences)."""
    first = ""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            first = line
            break
    return _fuzz_ratio(first, ground_truth) / 100


__all__ = [
    "classification_score",
    "code_sim_score",
    "count_score",
    "f1_score",
    "normalize_answer",
    "normalize_zh_answer",
    "qa_f1_score",
    "qa_f1_zh_score",
    "retrieval_score",
    "retrieval_zh_score",
    "rouge_score",
    "rouge_zh_score",
]
