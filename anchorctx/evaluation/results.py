"""Evaluate one checkpoint on one suite: resumable, idempotent, one results JSON per pair.

Layout (docs/ARCHITECTURE.md, evaluation results contract), with ``run_dir = checkpoint.parent.parent``::

    <run_dir>/eval/<key>/<suite>.json            final result (written atomically)
    <run_dir>/eval/<key>/<suite>.samples.jsonl   per-sample records, appended as produced

The key identifies the checkpoint, not just its folder name: a run's own checkpoints
(``<run_dir>/checkpoints/step-N``) are keyed ``step-N``; any other checkpoint directory
``<run_dir>/<folder>/<name>`` (a weight-averaged checkpoint, one passed with ``--checkpoint``)
is keyed ``<name>@<folder>``, so two checkpoints of one name in different folders never share
(and overwrite) results. Each evaluation output has its own writer lock.

Nothing is written outside ``run_root``: a checkpoint whose ``run_dir`` lies outside the
config's ``run_root`` (a base model under ``/models``, another experiment's checkpoint) is
evaluated into ``<run_root>/<name>/external/<sanitised folder name>-<hash of its resolved
path>/`` instead (:func:`eval_dir` with ``cfg``).

The first line of the samples file is a header holding the identity of the evaluation: the
checkpoint's content hash, the fingerprint of the evaluation config that affects this suite
(settings and input data) and the code version. A rerun with the same identity resumes (the
suite runner skips every key already recorded); any other identity starts fresh. A final
``<suite>.json`` with the same identity means there is nothing to do: it is returned without
loading the model, after checking it is the file that was written: the result records the
SHA-256 of its per-sample records and of its own content, so a hand-edited result or samples
file is recomputed from the samples (no model generation is repeated) instead of served.

Suite runners are the functions in :data:`SUITES` (name -> :class:`Suite`). Every runner has the
signature
``run_suite(model, tokenizer, cfg, *, done, on_sample, progress=True) -> dict`` and returns at
least ``scores`` (``{task: {length_or_split: score}}``), ``counts`` and ``not_run``.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anchorctx.evaluation import longbench, perplexity, ruler
from anchorctx.evaluation.integrity import records_problem, result_digest
from anchorctx.evaluation.lm_eval import harness
from anchorctx.evaluation.lm_eval import suites as lm_eval_suites
from anchorctx.evaluation.model_overrides import eval_model_overrides, is_external
from anchorctx.evaluation.records import Identity, ResultRecord, SamplesInfo
from anchorctx.evaluation.settings import LM_EVAL_PREFIX, LM_EVAL_TASKS, lm_eval_family
from anchorctx.io import (
    WriterLock,
    append_jsonl,
    atomic_write_text,
    hash_tree,
    read_json,
    read_jsonl,
    sha256_file,
)
from anchorctx.manifest import code_version, git_revision, package_versions
from anchorctx.models.checkpoints import checkpoint_step, model_dir_problem
from anchorctx.models.loading import resolve_device

if TYPE_CHECKING:
    from anchorctx.experiment import ExperimentConfig

Runner = Callable[..., dict[str, Any]]
log = logging.getLogger(__name__)

HEADER_KEY = "__header__"
RESULT_SCHEMA = 1
# The code that can change a score, relative to the anchorctx package (a folder covers every
# file under it): what builds the samples and scores them (the suites, the lm-eval adapter), loads
# the model, decodes its predictions and turns records into a result, and the settings they
# read. It alone makes the evaluation's code version: an edit elsewhere keeps cached results.
SCORE_SOURCES = (
    "evaluation/generation.py",
    "evaluation/lm_eval",
    "evaluation/longbench",
    "evaluation/model_overrides.py",
    "evaluation/perplexity.py",
    "evaluation/results.py",
    "evaluation/ruler",
    "evaluation/settings.py",
    "models/decoder.py",
    "models/decoding.py",
    "models/loading.py",
    "models/rope.py",
    "models/settings.py",
)
# The files of SCORE_SCOPE whose code cannot change a score (files only, so that a new file is
# never neutral by its folder): reading, averaging, comparing and reporting results, planning,
# splitting units over processes and running them (a unit's records are the same whatever the
# split), the results' integrity check, averaged weights (a new checkpoint, hashed as such),
# the checkpoint layout and writing.
SCORE_NEUTRAL_SOURCES = (
    "evaluation/__init__.py",
    "evaluation/arm_comparison.py",
    "evaluation/averaging.py",
    "evaluation/commands.py",
    "evaluation/cost_plan.py",
    "evaluation/curves.py",
    "evaluation/integrity.py",
    "evaluation/paired.py",
    "evaluation/paper_numbers.json",
    "evaluation/paper_numbers.py",
    "evaluation/records.py",
    "evaluation/report.py",
    "evaluation/schedule.py",
    "evaluation/seed_pairs.py",
    "evaluation/sharding.py",
    "evaluation/stacked_report.py",
    "evaluation/token_time.py",
    "evaluation/tracking.py",
    "evaluation/weights.py",
    "evaluation/worker.py",
    "models/__init__.py",
    "models/checkpoints.py",
    "models/safetensors_stream.py",
)
# Every source file under these folders is in exactly one of the two lists
# (tests/test_score_sources.py): a new module is classified when it is added.
SCORE_SCOPE = ("evaluation", "models")
_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


class EvaluationError(ValueError):
    """A checkpoint, suite or data file cannot be evaluated; the message says what to fix."""

    exit_code = 2  # a wrong path, suite or setting (anchorctx.cli)


class EmptyEvaluationError(EvaluationError):
    """A suite scored a task from no items (an empty data file): nothing is cached."""

    exit_code = 1  # the data on disk is wrong


class CheckpointLoadError(EvaluationError):
    """A checkpoint's files exist but cannot be loaded (truncated or corrupt weights)."""

    exit_code = 1


