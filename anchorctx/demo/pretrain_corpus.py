"""A generated pretraining corpus of retrieval-bearing documents (``pretrain.corpus``).

A small model pretrained only on the demo corpus' Zipf prose never learns to copy a fact from
far back in its context, so every long-context score of its continual-training arms is at
chance and the comparison says nothing. These documents teach the skills RULER measures, in
formats that resemble RULER's prompts but share none of its words or templates (so the model
is not trained on the test): the keys are pronounceable pseudo-words built from syllables (RULER
draws its keys from wonderwords' English nouns and adjectives and its variable names from
upper-case letters), the sentences are this module's own.

Document kinds (``KINDS``), one kind per document, each ending with its question and answer so
the language-modelling loss rewards the retrieval:

- ``kv``: a registry of key-value facts, then a query for one key (niah multikey-like);
- ``needle``: one to four facts hidden at random depths of a haystack (filler prose or a
  repeated filler sentence), with digit, hex-code or word values and one or several values per
  key (niah single / multivalue / multiquery-like);
- ``chain``: variable assignments chained through aliases among distractor chains; the question
  asks for every name holding a value (variable-tracking-like);
- ``count``: a list of coded words with skewed frequencies; the answer names the three most
  frequent (frequent-word-extraction-like);
- ``qa``: short passages about invented entities; a question answered by one passage
  (single-document QA-like).

Layout of ``out``::

    data/pretrain_<i>.jsonl   {"text": ..., "meta": {"redpajama_set_name": "Retrieval"}}
    pretrain.json             parameters and counts per kind; written last (marks completion)

The data directory is what ``ExperimentConfig.pretraining`` adds to ``data.sources``.

``task_format_documents`` (``pretrain.corpus.task_format_documents``, 0 by default) adds documents
in RULER's own task formats: the project's RULER generator (``evaluation/ruler``) writes them with
this corpus' seed (never the evaluation's), at lengths up to the pretraining length, over a
haystack of generated prose instead of the evaluation's essays, each ending with its reference
answer: this module's pseudo-word prose, or for a share of the essay-haystack tasks' documents
(``pretrain.corpus.english_haystack_share``, 0 by default) English-word prose (this module's
sentence templates over RULER's own word lists, wonderwords' nouns, adjectives and verbs; never
the evaluation's essays or their templates). Without them a small model learns to retrieve in
the formats above but does not transfer to RULER's prompts (measured: 0.0 on every RULER task at 2K after 700 steps
on an H200, docs/runs/2026-11-23-runs-1-6-pretraining-recipe.md). With them the 2K score measures a
model that knows the formats, and what the arms' continual training changes is whether retrieval
reaches 4K-16K. They are written to ``data/task_format_<i>.jsonl`` (domain ``Retrieval`` too).
"""

from __future__ import annotations

import functools
import json
import random
import re
from collections import Counter
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from anchorctx.io import (
    DirectoryOwner,
    atomic_write_json,
    check_replaceable,
    hash_tree,
    owned_directory,
)
from anchorctx.process import spawn_pool

if TYPE_CHECKING:
    from anchorctx.experiment import ExperimentConfig

PRETRAIN_CORPUS_VERSION = 4
DOMAIN = "Retrieval"  # the domain name of every document (pretraining mixes it with the demo's)
KINDS: tuple[str, ...] = ("kv", "needle", "chain", "count", "qa")
FILES = 4  # documents spread over this many files, like the demo corpus

# RULER's tasks whose formats the task-format documents teach: every niah variant, variable
# tracking and frequent words (the QA tasks need a passage set; the corpus' own `qa` kind stands
# in). Lengths: prompt plus answer budget, up to the pretraining length. Each document carries
# one answer, so the short ones carry the most answers per token (a quarter-length document four
# times a full one's): the skill is learnt from answers; the full length keeps the longest
# haystacks the base model is evaluated on.
TASK_FORMAT_TASKS: tuple[str, ...] = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "fwe",
)
TASK_FORMAT_LENGTHS: tuple[float, ...] = (0.25, 0.5, 1.0)  # of the pretraining length
# The RULER generator's seed for these documents: the corpus seed plus this offset, far from
# any evaluation seed (evaluation.ruler.seed is 42 by default), so no evaluation sample recurs.
TASK_FORMAT_SEED_OFFSET = 1_000_003
_HAYSTACK_WORDS = 60_000  # prose per haystack of the essay-haystack tasks (repeats if short)
# RULER's tasks whose haystack is an essay: ``english_haystack_share`` of their task-format
# documents go over English-word prose instead of pseudo-word prose. Why the option: with
# pseudo-word haystacks the base model found needles in RULER's noise haystack (niah_single_1,
# 94.6-96.4% at 2K on an H200) more often than in its English essay one (niah_single_2,
# 76.8-78.6%; runs 4 and 5 in docs/runs/2026-11-23-runs-1-6-pretraining-recipe.md). Why off by
# default: with a share of 0.5 the same 1200 steps did not form the key-to-value lookup at all (run
# 6: niah_single_1 16.1%).
ESSAY_TASKS: tuple[str, ...] = (
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multivalue",
    "niah_multiquery",
)
# The haystacks and the offsets of their generator seeds: the English documents use their own
# seed so that their needles are not the pseudo-word documents' again.
HAYSTACKS: dict[str, int] = {"pseudo": 0, "english": 7_919}

