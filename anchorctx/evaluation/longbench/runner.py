"""Run LongBench v1 on a loaded model from a local directory of ``{dataset}.jsonl`` files.

Per dataset: fill the template, truncate the middle of over-long prompts to the token budget,
decode greedily (one anchor/BOS in front, :func:`anchorctx.evaluation.generation.generate_greedy`),
cut to the first line where LongBench does, score with the dataset's metric (max over answers),
and report ``100 x mean``; categories are the unweighted means of their datasets.

As LongBench's ``pred.py`` (THUDM/LongBench, revision in ``tasks.LONGBENCH_REVISION``): the
prompt is tokenised with its leading special token (here the anchor: BOS, or EOS for tokenizers
without BOS); when that is longer than ``max_length`` (``model2maxlen``: a fixed number per
model, ``evaluation.longbench.max_length``), its first and last ``int(max_length/2)`` tokens are
decoded back to text (special tokens dropped) and that text is encoded again with the anchor.
samsum forbids EOS and "\n" as the first token and stops at "\n" (``StopRules``).

The datasets default to pred.py's: all 21, the five Chinese ones included (their word-level
metrics need ``jieba``, checked before any generation). A dataset whose file is absent is
reported under ``not_run`` and never replaced; an empty or malformed one (invalid JSON, a
record that is not an object, a field missing or of another type) is one error naming the file,
the line, the field and ``evaluation.longbench.data_dir``.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anchorctx.evaluation.longbench.tasks import (
    ALL_DATASETS,
    DATASET2MAXLEN,
    JIEBA_DATASETS,
    LONGBENCH_REPOSITORY,
    LONGBENCH_REVISION,
    SAMSUM_RULE_DATASETS,
    build_prompt,
    category_scores,
    check_datasets,
    dataset_score,
    default_max_length,
    score_sample,
    truncate_middle,
)

if TYPE_CHECKING:
    from anchorctx.experiment import ExperimentConfig

OnSample = Callable[[dict[str, Any]], None]
REQUIRED_FIELDS = ("input", "context", "answers")
DATA_KEY = "evaluation.longbench.data_dir"
# The type of every field the suite reads (LongBench's published records), None allowed where
# the release leaves it empty.
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "input": (str,),
    "context": (str,),
    "answers": (list,),
    "all_classes": (list, type(None)),
    "_id": (str, int),
    "length": (int, type(None)),
}


class LongBenchDataError(ValueError):
    """A LongBench data file is malformed or the token budget is impossible."""


# ------------------------------------------------------------------------------------ data
def _row_problem(row: object) -> str | None:
    """What is wrong with one record (None: nothing): not an object, a field missing, a field
    of another type, an answer that is not text."""
    if not isinstance(row, dict):
        return f"record is {type(row).__name__}, expected a JSON object"
    missing = [f for f in REQUIRED_FIELDS if f not in row]
    if missing:
        return f"record lacks {missing}"
    for name, types in FIELD_TYPES.items():
        if name in row and not isinstance(row[name], types):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            return f"field {name!r} is {type(row[name]).__name__}, expected {want}"
    if not all(isinstance(a, str) for a in row["answers"]):
        return "field 'answers' holds a non-string answer"
    return None


def load_rows(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Records of one ``{dataset}.jsonl`` (the first ``limit``), checked for the fields used
    and their types; an empty file is an error (a dataset is never scored on 0 records).
    Every error is one line naming the file, the line, the field and ``DATA_KEY``."""
    rows = []
    with path.open(encoding="utf-8") as fh:
        lineno = 0
        try:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise LongBenchDataError(
                        f"{path}:{lineno}: invalid JSON ({err.msg}) ({DATA_KEY})"
                    ) from None
                if problem := _row_problem(row):
                    raise LongBenchDataError(f"{path}:{lineno}: {problem} ({DATA_KEY})")
                rows.append(row)
                if limit is not None and len(rows) >= limit:
                    break
        except UnicodeDecodeError as err:
            raise LongBenchDataError(
                f"{path}:{lineno + 1}: not UTF-8 text ({err.reason}) ({DATA_KEY})"
            ) from None
    if not rows:
        raise LongBenchDataError(
            f"{path}: no records (empty file) ({DATA_KEY}): a dataset is never scored on 0 "
            "records; write it again, or remove the file to report the dataset as not run"
        )
    return rows