@dataclass(frozen=True)
class Suite:
    """How to run one suite and which part of ``cfg.evaluation`` determines its scores."""

    runner: Runner
    section: str | None = None  # sub-section of cfg.evaluation, e.g. "ruler"
    ignore: tuple[str, ...] = ()  # fields of that section that do not affect this suite
    required: tuple[str, ...] = ()  # path fields of that section that must be set
    # Top-level cfg.evaluation fields that affect it (generation batching pads prompts; the
    # engine and the decode kernel change floating-point rounding, so tokens can differ).
    common: tuple[str, ...] = ("dtype", "batch_size", "engine", "deterministic_decode")
    # Cheap checks of the data files' content before the model loads (an empty file is an
    # error naming it, not a model load followed by a score from 0 items).
    preflight: Callable[[ExperimentConfig], None] | None = None
    # The data files it reads, by config key, where the section's own path fields do not say
    # (lm-eval suites: the files of their units only, not a whole dataset directory).
    inputs: Callable[[ExperimentConfig], dict[str, Path]] | None = None
    # Its runner decodes through generate_greedy alone, so a compile-only pass
    # (generation.compile_only) costs it no prefill or decoding: it can be compiled ahead.
    decodes: bool = False
    # Settings outside its section that change its scores (they join its fingerprint).
    derived: Callable[[ExperimentConfig], dict[str, Any]] | None = None
    # Its runner takes the evaluated directory as ``checkpoint=`` (what its anchorctx.json says).
    takes_checkpoint: bool = False


def _perplexity_preflight(cfg: ExperimentConfig) -> None:
    try:
        perplexity.check_data(cfg)
    except perplexity.PerplexityDataError as err:
        raise EvaluationError(f"suite 'perplexity': {err}") from None


def _perplexity_runner(model: Any, tokenizer: Any, cfg: ExperimentConfig, **kw: Any) -> dict:
    """:func:`perplexity.run_suite`, its data errors as this module's one-line errors."""
    try:
        return perplexity.run_suite(model, tokenizer, cfg, **kw)
    except perplexity.PerplexityDataError as err:
        raise EvaluationError(f"suite 'perplexity': {err}") from None


