"""RULER sample generation at a target length, for any Hugging Face tokenizer.

The length budget is RULER's: the prompt (task input plus answer prefix) plus the task's
maximum new tokens fits in the target length, counting tokens without BOS.

Default (``fit="ruler"``), as NVIDIA/RULER does it: the haystack size is the largest that fits
on one probe sample, searched from the task's ``incremental`` upwards (RULER bisects; here an
interpolating search finds the same largest fitting size with fewer tokenisations); when not
even ``incremental`` fits, the size is ``incremental`` anyway. A sample that overflows is drawn
again with fresh randomness, each time one *whole step* of haystack smaller (500 essay words,
25 noise lines, 10 documents, ...) while the size is above ``incremental``, and at that size
otherwise (RULER retries forever; here ``MAX_REDRAWS`` draws, then an error). A size that is not
a multiple of the step can so end below ``incremental``, as in RULER. So samples at 4K
are 2.3K-4.1K tokens long. FWE has its own rule (freq_words_extraction.py): its word count grows
from ``max_len // 6`` in steps of ``max_len // 32`` while the prompt stays below ``max_len``,
then steps back once; overflowing samples drop whole steps.

``fit="tight"`` (an option, off by default) instead shrinks an overflowing sample to the largest
size that fits: samples come out within a few tokens of the target (3.96K-4.10K at 4K), at the
price of lengths that differ from the reference's.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal, cast

from tqdm.auto import tqdm

from anchorctx.evaluation.ruler import constants as C
from anchorctx.evaluation.ruler import tasks as T
from anchorctx.evaluation.ruler.data import DATA_KEYS, SPLITTER_KEY

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_SEARCH_INDEX = 0  # RULER sizes the haystack on sample 0 (qa.py: generate_input_output(0, ...))
# Draws of one sample at the smallest size (``incremental``) before giving up: RULER's loop
# retries there without end; a sample that overflows this often at that size cannot fit.
MAX_REDRAWS = 100
Fit = Literal["ruler", "tight"]
FITS: tuple[str, ...] = ("ruler", "tight")


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
        return T.CWEBuilder(spec.args, length, seed, paths)
    if spec.family == "fwe":
        return T.FWEBuilder(spec.args, length, seed)
    return T.QABuilder(task, spec.args, length, seed, paths)


def sample_rng(seed: int, task: str, length: int, index: int, attempt: int = 0) -> random.Random:
    """The generator of draw ``attempt`` of one sample: each redraw of an overflowing sample
    is fresh randomness, as RULER's retry loop draws from its running global stream."""
    # str seeds hash with SHA-512 in CPython: stable across processes and platforms.
    key = f"ruler/{seed}/{task}/{length}/{index}"
    return random.Random(key if attempt == 0 else f"{key}/{attempt}")


