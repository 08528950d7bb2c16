"""Run the RULER suite on a loaded model: generate samples, predict greedily, score, resume.

Per-sample records reach ``on_sample`` as soon as their batch is decoded, so the caller can
append them to a journal; on the next run those records come back in ``done`` and are neither
regenerated nor predicted again. A (task, length) whose samples are all done costs nothing.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from anchorctx.evaluation.ruler import constants as C
from anchorctx.evaluation.ruler.data import (
    DATA_KEYS,
    SPLITTER_KEY,
    MissingDataError,
    english_words,
    punkt_splitter,
    resolve_path,
)
from anchorctx.evaluation.ruler.generate import generate, num_available
from anchorctx.evaluation.ruler.scoring import sample_score
from anchorctx.io import atomic_write_text
from anchorctx.models.loading import lengths_beyond

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from anchorctx.evaluation.settings import EvaluationConfig
    from anchorctx.experiment import ExperimentConfig

Record = dict[str, Any]


class RulerLengthError(ValueError):
    """A RULER length is beyond what the model is configured for."""


class SampleCache:
    """RULER samples already generated in this process, per sample.

    An experiment evaluates every checkpoint of every arm on the same samples (same tasks,
    lengths, seed, fit, tokenizer and data), and generating them is CPU work the GPU waits for:
    ~20 s per checkpoint at 16K with the demo tokenizer (each sample tokenised, the essay
    haystacks fitted). A sample is a pure function of that identity and its index, so the
    first evaluation generates it and the others reuse it. Bounded by the characters held
    (a 128K sample is ~0.5 MB of text); the oldest go first. Thread-safe: the flow evaluates
    checkpoints in threads."""

    def __init__(self, max_chars: int = 256_000_000) -> None:
        self.max_chars = max_chars
        self._samples: OrderedDict[tuple, dict] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    @staticmethod
    def identity(task, length, tokenizer, seed, fit, paths) -> tuple:
        """What a sample depends on besides its index: the tokenizer by content (each
        checkpoint loads its own copy), the data files by path, size and modification time."""
        tok = hashlib.sha256(repr(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()
        files = []
        for key, value in sorted(paths.items()):
            path = Path(value) if value is not None else None
            stat = path.stat() if path is not None and path.is_file() else None
            files.append((key, str(value), stat and (stat.st_size, stat.st_mtime_ns)))
        return (task, length, seed, fit, tok, tuple(files))

    def samples(
        self, task, length, tokenizer, num_samples, seed, indices, fit, paths, store=None
    ) -> list:
        """``generate(task, length, ...)`` of ``indices``, generating only those neither held
        nor in ``store`` (a directory shared by the processes of one experiment, or None)."""
        ident = self.identity(task, length, tokenizer, seed, fit, paths)
        with self._lock:
            held = {i: self._samples[(ident, i)] for i in indices if (ident, i) in self._samples}
        missing = [i for i in indices if i not in held]
        stored = SampleStore(store, ident, task, length) if store is not None and missing else None
        if stored is not None:
            found = stored.read()
            held.update((i, found[i]) for i in missing if i in found)
            with self._lock:
                for i in missing:
                    if i in found:
                        self._put((ident, i), found[i])
            missing = [i for i in missing if i not in held]
        if missing:
            new = generate(
                task, length, tokenizer, num_samples, seed, indices=missing, fit=fit, **paths
            )
            with self._lock:
                for sample in new:
                    self._put((ident, sample["index"]), sample)
            held.update((sample["index"], sample) for sample in new)
            if stored is not None:
                stored.add(new)
        return [held[i] for i in indices if i in held]

    @staticmethod
    def prompt_ids(sample: dict, tokenizer) -> list[int]:
        """``encode_prompt`` of the sample's base-model prompt, encoded once and kept with the
        cached sample (int32, ~4 bytes a token): every later checkpoint's evaluation reuses it
        (measured on an H200: 13 s of CPU per RULER pass at 2K-16K, 56 samples per cell)."""
        # Imported here: generation imports torch; importing the suite registry stays light.
        import numpy as np

        from anchorctx.evaluation.generation import encode_prompt
        from anchorctx.models.loading import anchor_token_id

        ids = sample.get("prompt_ids")
        # The identity holds the vocabulary, not the anchor rule: a tokenizer whose anchor
        # differs re-encodes.
        if ids is None or ids[0] != anchor_token_id(tokenizer):
            text = sample["input"] + sample["answer_prefix"]
            ids = np.asarray(encode_prompt(tokenizer, text), dtype=np.int32)
            sample["prompt_ids"] = ids
        return ids.tolist()

    def _put(self, key: tuple, sample: dict) -> None:
        if key in self._samples:
            return
        self._samples[key] = sample
        self._chars += len(sample["input"])
        while self._chars > self.max_chars and len(self._samples) > 1:
            _, old = self._samples.popitem(last=False)
            self._chars -= len(old["input"])

    def clear(self) -> None:
        with self._lock:
            self._samples.clear()
            self._chars = 0


SAMPLES = SampleCache()  # the process' cache, shared by every evaluation in it


class SampleStore:
    """One (task, length, identity)'s samples on disk, for the other processes of an
    experiment: each arm's evaluation and each shard is a process of its own, and without it
    every one of them generates the same samples again. A file per cell, named by a hash of the
    identity (:meth:`SampleCache.identity`: tokenizer vocabulary, seed, fit, data files by path,
    size and time), holding ``{"identity": ..., "samples": {index: sample}}`` as JSON (no
    pickle); written atomically. A file that cannot be read, or holds another identity, is
    treated as empty and replaced: the samples are generated again, nothing fails. Two
    processes adding to one file at once may each drop the other's additions (the last rename
    wins); those samples are generated again later."""

    def __init__(self, directory: Path, ident: tuple, task: str, length: int) -> None:
        self.digest = hashlib.sha256(repr(ident).encode()).hexdigest()[:16]
        self.path = Path(directory) / f"{task}-{length}-{self.digest}.json"

    def read(self) -> dict[int, dict]:
        try:
            data = json.loads(self.path.read_text())
            if data["identity"] != self.digest:
                return {}
            return {int(i): sample for i, sample in data["samples"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}

    def add(self, new: list[dict]) -> None:
        samples = {str(i): s for i, s in self.read().items()}
        for sample in new:  # the token ids stay in memory (SampleCache.prompt_ids)
            samples[str(sample["index"])] = {k: v for k, v in sample.items() if k != "prompt_ids"}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps({"identity": self.digest, "samples": samples}))


def sample_store(cfg: ExperimentConfig) -> Path | None:
    """Where ``cfg``'s RULER samples are kept for the experiment's other processes, or None
    (``evaluation.ruler.sample_store`` off)."""
    return cfg.experiment_dir / "ruler-samples" if cfg.evaluation.ruler.sample_store else None


def record_key(task: str, length: int, index: int) -> str:
    return f"{task}/{length}/{index}"


def selected_tasks(tasks: list[str] | None, exclude: list[str]) -> list[str]:
    """The configured tasks (default: all 13, in RULER's order) minus ``exclude``."""
    for name in [*(tasks or []), *exclude]:
        C.task_spec(name)  # unknown names fail here, with the valid ones listed
    chosen = list(tasks) if tasks else list(C.TASKS)
    return [t for t in chosen if t not in set(exclude)]


def check_lengths(lengths: list[int], model: PreTrainedModel) -> None:
    limit, too_long = lengths_beyond(model, lengths)
    if too_long:
        raise RulerLengthError(
            f"RULER lengths {too_long} exceed the model's max_position_embeddings={limit}. "
            f"Drop them from evaluation.ruler.lengths, or evaluate a model trained for them "
            f"(model.max_position_embeddings / rope_theta)."
        )


def data_paths(cfg: ExperimentConfig) -> dict[str, Any]:
    r = cfg.evaluation.ruler
    return {
        "essay_path": r.essay_path,
        "squad_path": r.squad_path,
        "hotpotqa_path": r.hotpotqa_path,
        "english_words_path": r.english_words_path,
        "nltk_data": r.nltk_data,
    }


def _predict(model, tokenizer, samples, evaluation: EvaluationConfig, bar, emit) -> None:
    """Greedy predictions for ``samples`` (one task and length), emitted batch by batch."""
    # Imported here: generation imports torch; importing the suite registry stays light.
    from anchorctx.evaluation.generation import generate_greedy

    def on_batch(indices: list[int], texts: list[str]) -> None:
        for i, text in zip(indices, texts):
            emit(samples[i], text)
        bar.update(len(indices))

    generate_greedy(
        model,
        tokenizer,
        [s["input"] + s["answer_prefix"] for s in samples],
        max_new_tokens=samples[0]["max_new_tokens"],
        batch_size=evaluation.batch_size,
        progress=False,
        on_batch=on_batch,
        engine=evaluation.engine,
        deterministic=evaluation.deterministic_decode,
        encoded=[SampleCache.prompt_ids(s, tokenizer) for s in samples],
    )


def run_suite(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    cfg: ExperimentConfig,
    *,
    done: Mapping[str, Record],
    on_sample: Callable[[Record], None],
    progress: bool = True,
) -> dict[str, Any]:
    """RULER on ``model``: ``{"scores": {task: {str(length): score}}, "counts": {...},
    "not_run": {task: reason}}``. Records: key, task, length, index, prediction, references,
    score (0-100)."""
    r = cfg.evaluation.ruler
    check_lengths(r.lengths, model)
    paths, store = data_paths(cfg), sample_store(cfg)
    plan, not_run = plan_samples(
        selected_tasks(r.tasks, r.exclude), r.lengths, r.num_samples, paths, done
    )
    bar = tqdm(
        total=sum(len(p) for p in plan.values()),
        desc="ruler",
        unit="sample",
        disable=not progress,
        dynamic_ncols=True,
    )
    records: dict[str, Record] = {k: v for k, v in done.items()}

    for (task, length), pending in plan.items():
        if not pending:
            continue
        bar.set_postfix_str(f"{task} @ {length}")

        def emit(sample: dict, prediction: str, length: int = length) -> None:
            rec = _record(sample, prediction, length)
            records[rec["key"]] = rec
            on_sample(rec)

        samples = SAMPLES.samples(
            task, length, tokenizer, r.num_samples, r.seed, pending, r.fit, paths, store
        )
        # Samples of one (task, length) share their length to within a few tokens: batching
        # them wastes almost nothing on padding.
        _predict(model, tokenizer, samples, cfg.evaluation, bar, emit)
    bar.close()
    summary = _summarise(plan, records, not_run, r.num_samples, paths)
    summary["reference"] = {
        "repository": C.RULER_REPOSITORY,
        "revision": C.RULER_REVISION,
        "fit": r.fit,
    }
    return summary


def prefetch_samples(
    cfg: ExperimentConfig,
    tokenizer: PreTrainedTokenizerBase,
    should_stop: Callable[[], bool] = lambda: False,
) -> int:
    """Generate and encode every sample :func:`run_suite` of ``cfg`` will ask for into this
    process' :data:`SAMPLES`, longest lengths first (they cost the most); returns how many
    are held. A flow calls it in a thread while the GPU trains, so the first evaluation finds
    its samples ready (they are CPU work the GPU otherwise waits for: ~40 s at 2K-16K with 56
    samples per cell, measured on an H200 host). Tasks whose data is missing are skipped here;
    the evaluation reports them. ``should_stop`` is asked between (task, length) cells."""
    r = cfg.evaluation.ruler
    paths, store = data_paths(cfg), sample_store(cfg)
    plan, _ = plan_samples(selected_tasks(r.tasks, r.exclude), r.lengths, r.num_samples, paths, {})
    held = 0
    for (task, length), indices in sorted(plan.items(), key=lambda kv: -kv[0][1]):
        if should_stop():
            break
        for sample in SAMPLES.samples(
            task, length, tokenizer, r.num_samples, r.seed, indices, r.fit, paths, store
        ):
            SampleCache.prompt_ids(sample, tokenizer)
            held += 1
    return held


def plan_samples(tasks, lengths, num_samples, paths, done):
    """Pending sample indices per (task, length); tasks without their data go to not_run."""
    plan: dict[tuple[str, int], list[int]] = {}
    not_run: dict[str, str] = {}
    for task in tasks:
        try:
            _probe_data(task, paths)
            n = num_available(task, num_samples, **paths)
        except MissingDataError as err:
            not_run[task] = str(err)
            continue
        for length in lengths:
            plan[(task, length)] = [i for i in range(n) if record_key(task, length, i) not in done]
    return plan, not_run


def _probe_data(task: str, paths: dict) -> None:
    """Raise MissingDataError now (not mid-suite) when the task's data file is absent, and
    MissingSplitterError (which stops the suite) when an essay task has no sentence model."""
    spec = C.task_spec(task)
    if spec.family == "niah" and spec.args["type_haystack"] == "essay":
        resolve_path(task, "essay", paths)
        nltk_data = paths.get(SPLITTER_KEY)
        punkt_splitter(Path(nltk_data) if nltk_data is not None else None)
    elif spec.family == "qa":
        resolve_path(task, spec.args["dataset"], paths)
    elif spec.family == "cwe" and paths.get(DATA_KEYS["english_words"]) is not None:
        # A named english_words.json is checked now like the other files (absent: CWE not run,
        # with the one-line reason; malformed: DataFormatError), not at the first length near
        # 128K that needs it, hours into the suite. Unnamed, CWE runs up to wonderwords' limit.
        english_words(resolve_path(task, "english_words", paths))


def _record(sample: dict, prediction: str, length: int) -> Record:
    task, index = sample["task"], sample["index"]
    return {
        "key": record_key(task, length, index),
        "task": task,
        "length": length,
        "index": index,
        "prediction": prediction,
        "references": sample["outputs"],
        "prompt_tokens": sample["length"] - sample["max_new_tokens"],
        "score": sample_score(task, prediction, sample["outputs"]),
    }


def _summarise(plan, records, not_run, num_samples, paths) -> dict[str, Any]:
    scores: dict[str, dict[str, float]] = {}
    counts: dict[str, dict[str, int]] = {}
    for task, length in plan:
        recs = [
            records[k]
            for k in (
                record_key(task, length, i)
                for i in range(num_available(task, num_samples, **paths))
            )
            if k in records
        ]
        if recs:
            # RULER's metric functions return round(score, 2) (scripts/eval/synthetic/constants.py).
            mean = sum(x["score"] for x in recs) / len(recs)
            scores.setdefault(task, {})[str(length)] = round(mean, 2)
            counts.setdefault(task, {})[str(length)] = len(recs)
    return {"scores": scores, "counts": counts, "not_run": not_run}
