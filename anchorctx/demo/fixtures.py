"""Tiny, deterministic evaluation data in the real file formats, for the demo and the tests.

One generator, two entry points: :func:`write_eval_fixtures` writes every suite's inputs (the
demo's ``evaluation.demo_fixtures``) or any subset of them (``keys``); :func:`write_ruler_fixtures`
is the RULER-only subset, returned under the ``evaluation.ruler`` config keys, as the RULER tests
use it. Each file has its own seeded writer, so a subset holds the same bytes as the full set.

Every benchmark reads user-supplied local files (nothing is downloaded). To let the demo and
the CI suite exercise the exact same readers, this module writes small synthetic stand-ins:

| key              | path under ``out``          | format of the real file                           |
|------------------|-----------------------------|---------------------------------------------------|
| ``essay``        | ``essays.json``             | RULER's ``PaulGrahamEssays.json``: ``{"text": ...}`` |
| ``squad``        | ``squad.json``              | SQuAD v2.0 dev (``data/paragraphs/qas``)          |
| ``hotpotqa``     | ``hotpotqa.json``           | HotpotQA dev distractor (list of questions)       |
| ``longbench_dir``| ``longbench/{name}.jsonl``  | THUDM LongBench v1 (one file per dataset)         |
| ``mmlu_dir``     | ``mmlu/{dev,test}/{subject}.jsonl`` | ``cais/mmlu`` records (see evaluation.lm_eval.harness) |
| ``hellaswag_dir``| ``hellaswag/validation.jsonl`` | ``Rowan/hellaswag`` records                    |
| ``nltk_data``    | ``nltk_data/tokenizers/punkt_tab/english/`` | NLTK's ``punkt_tab`` model layout |

:mod:`anchorctx.demo.paper_assets` (``anchorctx demo-assets --paper``) reuses these writers at
the paper configs' sizes; :func:`paul_graham_json` writes the essay file the way RULER's
``download_paulgraham_essay.py`` does (several essays concatenated, whitespace at both ends).

The ``nltk_data`` stand-in is a Punkt model with no learnt parameters (no abbreviations): it lets
the demo split its synthetic essays offline. Real evaluations point ``evaluation.ruler.nltk_data``
at NLTK's pretrained model (``python -m nltk.downloader -d DIR punkt_tab``).

The text is generated from a small built-in lexicon with a seeded RNG: no copyrighted content,
identical bytes for identical ``seed``. Answers are planted in the text so a perfect reader
could score 100; RULER's QA answers are fixed codes (SQuAD title ``t`` paragraph ``p`` answers
``Harbor{t}{p}``, HotpotQA question ``q`` answers ``river{q}x0``) that tests can assert on.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anchorctx.io import DirectoryOwner, owned_directory, read_json

if TYPE_CHECKING:
    from anchorctx.experiment import ExperimentConfig

FIXTURES_VERSION = 4
KEYS = ("essay", "squad", "hotpotqa", "longbench_dir", "mmlu_dir", "hellaswag_dir", "nltk_data")
RULER_KEYS = ("essay", "squad", "hotpotqa", "nltk_data")
_RELATIVE = {
    "essay": "essays.json",
    "squad": "squad.json",
    "hotpotqa": "hotpotqa.json",
    "longbench_dir": "longbench",
    "mmlu_dir": "mmlu",
    "hellaswag_dir": "hellaswag",
    "nltk_data": "nltk_data",
}
# The four files of an NLTK punkt_tab language model (nltk.tokenize.punkt.load_punkt_params).
PUNKT_TAB_FILES = ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab")
MMLU_FIXTURE_SUBJECTS = ("abstract_algebra", "astronomy", "high_school_geography")

# ------------------------------------------------------------------------------------ lexicon
ADJECTIVES = [
    "amber",
    "quiet",
    "bright",
    "narrow",
    "ancient",
    "gentle",
    "hollow",
    "silver",
    "rapid",
    "humble",
    "distant",
    "golden",
    "crimson",
    "steady",
    "frozen",
    "curious",
    "modest",
    "vivid",
    "patient",
    "sturdy",
    "rustic",
    "lively",
    "serene",
    "northern",
    "western",
    "copper",
    "marble",
    "velvet",
    "brisk",
    "dusty",
]
NOUNS = [
    "river",
    "lantern",
    "harbor",
    "orchard",
    "bridge",
    "meadow",
    "tower",
    "garden",
    "valley",
    "engine",
    "library",
    "market",
    "canal",
    "forest",
    "island",
    "castle",
    "village",
    "mill",
    "beacon",
    "chapel",
    "quarry",
    "vineyard",
    "workshop",
    "observatory",
    "railway",
    "fountain",
    "archive",
    "glacier",
    "lighthouse",
]
VERBS = [
    "watches",
    "crosses",
    "guards",
    "shelters",
    "follows",
    "supplies",
    "borders",
    "faces",
    "joins",
    "serves",
    "overlooks",
    "surrounds",
    "feeds",
    "connects",
    "outlasts",
]
PLACES = [
    "Ardel",
    "Brimvale",
    "Corwick",
    "Dunmere",
    "Elsford",
    "Farrowby",
    "Glenhaven",
    "Harlow",
    "Istmere",
    "Jorvale",
    "Kestrel",
    "Lowmarsh",
    "Mirefield",
    "Northam",
    "Oakhurst",
    "Pellingham",
    "Quarrow",
    "Rosedene",
    "Saltmere",
    "Thornbury",
    "Upwell",
    "Varnham",
    "Westmoor",
    "Yarrowfield",
]
NAMES = [
    "Alia",
    "Brenn",
    "Cato",
    "Dessa",
    "Elric",
    "Fenna",
    "Galen",
    "Hesper",
    "Ilya",
    "Joren",
    "Kalla",
    "Loric",
    "Maren",
    "Nils",
    "Orla",
    "Perrin",
    "Quill",
    "Rhea",
    "Soren",
    "Talia",
    "Ulric",
    "Vesna",
    "Wren",
    "Yuri",
]


class FixtureWriter:
    """Seeded sentence and paragraph generator over the built-in lexicon."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def pick(self, seq: tuple[str, ...] | list[str]) -> str:
        return self.rng.choice(seq)

    def sentence(self) -> str:
        r = self.pick
        return (
            f"The {r(ADJECTIVES)} {r(NOUNS)} {r(VERBS)} the {r(ADJECTIVES)} {r(NOUNS)} "
            f"near {r(PLACES)}."
        )

    def paragraph(self, sentences: int) -> str:
        return " ".join(self.sentence() for _ in range(sentences))

    def words(self, n: int) -> str:
        """About ``n`` words of prose, as sentences."""
        out: list[str] = []
        count = 0
        while count < n:
            s = self.sentence()
            out.append(s)
            count += len(s.split())
        return " ".join(out)


