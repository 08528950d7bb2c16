"""RULER's inputs: local data files (essays, SQuAD, HotpotQA), word lists, sentence splitting.

Nothing is downloaded. A task whose file is not configured or not present raises
:class:`MissingDataError` naming the config key to set; the caller records the task as not run.
A file that is present but empty, not JSON or not in its published layout raises
:class:`DataFormatError`, one line ``evaluation.ruler.<key> = <path>: <place and field>``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from wonderwords import random_word

# Which data file each task family needs, and the config key that names it.
DATA_KEYS = {
    "essay": "essay_path",
    "squad": "squad_path",
    "hotpotqa": "hotpotqa_path",
    "english_words": "english_words_path",
}
DATA_DESCRIPTIONS = {
    "essay": "the Paul Graham essays JSON ({'text': ...}) of RULER's download_paulgraham_essay.py",
    "squad": "the SQuAD v2.0 dev set JSON (dev-v2.0.json)",
    "hotpotqa": "the HotpotQA dev distractor JSON (hotpot_dev_distractor_v1.json)",
    "english_words": (
        "more distinct words than wonderwords has, i.e. RULER's "
        "scripts/data/synthetic/json/english_words.json (a git-LFS file of that repository)"
    ),
}
# Not a data file: the directory holding NLTK's punkt_tab model (see punkt_splitter).
SPLITTER_KEY = "nltk_data"


class MissingDataError(FileNotFoundError):
    """A RULER task needs a local data file that is not configured or not present."""

    def __init__(self, task: str, kind: str, path: str | Path | None):
        key = f"evaluation.ruler.{DATA_KEYS[kind]}"
        where = "is not set" if path is None else f"points to a missing file: {path}"
        super().__init__(
            f"RULER task {task!r} needs {DATA_DESCRIPTIONS[kind]}; {key} {where}. "
            f"Set it (e.g. --set {key}=/data/...) or leave {task!r} out of evaluation.ruler.tasks."
        )
        self.task, self.kind, self.key = task, kind, key


def resolve_path(task: str, kind: str, paths: dict[str, str | Path | None]) -> Path:
    raw = paths.get(DATA_KEYS[kind])
    if raw is None or not Path(raw).is_file():
        raise MissingDataError(task, kind, raw)
    return Path(raw)


# ----------------------------------------------------------------------------- essays
@lru_cache(maxsize=4)
def essay_words(path: Path) -> tuple[str, ...]:
    """The essay haystack as niah.py holds it: ``re.sub(r'\\s+', ' ', text).split(' ')``.

    RULER's ``PaulGrahamEssays.json`` starts and ends with whitespace (html2text output ends in
    blank lines), so the first and last entries are empty strings; they count as haystack words,
    as they do in niah.py's ``haystack[:num_haystack]``.
    """
    src = _Source(path, "essay")
    if path.suffix == ".json":  # RULER's PaulGrahamEssays.json layout: {"text": "..."}
        text = src.field(src.load_json(), "text", "the top-level object", str)
    else:
        text = src.read_text()
    words = tuple(re.sub(r"\s+", " ", text).split(" "))
    if len(_core(words)) < 50:
        raise src.error(
            f"field 'text' has only {len(_core(words))} words: not a haystack"
            if path.suffix == ".json"
            else f"only {len(_core(words))} words: not a haystack"
        )
    return words


def _core(words: tuple[str, ...]) -> tuple[str, ...]:
    """The non-empty words: only the ends can be empty (whitespace runs are already collapsed)."""
    lead = 1 if words and words[0] == "" else 0
    trail = 1 if len(words) > lead and words[-1] == "" else 0
    return words[lead : len(words) - trail]


PUNKT_RESOURCE = "tokenizers/punkt_tab/english/"


class MissingSplitterError(LookupError):
    """NLTK's pretrained English Punkt model (``punkt_tab``), RULER's sentence splitter, is absent."""


@lru_cache(maxsize=4)
def punkt_splitter(nltk_data: Path | None = None) -> Callable[[str], list[str]]:
    """``nltk.sent_tokenize`` with the pretrained English Punkt model, as niah.py splits essays.

    The model (NLTK resource ``punkt_tab``, not on PyPI) is looked up in ``nltk_data`` (a
    directory in NLTK's data layout, ``evaluation.ruler.nltk_data``) or else on NLTK's own search
    path. An untrained Punkt splits differently at abbreviations ("Mr.", "e.g."), which moves
    needles, so a missing model is an error, never a silent fallback.
    """
    # Imported here: nltk takes over a second to import; only essay haystacks need it.
    import nltk
    from nltk.tokenize.punkt import PunktSentenceTokenizer, load_punkt_params

    if nltk_data is not None and str(nltk_data) not in nltk.data.path:
        # NLTK reads model files only below a directory of nltk.data.path (its path sandbox);
        # appending there is NLTK's documented way to add a data directory.
        nltk.data.path.append(str(nltk_data))
    try:
        found = nltk.data.find(PUNKT_RESOURCE, paths=[str(nltk_data)] if nltk_data else None)
    except LookupError:
        where = f"under {nltk_data}" if nltk_data else "on NLTK's data path"
        raise MissingSplitterError(
            f"RULER's essay tasks need NLTK's pretrained English Punkt model ({PUNKT_RESOURCE}), "
            f"not found {where}: run `python -m nltk.downloader -d DIR punkt_tab` and set "
            f"evaluation.ruler.nltk_data=DIR (or install it on NLTK's default path)"
        ) from None
    return PunktSentenceTokenizer(load_punkt_params(found)).tokenize


@lru_cache(maxsize=4)
def _essay_split(path: Path, nltk_data: Path | None) -> tuple[tuple[str, ...], np.ndarray]:
    """Sentences of the whole essay text and the cumulative word count at each sentence end."""
    core = _core(essay_words(path))
    # niah.py splits ``" ".join(words).strip()``: the empty end words leave only the spaces that
    # strip() removes, so this is the text of the non-empty words.
    sents = tuple(punkt_splitter(nltk_data)(" ".join(core)))
    ends = np.cumsum([len(s.split(" ")) for s in sents])
    if int(ends[-1]) != len(core):  # the splitter dropped or merged whitespace: no shortcut
        raise ValueError(f"{path}: sentence split does not preserve the essay's words")
    return sents, ends


@lru_cache(maxsize=64)
def essay_sentences(path: Path, num_words: int, nltk_data: Path | None = None) -> tuple[str, ...]:
    """Sentences of the first ``num_words`` haystack words (the haystack repeats when shorter).

    niah.py sentence-splits ``" ".join((haystack * repeats)[:num_words]).strip()``. Splitting
    the whole essay once and cutting at ``num_words`` gives the same sentences (the cut one
    becomes the last, partial sentence) without re-running the splitter for every candidate
    size of the length search. Empty end words (an essay file with whitespace at both ends)
    take a place among the ``num_words`` but add no text, as in niah.py.
    """
    words = essay_words(path)
    lead = 1 if words[0] == "" else 0
    sents, ends = _essay_split(path, nltk_data)
    total = int(ends[-1])
    full, rest = divmod(num_words, len(words))
    rest = max(0, min(rest - lead, total))  # non-empty words among the first `rest`
    out = list(sents) * full
    if rest:
        k = int(np.searchsorted(ends, rest, side="left"))  # sentence holding word number `rest`
        start = int(ends[k - 1]) if k else 0
        out += sents[:k]
        out.append(" ".join(sents[k].split(" ")[: rest - start]))
    return tuple(out)


# ----------------------------------------------------------------------------- word lists
@lru_cache(maxsize=1)
def wonderwords_lists() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(nouns, adjectives, verbs) from the wonderwords package, deduplicated and sorted."""

    def load(name: str) -> tuple[str, ...]:
        return tuple(sorted(set(random_word._get_words_from_text_file(name))))

    return load("nounlist.txt"), load("adjectivelist.txt"), load("verblist.txt")


@lru_cache(maxsize=2)
def english_words(path: Path) -> tuple[str, ...]:
    """common_words_extraction.py's fallback list: the *values* of english_words.json, in file
    order (the original samples from them without sorting or deduplicating)."""
    src = _Source(path, "english_words")
    data = src.load_json()
    if not isinstance(data, dict) or not data:
        raise src.error("expected a non-empty JSON object whose values are words")
    for key, value in data.items():
        if not isinstance(value, str):
            raise src.error(f"field {key!r} is {type(value).__name__}, expected a word (str)")
    return tuple(data.values())


# ----------------------------------------------------------------------------- QA datasets
@dataclass(frozen=True)
class QAItem:
    query: str
    outputs: tuple[str, ...]
    context: tuple[int, ...]  # gold document indices
    more_context: tuple[int, ...] = ()  # same-article paragraphs (SQuAD): preferred distractors


@dataclass(frozen=True)
class QAData:
    items: tuple[QAItem, ...]
    docs: tuple[str, ...]


class DataFormatError(ValueError):
    """A RULER input file is not in its published layout (empty, not JSON, a field missing or
    of another type); the one-line message names the config key, the file and the field."""


@dataclass(frozen=True)
class _Source:
    """One RULER input file and the config key that names it: every error about its content
    reads ``evaluation.ruler.<key> = <path>: <what is wrong>``."""

    path: Path
    kind: str  # a key of DATA_KEYS

    def error(self, detail: str) -> DataFormatError:
        key = f"evaluation.ruler.{DATA_KEYS[self.kind]}"
        return DataFormatError(f"{key} = {self.path}: {detail}")

    def read_text(self) -> str:
        try:
            text = self.path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise self.error(f"not UTF-8 text ({err.reason} at byte {err.start})") from None
        if not text.strip():
            raise self.error(f"empty file; expected {DATA_DESCRIPTIONS[self.kind]}")
        return text

    def load_json(self) -> object:
        text = self.read_text()
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise self.error(
                f"not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); expected "
                f"{DATA_DESCRIPTIONS[self.kind]}"
            ) from None

    def field(self, record: object, key: str, where: str, kind: type | tuple[type, ...]):
        """``record[key]`` checked for type; a missing or mistyped field names the place."""
        if not isinstance(record, dict):
            raise self.error(f"{where} is {type(record).__name__}, expected an object with {key!r}")
        if key not in record:
            raise self.error(f"{where} has no field {key!r}")
        value = record[key]
        if not isinstance(value, kind):
            names = (
                kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            )
            raise self.error(
                f"field {key!r} of {where} is {type(value).__name__}, expected {names}"
            )
        return value


@lru_cache(maxsize=2)
def read_squad(path: Path) -> QAData:
    """SQuAD v2 dev, answerable questions only (qa.py: read_squad)."""
    src = _Source(path, "squad")
    data = src.field(src.load_json(), "data", "the top-level object", list)
    articles = []  # (article's paragraph contexts, [(context, qas)])
    for a, article in enumerate(data):
        where = f"data[{a}]"
        pars = []
        for p, par in enumerate(src.field(article, "paragraphs", where, list)):
            pw = f"{where}.paragraphs[{p}]"
            pars.append((src.field(par, "context", pw, str), src.field(par, "qas", pw, list)))
        articles.append(pars)
    docs = sorted({context for pars in articles for context, _ in pars})
    index = {c: i for i, c in enumerate(docs)}
    items = []
    for a, pars in enumerate(articles):
        article_docs = [index[context] for context, _ in pars]
        for p, (context, qas) in enumerate(pars):
            gold = index[context]
            for q, qa in enumerate(qas):
                where = f"data[{a}].paragraphs[{p}].qas[{q}]"
                if not isinstance(qa, dict):
                    raise src.error(f"{where} is {type(qa).__name__}, expected an object")
                if qa.get("is_impossible", False):
                    continue
                answers = src.field(qa, "answers", where, list)
                items.append(
                    QAItem(
                        query=src.field(qa, "question", where, str),
                        outputs=tuple(
                            src.field(ans, "text", f"{where}.answers[{i}]", str)
                            for i, ans in enumerate(answers)
                        ),
                        context=(gold,),
                        more_context=tuple(i for i in article_docs if i != gold),
                    )
                )
    return _checked(QAData(tuple(items), tuple(docs)), src)


@lru_cache(maxsize=2)
def read_hotpotqa(path: Path) -> QAData:
    """HotpotQA dev distractor: the question's ten paragraphs are its documents (qa.py)."""
    src = _Source(path, "hotpotqa")
    data = src.load_json()
    if not isinstance(data, list):
        raise src.error(
            f"the top level is {type(data).__name__}, expected a JSON list of questions "
            "(HotpotQA dev layout)"
        )

    def doc(title: str, sentences: list[str]) -> str:
        return f"{title}\n{''.join(sentences)}"

    rows = []  # (question, answer, [document text])
    for i, d in enumerate(data):
        where = f"question {i}"
        paragraphs = []
        for c, par in enumerate(src.field(d, "context", where, list)):
            ok = (
                isinstance(par, list)
                and len(par) == 2
                and isinstance(par[0], str)
                and isinstance(par[1], list)
                and all(isinstance(s, str) for s in par[1])
            )
            if not ok:
                raise src.error(
                    f"field 'context' of {where}, paragraph {c}, is not [title, [sentences]]"
                )
            paragraphs.append(doc(par[0], par[1]))
        rows.append(
            (
                src.field(d, "question", where, str),
                src.field(d, "answer", where, str),
                paragraphs,
            )
        )
    docs = sorted({text for _, _, paragraphs in rows for text in paragraphs})
    index = {c: i for i, c in enumerate(docs)}
    items = tuple(
        QAItem(query=q, outputs=(a,), context=tuple(index[t] for t in paragraphs))
        for q, a, paragraphs in rows
    )
    return _checked(QAData(items, tuple(docs)), src)


def _checked(data: QAData, src: _Source) -> QAData:
    if not data.items:
        raise src.error("no answerable questions found")
    return data
