"""Sample builders for the five RULER task families (NIAH, VT, CWE, FWE, QA).

A builder turns a haystack *size* (essay words, noise sentences, list words, documents) and a
sample's own random generator into one sample. :mod:`.generate` searches the size that fills
the token budget. Each sample gets its own generator, seeded from (seed, task, length, index):
sample ``i`` is the same whether it is generated alone (resume) or with all the others.

The construction follows NVIDIA/RULER ``scripts/data/synthetic/*.py`` step by step; the comments
name the file each rule comes from.
"""

from __future__ import annotations

import random
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from anchorctx.evaluation.ruler import constants as C
from anchorctx.evaluation.ruler import data as D


@dataclass(frozen=True)
class Sample:
    input: str
    answer_prefix: str
    outputs: list[str]

    @property
    def prompt(self) -> str:
        return self.input + self.answer_prefix


class Builder:
    """Base: ``build(size, index, rng)``; sizes lie in ``[min_size, max_size]``."""

    min_size: int = 1
    max_size: int | None = None
    max_samples: int | None = None  # QA: the number of questions in the file
    # RULER's ``incremental``: the first size tried when estimating tokens per unit, the
    # smallest size the search considers (and its fallback), and the step by which a sample
    # that overflows the budget is shrunk (a whole step at a time).
    probe: int = 10

    @property
    def step(self) -> int:
        return self.probe

    def build(self, size: int, index: int, rng: random.Random) -> Sample:
        raise NotImplementedError