def _sid(*parts: Any) -> str:
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:24]


# ----------------------------------------------------------------------------- RULER inputs
def essay_json(w: FixtureWriter, words: int) -> dict[str, str]:
    """RULER reads ``json.load(f)["text"]`` and splits it on whitespace."""
    paragraphs = []
    total = 0
    while total < words:
        p = w.paragraph(w.rng.randint(4, 9))
        paragraphs.append(p)
        total += len(p.split())
    return {"text": "\n\n".join(paragraphs)}


def paul_graham_json(w: FixtureWriter, words: int) -> dict[str, str]:
    """``PaulGrahamEssays.json`` as RULER's ``download_paulgraham_essay.py`` writes it: the plain
    concatenation of essays, some as plain-text files (a title line, paragraphs, a final
    newline), most as html2text output (which starts and ends with blank lines). So the text has
    whitespace at both ends, blank lines between paragraphs, and no separator between essays."""
    essays, total, k = [], 0, 0
    while total < words:
        title = f"The {w.pick(ADJECTIVES).title()} {w.pick(NOUNS).title()}"
        paragraphs = [w.paragraph(w.rng.randint(3, 8)) for _ in range(w.rng.randint(4, 12))]
        total += sum(len(p.split()) for p in paragraphs) + len(title.split())
        if k % 4 == 1:  # a .txt essay
            essays.append(title + "\n\n" + "\n\n".join(paragraphs) + "\n")
        else:  # html2text output: a blank line before the body, blank lines after it
            essays.append("\n\n" + title + "\n\n" + "\n\n".join(paragraphs) + "\n\n")
        k += 1
    if k % 4 == 2:  # the last essay was a .txt one: the real file ends in html2text's "\n\n"
        essays.append("\n\n" + w.paragraph(3) + "\n\n")
    return {"text": "".join(essays)}