# Syllables of the pseudo-words. Three or more syllables make a word that is (almost surely)
# no English word; tests check the generated keys against RULER's word lists.
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "tr", "kl")
_VOWELS = ("a", "e", "i", "o", "u")
_FUNCTION = ("the", "of", "and", "to", "in", "a", "is", "that", "for", "as", "with", "on", "by")

# The retrieval documents' own sentence templates (RULER's are in evaluation/ruler/constants.py
# and are not reused).
_FACT = (
    "Note that the {attr} of {key} is {value}.",
    "Keep in mind: {key} has the {attr} {value}.",
    "For the record, the {attr} recorded for {key} is {value}.",
)
_ATTRS = ("locker code", "badge number", "vault tag", "ledger entry", "pass phrase", "serial")
_KV_HEAD = "Below is a table: each line gives an item and its {attr}."
_KV_QUERY = "Question: what is the {attr} of {key}? Answer: {value}"
_NEEDLE_QUERY = "Question: which {attr} was given for {key}? Answer: {value}"
_NEEDLE_QUERY_MANY = "Question: list every {attr} given for {key}. Answer: {values}"
_CHAIN_FIRST = "let {name} := {value};"
_CHAIN_NEXT = "let {name} := {prev};"
_CHAIN_QUERY = "Question: which names end up holding {value}? Answer: {names}"
_COUNT_HEAD = "Here is a long list of coded tokens."
_COUNT_QUERY = "Question: which three tokens occur most often in the list? Answer: {words}"
_QA_SENTENCE = (
    "{entity} was built in {place} by {person}.",
    "{entity} first opened in the year {year}.",
    "The keeper of {entity} is {person}.",
)
_QA_QUERY = (
    ("Question: who built {entity}? Answer: {person}", "person"),
    ("Question: in which year did {entity} open? Answer: {year}", "year"),
    ("Question: where was {entity} built? Answer: {place}", "place"),
)

# Half the documents are framed the way RULER frames its prompts (an instruction first, then the
# text, then the question, and an answer prefix before the answer), in words of this module.
_INSTRUCT = {
    "kv": "Memorise the table that follows; a question about one of its items comes after it.",
    "needle": "A few facts are buried in the text that follows. Memorise them; a question about "
    "them comes at the end.",
    "chain": "Track the name assignments in the text that follows; a question about them comes "
    "at the end.",
    "count": "Read the coded tokens that follow and keep count of how often each one occurs.",
    "qa": "Read the passages that follow and answer the question at the end from them.",
}
_ECHO = {
    "kv": "as listed in the table above, the answer is",
    "needle": "as stated in the text above, the answer is",
    "chain": "following the assignments above, the names are",
    "count": "counting the list above, the three most frequent are",
    "qa": "according to the passages above, the answer is",
}


# Sentence templates of the English-word haystack ({A} adjective, {N} noun, {V} verb): this
# module's own, unlike the evaluation essays' single "The adj noun verb the adj noun near place."
_ENGLISH_SENTENCES = (
    "A {A} {N} can {V} the {N} of a {A} {N}.",
    "Many a {N} will {V} when the {N} is {A}.",
    "It is {A} to {V} a {N} with the {N}.",
    "Every {A} {N} will {V} its {A} {N} in time.",
    "We {V} the {N} because it was {A} and {A}.",
    "Nobody would {V} a {N} without a {A} {N}.",
)


