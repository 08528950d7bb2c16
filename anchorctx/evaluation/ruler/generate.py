"""RULER sample generation at a target length, for any Hugging Face tokenizer.

The length budget is RULER's: the prompt (task input plus answer prefix) plus the task's
maximum new tokens fits in the target length, counting tokens without BOS. The haystack size
is found once per (task, length) with a doubling-then-bisecting search on a probe sample;
every sample is then checked and, in the rare case it is longer (its needles or documents
tokenise longer), shrunk with the same search on its own content.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from anchorctx.evaluation.ruler import constants as C
from anchorctx.evaluation.ruler import tasks as T
from anchorctx.evaluation.ruler.data import DATA_KEYS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_SEARCH_INDEX = 0  # RULER sizes the haystack on sample 0 (qa.py: generate_input_output(0, ...))


def token_counter(tokenizer: PreTrainedTokenizerBase) -> Callable[[str], int]:
    """Token count of a text without special tokens (RULER's ``len(text_to_tokens(text))``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # fast path: the Rust tokenizer, no Python-side id lists
        return lambda text: len(backend.encode(text, add_special_tokens=False).ids)
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def make_builder(task: str, length: int, seed: int, paths: dict, count) -> T.Builder:
    spec = C.task_spec(task)
    if spec.family == "niah":
        return T.NiahBuilder(task, spec.args, length, seed, paths)
    if spec.family == "vt":
        return T.VTBuilder(spec.args, length, seed, count)
    if spec.family == "cwe":
        return T.CWEBuilder(spec.args, length, seed)
    if spec.family == "fwe":
        return T.FWEBuilder(spec.args, length, seed)
    return T.QABuilder(task, spec.args, length, seed, paths)


def sample_rng(seed: int, task: str, length: int, index: int) -> random.Random:
    # str seeds hash with SHA-512 in CPython: stable across processes and platforms.
    return random.Random(f"ruler/{seed}/{task}/{length}/{index}")


class _Fitter:
    """Builds samples of one (task, length) and keeps each inside the token budget."""

    def __init__(self, task: str, length: int, tokenizer, seed: int, paths: dict):
        self.task, self.length, self.seed = task, length, seed
        self.spec = C.task_spec(task)
        self.count = token_counter(tokenizer)
        self.budget = length - self.spec.max_new_tokens
        if self.budget <= 0:
            raise ValueError(f"length {length} leaves no room for {task}'s "
                             f"{self.spec.max_new_tokens} new tokens")  # fmt: skip
        self.builder = make_builder(task, length, seed, paths, self.count)
        self.size = self._search(_SEARCH_INDEX)

    def _sample(self, size: int, index: int) -> T.Sample:
        return self.builder.build(size, index, sample_rng(self.seed, self.task, self.length, index))

    def _tokens(self, size: int, index: int) -> int:
        return self.count(self._sample(size, index).prompt)

    def _search(self, index: int, cap: int | None = None) -> int:
        b = self.builder
        caps = [x for x in (cap, b.max_size) if x is not None]
        hi = min(caps) if caps else None
        guess = self._guess(index) if cap is None else cap - 1
        size = T.largest_fitting(lambda n: self._tokens(n, index), self.budget, b.min_size,
                                 guess, hi)  # fmt: skip
        if size is None:
            raise ValueError(
                f"RULER {self.task}: even the smallest haystack ({b.min_size} units, with the "
                f"task's fixed template and one-shot example) needs more than {self.budget} "
                f"prompt tokens with this tokenizer; evaluate {self.task} at a longer length"
            )
        return size

    def _guess(self, index: int) -> int:
        """Haystack units that should fill the budget: tokens per unit from two probes (the
        difference cancels the fixed template and one-shot example)."""
        b = self.builder
        p = max(b.probe, b.min_size)
        if b.max_size is not None:
            p = min(p, max(b.max_size // 2, b.min_size))
        t1 = self.count(self._sample(p, index).prompt)
        t2 = self.count(self._sample(2 * p, index).prompt)
        per_unit = max((t2 - t1) / p, 1e-3)
        return max(int((self.budget - t1) / per_unit) + p, b.min_size + 1)

    def sample(self, index: int) -> dict[str, Any]:
        s = self._sample(self.size, index)
        n_tokens = self.count(s.prompt)
        if n_tokens > self.budget:  # this sample's content tokenises longer: shrink it alone
            s = self._sample(self._search(index, cap=self.size), index)
            n_tokens = self.count(s.prompt)
        return {"index": index, "task": self.task, "input": s.input,
                "answer_prefix": s.answer_prefix, "outputs": list(s.outputs),
                "length": n_tokens + self.spec.max_new_tokens,
                "max_new_tokens": self.spec.max_new_tokens}  # fmt: skip


def _check_paths(paths: dict) -> None:
    unknown = set(paths) - set(DATA_KEYS.values())
    if unknown:
        raise TypeError(f"unknown RULER data argument(s) {sorted(unknown)}; "
                        f"expected {sorted(DATA_KEYS.values())}")  # fmt: skip


def num_available(task: str, num_samples: int, **data_paths) -> int:
    """Samples a task can provide: QA tasks have one per answerable question in the file."""
    if C.task_spec(task).family != "qa":
        return num_samples
    b = T.QABuilder(task, C.task_spec(task).args, 0, 0, data_paths)
    return min(num_samples, b.max_samples or num_samples)


def generate(
    task: str,
    length: int,
    tokenizer: PreTrainedTokenizerBase,
    num_samples: int,
    seed: int = 42,
    *,
    indices: Iterable[int] | None = None,
    progress: bool = False,
    **data_paths,
) -> list[dict[str, Any]]:
    """RULER samples of ``task`` at ``length`` tokens.

    Each sample: ``input`` (the task text), ``answer_prefix`` (appended to ``input`` to form the
    base-model prompt), ``outputs`` (reference strings), ``length`` (prompt tokens plus
    ``max_new_tokens``, never above ``length``), ``max_new_tokens``, ``index``, ``task``.
    ``indices`` generates a subset (each sample is independent of the others); QA tasks give at
    most one sample per question in their file. Data files come as ``essay_path``,
    ``squad_path``, ``hotpotqa_path``; a needed one that is absent raises ``MissingDataError``.
    """
    _check_paths(data_paths)
    fitter = _Fitter(task, length, tokenizer, seed, data_paths)
    available = min(num_samples, fitter.builder.max_samples or num_samples)
    wanted = list(range(available)) if indices is None else [i for i in indices if i < available]
    bar = tqdm(wanted, desc=f"ruler {task} @ {length}", unit="sample", disable=not progress)
    return [fitter.sample(i) for i in bar]
