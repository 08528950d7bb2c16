"""The benchmark-defining constants of RULER (NVIDIA/RULER), one place for all of them.

Every string here must match the original character for character: a changed space in a
template changes the tokens the model sees and makes scores incomparable with published ones.
Each constant names the file of NVIDIA/RULER it comes from; all of them follow one revision,
:data:`RULER_REVISION`, which every results file records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

# The NVIDIA/RULER commit these constants and the sample construction follow. Its templates
# are the 2025 ones (newline-joined VT haystack, randomised one-shot example, the "assigned"
# spelling fixed on 2025-05-13, CWE's english_words.json fallback).
RULER_REPOSITORY = "NVIDIA/RULER"
RULER_REVISION = "c3f5e3b4f87f97e048793bb510a3a6b19a46bf3a"

# ------------------------------------------------------------------------------ templates
# scripts/data/synthetic/constants.py, TASKS["niah"]
NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to "
    "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all "
    "the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
# scripts/data/synthetic/constants.py, TASKS["niah"]["answer_prefix"]
NIAH_ANSWER_PREFIX = (
    " The special magic {type_needle_v} for {query} mentioned in the provided text are"
)

# scripts/data/synthetic/constants.py, TASKS["variable_tracking"]. Revisions before 2025-05-13
# spelled "assgined" in the answer prefix, with an older haystack and one-shot format; this is
# the current revision's prefix, consistent with the haystack and one-shot format used here.
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
    "variables are assigned the value {query}, they are: "
)

# scripts/data/synthetic/constants.py, TASKS["common_words_extraction"]
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common "
    "words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"

# scripts/data/synthetic/constants.py, TASKS["freq_words_extraction"]
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three "
    "most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. "
    "Please ignore the dots '....'. What are the three most frequently appeared words in the "
    "above coded text?"
)
FWE_ANSWER_PREFIX = (
    " Answer: According to the coded text above, the three most frequently appeared words are:"
)

# scripts/data/synthetic/constants.py, TASKS["qa"]
QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not "
    "output any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the "
    "question based on the given documents. Only give me the answer and do not output any other "
    "words.\n\nQuestion: {query}"
)
QA_ANSWER_PREFIX = " Answer:"

# ------------------------------------------------------------------------------ haystacks
# scripts/data/synthetic/niah.py and variable_tracking.py: the "noise" (formerly "repeat") haystack.
NOISE_SENTENCE = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
# scripts/data/synthetic/niah.py: the needle sentence (also the "needle" haystack's filler).
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
# scripts/data/synthetic/qa.py: DOCUMENT_PROMPT.
QA_DOCUMENT = "Document {i}:\n{document}"

# scripts/data/synthetic/niah.py: needle depths (percent of the haystack's sentences).
DEPTHS: list[int] = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True))]

# scripts/data/synthetic/constants.py: tokens_to_generate per task family.
MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}

# The Llama-2 evaluation of the AnchorAttention paper leaves these two out of the average.
PAPER_EXCLUDE: tuple[str, ...] = ("niah_multikey_3", "cwe")


# ------------------------------------------------------------------------------ the 13 tasks
Family = Literal["niah", "vt", "cwe", "fwe", "qa"]
Metric = Literal["string_match_all", "string_match_part"]


@dataclass(frozen=True)
class TaskSpec:
    name: str
    family: Family
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def max_new_tokens(self) -> int:
        return MAX_NEW_TOKENS[self.family]

    @property
    def metric(self) -> Metric:
        # scripts/eval/synthetic/constants.py: qa scores any-alias, every other task all-refs.
        return "string_match_part" if self.family == "qa" else "string_match_all"


def _niah(name: str, haystack: str, k: str, v: str, nk: int = 1, nv: int = 1, nq: int = 1):
    args = dict(
        type_haystack=haystack,
        type_needle_k=k,
        type_needle_v=v,
        num_needle_k=nk,
        num_needle_v=nv,
        num_needle_q=nq,
    )
    return TaskSpec(name, "niah", args)


# scripts/synthetic.yaml, in the benchmark's order.
TASK_SPECS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        _niah("niah_single_1", "noise", "words", "numbers"),
        _niah("niah_single_2", "essay", "words", "numbers"),
        _niah("niah_single_3", "essay", "words", "uuids"),
        _niah("niah_multikey_1", "essay", "words", "numbers", nk=4),
        _niah("niah_multikey_2", "needle", "words", "numbers"),
        _niah("niah_multikey_3", "needle", "uuids", "uuids"),
        _niah("niah_multivalue", "essay", "words", "numbers", nv=4),
        _niah("niah_multiquery", "essay", "words", "numbers", nq=4),
        TaskSpec("vt", "vt", {"num_chains": 1, "num_hops": 4}),
        TaskSpec("cwe", "cwe", {"freq_cw": 30, "freq_ucw": 3, "num_cw": 10}),
        TaskSpec("fwe", "fwe", {"alpha": 2.0, "coded_wordlen": 6}),
        TaskSpec("qa_1", "qa", {"dataset": "squad"}),
        TaskSpec("qa_2", "qa", {"dataset": "hotpotqa"}),
    )
}
TASKS: tuple[str, ...] = tuple(TASK_SPECS)


def task_spec(task: str) -> TaskSpec:
    try:
        return TASK_SPECS[task]
    except KeyError:
        raise ValueError(
            f"unknown RULER task {task!r}; the tasks are: {', '.join(TASKS)}"
        ) from None
