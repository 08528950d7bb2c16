"""Held-out generated evaluation data sized for a small GPU experiment (``configs/gpu-small.yaml``).

The demo fixtures (:mod:`anchorctx.demo.fixtures`) hold a few items per benchmark, enough to
exercise the pipeline; a comparison of arms needs hundreds, and RULER up to 16K needs a longer
essay and more SQuAD paragraphs. This module writes, under ``out``:

- ``fixtures/``: the demo fixtures with a longer essay (RULER's niah haystack, punkt stand-in);
- ``squad.json``: SQuAD v2 layout, one answerable question per paragraph (RULER qa_1);
- ``mmlu/{dev,test}/<subject>.jsonl`` and ``hellaswag/validation.jsonl``: short-context checks
  in the ``cais/mmlu`` and ``Rowan/hellaswag`` fields.

Every name and sentence is built from English words (wonderwords' lists, the source of RULER's
keys), never from the pretraining corpus' syllable pseudo-words (:mod:`.pretrain_corpus`), and
with templates of this module only: the pretrained model has seen the *kinds* of task, never
these items. ``manifest.json`` is written last and marks a complete copy.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anchorctx.io import DirectoryOwner, atomic_write_json, owned_directory, read_json

if TYPE_CHECKING:
    from anchorctx.experiment import ExperimentConfig

HELDOUT_VERSION = 1
SUBJECTS = ("abstract_algebra", "astronomy", "high_school_geography")  # real MMLU subject names


def _words() -> tuple[list[str], list[str]]:
    from anchorctx.evaluation.ruler.data import wonderwords_lists

    nouns, adjs, _ = wonderwords_lists()
    keep = lambda ws: [w for w in ws if w.isalpha() and w.islower() and 3 <= len(w) <= 9]  # noqa: E731
    return keep(nouns), keep(adjs)


class _Items:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.nouns, self.adjs = _words()

    def name(self) -> str:
        return f"the {self.rng.choice(self.adjs)} {self.rng.choice(self.nouns)}"

    def person(self) -> str:
        return (
            self.rng.choice(self.nouns).capitalize() + " " + self.rng.choice(self.adjs).capitalize()
        )

    def filler(self, sentences: int) -> str:
        r = self.rng
        return " ".join(
            f"{self.name().capitalize()} stood near {self.name()} for a while."
            if r.random() < 0.5
            else f"Nobody expected {self.name()} to be so {r.choice(self.adjs)}."
            for _ in range(sentences)
        )

    def squad(self, paragraphs: int) -> dict[str, Any]:
        data = []
        for a in range(paragraphs // 4):
            pars = []
            for p in range(4):
                thing, who = self.name(), self.person()
                fact = f"In its early days {thing} was looked after by {who}."
                context = f"{self.filler(2)} {fact} {self.filler(2)}"
                pars.append(
                    {
                        "context": context,
                        "qas": [
                            {
                                "question": f"Who looked after {thing} in its early days?",
                                "id": f"heldout-{a}-{p}",
                                "is_impossible": False,
                                "answers": [{"text": who, "answer_start": context.index(who)}],
                            }
                        ],
                    }
                )
            data.append({"title": f"article {a}", "paragraphs": pars})
        return {"version": "v2.0", "data": data}

    def mmlu(self, subject: str) -> dict[str, Any]:
        """A passage-reading multiple-choice question (the answer is stated in the question)."""
        people = [self.person() for _ in range(4)]
        answer = self.rng.randrange(4)
        thing = self.name()
        question = f"{thing.capitalize()} was repaired by {people[answer]}. Who repaired {thing}?"
        return {"question": question, "subject": subject, "choices": people, "answer": answer}

    def hellaswag(self, i: int) -> dict[str, Any]:
        thing, colour = self.name(), self.rng.choice(self.adjs)
        ctx_a = f"Everyone agreed that {thing} was {colour}."
        ctx_b = f"Asked about it later, they said that {thing} was"
        others = self.rng.sample([a for a in self.adjs if a != colour], 3)
        label = self.rng.randrange(4)
        endings = [f"{w}." for w in others]
        endings.insert(label, f"{colour}.")
        return {
            "ind": i,
            "activity_label": "Recall",
            "ctx_a": ctx_a,
            "ctx_b": ctx_b,
            "ctx": f"{ctx_a} {ctx_b}",
            "endings": endings,
            "source_id": f"heldout~{i}",
            "split": "val",
            "split_type": "indomain",
            "label": str(label),
        }


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


HELDOUT_OWNER = DirectoryOwner("heldout-eval", "held-out evaluation data")


def _recorded_params(manifest: Path) -> object:
    """The parameters ``manifest`` records; None when it is absent or not ours (a user's
    ``manifest.json``: the writer then refuses the directory)."""
    try:
        meta = read_json(manifest)
    except (OSError, ValueError):
        return None
    return meta.get("params") if isinstance(meta, dict) else None


def write_heldout_eval(
    out: str | Path,
    *,
    seed: int = 0,
    essay_words: int = 40_000,
    squad_paragraphs: int = 400,
    items: int = 400,
) -> dict[str, Path]:
    """Write the data under ``out`` (reused when complete with the same parameters); returns
    the paths the config names (``essay``, ``squad``, ``nltk_data``, ``mmlu_dir``,
    ``hellaswag_dir``)."""
    from anchorctx.demo.fixtures import write_eval_fixtures

    root = Path(out)
    params = {
        "version": HELDOUT_VERSION,
        "seed": seed,
        "essay_words": essay_words,
        "squad_paragraphs": squad_paragraphs,
        "items": items,
    }
    paths = {
        "essay": root / "fixtures" / "essays.json",
        "squad": root / "squad.json",
        "nltk_data": root / "fixtures" / "nltk_data",
        "mmlu_dir": root / "mmlu",
        "hellaswag_dir": root / "hellaswag",
    }
    manifest = root / "manifest.json"
    if _recorded_params(manifest) == params:
        return paths
    gen = _Items(seed)
    with owned_directory(root, HELDOUT_OWNER) as tmp:
        write_eval_fixtures(tmp / "fixtures", seed=seed, essay_words=essay_words)
        (tmp / "squad.json").write_text(json.dumps(gen.squad(squad_paragraphs)))
        for i, subject in enumerate(SUBJECTS):  # dev: the 5 few-shot examples MMLU prepends
            _jsonl(tmp / "mmlu" / "dev" / f"{subject}.jsonl", [gen.mmlu(subject) for _ in range(5)])
            count = items // len(SUBJECTS) + (i < items % len(SUBJECTS))  # `items` in all
            _jsonl(
                tmp / "mmlu" / "test" / f"{subject}.jsonl",
                [gen.mmlu(subject) for _ in range(count)],
            )
        _jsonl(tmp / "hellaswag" / "validation.jsonl", [gen.hellaswag(i) for i in range(items)])
        atomic_write_json(tmp / "manifest.json", {"params": params})
    return paths


def ensure_heldout_eval(cfg: ExperimentConfig) -> dict[str, Path] | None:
    """Write ``evaluation.heldout_data`` when the config names it (None: it does not)."""
    from anchorctx.demo.fixtures import data_seed

    if cfg.evaluation.heldout_data is None:
        return None
    return write_heldout_eval(cfg.evaluation.heldout_data, seed=data_seed(cfg))