def _fact(w: FixtureWriter, place: str) -> tuple[str, str, str]:
    """(sentence, question, answer) with the answer a span of the sentence."""
    adj, noun, name = w.pick(ADJECTIVES), w.pick(NOUNS), w.pick(NAMES)
    year = str(w.rng.randint(1400, 1999))
    if w.rng.random() < 0.5:
        return (
            f"The {adj} {noun} of {place} was built by {name} in {year}.",
            f"Who built the {adj} {noun} of {place}?",
            name,
        )
    return (
        f"The {adj} {noun} of {place} was completed in the year {year} by {name}.",
        f"In which year was the {adj} {noun} of {place} completed?",
        year,
    )


def squad_json(w: FixtureWriter, titles: int, paragraphs: int) -> dict[str, Any]:
    """SQuAD v2.0 layout; RULER's qa_1 keeps the answerable questions only.

    Paragraph ``p`` of title ``t`` answers ``Harbor{t}{p}`` (and the alias ``the Harbor{t}{p}``,
    as SQuAD dev lists several annotators' spans); one digit for ``p`` keeps the codes distinct.
    """
    if paragraphs > 10:
        raise ValueError(f"squad_json: paragraphs={paragraphs} > 10 would repeat answer codes")
    data = []
    for t in range(titles):
        place = PLACES[t % len(PLACES)] + ("" if t < len(PLACES) else str(t))
        pars = []
        for p in range(paragraphs):
            answer = f"Harbor{t}{p}"
            fact = f"The old port of {place} part {p} was renamed the {answer} in spring."
            before, after = w.paragraph(w.rng.randint(4, 8)), w.paragraph(w.rng.randint(2, 6))
            context = f"{before} {fact} {after}"
            start = context.index(fact) + fact.index(answer)
            qas = [
                {
                    "question": f"What was the old port of {place} part {p} renamed?",
                    "id": _sid("squad", t, p, 0),
                    "answers": [
                        {"text": answer, "answer_start": start},
                        {"text": f"the {answer}", "answer_start": start - len("the ")},
                    ],
                    "is_impossible": False,
                },
                {  # unanswerable, as in v2.0: no answers, a plausible one instead
                    "question": f"Who repaired the {w.pick(ADJECTIVES)} tower of {place}?",
                    "id": _sid("squad", t, p, 1),
                    "answers": [],
                    "plausible_answers": [{"text": answer, "answer_start": start}],
                    "is_impossible": True,
                },
            ]
            pars.append({"context": context, "qas": qas})
        data.append({"title": place, "paragraphs": pars})
    return {"version": "v2.0", "data": data}


def _sentences(w: FixtureWriter, n: int) -> list[str]:
    # HotpotQA stores a paragraph as a list of sentences, later ones with a leading space,
    # so that "".join(sentences) (what RULER does) reproduces the paragraph text.
    return [(" " if i else "") + w.sentence() for i in range(n)]