def sample_keys(dataset: str, rows: list[dict[str, Any]]) -> list[str]:
    """``{dataset}/{_id}`` per record (record index when a file has no ``_id``)."""
    keys = [f"{dataset}/{row.get('_id', f'#{i}')}" for i, row in enumerate(rows)]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise LongBenchDataError(f"duplicate sample id {dup!r}: every _id must be unique")
    return keys


# -------------------------------------------------------------------------------- prompts
def prompt_budget(model_max: int | None, max_new_tokens: int, max_length: int | None) -> int:
    """LongBench's ``max_length`` for this model: the configured value, else the
    ``model2maxlen`` convention for the model's position limit; checked against that limit."""
    if max_length is None:
        if model_max is None:
            raise LongBenchDataError(
                "the model config has no max_position_embeddings: set evaluation.longbench.max_length"
            )
        if model_max < 1024:
            raise LongBenchDataError(
                f"max_position_embeddings={model_max} has no model2maxlen default (below 1K): "
                "set evaluation.longbench.max_length"
            )
        max_length = default_max_length(model_max)
    if model_max is not None and max_length + max_new_tokens > model_max:
        raise LongBenchDataError(
            f"evaluation.longbench.max_length={max_length} plus {max_new_tokens} new tokens exceeds "
            f"the model's max_position_embeddings={model_max}: lower max_length to at most "
            f"{model_max - max_new_tokens} (or raise the model's limit, e.g. model.max_position_embeddings)"
        )
    return max_length


def fit_prompt(tokenizer: Any, text: str, max_length: int) -> tuple[str, int, bool]:
    """(prompt text, its token count with the anchor, truncated?) as ``pred.py`` builds it.

    The anchored ids stand for ``pred.py``'s ``tokenizer(prompt)`` (BOS first). Over
    ``max_length``: decode the first and the last ``int(max_length/2)`` ids, skipping special
    tokens, and join the two texts. Re-encoding can merge tokens at the seam, so the final count
    may differ from ``max_length`` by a token or two, exactly as in the reference.
    """
    # Imported here: generation imports torch; importing the suite registry stays light.
    from anchorctx.evaluation.generation import encode_prompt

    ids = encode_prompt(tokenizer, text)
    if len(ids) <= max_length:
        return text, len(ids), False
    kept = truncate_middle(ids, max_length)
    half = len(kept) // 2
    cut = tokenizer.decode(kept[:half], skip_special_tokens=True) + tokenizer.decode(
        kept[half:], skip_special_tokens=True
    )
    return cut, len(encode_prompt(tokenizer, cut)), True


def decode_rules(tokenizer: Any, dataset: str):
    """``pred.py``'s samsum rule as data for the generator; None for every other dataset."""
    # Imported here: models.decoding imports torch, which the suite registry skips.
    from anchorctx.models.decoding import StopRules

    if dataset not in SAMSUM_RULE_DATASETS:
        return None
    newline = tokenizer.encode("\n", add_special_tokens=False)[-1]
    eos = tokenizer.eos_token_id
    forbid = (newline,) if eos is None else (eos, newline)
    return StopRules(stop_token_ids=(newline,), suppress_first=forbid)


# ---------------------------------------------------------------------------------- suite
def _model_max(model: Any) -> int | None:
    value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(value) if value else None