class _Fitter:
    """Builds samples of one (task, length) and keeps each inside the token budget."""

    def __init__(
        self, task: str, length: int, tokenizer, seed: int, paths: dict, fit: Fit = "ruler"
    ):
        if fit not in FITS:
            raise ValueError(f"unknown RULER fit {fit!r}; expected one of {FITS}")
        self.task, self.length, self.seed, self.fit = task, length, seed, fit
        self.spec = C.task_spec(task)
        self.count = token_counter(tokenizer)
        self.budget = length - self.spec.max_new_tokens
        if self.budget <= 0:
            raise ValueError(
                f"length {length} leaves no room for {task}'s {self.spec.max_new_tokens} new tokens"
            )
        self.builder = make_builder(task, length, seed, paths, self.count)
        if self.spec.family == "fwe" and fit == "ruler":
            self.size = self._fwe_size(_SEARCH_INDEX)
        else:
            self.size = self._search(_SEARCH_INDEX)

    def _sample(self, size: int, index: int, attempt: int = 0) -> T.Sample:
        rng = sample_rng(self.seed, self.task, self.length, index, attempt)
        return self.builder.build(size, index, rng)

    def _tokens(self, size: int, index: int) -> int:
        return self.count(self._sample(size, index).prompt)

    def _search(self, index: int, cap: int | None = None) -> int:
        """Largest fitting size. RULER's search (``cap`` None) runs from the task's
        ``incremental`` (``builder.step``) and falls back to it when nothing fits; the tight
        shrink (``cap`` set) searches down to ``min_size`` and fails when nothing fits."""
        b = self.builder
        caps = [x for x in (cap, b.max_size) if x is not None]
        hi = min(caps) if caps else None
        lo = b.min_size if cap is not None else max(b.step, b.min_size)
        if hi is not None:
            lo = min(lo, hi)
        guess = self._guess(index) if cap is None else cap - 1
        size = T.largest_fitting(lambda n: self._tokens(n, index), self.budget, lo, guess, hi)
        if size is not None:
            return size
        if cap is None:
            return lo
        raise ValueError(
            f"RULER {self.task}: even the smallest haystack ({b.min_size} units, with the "
            f"task's fixed template and one-shot example) needs more than {self.budget} "
            f"prompt tokens with this tokenizer; evaluate {self.task} at a longer length"
        )

    def _fwe_size(self, index: int) -> int:
        """freq_words_extraction.py: from ``max_len // 6`` words, add a step while the prompt is
        under the budget (strictly), then take one step back."""
        b = cast(T.FWEBuilder, self.builder)  # this task's builder
        size = b.start
        while self._tokens(size, index) < self.budget:
            size += b.step
        return size - b.step

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
        if n_tokens > self.budget and self.fit == "tight":  # shrink to the largest that fits
            s = self._sample(self._search(index, cap=self.size), index)
            n_tokens = self.count(s.prompt)
        size, attempt, stuck, step = self.size, 0, 0, self.builder.step
        while n_tokens > self.budget:  # RULER: draw again, a whole step smaller while possible
            attempt += 1
            # prepare's rule: ``if used > incremental: used -= incremental`` (a size below the
            # builder's minimum, where RULER's draw itself fails, is not taken).
            if size > step and size - step >= self.builder.min_size:
                size -= step
            else:
                stuck += 1
                if stuck > MAX_REDRAWS:
                    raise ValueError(
                        f"RULER {self.task} sample {index} does not fit {self.budget} prompt "
                        f"tokens even at its smallest haystack ({size} units) after "
                        f"{MAX_REDRAWS} draws; evaluate {self.task} at a longer length"
                    )
            s = self._sample(size, index, attempt)
            n_tokens = self.count(s.prompt)
        return {
            "index": index,
            "task": self.task,
            "input": s.input,
            "answer_prefix": s.answer_prefix,
            "outputs": list(s.outputs),
            "length": n_tokens + self.spec.max_new_tokens,
            "max_new_tokens": self.spec.max_new_tokens,
        }


def _check_paths(paths: dict) -> None:
    known = {*DATA_KEYS.values(), SPLITTER_KEY}
    unknown = set(paths) - known
    if unknown:
        raise TypeError(
            f"unknown RULER data argument(s) {sorted(unknown)}; expected {sorted(known)}"
        )


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
    fit: Fit = "ruler",
    **data_paths,
) -> list[dict[str, Any]]:
    """RULER samples of ``task`` at ``length`` tokens.

    Each sample: ``input`` (the task text), ``answer_prefix`` (appended to ``input`` to form the
    base-model prompt), ``outputs`` (reference strings), ``length`` (prompt tokens plus
    ``max_new_tokens``, never above ``length``), ``max_new_tokens``, ``index``, ``task``.
    ``indices`` generates a subset (each sample is independent of the others); QA tasks give at
    most one sample per question in their file. Data files come as ``essay_path``,
    ``squad_path``, ``hotpotqa_path``, ``english_words_path`` (CWE beyond wonderwords); a needed
    one that is absent raises ``MissingDataError``. ``nltk_data`` names a directory holding
    NLTK's ``punkt_tab`` model. ``fit``: "ruler" (default, RULER's whole-step rule) or "tight".
    """
    _check_paths(data_paths)
    fitter = _Fitter(task, length, tokenizer, seed, data_paths, fit)
    available = min(num_samples, fitter.builder.max_samples or num_samples)
    wanted = list(range(available)) if indices is None else [i for i in indices if i < available]
    bar = tqdm(wanted, desc=f"ruler {task} @ {length}", unit="sample", disable=not progress)
    return [fitter.sample(i) for i in bar]