def hotpotqa_json(w: FixtureWriter, questions: int, distractor_pool: int) -> list[dict[str, Any]]:
    """HotpotQA dev-distractor layout: 2 gold paragraphs and 8 distractors per question.

    Paragraphs are one or two sentences: RULER's qa_2 always keeps all ten paragraphs of a
    question, so short ones let the demo run qa_2 at 1K tokens. Question ``q`` answers
    ``river{q}x0``; its gold paragraph also names ``river{q}x1``, a near miss.
    """
    pool = [
        (f"The {w.pick(ADJECTIVES).title()} {w.pick(NOUNS).title()} {i}", _sentences(w, 1))
        for i in range(distractor_pool)
    ]
    rows = []
    for q in range(questions):
        site = (
            f"The {w.pick(ADJECTIVES).title()} {w.pick(NOUNS).title()} of {PLACES[q % len(PLACES)]}"
        )
        town, river = f"{w.pick(PLACES)}ton {q}", f"river{q}x0"
        gold_a = (site, [f"{site} is a landmark located in {town}."])
        gold_b = (
            town,
            [
                f"{town} is a market town on the {river}, which river{q}x1 feeds.",
                *_sentences(w, 2)[1:],
            ],
        )
        context = [list(gold_a), list(gold_b)] + [list(p) for p in w.rng.sample(pool, 8)]
        w.rng.shuffle(context)
        rows.append(
            {
                "_id": _sid("hotpotqa", q),
                "answer": river,
                "question": f"Which river flows through the town where {site} is located?",
                "supporting_facts": [[site, 0], [town, 0]],
                "context": context,
                "type": "bridge",
                "level": "medium",
            }
        )
    return rows


# ------------------------------------------------------------------------------- LongBench
def _lb_row(
    name: str,
    i: int,
    context: str,
    inp: str,
    answers: list[str],
    all_classes: list[str] | None = None,
) -> dict[str, Any]:
    return {
        "input": inp,
        "context": context,
        "answers": answers,
        "length": len(context.split()),  # LongBench counts words for English data
        "dataset": name,
        "language": "en",
        "all_classes": all_classes,
        "_id": _sid("longbench", name, i),
    }


def _lb_qa(w: FixtureWriter, name: str, i: int, words: int) -> dict[str, Any]:
    place = w.pick(PLACES)
    fact, question, answer = _fact(w, place)
    context = f"{w.words(words // 2)} {fact} {w.words(words // 2)}"
    return _lb_row(name, i, context, question, [answer])


def _lb_multidoc(w: FixtureWriter, name: str, i: int, passages: int) -> dict[str, Any]:
    place = w.pick(PLACES)
    fact, question, answer = _fact(w, place)
    gold = w.rng.randrange(passages)
    parts = []
    for p in range(passages):
        body = f"{w.paragraph(3)} {fact}" if p == gold else w.paragraph(4)
        parts.append(f"Passage {p + 1}:\n{place if p == gold else w.pick(PLACES)}\n{body}")
    return _lb_row(name, i, "\n".join(parts), question, [answer])


def _lb_summary(w: FixtureWriter, name: str, i: int, words: int) -> dict[str, Any]:
    context = w.words(words)
    query = "What did the group decide about the harbor?" if name == "qmsum" else ""
    return _lb_row(name, i, context, query, [w.paragraph(3)])


TREC_CLASSES = [
    "Description of something",
    "Definition of something",
    "City",
    "Country",
    "Individual",
    "Date",
    "Number of something",
    "Other location",
]


def _lb_trec(w: FixtureWriter, name: str, i: int, shots: int) -> dict[str, Any]:
    lines = [
        f"Question: What is the {w.pick(NOUNS)} of {w.pick(PLACES)}?\nType: {w.pick(TREC_CLASSES)}"
        for _ in range(shots)
    ]
    gold = w.pick(TREC_CLASSES)
    inp = f"Question: Which {w.pick(NOUNS)} is in {w.pick(PLACES)}?\nType:"
    return _lb_row(name, i, "\n".join(lines), inp, [gold], all_classes=TREC_CLASSES)


def _lb_triviaqa(w: FixtureWriter, name: str, i: int, shots: int) -> dict[str, Any]:
    blocks = []
    for _ in range(shots + 1):
        place = w.pick(PLACES)
        fact, question, answer = _fact(w, place)
        blocks.append((f"Passage: {w.paragraph(2)} {fact}\nQuestion: {question}\nAnswer:", answer))
    context = "\n\n".join(f"{text} {answer}" for text, answer in blocks[:-1])
    return _lb_row(name, i, context, blocks[-1][0], [blocks[-1][1], blocks[-1][1].lower()])


def _dialogue(w: FixtureWriter) -> str:
    a, b = w.rng.sample(NAMES, 2)
    return "\n".join(f"{(a, b)[k % 2]}: {w.sentence()}" for k in range(4))