def english_prose(rng: random.Random, words: int) -> str:
    """About ``words`` words of English prose in paragraphs: the templates above filled with
    wonderwords' nouns, adjectives and verbs (the lists RULER draws its needle keys from)."""
    from anchorctx.evaluation.ruler.data import wonderwords_lists

    nouns, adjectives, verbs = wonderwords_lists()
    pick = {"A": adjectives, "N": nouns, "V": verbs}
    paragraphs, paragraph, count = [], [], 0
    while count < words:
        template = rng.choice(_ENGLISH_SENTENCES)
        sentence = re.sub(r"\{([ANV])\}", lambda m: rng.choice(pick[m.group(1)]), template)
        paragraph.append(sentence[0].upper() + sentence[1:])
        count += len(sentence.split())
        if len(paragraph) >= rng.randint(4, 9):
            paragraphs.append(" ".join(paragraph))
            paragraph = []
    paragraphs.append(" ".join(paragraph))
    return "\n\n".join(p for p in paragraphs if p)


def english_words() -> frozenset[str]:
    """The words RULER draws keys and values from (wonderwords' nouns, adjectives, verbs)."""
    from anchorctx.evaluation.ruler.data import wonderwords_lists

    return frozenset(w.lower() for words in wonderwords_lists() for w in words)


class _Gen:
    """One seeded stream of pseudo-words, values and filler text."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.english = english_words()
        self.vocab = sorted({self.word(2) for _ in range(4000)})

    def word(self, syllables: int) -> str:
        """A pseudo-word; never an English word of RULER's lists (a few CV syllables are)."""
        r = self.rng
        while True:
            w = "".join(r.choice(_ONSETS) + r.choice(_VOWELS) for _ in range(syllables))
            if w not in self.english:
                return w

    def key(self) -> str:
        return f"{self.word(3)}-{self.word(3)}"

    def value(self, kind: str) -> str:
        r = self.rng
        if kind == "digits":
            n = r.randint(4, 8)
            return str(r.randrange(10 ** (n - 1), 10**n))
        if kind == "hex":
            return "-".join(f"{r.getrandbits(16):04x}" for _ in range(3))
        return self.word(3)

    def filler(self, words: int) -> str:
        r = self.rng
        out, sentence = [], []
        for _ in range(words):
            sentence.append(r.choice(_FUNCTION) if r.random() < 0.35 else r.choice(self.vocab))
            if len(sentence) >= r.randint(6, 16):
                out.append(" ".join(sentence).capitalize() + ".")
                sentence = []
        return " ".join(out)


def _kv(g: _Gen) -> str:
    r = g.rng
    attr = r.choice(_ATTRS)
    kind = r.choice(("digits", "hex", "word"))
    facts = [(g.key(), g.value(kind)) for _ in range(r.randint(8, 60))]
    lines = [_KV_HEAD.format(attr=attr)] + [f"{k}: {v}" for k, v in facts]
    key, value = r.choice(facts)
    return "\n".join(lines) + "\n" + _KV_QUERY.format(attr=attr, key=key, value=value)


def _needle(g: _Gen) -> str:
    r = g.rng
    attr = r.choice(_ATTRS)
    kind = r.choice(("digits", "hex", "word"))
    keys = [g.key() for _ in range(r.randint(1, 4))]
    per_key = r.choice((1, 1, 1, 2, 3))  # several values per key: the multivalue format
    needles = [(k, g.value(kind)) for k in keys for _ in range(per_key)]
    if r.random() < 0.3:  # a repeated filler sentence as the haystack (noise-haystack format)
        unit = g.filler(12)
        sentences = [unit] * r.randint(10, 60)
    else:
        sentences = [s.rstrip(".") + "." for s in g.filler(r.randint(100, 600)).split(". ")]
    for k, v in needles:
        sentences.insert(
            r.randrange(len(sentences) + 1), r.choice(_FACT).format(attr=attr, key=k, value=v)
        )
    key = r.choice(keys)
    values = [v for k, v in needles if k == key]
    if len(values) == 1:
        query = _NEEDLE_QUERY.format(attr=attr, key=key, value=values[0])
    else:
        query = _NEEDLE_QUERY_MANY.format(attr=attr, key=key, values=", ".join(values))
    return " ".join(sentences) + "\n" + query


