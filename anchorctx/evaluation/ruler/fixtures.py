"""Small synthetic data files in the formats RULER reads: essays JSON, SQuAD v2, HotpotQA.

For the demo and the tests only: they exercise the real readers and prompt construction, and a
model can score on them (every answer is in its gold document), but they are not the benchmark.
"""

from __future__ import annotations

import random
from pathlib import Path

from anchorctx.io import atomic_write_json

_WORDS = [
    "startup",
    "founders",
    "build",
    "products",
    "that",
    "users",
    "want",
    "while",
    "investors",
    "fund",
    "growth",
    "and",
    "essays",
    "argue",
    "about",
    "cities",
    "schools",
    "wealth",
    "work",
    "taste",
    "ideas",
    "hackers",
    "painters",
]


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 16))).capitalize() + "."


def write_essay(path: Path, paragraphs: int = 120) -> Path:
    rng = random.Random(0)
    text = "\n\n".join(" ".join(_sentence(rng) for _ in range(8)) for _ in range(paragraphs))
    atomic_write_json(path, {"text": text})
    return path


def write_squad(path: Path, articles: int = 6, paragraphs: int = 5) -> Path:
    """Each paragraph holds its answer; one unanswerable question per paragraph is skipped."""
    data = []
    for a in range(articles):
        paras = []
        for p in range(paragraphs):
            answer = f"Harbor{a}{p}"
            context = f"The old port of article {a} part {p} was renamed {answer} in spring. " * 6
            paras.append({"context": context, "qas": [
                {"question": f"What was port {a}-{p} renamed?", "is_impossible": False,
                 "answers": [{"text": answer}, {"text": f"the {answer}"}]},
                {"question": "What is unknowable?", "is_impossible": True, "answers": []},
            ]})  # fmt: skip
        data.append({"title": f"Article {a}", "paragraphs": paras})
    atomic_write_json(path, {"version": "v2.0", "data": data})
    return path


def write_hotpotqa(path: Path, questions: int = 30) -> Path:
    """Ten paragraphs per question; the answer sits in the first (gold) one."""
    items = []
    for q in range(questions):
        context = [[f"Title {q}-{j}", [f"Doc {q}-{j} tells of river{q}x{j}. "] * 4]
                   for j in range(10)]  # fmt: skip
        items.append({"_id": str(q), "question": f"Which river joins {q}?",
                      "answer": f"river{q}x0", "context": context})  # fmt: skip
    atomic_write_json(path, items)
    return path


def write_ruler_fixtures(out: str | Path) -> dict[str, Path]:
    """Write the three files under ``out`` and a parameter-free Punkt model; returns
    ``{essay_path, squad_path, hotpotqa_path, nltk_data}`` (``evaluation.ruler`` config keys)."""
    from anchorctx.evaluation.fixtures import write_empty_punkt

    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    return {
        "essay_path": write_essay(root / "PaulGrahamEssays.json"),
        "squad_path": write_squad(root / "squad.json"),
        "hotpotqa_path": write_hotpotqa(root / "hotpotqa.json"),
        "nltk_data": write_empty_punkt(root / "nltk_data"),
    }