def _run_dataset(
    model: Any,
    tokenizer: Any,
    cfg: ExperimentConfig,
    dataset: str,
    rows: list[dict[str, Any]],
    keys: list[str],
    todo: list[int],
    on_sample: OnSample,
    progress: bool,
) -> list[dict[str, Any]]:
    """Generate and score the records ``todo`` (indices into rows); emit each record."""
    # Imported here: generation imports torch, which the suite registry skips; looked up at call
    # time, so tests can substitute generate_greedy.
    from anchorctx.evaluation.generation import generate_greedy

    lcfg = cfg.evaluation.longbench
    max_new = DATASET2MAXLEN[dataset]
    budget = prompt_budget(_model_max(model), max_new, lcfg.max_length)
    fitted = [fit_prompt(tokenizer, build_prompt(dataset, rows[i]), budget) for i in todo]
    produced: list[dict[str, Any]] = []

    def on_batch(indices: list[int], texts: list[str]) -> None:
        for j, text in zip(indices, texts):
            row = rows[todo[j]]
            record = {
                "key": keys[todo[j]],
                "dataset": dataset,
                "prediction": text,
                "answers": list(row["answers"]),
                "score": score_sample(dataset, text, row["answers"], row.get("all_classes")),
                "prompt_tokens": fitted[j][1],
                "truncated": fitted[j][2],
                "length": row.get("length"),
            }
            on_sample(record)
            produced.append(record)

    generate_greedy(
        model,
        tokenizer,
        [f[0] for f in fitted],
        max_new_tokens=max_new,
        batch_size=cfg.evaluation.batch_size,
        progress=progress,
        desc=f"longbench/{dataset}",
        on_batch=on_batch,
        stop=decode_rules(tokenizer, dataset),
        engine=cfg.evaluation.engine,
        deterministic=cfg.evaluation.deterministic_decode,
    )
    return produced


def _check_jieba(names: list[str], data_dir: Path) -> None:
    """Fail before generating anything when a Chinese dataset to score needs jieba."""
    need = [n for n in names if n in JIEBA_DATASETS and (data_dir / f"{n}.jsonl").is_file()]
    if need and importlib.util.find_spec("jieba") is None:
        raise LongBenchDataError(
            f"LongBench {', '.join(need)} are scored on jieba word segmentation, which is not "
            "installed: pip install jieba, or leave them out of evaluation.longbench.datasets"
        )


def run_suite(
    model: Any,
    tokenizer: Any,
    cfg: ExperimentConfig,
    *,
    done: dict[str, dict[str, Any]],
    on_sample: OnSample,
    progress: bool = True,
) -> dict[str, Any]:
    """LongBench scores ``{dataset: {"score": x}}``, category means, counts and ``not_run``."""
    lcfg = cfg.evaluation.longbench
    if lcfg.data_dir is None:
        raise LongBenchDataError("evaluation.longbench.data_dir is not set")
    names = check_datasets(lcfg.datasets or ALL_DATASETS)
    _check_jieba(names, Path(lcfg.data_dir))
    scores: dict[str, float] = {}
    counts: dict[str, int] = {}
    not_run: dict[str, str] = {}
    for dataset in names:
        path = Path(lcfg.data_dir) / f"{dataset}.jsonl"
        if not path.is_file():
            not_run[dataset] = f"no data file {path}"
            continue
        rows = load_rows(path, lcfg.limit)  # an empty or malformed file: an error naming it
        keys = sample_keys(dataset, rows)
        todo = [i for i, k in enumerate(keys) if k not in done]
        new = (
            _run_dataset(model, tokenizer, cfg, dataset, rows, keys, todo, on_sample, progress)
            if todo
            else []
        )
        by_key = {**{k: done[k] for k in keys if k in done}, **{r["key"]: r for r in new}}
        scores[dataset] = dataset_score([float(by_key[k]["score"]) for k in keys])
        counts[dataset] = len(keys)
    return {
        "scores": {d: {"score": s} for d, s in scores.items()},
        "categories": category_scores(scores),
        "counts": counts,
        "not_run": not_run,
        "reference": {"repository": LONGBENCH_REPOSITORY, "revision": LONGBENCH_REVISION},
    }