def _chain(g: _Gen) -> str:
    r = g.rng
    chains = []
    for _ in range(r.randint(1, 4)):
        names = [g.word(2) + "_" + g.word(1) for _ in range(r.randint(2, 6))]
        value = str(r.randrange(10_000, 100_000))
        steps = [_CHAIN_FIRST.format(name=names[0], value=value)]
        steps += [_CHAIN_NEXT.format(name=n, prev=p) for p, n in pairwise(names)]
        chains.append((names, value, steps))
    # Interleave the chains' steps in order, with filler between them.
    pending = [list(c[2]) for c in chains]
    parts = []
    while any(pending):
        parts.append(r.choice([p for p in pending if p]).pop(0))
        if r.random() < 0.6:
            parts.append(g.filler(r.randint(10, 60)))
    names, value, _ = r.choice(chains)
    return " ".join(parts) + "\n" + _CHAIN_QUERY.format(value=value, names=" ".join(names))


def _count(g: _Gen) -> str:
    r = g.rng
    words = [g.word(3) for _ in range(r.randint(10, 40))]
    # Zipf-like weights with distinct top counts, so the three most frequent are unambiguous.
    weights = [1.0 / (i + 1) ** 1.2 for i in range(len(words))]
    drawn = r.choices(words, weights=weights, k=r.randint(100, 450))
    ranked = Counter(drawn).most_common()
    # Make the top three counts strictly decreasing and above the fourth: the answer is exact.
    top = [w for w, _ in ranked[:3]]
    floor = ranked[3][1] if len(ranked) > 3 else 0
    extra = []
    for w, c in reversed(ranked[:3]):
        need = max(0, floor + 1 - c)
        extra += [w] * need
        floor = c + need
    drawn += extra
    r.shuffle(drawn)
    return _COUNT_HEAD + " " + " ".join(drawn) + "\n" + _COUNT_QUERY.format(words=" ".join(top))


def _qa(g: _Gen) -> str:
    r = g.rng
    passages, facts = [], []
    for i in range(r.randint(2, 8)):
        fact = {
            "entity": g.word(3).capitalize() + " " + r.choice(("Hall", "Tower", "Mill", "Yard")),
            "place": g.word(2).capitalize(),
            "person": g.word(2).capitalize() + " " + g.word(3).capitalize(),
            "year": str(r.randrange(1200, 2000)),
        }
        body = " ".join(s.format(**fact) for s in _QA_SENTENCE)
        passages.append(f"Passage {i + 1}: {body} {g.filler(r.randint(10, 60))}")
        facts.append(fact)
    template, _ = r.choice(_QA_QUERY)
    return "\n".join(passages) + "\n" + template.format(**r.choice(facts))


_MAKERS = {"kv": _kv, "needle": _needle, "chain": _chain, "count": _count, "qa": _qa}


def _framed(g: _Gen, kind: str, text: str) -> str:
    """Every other document on average: the instruction first and the answer prefix."""
    if g.rng.random() < 0.5:
        return text
    body, question = text.rsplit("\n", 1)
    question = question.replace("Answer: ", f"Answer: {_ECHO[kind]}: ", 1)
    return f"{_INSTRUCT[kind]}\n\n{body}\n{question}"


def generate_documents(seed: int, documents: int) -> list[tuple[str, str]]:
    """``documents`` (kind, text) pairs, the kinds in turn, deterministic in ``seed``. Every
    document ends with a line ``Question: ... Answer: [prefix: ]answer``."""
    g = _Gen(seed)
    kinds = [KINDS[i % len(KINDS)] for i in range(documents)]
    return [(kind, _framed(g, kind, _MAKERS[kind](g))) for kind in kinds]


def _params(seed: int, documents: int, task_format: dict | None) -> dict:
    params: dict[str, Any] = {
        "version": PRETRAIN_CORPUS_VERSION,
        "seed": seed,
        "documents": documents,
    }
    if task_format:
        params["task_format"] = task_format
    return params