SUITES: dict[str, Suite] = {
    "ruler": Suite(ruler.run_suite, "ruler", ignore=("sample_store",), decodes=True),
    "longbench": Suite(longbench.run_suite, "longbench", required=("data_dir",), decodes=True),
    "mmlu": Suite(
        harness.run_suite_mmlu,
        "harness",
        ignore=("hellaswag_dir",),
        required=("mmlu_dir",),
        common=("dtype",),
        preflight=harness.check_mmlu_data,
    ),
    "hellaswag": Suite(
        harness.run_suite_hellaswag,
        "harness",
        ignore=("mmlu_dir", "mmlu_fewshot"),
        required=("hellaswag_dir",),
        common=("dtype",),
        preflight=harness.check_hellaswag_data,
    ),
    "perplexity": Suite(
        _perplexity_runner,
        "perplexity",
        required=("data_path",),
        common=("dtype",),
        preflight=_perplexity_preflight,
        derived=perplexity.resolved_settings,
        takes_checkpoint=True,
    ),
}


def _lm_eval_suite(name: str) -> Suite:
    """Suite ``lm_eval:<task or group>``: lm-eval's long-context task through the lm-eval model
    ``anchorctx`` (:mod:`anchorctx.evaluation.lm_eval.suites`); its fingerprint covers the
    shared ``evaluation.lm_eval`` settings and its own family's section only."""
    family = lm_eval_family(lm_eval_suites.suite_task(name))
    others = tuple(f for f in LM_EVAL_TASKS if f != family)

    def preflight(cfg: ExperimentConfig) -> None:
        try:
            lm_eval_suites.check_data(cfg, name)
        except lm_eval_suites.LmEvalDataError as err:
            raise EvaluationError(f"suite {name!r}: {err}") from None

    def inputs(cfg: ExperimentConfig) -> dict[str, Path]:
        try:
            return lm_eval_suites.inputs(cfg, name)
        except lm_eval_suites.LmEvalDataError as err:
            raise EvaluationError(f"suite {name!r}: {err}") from None

    return Suite(
        lm_eval_suites.suite_runner(name),
        "lm_eval",
        ignore=others,
        common=("dtype", "engine", "deterministic_decode"),
        preflight=preflight,
        inputs=inputs,
    )


# ------------------------------------------------------------------------------ identities
def get_suite(name: str) -> Suite:
    if name.startswith(LM_EVAL_PREFIX) and lm_eval_family(name.removeprefix(LM_EVAL_PREFIX)):
        return _lm_eval_suite(name)
    try:
        return SUITES[name]
    except KeyError:
        raise EvaluationError(
            f"unknown evaluation suite {name!r}; available: {', '.join(sorted(SUITES))} and "
            "lm_eval:<task> (lm-eval's long-context tasks, see evaluation.suites)"
        ) from None


def suite_stem(suite: str) -> str:
    """The file name stem of a suite's results: its name, ``:`` as ``-`` (``lm_eval:ruler`` ->
    ``lm_eval-ruler.json``; a colon reads as a host name to scp and rsync)."""
    return suite.replace(":", "-")


def check_checkpoint(checkpoint: str | Path) -> Path:
    """The checkpoint directory, or an error naming what is missing."""
    ckpt = Path(checkpoint)
    if not ckpt.is_dir():
        raise EvaluationError(
            f"checkpoint not found: {ckpt} (expected a directory such as "
            "<run_dir>/checkpoints/step-000100; list a run's checkpoints with "
            "`anchorctx evaluate CONFIG` and no --checkpoint)"
        )
    if problem := model_dir_problem(ckpt):
        raise EvaluationError(f"incomplete checkpoint {ckpt}: {problem}")
    if not any(next(ckpt.glob(p), None) for p in _WEIGHT_PATTERNS):
        raise EvaluationError(
            f"incomplete checkpoint {ckpt}: no weights (*.safetensors or pytorch_model*.bin)"
        )
    return ckpt


def _check_tokenizer(ckpt: Path) -> None:
    """Before loading: evaluation needs the checkpoint's own tokenizer."""
    if problem := model_dir_problem(ckpt, tokenizer=True):
        raise EvaluationError(f"incomplete checkpoint {ckpt}: {problem}")