def _lb_samsum(w: FixtureWriter, name: str, i: int, shots: int) -> dict[str, Any]:
    context = "\n\n".join(
        f"Dialogue: {_dialogue(w)}\nSummary: {w.sentence()}" for _ in range(shots)
    )
    return _lb_row(name, i, context, f"Dialogue: {_dialogue(w)}\nSummary: ", [w.sentence()])


def _lb_passage_count(w: FixtureWriter, name: str, i: int, unique: int) -> dict[str, Any]:
    paragraphs = [w.paragraph(3) for _ in range(unique)]
    shown = paragraphs + w.rng.sample(paragraphs, max(1, unique // 2))
    w.rng.shuffle(shown)
    context = "\n\n".join(f"Paragraph {k + 1}: {p}" for k, p in enumerate(shown))
    return _lb_row(name, i, context, "", [str(unique)])


def _lb_passage_retrieval(w: FixtureWriter, name: str, i: int, passages: int) -> dict[str, Any]:
    paragraphs = [w.paragraph(4) for _ in range(passages)]
    gold = w.rng.randrange(passages)
    context = "\n\n".join(f"Paragraph {k + 1}: {p}" for k, p in enumerate(paragraphs))
    abstract = " ".join(paragraphs[gold].split(". ")[:2])
    return _lb_row(name, i, context, abstract, [f"Paragraph {gold + 1}"])


def _code(w: FixtureWriter, functions: int) -> list[str]:
    lines = []
    for f in range(functions):
        noun = w.pick(NOUNS)
        lines += [
            f"def count_{noun}_{f}(items):",
            f"    total_{noun} = 0",
            "    for item in items:",
            f"        total_{noun} += len(item)",
            f"    return total_{noun}",
            "",
        ]
    return lines


def _lb_lcc(w: FixtureWriter, name: str, i: int, functions: int) -> dict[str, Any]:
    lines = _code(w, functions)
    cut = len(lines) - 3  # predict "        total_x += len(item)" of the last function
    return _lb_row(name, i, "\n".join(lines[:cut]) + "\n", "", [lines[cut]])


def _lb_repobench(w: FixtureWriter, name: str, i: int, functions: int) -> dict[str, Any]:
    lines = _code(w, functions)
    cut = len(lines) - 3
    context = f"# Path: pkg/{w.pick(NOUNS)}.py\n" + "\n".join(lines[: cut - 4]) + "\n"
    inp = "\n".join(lines[cut - 4 : cut]) + "\n"
    return _lb_row(name, i, context, inp, [lines[cut]])


# dataset -> (row builder, size argument): sizes keep the demo's prompts within 2K tokens.
_LONGBENCH_BUILDERS: dict[str, tuple[Callable[..., dict[str, Any]], int]] = {
    "narrativeqa": (_lb_qa, 600),
    "qasper": (_lb_qa, 400),
    "multifieldqa_en": (_lb_qa, 300),
    "hotpotqa": (_lb_multidoc, 6),
    "2wikimqa": (_lb_multidoc, 5),
    "musique": (_lb_multidoc, 8),
    "gov_report": (_lb_summary, 500),
    "qmsum": (_lb_summary, 400),
    "multi_news": (_lb_summary, 350),
    "trec": (_lb_trec, 12),
    "triviaqa": (_lb_triviaqa, 4),
    "samsum": (_lb_samsum, 4),
    "passage_count": (_lb_passage_count, 5),
    "passage_retrieval_en": (_lb_passage_retrieval, 6),
    "lcc": (_lb_lcc, 5),
    "repobench-p": (_lb_repobench, 5),
}


def longbench_rows(w: FixtureWriter, samples: int) -> dict[str, list[dict[str, Any]]]:
    return {
        name: [build(w, name, i, size) for i in range(samples)]
        for name, (build, size) in _LONGBENCH_BUILDERS.items()
    }


# ------------------------------------------------------------------------- MMLU / HellaSwag
def _mmlu_question(w: FixtureWriter, subject: str) -> dict[str, Any]:
    a, b = w.rng.randint(2, 40), w.rng.randint(2, 40)
    right = a + b
    wrong = w.rng.sample([v for v in range(right - 9, right + 10) if v != right], 3)
    choices = [str(v) for v in wrong]
    answer = w.rng.randrange(4)
    choices.insert(answer, str(right))
    noun = w.pick(NOUNS)
    question = (
        f"A {noun} survey counts {a} {noun}s in one district and {b} in another. How many in total?"
    )
    return {"question": question, "subject": subject, "choices": choices, "answer": answer}


def mmlu_rows(
    w: FixtureWriter, dev: int, test: int, subjects: tuple[str, ...] = MMLU_FIXTURE_SUBJECTS
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """split -> subject -> rows (``cais/mmlu`` fields: question, subject, choices, answer)."""
    out: dict[str, dict[str, list[dict[str, Any]]]] = {"dev": {}, "test": {}}
    for subject in subjects:
        out["dev"][subject] = [_mmlu_question(w, subject) for _ in range(dev)]
        out["test"][subject] = [_mmlu_question(w, subject) for _ in range(test)]
    return out


def hellaswag_rows(w: FixtureWriter, n: int) -> list[dict[str, Any]]:
    """``Rowan/hellaswag`` validation records (label is a string there)."""
    rows = []
    for i in range(n):
        noun, place, name = w.pick(NOUNS), w.pick(PLACES), w.pick(NAMES)
        ctx_a = f"{name} walks toward the {noun} in {place}."
        ctx_b = "she"
        endings = [
            f"{verb} the {w.pick(ADJECTIVES)} {w.pick(NOUNS)} slowly."
            for verb in w.rng.sample(VERBS, 4)
        ]
        rows.append(
            {
                "ind": i,
                "activity_label": f"Visiting the {noun}",
                "ctx_a": ctx_a,
                "ctx_b": ctx_b,
                "ctx": f"{ctx_a} {ctx_b}",
                "endings": endings,
                "source_id": f"fixture~{_sid('hs', i)}",
                "split": "val",
                "split_type": "indomain",
                "label": str(w.rng.randrange(4)),
            }
        )
    return rows


# ------------------------------------------------------------------------------ writing
def dump_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def dump_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=1) + "\n")


def _write_key(tmp: Path, key: str, seed: int, essay_words: int, longbench_samples: int) -> None:
    # One writer per file, seeded by the file's own offset: changing one generator, or writing a
    # subset of the keys, never changes the bytes of another file.
    path = tmp / _RELATIVE[key]
    if key == "essay":
        dump_json(path, essay_json(FixtureWriter(seed), essay_words))
    elif key == "squad":
        dump_json(path, squad_json(FixtureWriter(seed + 1), titles=8, paragraphs=5))
    elif key == "hotpotqa":
        dump_json(path, hotpotqa_json(FixtureWriter(seed + 2), 16, 160))
    elif key == "longbench_dir":
        for name, rows in longbench_rows(FixtureWriter(seed + 3), longbench_samples).items():
            dump_jsonl(path / f"{name}.jsonl", rows)
    elif key == "mmlu_dir":
        for split, subjects in mmlu_rows(FixtureWriter(seed + 4), dev=5, test=4).items():
            for subject, rows in subjects.items():
                dump_jsonl(path / split / f"{subject}.jsonl", rows)
    elif key == "hellaswag_dir":
        dump_jsonl(path / "validation.jsonl", hellaswag_rows(FixtureWriter(seed + 5), 8))
    else:  # "nltk_data"
        write_empty_punkt(path)


def write_empty_punkt(root: Path) -> Path:
    """An NLTK data directory whose English punkt_tab model has no learnt parameters (demo and
    tests only: it splits like an untrained Punkt, not like the pretrained model)."""
    lang = root / "tokenizers" / "punkt_tab" / "english"
    lang.mkdir(parents=True, exist_ok=True)
    for name in PUNKT_TAB_FILES:
        (lang / name).write_text("")
    return root


def _manifest(
    keys: tuple[str, ...], seed: int, essay_words: int, longbench_samples: int
) -> dict[str, Any]:
    return {
        "kind": "anchorctx-eval-fixtures",
        "version": FIXTURES_VERSION,
        "seed": seed,
        "essay_words": essay_words,
        "longbench_samples": longbench_samples,
        "files": {key: _RELATIVE[key] for key in keys},
        "note": "Synthetic stand-ins in the real formats; not benchmark data.",
    }


# Who may replace a fixture directory: this writer, whatever the seed or the keys (a config's
# new data seed rewrites its own fixtures in place); never a directory of the user's.
FIXTURES_OWNER = DirectoryOwner("eval-fixtures", "a directory of evaluation fixtures")


def fixture_paths(out: str | Path) -> dict[str, Path]:
    out = Path(out)
    return {key: out / rel for key, rel in _RELATIVE.items()}


def write_eval_fixtures(
    out: str | Path,
    *,
    seed: int = 0,
    essay_words: int = 12_000,
    longbench_samples: int = 3,
    keys: tuple[str, ...] = KEYS,
) -> dict[str, Path]:
    """Write the fixtures ``keys`` (default: all) under ``out``, replacing it atomically; return
    their paths by key.

    The essay is long enough for RULER at 4K-8K tokens with a byte-level BPE tokenizer; SQuAD
    (40 paragraphs of about 100 words, 80 answer spans) and HotpotQA (about 190 short distinct paragraphs) fill 4K-8K QA prompts.
    """
    unknown = sorted(set(keys) - set(KEYS))
    if unknown:
        raise ValueError(f"write_eval_fixtures: unknown keys {unknown}; known: {list(KEYS)}")
    out = Path(out)
    with owned_directory(out, FIXTURES_OWNER) as tmp:
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the data is meant to be shared
        for key in keys:
            _write_key(tmp, key, seed, essay_words, longbench_samples)
        dump_json(tmp / "manifest.json", _manifest(keys, seed, essay_words, longbench_samples))
    paths = fixture_paths(out)
    return {key: paths[key] for key in keys}


def _is_current(out: Path, seed: int) -> bool:
    manifest = out / "manifest.json"
    if not manifest.is_file():
        return False
    try:
        meta = read_json(manifest)
    except ValueError:  # not ours (a user's manifest.json): the writer below refuses the directory
        return False
    if not isinstance(meta, dict):
        return False
    return (
        meta.get("version") == FIXTURES_VERSION
        and meta.get("seed") == seed
        and all(p.exists() for p in fixture_paths(out).values())
    )


def ensure_eval_fixtures(cfg: ExperimentConfig) -> dict[str, Path] | None:
    """Write the fixtures to ``cfg.evaluation.demo_fixtures`` unless a current copy is there.

    Returns the paths, or ``None`` when the config names no fixture directory (real data).
    The seed is :func:`data_seed`'s, so two configs with the same one share identical files.
    """
    out = cfg.evaluation.demo_fixtures
    if out is None:
        return None
    out, seed = Path(out), data_seed(cfg)
    if _is_current(out, seed):
        return fixture_paths(out)
    return write_eval_fixtures(out, seed=seed)


def data_seed(cfg: ExperimentConfig) -> int:
    """The seed of the generated evaluation data: ``evaluation.data_seed``, else the
    experiment's (an arm trained under another seed keeps the experiment's data)."""
    ev = cfg.evaluation.data_seed
    return cfg.seed if ev is None else ev


# ----------------------------------------------------------------------- the RULER-only set
# ``evaluation.ruler`` config key of each RULER fixture.
_RULER_CONFIG_KEYS = {
    "essay": "essay_path",
    "squad": "squad_path",
    "hotpotqa": "hotpotqa_path",
    "nltk_data": "nltk_data",
}


def write_ruler_fixtures(out: str | Path, *, seed: int = 0) -> dict[str, Path]:
    """Write RULER's three inputs and a parameter-free Punkt model under ``out`` (the same bytes
    as in :func:`write_eval_fixtures` with this ``seed``); returns
    ``{essay_path, squad_path, hotpotqa_path, nltk_data}`` (``evaluation.ruler`` config keys)."""
    paths = write_eval_fixtures(out, seed=seed, keys=RULER_KEYS)
    return {_RULER_CONFIG_KEYS[key]: path for key, path in paths.items()}