def _task_format_plan(count: int, seq_len: int) -> list[tuple[str, list[tuple[int, int]]]]:
    """Per task of ``TASK_FORMAT_TASKS``: its (length, documents) cells, lengths ascending;
    ``count`` spread evenly over the cells in task-major order."""
    lengths = sorted({max(256, int(f * seq_len)) for f in TASK_FORMAT_LENGTHS})
    cells = [(t, n) for t in TASK_FORMAT_TASKS for n in lengths]
    per_cell = [count // len(cells) + (i < count % len(cells)) for i in range(len(cells))]
    return [
        (t, [(n, k) for (task, n), k in zip(cells, per_cell) if task == t])
        for t in TASK_FORMAT_TASKS
    ]


@functools.lru_cache(maxsize=2)
def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _task_documents(
    task: str, cells: list[tuple[int, int]], seed: int, tokenizer: str, paths: dict
) -> list[tuple[str, int, str]]:
    """(task, length, text) documents of one task over its cells. A length too short for the
    task's template and answer budget (the generator's ValueError; e.g. the uuid multikey task
    at 512 tokens of a small vocabulary) passes its documents on to the task's next length."""
    # Imported here: the RULER generator imports transformers, which the rest of this module
    # and its tests without task formats skip.
    from anchorctx.evaluation.ruler.generate import generate

    tok = _load_tokenizer(tokenizer)
    docs: list[tuple[str, int, str]] = []
    carried = 0
    for i, (length, n) in enumerate(cells):
        n += carried
        if not n:
            continue
        try:
            samples = generate(task, length, tok, n, seed, fit="tight", **paths)
        except ValueError:
            if i == len(cells) - 1:
                raise
            carried = n
            continue
        carried = 0
        sep = " " if task in ("vt", "fwe") else ", "
        # The answer follows the prefix as the model would continue it: one space between
        # them (vt's prefix already ends with one).
        docs += [
            (
                task,
                length,
                s["input"] + s["answer_prefix"].rstrip(" ") + " " + sep.join(s["outputs"]),
            )
            for s in samples
        ]
    return docs


def _task_format_jobs(
    count: int, seq_len: int, english_share: float = 0.0
) -> list[tuple[str, str, list[tuple[int, int]]]]:
    """(task, haystack name, cells) per generation job: ``_task_format_plan``'s cells, those of
    ``ESSAY_TASKS`` split between the English haystack (``english_share`` of each cell, rounded
    down) and the pseudo-word one (the rest); the other tasks' haystack is RULER's own (noise or
    needles), generated by the pseudo-word job."""
    jobs = []
    for task, cells in _task_format_plan(count, seq_len):
        english = [(n, int(k * english_share) if task in ESSAY_TASKS else 0) for n, k in cells]
        pseudo = [(n, k - e) for (n, k), (_, e) in zip(cells, english)]
        jobs += [(task, "pseudo", pseudo), (task, "english", english)]
    return [job for job in jobs if any(k for _, k in job[2])]


def haystack_paths(work: Path, name: str) -> dict[str, Path]:
    """The RULER data paths of haystack ``name`` under ``work`` (``task_format_documents``
    writes them)."""
    essay = "essays.json" if name == "pseudo" else f"essays_{name}.json"
    return {"essay_path": work / essay, "nltk_data": work / "nltk_data"}


def haystack_seed(seed: int, name: str) -> int:
    """The RULER generator's seed for corpus seed ``seed`` over haystack ``name``."""
    return seed + TASK_FORMAT_SEED_OFFSET + HAYSTACKS[name]


def task_format_documents(
    count: int,
    *,
    seed: int,
    tokenizer: str | Path,
    seq_len: int,
    work: Path,
    workers: int = 1,
    english_share: float = 0.0,
) -> list[tuple[str, int, str]]:
    """``count`` (task, length, text) documents in RULER's task formats: ``TASK_FORMAT_TASKS``
    in turn over ``TASK_FORMAT_LENGTHS`` × ``seq_len`` tokens of ``tokenizer`` (``length``: the
    one each document was fitted to), each the prompt, answer prefix, then the reference answer.
    ``work`` receives the haystack files the generator reads (``haystack_paths``: the essay of
    each haystack used and an empty Punkt model). ``english_share``: the share of the essay
    tasks' documents over English-word prose (module doc). ``workers`` > 1 generates the jobs in
    that many processes; the documents are the same for any ``workers``."""
    from anchorctx.demo.fixtures import write_empty_punkt

    work.mkdir(parents=True, exist_ok=True)
    write_empty_punkt(work / "nltk_data")
    g = _Gen(seed + TASK_FORMAT_SEED_OFFSET)
    essays = {"pseudo": g.filler(_HAYSTACK_WORDS)}
    if english_share > 0:
        rng = random.Random(haystack_seed(seed, "english"))
        essays["english"] = english_prose(rng, _HAYSTACK_WORDS)
    for name, text in essays.items():
        haystack_paths(work, name)["essay_path"].write_text(json.dumps({"text": text}))
    jobs = [
        (task, cells, haystack_seed(seed, name), str(tokenizer), haystack_paths(work, name))
        for task, name, cells in _task_format_jobs(count, seq_len, english_share)
    ]
    workers = min(workers, len(jobs))
    if workers > 1:
        with spawn_pool(workers) as pool:
            parts = list(pool.map(_task_documents, *zip(*jobs)))
    else:
        parts = [_task_documents(*job) for job in jobs]
    docs = [doc for part in parts for doc in part]
    random.Random(seed).shuffle(docs)
    return docs


PRETRAIN_OWNER = DirectoryOwner("pretrain-corpus", "a pretraining corpus")


def write_pretrain_corpus(
    out: str | Path,
    *,
    seed: int = 0,
    documents: int = 1000,
    task_format_documents: int = 0,
    tokenizer: str | Path | None = None,
    seq_len: int = 2048,
    workers: int = 1,
    english_haystack_share: float = 0.0,
) -> Path:
    """Write (or reuse, when complete with the same parameters) the corpus at ``out``; returns
    its data directory. ``task_format_documents`` > 0 adds that many documents in RULER's task
    formats (see the module doc), fitted to ``seq_len`` tokens of ``tokenizer``, generated in
    ``workers`` processes (the corpus does not depend on it)."""
    root = Path(out)
    task_format = None
    if task_format_documents:
        if tokenizer is None:
            raise ValueError(
                "pretrain.corpus.task_format_documents needs a tokenizer "
                "(model.tokenizer) to fit RULER's formats to the pretraining length"
            )
        task_format = {
            "documents": task_format_documents,
            "seq_len": seq_len,
            "tokenizer": hash_tree(tokenizer)[:16],
        }
        if english_haystack_share:  # absent at 0: the corpus of earlier versions, unchanged
            task_format["english_share"] = english_haystack_share
    params = _params(seed, documents, task_format)
    marker = root / "pretrain.json"
    if marker.is_file() and json.loads(marker.read_text()).get("params") == params:
        return root / "data"
    check_replaceable(root, PRETRAIN_OWNER)  # before minutes of generating
    # With task-format documents and workers, the five kinds (one seeded stream, ~20 s of CPU
    # for 30000 documents) are written in a process of their own meanwhile.
    side = spawn_pool(1) if task_format is not None and workers > 1 else None
    try:
        plain = side.submit(generate_documents, seed, documents) if side is not None else None
        with owned_directory(root, PRETRAIN_OWNER) as tmp:
            (tmp / "data").mkdir(parents=True)
            formatted = []
            if task_format is not None:
                formatted = _task_format(
                    task_format_documents,
                    seed=seed,
                    tokenizer=cast("str | Path", tokenizer),  # checked above with task_format
                    seq_len=seq_len,
                    work=tmp / "task_format",
                    workers=workers,
                    english_share=english_haystack_share,
                )
                _write_jsonl(tmp / "data", "task_format", [text for _, _, text in formatted])
            docs = plain.result() if plain is not None else generate_documents(seed, documents)
            _write_jsonl(tmp / "data", "pretrain", [text for _, text in docs])
            docs = docs + [(task, text) for task, _, text in formatted]
            counts = Counter(kind for kind, _ in docs)
            words = sum(len(text.split()) for _, text in docs)
            atomic_write_json(
                tmp / "pretrain.json", {"params": params, "kinds": dict(counts), "words": words}
            )
    finally:
        if side is not None:
            side.shutdown(cancel_futures=True)
    return root / "data"


def _write_jsonl(data: Path, stem: str, texts: list[str]) -> None:
    """``texts`` spread over ``FILES`` files ``<stem>_<i>.jsonl``, domain ``DOMAIN``."""
    for f in range(FILES):
        with (data / f"{stem}_{f}.jsonl").open("w") as fh:
            for text in texts[f::FILES]:
                fh.write(json.dumps({"text": text, "meta": {"redpajama_set_name": DOMAIN}}))
                fh.write("\n")


def ensure_pretrain_corpus(cfg: ExperimentConfig) -> Path | None:
    """Write the corpus named by ``cfg.pretrain.corpus`` when it is missing (None: no
    ``pretrain`` section)."""
    if cfg.pretrain is None:
        return None
    corpus = cfg.pretrain.corpus
    seq_len = int(cfg.pretrain.overrides.get("data.seq_len", cfg.data.seq_len))
    return write_pretrain_corpus(
        corpus.dir,
        seed=corpus.seed,
        documents=corpus.documents,
        task_format_documents=corpus.task_format_documents,
        tokenizer=cfg.model.tokenizer,
        seq_len=seq_len,
        workers=cfg.data.num_workers,
        english_haystack_share=corpus.english_haystack_share,
    )


_task_format = task_format_documents  # write_pretrain_corpus' parameter shadows the name