# ---------------------------------------------------------------------------------- NIAH
class NiahBuilder(Builder):
    """scripts/data/synthetic/niah.py: needles of key/value pairs in an essay, noise or needle
    haystack; a query over ``num_needle_q`` of the keys."""

    def __init__(self, task: str, args: dict, length: int, seed: int, paths: dict):
        self.a = dict(args)
        self.a["num_needle_k"] = max(args["num_needle_k"], args["num_needle_q"])  # niah.py
        self.seed = seed
        self.kind = args["type_haystack"]
        self.essay = D.resolve_path(task, "essay", paths) if self.kind == "essay" else None
        nltk_data = paths.get(D.SPLITTER_KEY)
        self.nltk_data = Path(nltk_data) if nltk_data is not None else None
        if self.essay is not None:
            D.punkt_splitter(self.nltk_data)  # a missing sentence model fails here, not mid-run
        nouns, adjs, _ = D.wonderwords_lists()
        self.nouns, self.adjs = nouns, adjs
        # niah.py: incremental 500 words (essay), 25 sentences (noise/needle), 5 below 4K.
        self.probe = 500 if self.kind == "essay" else (25 if length >= 4096 else 5)
        self.min_size = 1 if self.kind == "essay" else max(1, self._num_needles())

    def _num_needles(self) -> int:
        return self.a["num_needle_k"] * self.a["num_needle_v"]

    def _random(self, kind: str, rng: random.Random) -> str:
        if kind == "numbers":  # niah.py: 7-digit numbers
            return str(rng.randint(10**6, 10**7 - 1))
        if kind == "words":
            # niah.py draws from the sorted set of all "adjective-noun" pairs (6.2M strings);
            # an independent uniform adjective and noun is the same distribution without the
            # half-gigabyte list.
            return f"{rng.choice(self.adjs)}-{rng.choice(self.nouns)}"
        if kind == "uuids":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        raise ValueError(f"unknown needle type {kind!r}")

    def _needles(self, rng: random.Random) -> tuple[list[str], list[list[str]], list[str]]:
        a, keys, values, needles = self.a, [], [], []
        for _ in range(a["num_needle_k"]):
            keys.append(self._random(a["type_needle_k"], rng))
            vals = [self._random(a["type_needle_v"], rng) for _ in range(a["num_needle_v"])]
            needles += [
                C.NEEDLE.format(type_needle_v=a["type_needle_v"], key=keys[-1], value=v)
                for v in vals
            ]
            values.append(vals)
        random.Random(self.seed).shuffle(needles)  # niah.py: a fixed-seed shuffle
        return keys, values, needles

    def _essay_context(self, size: int, needles: list[str], rng: random.Random) -> str:
        assert self.essay is not None
        sents = D.essay_sentences(self.essay, size, self.nltk_data)
        depths = sorted(int(len(sents) * (d / 100)) for d in rng.sample(C.DEPTHS, len(needles)))
        cuts = [0, *depths, len(sents)]
        parts: list[str] = []
        for i in range(1, len(cuts)):
            parts.append(" ".join(sents[cuts[i - 1] : cuts[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        return " ".join(parts)

    def _line_context(self, size: int, needles: list[str], rng: random.Random) -> str:
        if self.kind == "noise":
            lines = [C.NOISE_SENTENCE] * size
        else:  # "needle": distractor needles with random keys and values
            a = self.a
            lines = [
                C.NEEDLE.format(
                    type_needle_v=a["type_needle_v"],
                    key=self._random(a["type_needle_k"], rng),
                    value=self._random(a["type_needle_v"], rng),
                )
                for _ in range(size)
            ]
        for at, needle in zip(sorted(rng.sample(range(size), len(needles)), reverse=True), needles):
            lines.insert(at, needle)
        return "\n".join(lines)

    def build(self, size: int, index: int, rng: random.Random) -> Sample:
        keys, values, needles = self._needles(rng)
        if self.kind == "essay":
            context = self._essay_context(size, needles, rng)
        else:
            context = self._line_context(size, needles, rng)
        picked = rng.sample(range(self.a["num_needle_k"]), self.a["num_needle_q"])
        queries = [keys[i] for i in picked]
        answers = [v for i in picked for v in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        template, prefix, type_v = C.NIAH_TEMPLATE, C.NIAH_ANSWER_PREFIX, self.a["type_needle_v"]
        if self.a["num_needle_q"] * self.a["num_needle_v"] == 1:
            template, prefix = _singular(template), _singular(prefix)
            type_v = type_v[:-1]
        fill = dict(type_needle_v=type_v, query=query)
        return Sample(template.format(context=context, **fill), prefix.format(**fill), answers)


def _singular(text: str) -> str:
    """niah.py's rewrite of the template when one value is asked for (order matters)."""
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        text = text.replace(old, new)
    return text


# ---------------------------------------------------------------------------------- VT
# variable_tracking.py main(): the one-shot example is a sample of max_seq_length=500 whose
# haystack search uses incremental 5 (the noise haystack without an example).
VT_ICL_TOKENS = 500
VT_ICL_INCREMENTAL = 5


class VTBuilder(Builder):
    """scripts/data/synthetic/variable_tracking.py: chains ``VAR A = 12345``, ``VAR B = VAR A``
    hidden in the noise haystack, after a one-shot example with 3-letter names."""

    def __init__(self, args: dict, length: int, seed: int, count: Callable[[str], int]):
        self.chains, self.hops = args["num_chains"], args["num_hops"]
        self.seed = seed
        self.min_size = self.hops + 1
        # variable_tracking.py: incremental 10 noise sentences, 5 below 4K.
        self.probe = 10 if length >= 4096 else 5
        self.icl = self._icl_example(count)

    def _chains(self, rng: random.Random, icl: bool) -> tuple[list[list[str]], list[list[str]]]:
        k, hops = (3, min(10, self.hops)) if icl else (5, self.hops)
        names = [
            "".join(rng.choices(string.ascii_uppercase, k=k))
            for _ in range((hops + 1) * self.chains)
        ]
        while len(set(names)) < self.chains * (hops + 1):
            names.append("".join(rng.choices(string.ascii_uppercase, k=k)))
        var_sets, chains = [], []
        for i in range(0, len(names), hops + 1):
            v = names[i : i + hops + 1]
            var_sets.append(v)
            # np.random.randint(10000, 99999) in the original: the high end is exclusive.
            first = "12345" if icl else str(rng.randrange(10000, 99999))
            chains.append(
                [f"VAR {v[0]} = {first}"] + [f"VAR {v[j + 1]} = VAR {v[j]} " for j in range(hops)]
            )
        return var_sets, chains

    def _question(self, size: int, rng: random.Random, icl: bool) -> tuple[str, str, list[str]]:
        var_sets, chains = self._chains(rng, icl)
        lines = [C.NOISE_SENTENCE] * size
        for chain in chains:
            at = sorted(rng.sample(range(len(lines)), len(chain)))
            for j, (pos, line) in enumerate(zip(at, chain)):
                lines.insert(pos + j, line)
        context = "\n".join(lines).replace(". \n", ".\n")
        value = chains[0][0].split("=")[-1].strip()
        hops = min(10, self.hops) if icl else self.hops
        fill = dict(query=value, num_v=hops + 1)
        return (
            C.VT_TEMPLATE.format(context=context, **fill),
            C.VT_ANSWER_PREFIX.format(**fill),
            var_sets[0],
        )

    def _icl_example(self, count: Callable[[str], int]) -> str:
        """The one-shot example, built once and renamed for every sample. variable_tracking.py
        sizes it as a sample of 500 tokens with no new tokens: only its question (template and
        answer prefix) must fit; the answer and a newline are appended afterwards. Its size
        search starts at the example's ``incremental`` (5 noise lines) and falls back to it."""

        def question(size: int) -> tuple[str, str, list[str]]:
            return self._question(size, random.Random(self.seed), icl=True)

        def tokens(size: int) -> int:
            q, prefix, _ = question(size)
            return count(q + prefix)

        floor = max(VT_ICL_INCREMENTAL, self.hops + 1)
        size = largest_fitting(tokens, VT_ICL_TOKENS, floor, 2 * floor) or floor
        q, prefix, answer = question(size)
        return q + prefix + " " + " ".join(answer) + "\n"

    def _randomized_icl(self, rng: random.Random) -> str:
        icl = self.icl
        for name in icl.strip().split()[-self.hops - 1 :]:
            icl = icl.replace(name, "".join(rng.choices(string.ascii_uppercase, k=len(name))))
        return icl.replace("12345", str(rng.randrange(10000, 99999)))

    def build(self, size: int, index: int, rng: random.Random) -> Sample:
        icl = self._randomized_icl(rng)
        question, prefix, answer = self._question(size, rng, icl=False)
        return Sample(icl + "\n" + question, prefix, answer)


# ---------------------------------------------------------------------------------- CWE
class CWEBuilder(Builder):
    """scripts/data/synthetic/common_words_extraction.py: a numbered word list where 10 words
    appear 30 times and the rest 3 times (6 and 1 below 4K), after a one-shot example."""

    def __init__(self, args: dict, length: int, seed: int, paths: dict | None = None):
        nouns, adjs, verbs = D.wonderwords_lists()
        words = sorted(set(nouns + adjs + verbs))
        random.Random(seed).shuffle(words)
        self.words, self.seed, self.num_cw = words, seed, args["num_cw"]
        if length < 4096:
            self.example_shape, self.shape = (20, 3, 1), (6, 1)
        else:
            self.example_shape, self.shape = (40, 10, 3), (args["freq_cw"], args["freq_ucw"])
        self.min_size, self.probe = self.num_cw, 10
        # Past the wonderwords list (about 8.2K words, reached near 128K tokens) the original
        # samples from english_words.json instead; without that file the list is the limit and
        # asking for more is an error (see _pool), never a silently shorter sample.
        raw = (paths or {}).get(D.DATA_KEYS["english_words"])
        self.english_path = Path(raw) if raw is not None else None
        self.english: tuple[str, ...] | None = None
        if self.english_path is not None and self.english_path.is_file():
            self.english = D.english_words(self.english_path)
        self.max_size = len(self.english) if self.english is not None else None

    def _pool(self, n: int) -> list[str] | tuple[str, ...]:
        """common_words_extraction.py: wonderwords up to their count, english_words beyond."""
        if n <= len(self.words):
            return self.words
        if self.english is None:
            raise D.MissingDataError("cwe", "english_words", self.english_path)
        return self.english

    def _example(self, n: int, common: int, uncommon: int, rng) -> tuple[str, list[str]]:
        chosen = rng.sample(self._pool(n), n)
        top, rest = chosen[: self.num_cw], chosen[self.num_cw :]
        listed = top * common + rest * uncommon
        random.Random(self.seed).shuffle(listed)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), top

    def build(self, size: int, index: int, rng: random.Random) -> Sample:
        ex_context, ex_answer = self._example(*self.example_shape, rng)
        context, answer = self._example(size, *self.shape, rng)
        shot = (
            C.CWE_TEMPLATE.format(context=ex_context)
            + C.CWE_ANSWER_PREFIX
            + " "
            + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_answer))
        )
        return Sample(
            shot + "\n" + C.CWE_TEMPLATE.format(context=context), C.CWE_ANSWER_PREFIX, answer
        )


# ---------------------------------------------------------------------------------- FWE
def zeta(alpha: float, terms: int = 1000) -> float:
    """Riemann zeta (alpha > 1) by Euler-Maclaurin: partial sum plus the integral tail."""
    n = float(terms)
    head = float(np.sum(np.arange(1, terms, dtype=np.float64) ** -alpha))
    return head + n ** (1 - alpha) / (alpha - 1) + 0.5 * n**-alpha + alpha * n ** (-alpha - 1) / 12


class FWEBuilder(Builder):
    """scripts/data/synthetic/freq_words_extraction.py: random 6-letter "coded" words with Zipf
    (alpha 2) counts; the most frequent one is '...' noise, the answer is ranks 2-4."""

    def __init__(self, args: dict, length: int, seed: int):
        self.alpha, self.wordlen, self.seed = args["alpha"], args["coded_wordlen"], seed
        # freq_words_extraction.py: max_len = L - tokens_to_generate; vocab_size = max_len // 50;
        # the word count grows from max_len // 6 in steps of max_len // 32. (The floor of 4 keeps
        # three answer words below 250 tokens, where the original has no valid vocabulary.)
        max_len = length - C.MAX_NEW_TOKENS["fwe"]
        self.vocab_size = max(max_len // 50, 4)
        self.start = max(max_len // self.wordlen, 1)
        self.probe = max(max_len // 32, 1)
        self.zeta = zeta(self.alpha)

    def _vocab(self, rng: random.Random) -> list[str]:
        letters, n = string.ascii_lowercase, self.vocab_size
        vocab = ["".join(rng.choices(letters, k=self.wordlen)) for _ in range(n)]
        while len(set(vocab)) < n:
            vocab.append("".join(rng.choices(letters, k=self.wordlen)))
        vocab = sorted(set(vocab))
        random.Random(self.seed).shuffle(vocab)
        vocab[0] = "..."  # the top rank is noise the question tells the model to ignore
        return vocab

    def build(self, size: int, index: int, rng: random.Random) -> Sample:
        vocab = self._vocab(rng)
        ranks = np.arange(1, len(vocab) + 1, dtype=np.float64)
        counts = (size * ranks**-self.alpha / self.zeta).astype(int)
        words = [w for w, c in zip(vocab, counts) for _ in range(c)]
        random.Random(self.seed).shuffle(words)
        return Sample(
            C.FWE_TEMPLATE.format(context=" ".join(words)), C.FWE_ANSWER_PREFIX, vocab[1:4]
        )


# ---------------------------------------------------------------------------------- QA
class QABuilder(Builder):
    """scripts/data/synthetic/qa.py: the question's gold documents plus distractors (same-article
    paragraphs first for SQuAD), shuffled, as "Document i:" blocks. Sample i asks question i."""

    def __init__(self, task: str, args: dict, length: int, seed: int, paths: dict):
        kind = args["dataset"]  # qa.py: incremental 10 documents
        path: Path = D.resolve_path(task, kind, paths)
        self.qa = D.read_squad(path) if kind == "squad" else D.read_hotpotqa(path)
        self.seed = seed
        # No upper size: beyond the pool qa.py repeats the documents (see _documents).
        self.min_size, self.probe = 1, 10
        self.max_samples = len(self.qa.items)

    def _documents(self, size: int, item: D.QAItem, rng: random.Random) -> list[str]:
        docs = self.qa.docs
        if size >= len(docs):
            # qa.py: the whole pool, repeated as many times as needed and cut to ``size``.
            repeats = -(-size // len(docs))
            chosen = (list(range(len(docs))) * repeats)[:size]
        elif size - len(item.context) > len(item.more_context):
            taken = set(item.context) | set(item.more_context)
            extra = [i for i in range(len(docs)) if i not in taken]
            k = size - len(item.context) - len(item.more_context)
            chosen = [*item.context, *item.more_context, *rng.sample(extra, k)]
        else:
            k = max(0, size - len(item.context))
            chosen = [*item.context, *rng.sample(list(item.more_context), k)]
        texts = [docs[i] for i in chosen]
        random.Random(self.seed).shuffle(texts)  # qa.py: a fixed-seed shuffle
        return texts

    def build(self, size: int, index: int, rng: random.Random) -> Sample:
        item = self.qa.items[index]
        docs = self._documents(size, item, rng)
        context = "\n\n".join(C.QA_DOCUMENT.format(i=i + 1, document=d) for i, d in enumerate(docs))
        return Sample(
            C.QA_TEMPLATE.format(context=context, query=item.query),
            C.QA_ANSWER_PREFIX,
            list(item.outputs),
        )


# ---------------------------------------------------------------------------------- search
def largest_fitting(
    tokens: Callable[[int], int], budget: int, lo: int, guess: int, hi: int | None = None
) -> int | None:
    """Largest size n in [lo, hi] with ``tokens(n) <= budget``; None when even ``lo`` is over.

    ``tokens`` grows about linearly with the size, so the search interpolates (regula falsi)
    and falls back to bisection whenever an interpolation step fails to halve the bracket:
    typically 4-8 calls, each one tokenisation of a candidate prompt (0.1-1 s at 128K).
    """
    t_lo = tokens(lo)
    if t_lo > budget:
        return None
    good, t_good, bad, t_bad = lo, t_lo, None, None
    n, width = max(guess, lo + 1), None
    while True:
        if hi is not None:
            if good >= hi:
                return good
            n = min(n, hi)
        t = tokens(n)
        if t <= budget:
            good, t_good = n, t
        else:
            bad, t_bad = n, t
        if bad is not None and bad - good <= 1:
            return good
        n, width = _next_size(good, t_good, bad, t_bad, lo, t_lo, budget, width)


def _next_size(good, t_good, bad, t_bad, lo, t_lo, budget, width) -> tuple[int, int | None]:
    if bad is None:  # not bracketed yet: extrapolate past the budget by 2 %
        slope = (t_good - t_lo) / (good - lo) if good > lo and t_good > t_lo else None
        step = int((budget - t_good) / slope * 1.02) + 1 if slope else good
        return good + max(step, 1), None
    new_width = bad - good
    if width is not None and new_width > width // 2:  # interpolation stalled: bisect
        return (good + bad) // 2, new_width
    est = good + (budget - t_good) * (bad - good) / max(t_bad - t_good, 1)
    return min(max(int(est), good + 1), bad - 1), new_width
