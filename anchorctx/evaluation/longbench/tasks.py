"""LongBench v1 task definitions: prompts, generation lengths, metrics, categories, scoring.

Benchmark-defining values are LongBench's own:
- prompt templates: THUDM/LongBench ``config/dataset2prompt.json`` (verbatim; ``{context}`` and
  ``{input}`` are filled with ``str.format`` like ``pred.py`` does);
- max new tokens: ``config/dataset2maxlen.json`` (v1 release values);
- metric per dataset and the first-line cut: ``eval.py`` (``dataset2metric``, ``scorer``);
- middle truncation of over-long prompts: ``pred.py`` (keep the first and the last half).
Base models get the raw template (no chat wrapper), as the paper evaluates base models.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from anchorctx.evaluation.longbench import metrics as M

# The THUDM/LongBench commit the prompts, lengths, metrics and truncation follow (recorded in
# every results file).
LONGBENCH_REPOSITORY = "THUDM/LongBench"
LONGBENCH_REVISION = "2e00731f8d0bff23dc4325161044d0ed8af94c1e"

# From THUDM/LongBench config/dataset2prompt.json (exact strings, typos included: narrativeqa's
# "asconcisely" is what every published narrativeqa number was measured with).
DATASET2PROMPT: dict[str, str] = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the question asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "qasper": 'You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:',
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "multifieldqa_zh": "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答：",
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "musique": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",
    "passage_retrieval_en": 'Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n\nThe answer is: ',
    "passage_retrieval_zh": '以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：',
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

# From THUDM/LongBench config/dataset2maxlen.json (v1 release).
DATASET2MAXLEN: dict[str, int] = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "multifieldqa_zh": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "dureader": 128,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "vcsum": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "lsht": 64,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32,
    "lcc": 64,
    "repobench-p": 64,
}

Metric = Callable[..., float]
# From THUDM/LongBench LongBench/eval.py (dataset2metric).
DATASET2METRIC: dict[str, Metric] = {
    "narrativeqa": M.qa_f1_score,
    "qasper": M.qa_f1_score,
    "multifieldqa_en": M.qa_f1_score,
    "multifieldqa_zh": M.qa_f1_zh_score,
    "hotpotqa": M.qa_f1_score,
    "2wikimqa": M.qa_f1_score,
    "musique": M.qa_f1_score,
    "dureader": M.rouge_zh_score,
    "gov_report": M.rouge_score,
    "qmsum": M.rouge_score,
    "multi_news": M.rouge_score,
    "vcsum": M.rouge_zh_score,
    "trec": M.classification_score,
    "triviaqa": M.qa_f1_score,
    "samsum": M.rouge_score,
    "lsht": M.classification_score,
    "passage_retrieval_en": M.retrieval_score,
    "passage_count": M.count_score,
    "passage_retrieval_zh": M.retrieval_zh_score,
    "lcc": M.code_sim_score,
    "repobench-p": M.code_sim_score,
}

# eval.py cuts these predictions to their first line (few-shot tasks continue the pattern).
FIRST_LINE_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht"})

# The six English categories of the LongBench paper (and the AnchorAttention paper's tables).
CATEGORIES: dict[str, tuple[str, ...]] = {
    "Single-Doc QA": ("narrativeqa", "qasper", "multifieldqa_en"),
    "Multi-Doc QA": ("hotpotqa", "2wikimqa", "musique"),
    "Summarization": ("gov_report", "qmsum", "multi_news"),
    "Few-shot": ("trec", "triviaqa", "samsum"),
    "Synthetic": ("passage_count", "passage_retrieval_en"),
    "Code": ("lcc", "repobench-p"),
}
ENGLISH_DATASETS: tuple[str, ...] = tuple(d for names in CATEGORIES.values() for d in names)
CHINESE_DATASETS = ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")
# pred.py's default list (all 21, in its order; dataset2prompt.json lists them the same way).
ALL_DATASETS: tuple[str, ...] = tuple(DATASET2PROMPT)
# The Chinese datasets whose metrics segment words with jieba (qa_f1_zh, rouge_zh).
JIEBA_DATASETS = frozenset({"multifieldqa_zh", "dureader", "vcsum"})


def check_datasets(names: Sequence[str]) -> list[str]:
    unknown = [n for n in names if n not in DATASET2PROMPT]
    if unknown:
        raise ValueError(
            f"unknown LongBench dataset(s) {unknown} in evaluation.longbench.datasets; "
            f"valid: {', '.join(ALL_DATASETS)}"
        )
    return list(names)


def build_prompt(dataset: str, row: dict[str, Any]) -> str:
    """The dataset's template filled from the record (``pred.py``: ``format(**json_obj)``)."""
    return DATASET2PROMPT[dataset].format(**row)


def truncate_middle(ids: Sequence[int], max_length: int) -> list[int]:
    """``ids`` when it has at most ``max_length`` tokens, else its first and last
    ``int(max_length/2)`` tokens (``pred.py``; an odd ``max_length`` keeps one token fewer).

    Instructions sit at both ends of every template, so the middle of the context is what goes.
    """
    if max_length < 2:
        raise ValueError(f"LongBench max_length must be at least 2, got {max_length}")
    if len(ids) <= max_length:
        return list(ids)
    half = int(max_length / 2)
    return [*ids[:half], *ids[len(ids) - half :]]


def default_max_length(max_position_embeddings: int) -> int:
    """LongBench's ``config/model2maxlen.json`` convention: a model of ``k``K positions gets
    ``1000k - 500`` prompt tokens (4K: 3500, 8K: 7500, 16K: 15500, 32K: 31500, as listed there
    for every model); the same rule continues to 64K (63500) and 128K (127500)."""
    k = max_position_embeddings // 1024
    if k < 1:
        raise ValueError(f"max_position_embeddings={max_position_embeddings} is below 1K")
    return 1000 * k - 500


# ``pred.py`` stops samsum at a newline and forbids EOS or a newline as the first token.
SAMSUM_RULE_DATASETS = frozenset({"samsum"})


def postprocess(dataset: str, prediction: str) -> str:
    """``eval.py``: the first line (after leading newlines) for the few-shot datasets."""
    if dataset in FIRST_LINE_DATASETS:
        return prediction.lstrip("\n").split("\n")[0]
    return prediction


def score_sample(
    dataset: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None
) -> float:
    """Max over the reference answers of the dataset's metric, in [0, 1]."""
    prediction = postprocess(dataset, prediction)
    metric = DATASET2METRIC[dataset]
    score = 0.0
    for answer in answers:
        score = max(score, metric(prediction, answer, all_classes=all_classes))
    return score


def dataset_score(sample_scores: Sequence[float]) -> float:
    """``eval.py``: ``round(100 * mean, 2)``."""
    if not sample_scores:
        raise ValueError("no samples to score")
    return round(100 * sum(sample_scores) / len(sample_scores), 2)


def category_scores(scores: dict[str, float]) -> dict[str, float]:
    """Unweighted mean of each category's dataset scores, for categories fully present.

    A category with a dataset not run is left out rather than averaged over fewer datasets:
    such a number would not be comparable with published ones.
    """
    out = {}
    for name, members in CATEGORIES.items():
        if all(m in scores for m in members):
            out[name] = round(sum(scores[m] for m in members) / len(members), 2)
    return out