_Signature = tuple[tuple[str, int, int, int], ...]
_HASH_MEMO: dict[tuple[str, _Signature], str] = {}


def _signature(path: Path) -> _Signature:
    """Names, sizes, mtimes and inodes: a rewrite (or an atomic replace) changes it."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    out = []
    for p in files:
        st = p.stat()
        out.append(
            (
                p.relative_to(path).as_posix() if p != path else p.name,
                st.st_size,
                st.st_mtime_ns,
                st.st_ino,
            )
        )
    return tuple(out)


def _memo_hash(path: Path) -> str:
    """Content hash of a file or directory, memoised on its signature within the process
    (hashing a 7B checkpoint takes tens of seconds; idempotence checks happen often)."""
    path = path.resolve()
    key = (str(path), _signature(path))
    if key not in _HASH_MEMO:
        _HASH_MEMO[key] = sha256_file(path) if path.is_file() else hash_tree(path)
    return _HASH_MEMO[key]


def checkpoint_hash(checkpoint: str | Path) -> str:
    """Content hash of a checkpoint directory (weights, config, tokenizer, anchorctx.json)."""
    return _memo_hash(check_checkpoint(checkpoint))


def _signature_digest(signature: _Signature) -> str:
    return hashlib.sha256(repr(signature).encode()).hexdigest()[:24]


def checkpoint_hash_token(checkpoint: str | Path) -> str:
    """:func:`checkpoint_hash` with the files' signature it was computed for
    (``<signature digest>:<hash>``), for another process of this host to reuse through
    :func:`trust_checkpoint_hash` while the files are unchanged. Why: each of a flow's
    evaluation workers would otherwise read the whole checkpoint again to hash it (3.5 GB took
    ~3 s of each shard's setup; a 7B model is 13.5 GB)."""
    path = check_checkpoint(checkpoint).resolve()
    value = _memo_hash(path)
    return f"{_signature_digest(_signature(path))}:{value}"


def trust_checkpoint_hash(checkpoint: str | Path, token: str) -> bool:
    """Memoise the hash in ``token`` (:func:`checkpoint_hash_token`) if the checkpoint's files
    still have the signature it names (names, sizes, mtimes, inodes: the trust this process'
    own memo gives); whether they do. Otherwise the next :func:`checkpoint_hash` reads the
    files."""
    path = Path(checkpoint).resolve()
    digest, _, value = token.partition(":")
    if not path.is_dir() or not value:
        return False
    signature = _signature(path)
    if _signature_digest(signature) != digest:
        return False
    _HASH_MEMO[(str(path), signature)] = value
    return True


def suite_config(cfg: ExperimentConfig, suite: str) -> dict[str, Any]:
    """The part of ``cfg.evaluation`` that can change this suite's scores."""
    spec = get_suite(suite)
    ev = cfg.evaluation.model_dump(mode="json")
    out: dict[str, Any] = {k: ev[k] for k in spec.common}
    if spec.section is not None:
        out[spec.section] = {k: v for k, v in ev[spec.section].items() if k not in spec.ignore}
    if spec.derived is not None:
        out["derived"] = spec.derived(cfg)
    return out


def _path_fields(cfg: ExperimentConfig, spec: Suite) -> dict[str, Path]:
    if spec.section is None:
        return {}
    section = getattr(cfg.evaluation, spec.section)
    return {
        name: Path(value)
        for name, value in section
        if isinstance(value, Path) and name not in spec.ignore
    }


def input_fingerprints(cfg: ExperimentConfig, suite: str) -> dict[str, str]:
    """Content hashes of the data files and directories this suite reads."""
    spec = get_suite(suite)
    if spec.inputs is not None:
        return {
            key: _memo_hash(path)[:16] for key, path in spec.inputs(cfg).items() if path.exists()
        }
    return {
        f"evaluation.{spec.section}.{name}": _memo_hash(path)[:16]
        for name, path in _path_fields(cfg, spec).items()
        if path.exists()
    }


def evaluation_fingerprint(cfg: ExperimentConfig, suite: str) -> str:
    """Hash of the suite's settings and input data: equal fingerprints give equal scores."""
    payload = {
        "suite": suite,
        "config": suite_config(cfg, suite),
        "inputs": input_fingerprints(cfg, suite),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def check_unchanged(cfg: ExperimentConfig, suite: str, ident: Identity) -> None:
    """Raise when the suite's settings or input files changed after ``ident`` was taken (at the
    start of an evaluation): its records would mix two sample sets under one identity. The
    content hashes are memoised on the files' signatures, so an unchanged input costs a stat."""
    now = evaluation_fingerprint(cfg, suite)
    if now != ident["evaluation_fingerprint"]:
        raise EvaluationError(
            f"suite {suite!r}: its input files or settings changed while it ran (evaluation "
            f"fingerprint {ident['evaluation_fingerprint']} at the start, {now} now; "
            f"inputs now {input_fingerprints(cfg, suite)}): another process rewrote them? "
            "No result is written; run it again"
        )


def evaluation_code_version() -> str:
    """anchorctx's version plus a hash of the code that can change scores."""
    return code_version(SCORE_SOURCES, exclude=())


def identity(cfg: ExperimentConfig, checkpoint: str | Path, suite: str) -> Identity:
    """What a cached result must match to be reused (also a good task cache key). Reads only:
    demo input data must exist before (``anchorctx.demo.ensure_eval_fixtures``)."""
    ident: Identity = {
        "checkpoint_hash": checkpoint_hash(checkpoint),
        "evaluation_fingerprint": evaluation_fingerprint(cfg, suite),
        "code_version": evaluation_code_version(),
    }
    if overrides := eval_model_overrides(cfg, checkpoint):
        # Only when set: the identities of every other evaluation stay as they were.
        ident["model_overrides"] = json.dumps(overrides, sort_keys=True)
    return ident


# ---------------------------------------------------------------------------------- paths
def checkpoint_key(checkpoint: str | Path, cfg: ExperimentConfig | None = None) -> str:
    """The checkpoint's name under ``<run_dir>/eval``: ``step-N`` for a run's own checkpoints,
    ``<name>@<folder>`` for any other (unique within the run directory, stable if it moves);
    with ``cfg``, a checkpoint outside its ``run_root`` gets :func:`external_key`."""
    ckpt = Path(checkpoint).resolve()
    if cfg is not None and is_external(ckpt, cfg):
        return external_key(ckpt)
    if ckpt.parent.name == "checkpoints":
        return ckpt.name
    return f"{ckpt.name}@{ckpt.parent.name}"


def external_key(checkpoint: str | Path) -> str:
    """``<folder name, sanitised>-<12 hex digits of the resolved path's SHA-256>``: readable,
    and distinct for two folders of one name."""
    ckpt = Path(checkpoint).resolve()
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", ckpt.name).strip("._-")[:64] or "checkpoint"
    return f"{name}-{hashlib.sha256(os.fsencode(ckpt)).hexdigest()[:12]}"


def eval_dir(checkpoint: str | Path, cfg: ExperimentConfig | None = None) -> Path:
    """``<run_dir>/eval/<checkpoint_key>`` with ``run_dir = checkpoint.parent.parent``.

    With ``cfg`` (every writer passes it), a checkpoint outside ``cfg.run_root`` is evaluated
    into ``<run_root>/<name>/external/<external_key>`` instead: nothing is written beside a
    checkpoint that is not the experiment's. Without ``cfg``: the checkpoint's own run
    directory (the same place for every checkpoint inside ``run_root``)."""
    ckpt = Path(checkpoint).resolve()
    if cfg is not None and is_external(ckpt, cfg):
        return Path(cfg.experiment_dir).resolve() / "external" / external_key(ckpt)
    return ckpt.parent.parent / "eval" / checkpoint_key(ckpt)


def result_path(checkpoint: str | Path, suite: str, cfg: ExperimentConfig | None = None) -> Path:
    return eval_dir(checkpoint, cfg) / f"{suite_stem(suite)}.json"


def samples_path(checkpoint: str | Path, suite: str, cfg: ExperimentConfig | None = None) -> Path:
    return eval_dir(checkpoint, cfg) / f"{suite_stem(suite)}.samples.jsonl"


def load_result(path: str | Path) -> ResultRecord | None:
    """A results JSON, or None when it is absent or unreadable (treated as not evaluated)."""
    path = Path(path)
    try:
        return read_json(path)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def result_matches(result: Mapping[str, Any] | None, ident: Identity, samples: Path) -> bool:
    """A cached result is served only if it has this identity, its content is what was
    written, and its per-sample records are the ones it was computed from."""
    if result is None or not all(result.get(k) == v for k, v in ident.items()):
        return False
    return records_problem(result, samples) is None  # samples: same directory


def result_is_intact(
    checkpoint: str | Path, suite: str, cfg: ExperimentConfig | None = None
) -> bool:
    """The result file of ``checkpoint``/``suite`` exists and is exactly what was written (its
    own digest and its per-sample records' hash match); identity is the caller's to check."""
    result = load_result(result_path(checkpoint, suite, cfg))
    return (
        result is not None and records_problem(result, samples_path(checkpoint, suite, cfg)) is None
    )


# ------------------------------------------------------------------------- input checks
def check_inputs(cfg: ExperimentConfig, suite: str) -> None:
    """Fail early, naming the config key, when a data path the suite needs is absent."""
    spec = get_suite(suite)
    paths = _path_fields(cfg, spec)
    # A suite's required fields are fields of its section (one without a section has none).
    section = getattr(cfg.evaluation, spec.section) if spec.section is not None else None
    for name in spec.required:
        if getattr(section, name, None) is None:
            raise EvaluationError(
                f"suite {suite!r} needs evaluation.{spec.section}.{name}: set it to the local "
                "data (see docs) or drop the suite from evaluation.suites"
            )
    for name, path in paths.items():
        if not path.exists():
            raise EvaluationError(
                f"evaluation.{spec.section}.{name} = {path} does not exist: fix the path, or "
                "unset it to report the tasks that need it as not run"
            )
    if spec.preflight is not None:
        spec.preflight(cfg)


# ---------------------------------------------------------------------- samples (resume)
def load_done(path: Path, ident: Identity) -> dict[str, dict[str, Any]] | None:
    """Records of a previous attempt with the same identity (None: start fresh)."""
    rows = read_jsonl(path)
    if not rows or rows[0].get(HEADER_KEY) != ident:
        return None
    return {row["key"]: row for row in rows[1:] if "key" in row}


def repair_torn_tail(path: Path) -> int:
    """Cut an unterminated last line (a crash mid-append) off a JSON-lines file, so the next
    append starts a line of its own; returns the bytes dropped. The dropped record is not in
    ``done`` afterwards, so the runner computes it again."""
    try:
        fh = path.open("rb+")
    except FileNotFoundError:
        return 0
    with fh:
        size = fh.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        fh.seek(size - 1)
        if fh.read(1) == b"\n":
            return 0
        end = size  # find the last newline, reading back in blocks
        keep = 0
        while end > 0:
            start = max(0, end - (1 << 16))
            fh.seek(start)
            block = fh.read(end - start)
            if (i := block.rfind(b"\n")) >= 0:
                keep = start + i + 1
                break
            end = start
        fh.truncate(keep)
        fh.flush()
        os.fsync(fh.fileno())
    log.warning(
        "%s: dropped a torn last line (%d bytes, a write cut short); its record is computed again",
        path,
        size - keep,
    )
    return size - keep


# ---------------------------------------------------------------------- time spent
def time_log_path(samples: Path) -> Path:
    """``<suite>.time.jsonl`` beside the samples file: one line per process that generated
    records of it (a shard, a merge, a resumed run), with its seconds. A result's own
    ``duration_s`` is the time of the process that wrote it, which after sharded or resumed
    generation is the merge's fraction of a second; the log keeps what the records cost."""
    return samples.with_name(samples.name.replace(".samples.jsonl", ".time.jsonl"))


def log_time(samples: Path, ident: Identity, process: str, seconds: dict[str, float]) -> None:
    """Append one process's seconds (model load, generation, ...) and records written."""
    row = {"identity": ident, "process": process, **{k: round(v, 3) for k, v in seconds.items()}}
    append_jsonl(time_log_path(samples), row)


def time_spent(samples: Path, ident: Identity) -> dict[str, Any]:
    """Seconds summed over the processes logged for this identity (each on its own device):
    ``process_s``, and how many processes."""
    rows = [r for r in read_jsonl(time_log_path(samples)) if r.get("identity") == ident]
    total = sum(float(v) for r in rows for k, v in r.items() if k.endswith("_s"))
    return {"process_s": round(total, 3), "processes": len(rows)}


def start_samples(path: Path, ident: Identity) -> None:
    """Start a samples (or shard) file afresh: only the header line holding ``ident``."""
    atomic_write_text(path, json.dumps({HEADER_KEY: ident}) + "\n")


# ------------------------------------------------------------------------------- models
# One cached model per thread: evaluations of one checkpoint on several suites load it once,
# and a thread pool running evaluations side by side never evicts another thread's model.
_LOCAL = threading.local()


def load_eval_model(
    checkpoint: Path, *, device: str, dtype: str, model_overrides: dict[str, Any] | None = None
) -> tuple[Any, Any]:
    """Model and tokenizer of a checkpoint with the stock attention (generation.py)."""
    # Imported here: generation imports torch, which evaluation's light entry points skip.
    from anchorctx.evaluation.generation import load_eval_model as _load

    return _load(checkpoint, device=device, dtype=dtype, model_overrides=model_overrides)


def cached_model(checkpoint: Path, cfg: ExperimentConfig, ckpt_hash: str) -> tuple[Any, Any]:
    """Load once per checkpoint; keep only the latest one so memory holds one model."""
    overrides = eval_model_overrides(cfg, checkpoint)
    key = (
        str(checkpoint.resolve()),
        ckpt_hash,
        cfg.evaluation.device,
        cfg.evaluation.dtype,
        json.dumps(overrides, sort_keys=True),
    )
    if getattr(_LOCAL, "key", None) != key:
        clear_model_cache()
        # Outside the try: a device this machine lacks is a config mistake, not a bad checkpoint.
        device = resolve_device(cfg.evaluation.device, "evaluation.device")
        try:
            extra = {"model_overrides": overrides} if overrides else {}
            loaded = load_eval_model(checkpoint, device=device, dtype=cfg.evaluation.dtype, **extra)
        except Exception as err:  # safetensors, transformers, OS errors: name the checkpoint
            detail = " ".join(str(err).split())
            raise CheckpointLoadError(
                f"cannot load checkpoint {checkpoint} ({type(err).__name__}: {detail}); "
                "it may be truncated or corrupt: re-create it or pick another checkpoint"
            ) from err
        _LOCAL.key, _LOCAL.model = key, loaded
    return _LOCAL.model


def clear_model_cache() -> None:
    """Drop this thread's cached evaluation model (and its GPU memory)."""
    _LOCAL.key, _LOCAL.model = None, None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        # A model's modules refer to each other in cycles: without a collection its tensors
        # would outlive the reference just dropped, and empty_cache could not free them.
        gc.collect()
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- evaluation
def evaluate_checkpoint(
    cfg: ExperimentConfig,
    checkpoint: str | Path,
    suite: str,
    *,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Evaluate ``checkpoint`` on ``suite``; return the path of ``<suite>.json``.

    Does no work when an up-to-date result exists (unless ``force``); resumes an interrupted
    evaluation of the same checkpoint and config from its per-sample records.
    """
    spec = get_suite(suite)
    ckpt = check_checkpoint(checkpoint)
    check_inputs(cfg, suite)
    ident = identity(cfg, ckpt, suite)
    out = result_path(ckpt, suite, cfg)  # under run_root, also for an external checkpoint
    samples = samples_path(ckpt, suite, cfg)
    if not force and result_matches(load_result(out), ident, samples):
        return out
    with WriterLock(out.parent / f".{suite_stem(suite)}.lock", f"evaluation output {out}"):
        if not force and result_matches(load_result(out), ident, samples):
            return out  # another process finished it while we checked
        return _evaluate(cfg, ckpt, suite, spec, ident, out, samples, force, progress)


def _evaluate(
    cfg: ExperimentConfig,
    ckpt: Path,
    suite: str,
    spec: Suite,
    ident: Identity,
    out: Path,
    samples: Path,
    force: bool,
    progress: bool,
) -> Path:
    # A crash mid-append leaves a torn last line; the next record must not be glued to it.
    repair_torn_tail(samples)
    done = None if force else load_done(samples, ident)
    if done is None:
        done = {}
        start_samples(samples, ident)
        time_log_path(samples).unlink(missing_ok=True)  # the records start afresh; so do times
    new = 0

    def on_sample(record: dict[str, Any]) -> None:
        nonlocal new
        if "key" not in record:
            raise EvaluationError(f"suite {suite!r} produced a sample record without 'key'")
        append_jsonl(samples, record)
        new += 1

    _check_tokenizer(ckpt)
    loading = time.time()
    model, tokenizer = cached_model(ckpt, cfg, ident["checkpoint_hash"])
    started = time.time()
    extra = {"checkpoint": ckpt} if spec.takes_checkpoint else {}
    raw = spec.runner(
        model, tokenizer, cfg, done=done, on_sample=on_sample, progress=progress, **extra
    )
    check_unchanged(cfg, suite, ident)
    seconds = {"load_s": started - loading, "generate_s": time.time() - started}
    log_time(samples, ident, "evaluate", seconds | {"records": new})
    if isinstance(raw, dict) and (empty := unscored(raw)):
        raise EmptyEvaluationError(
            f"suite {suite!r} scored {', '.join(empty[:5])} from 0 items: no result is written "
            f"(an empty data file? check the paths under evaluation.{spec.section or suite})"
        )
    draft = _result_record(cfg, ckpt, suite, ident, raw, started)
    draft |= time_spent(samples, ident)
    draft["samples"] = SamplesInfo(
        resumed=len(done), new=new, file=samples.name, sha256=sha256_file(samples)
    )
    # As JSON, the record the file holds: the digest covers what is written.
    result: ResultRecord = json.loads(json.dumps(draft, default=str))
    result["result_sha256"] = result_digest(result)
    atomic_write_text(out, json.dumps(result, indent=2) + "\n")
    return out


def unscored(raw: dict[str, Any]) -> list[str]:
    """The scores of a runner's output that were computed from 0 items (``counts`` says 0):
    ``task`` or ``task/key``. A score without a count is not judged here."""
    counts = raw.get("counts") or {}
    empty = []
    for task, by_key in (raw.get("scores") or {}).items():
        count = counts.get(task)
        if isinstance(count, dict) and isinstance(by_key, dict):
            empty += [f"{task}/{key}" for key in by_key if count.get(key) == 0]
        elif count == 0:
            empty.append(task)
    return empty


def _result_record(
    cfg: ExperimentConfig,
    ckpt: Path,
    suite: str,
    ident: Identity,
    raw: dict[str, Any],
    started: float,
) -> dict[str, Any]:
    if not isinstance(raw, dict) or "scores" not in raw:
        raise EvaluationError(f"suite {suite!r} runner returned no 'scores'")
    record: dict[str, Any] = {
        "schema": RESULT_SCHEMA,
        "suite": suite,
        "checkpoint": str(ckpt.resolve()),
        "checkpoint_name": ckpt.name,
        "step": checkpoint_step(ckpt),
        **ident,
        "evaluation": suite_config(cfg, suite),
        "inputs": input_fingerprints(cfg, suite),
        "scores": raw["scores"],
        "counts": raw.get("counts", {}),
        "not_run": raw.get("not_run", {}),
        "versions": package_versions(),
        "git": git_revision(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "duration_s": round(time.time() - started, 3),
    }
    for key, value in raw.items():  # suite-specific extras, e.g. LongBench "categories"
        record.setdefault(key, value)
    return record
