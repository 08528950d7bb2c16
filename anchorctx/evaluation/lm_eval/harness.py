"""MMLU and HellaSwag through lm-eval (the lm-eval model ``anchorctx`` on the loaded checkpoint),
from local files.

lm-eval's stock ``mmlu``/``hellaswag`` tasks read the Hugging Face Hub. Here each run writes
task YAMLs into a temporary directory that ``include`` lm-eval's own task files (so prompts,
few-shot sampling and metrics are exactly lm-eval's) and override only where the data comes
from (``dataset_path: json`` + ``data_files``). Scores are percentages (0-100).

Expected local layout
---------------------
``evaluation.harness.mmlu_dir`` - one file per subject and split, either

- ``{dev,test}/{subject}.jsonl`` with the ``cais/mmlu`` fields ``question``, ``choices``
  (4 strings), ``answer`` (0-3); e.g. written from ``datasets.load_dataset("cais/mmlu",
  subject)`` with ``ds[split].to_json(f"{split}/{subject}.jsonl")``; or
- the original release (Hendrycks et al., ``data.tar``): ``{dev,test}/{subject}_{split}.csv``
  (also under ``data/``), headerless rows ``question,A,B,C,D,answer-letter``.

MMLU is the 57 subjects' ``test`` split, ``mmlu_fewshot`` (5) examples from ``dev``, ``acc``,
micro-averaged over questions (lm-eval's ``weight_by_size``). Subjects without files are
reported under ``not_run``; the average then covers the subjects present (``complete`` says).

``evaluation.harness.hellaswag_dir`` - ``validation.jsonl`` (the ``Rowan/hellaswag`` fields
``ctx_a``, ``ctx_b``, ``activity_label``, ``endings``, ``label``) or the original release file
``hellaswag_val.jsonl`` (same fields). Metric: ``acc_norm``, zero-shot, validation split.

Model: the one lm-eval adapter, :class:`~anchorctx.evaluation.lm_eval.model.AnchorctxLM` (also
the model of the long-context ``lm_eval:<task>`` suites), scoring as lm-eval's ``hf`` model
does (:data:`HF_SCORING`). Every context lm-eval scores starts with exactly one anchor token,
the token the model was trained with at position 0 (BOS, or EOS for tokenizers without BOS such
as Qwen's), as in RULER and LongBench: for BOS tokenizers exactly what lm-eval's ``hf`` model
with ``add_bos_token=True`` encodes. The lm-eval version is recorded in results.

Resume: MMLU records one sample per subject, HellaSwag one per chunk of documents; finished
ones (in ``done``) are not evaluated again.

Empty input: a HellaSwag file, or an MMLU test file (a dev file too, with few-shot examples),
without a question is one error naming the file and the config key, raised before the model
loads (the suites' ``preflight``): a suite is never scored, and never cached, on 0 questions.
"""

from __future__ import annotations

import csv
import json
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from tqdm.auto import tqdm

from anchorctx.evaluation.lm_eval.call import (
    LmEvalDataError,
    evaluate,
    reference,
    task_manager,
    tasks_dir,
)

if TYPE_CHECKING:
    from anchorctx.experiment import ExperimentConfig

MMLU_SUBJECTS: tuple[str, ...] = tuple(
    [
        "abstract_algebra",
        "anatomy",
        "astronomy",
        "business_ethics",
        "clinical_knowledge",
        "college_biology",
        "college_chemistry",
        "college_computer_science",
        "college_mathematics",
        "college_medicine",
        "college_physics",
        "computer_security",
        "conceptual_physics",
        "econometrics",
        "electrical_engineering",
        "elementary_mathematics",
        "formal_logic",
        "global_facts",
        "high_school_biology",
        "high_school_chemistry",
        "high_school_computer_science",
        "high_school_european_history",
        "high_school_geography",
        "high_school_government_and_politics",
        "high_school_macroeconomics",
        "high_school_mathematics",
        "high_school_microeconomics",
        "high_school_physics",
        "high_school_psychology",
        "high_school_statistics",
        "high_school_us_history",
        "high_school_world_history",
        "human_aging",
        "human_sexuality",
        "international_law",
        "jurisprudence",
        "logical_fallacies",
        "machine_learning",
        "management",
        "marketing",
        "medical_genetics",
        "miscellaneous",
        "moral_disputes",
        "moral_scenarios",
        "nutrition",
        "philosophy",
        "prehistory",
        "professional_accounting",
        "professional_law",
        "professional_medicine",
        "professional_psychology",
        "public_relations",
        "security_studies",
        "sociology",
        "us_foreign_policy",
        "virology",
        "world_religions",
    ]
)
HELLASWAG_FILES = ("validation.jsonl", "hellaswag_val.jsonl")
HELLASWAG_CHUNK = 500  # documents per resumable unit
MMLU_KEY = "evaluation.harness.mmlu_dir"
HELLASWAG_KEY = "evaluation.harness.hellaswag_dir"
_TASK_PREFIX = "anchorctx"
OnSample = Callable[[dict[str, Any]], None]


class HarnessDataError(LmEvalDataError):
    """Local MMLU/HellaSwag files are missing or malformed; the message names the path."""


# ----------------------------------------------------------------------------- data layout
def _mmlu_file(root: Path, subject: str, split: str) -> Path | None:
    for base in (root, root / "data"):
        for candidate in (
            base / split / f"{subject}.jsonl",
            base / split / f"{subject}_{split}.csv",
        ):
            if candidate.is_file():
                return candidate
    return None


def mmlu_layout(mmlu_dir: str | Path) -> tuple[dict[str, dict[str, Path]], dict[str, str]]:
    """(subject -> {"dev": path, "test": path}, subject -> reason not run) for the 57 subjects."""
    root = Path(mmlu_dir)
    if not root.is_dir():
        raise HarnessDataError(f"evaluation.harness.mmlu_dir = {root} is not a directory")
    found: dict[str, dict[str, Path]] = {}
    missing: dict[str, str] = {}
    for subject in MMLU_SUBJECTS:
        files = {split: _mmlu_file(root, subject, split) for split in ("dev", "test")}
        absent = [s for s, p in files.items() if p is None]
        if absent:
            missing[subject] = f"no {'/'.join(absent)} file under {root}"
        else:
            found[subject] = files  # type: ignore[assignment]
    return found, missing


def hellaswag_file(hellaswag_dir: str | Path) -> Path:
    root = Path(hellaswag_dir)
    for name in HELLASWAG_FILES:
        if (root / name).is_file():
            return root / name
    raise HarnessDataError(
        f"no HellaSwag validation file in evaluation.harness.hellaswag_dir = {root}: "
        f"expected one of {', '.join(HELLASWAG_FILES)}"
    )


def _csv_to_jsonl(src: Path, dst: Path) -> Path:
    """Original MMLU CSV (question, A, B, C, D, letter) -> cais/mmlu JSON lines."""
    rows = []
    with src.open(newline="", encoding="utf-8") as fh:
        for i, rec in enumerate(csv.reader(fh)):
            letter = rec[5].strip() if len(rec) == 6 else ""
            if letter not in ("A", "B", "C", "D"):
                raise HarnessDataError(f"{src} row {i + 1}: expected question,A,B,C,D,letter")
            rows.append({"question": rec[0], "choices": rec[1:5], "answer": "ABCD".index(letter)})
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return dst


# The fields lm-eval's task files read from each record (mmlu/default, hellaswag/utils.py).
MMLU_FIELDS = ("question", "choices", "answer")
HELLASWAG_FIELDS = ("activity_label", "ctx_a", "ctx_b", "endings", "label")


def check_jsonl_fields(path: Path, fields: tuple[str, ...], what: str) -> None:
    """Every record of ``path`` is a JSON object with ``fields``; else one error naming the
    file, line and field (lm-eval would fail later, deep inside its data loading)."""
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise HarnessDataError(f"{path}:{lineno}: invalid JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise HarnessDataError(f"{path}:{lineno}: not a JSON object ({what} record)")
            missing = [f for f in fields if f not in record]
            if missing:
                raise HarnessDataError(
                    f"{path}:{lineno}: {what} record has no field {missing[0]!r} "
                    f"(expected {', '.join(fields)})"
                )


def _count_lines(path: Path) -> int:
    with path.open(encoding="utf-8") as fh:
        return sum(1 for line in fh if line.strip())


def count_records(path: Path, key: str, what: str, source: Path | None = None) -> int:
    """The records of a data file; an empty (or blank, or undecodable) file is an error naming
    it and the config key: a suite never scores (and caches) 0 questions. ``source``: the file
    the user gave, when ``path`` is a converted copy of it."""
    shown = source or path
    try:
        n = _count_lines(path)
    except UnicodeDecodeError as err:
        raise HarnessDataError(
            f"{shown} ({key}): not UTF-8 text ({err.reason} at byte {err.start})"
        ) from None
    if n == 0:
        raise HarnessDataError(
            f"{shown} ({key}): no {what} records (empty file): a suite is never scored on 0 "
            "questions; write the data again (see the layout in "
            "anchorctx/evaluation/lm_eval/harness.py)"
        )
    return n


def check_mmlu_data(cfg: ExperimentConfig) -> None:
    """Before the model loads: every MMLU subject present has a non-empty test file (and dev
    file, with few-shot examples); else one error naming the file."""
    hcfg = cfg.evaluation.harness
    if hcfg.mmlu_dir is None:
        return
    found, _ = mmlu_layout(hcfg.mmlu_dir)
    for files in found.values():
        for split, path in files.items():
            if split == "test" or hcfg.mmlu_fewshot > 0:
                count_records(path, MMLU_KEY, f"MMLU {split}")


def check_hellaswag_data(cfg: ExperimentConfig) -> None:
    """Before the model loads: the HellaSwag file holds questions; else one error naming it."""
    hcfg = cfg.evaluation.harness
    if hcfg.hellaswag_dir is not None:
        count_records(hellaswag_file(hcfg.hellaswag_dir), HELLASWAG_KEY, "HellaSwag validation")


# ----------------------------------------------------------------------------- task YAMLs
def _data_kwargs(files: dict[str, Path], cache: Path) -> dict[str, Any]:
    # A private datasets cache: the Arrow copies live and die with the task directory.
    return {"data_files": {k: str(v.resolve()) for k, v in files.items()}, "cache_dir": str(cache)}


def write_mmlu_yaml(
    task_dir: Path, subject: str, files: dict[str, Path], *, fewshot: int = 0
) -> str:
    """A task that includes lm-eval's ``mmlu_<subject>.yaml`` with local data; returns its name.
    An empty test file, or an empty dev file when ``fewshot`` examples are drawn from it, is an
    error naming the file."""
    base = tasks_dir() / "mmlu" / "default" / f"mmlu_{subject}.yaml"
    if not base.is_file():
        raise HarnessDataError(f"lm-eval has no MMLU task file {base}; check the lm-eval version")
    given = dict(files)
    files = {
        split: _csv_to_jsonl(p, task_dir / "data" / "mmlu" / split / f"{subject}.jsonl")
        if p.suffix == ".csv"
        else p
        for split, p in files.items()
    }
    for split, path in files.items():
        if split == "test" or fewshot > 0:
            source = given[split] if given[split] != path else None
            count_records(path, MMLU_KEY, f"MMLU {split}", source=source)
        check_jsonl_fields(path, MMLU_FIELDS, "MMLU (cais/mmlu)")
    name = f"{_TASK_PREFIX}_mmlu_{subject}"
    spec: dict[str, Any] = {
        "include": str(base),
        "task": name,
        "tag": [],
        "dataset_path": "json",
        "dataset_name": None,
        "dataset_kwargs": _data_kwargs(files, task_dir / "hf_cache"),
    }
    (task_dir / f"{name}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return name


def write_hellaswag_yaml(task_dir: Path, path: Path) -> str:
    base = tasks_dir() / "hellaswag" / "hellaswag.yaml"
    if not base.is_file():
        raise HarnessDataError(
            f"lm-eval has no HellaSwag task file {base}; check the lm-eval version"
        )
    check_jsonl_fields(path, HELLASWAG_FIELDS, "HellaSwag (Rowan/hellaswag)")
    name = f"{_TASK_PREFIX}_hellaswag"
    spec: dict[str, Any] = {
        "include": str(base),
        "task": name,
        "tag": [],
        "dataset_path": "json",
        "dataset_name": None,
        "dataset_kwargs": _data_kwargs({"validation": path}, task_dir / "hf_cache"),
        "training_split": None,
        "validation_split": "validation",
        "test_split": None,
    }
    (task_dir / f"{name}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return name


# ------------------------------------------------------------------------------ lm-eval run
# How these suites score with the anchorctx model: as lm-eval's ``hf`` model does, which they ran
# on before the adapter was shared (same log-likelihoods, same scores: tests/test_harness.py).
# softmax_dtype None: log-probabilities in the model's dtype (bfloat16 ones tie where float32
# ones would not, and a tie goes to the first choice); keep_anchor False: a context longer than
# the model's length is cut from the left, anchor included.
HF_SCORING: dict[str, Any] = {"keep_anchor": False, "softmax_dtype": None}


def evaluate_docs(
    lm: Any, manager: Any, task: str, doc_ids: list[int], num_fewshot: int
) -> list[dict[str, Any]]:
    """Per-document lm-eval results (``doc_id`` plus the task's metrics) for ``doc_ids``."""
    out = evaluate(lm, manager, task, num_fewshot=num_fewshot, samples={task: doc_ids})
    return sorted(out["samples"][task], key=lambda s: s["doc_id"])


def _progress(total: int, desc: str, enabled: bool) -> Any:
    return tqdm(total=total, desc=desc, unit="q", disable=not enabled, dynamic_ncols=True)


def _limit(n: int, limit: int | None) -> list[int]:
    return list(range(n if limit is None else min(n, limit)))


# ------------------------------------------------------------------------------------ MMLU
def _mmlu_units(
    cfg: ExperimentConfig, task_dir: Path, found: dict[str, dict[str, Path]]
) -> Iterator[tuple[str, str, list[int]]]:
    for subject, files in found.items():
        hcfg = cfg.evaluation.harness
        # Checks the files too: an empty test file (or dev file, with few-shot) is an error.
        name = write_mmlu_yaml(task_dir, subject, files, fewshot=hcfg.mmlu_fewshot)
        test = task_dir / "data" / "mmlu" / "test" / f"{subject}.jsonl"
        n = _count_lines(test if files["test"].suffix == ".csv" else files["test"])
        yield subject, name, _limit(n, hcfg.limit)


def _mmlu_record(subject: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    correct = [float(r["acc"]) for r in rows]
    return {
        "key": f"mmlu/{subject}",
        "subject": subject,
        "n": len(correct),
        "acc": 100 * sum(correct) / max(1, len(correct)),
        "doc_ids": [int(r["doc_id"]) for r in rows],
        "correct": correct,
    }


def run_suite_mmlu(
    model: Any,
    tokenizer: Any,
    cfg: ExperimentConfig,
    *,
    done: dict[str, dict[str, Any]],
    on_sample: OnSample,
    progress: bool = True,
) -> dict[str, Any]:
    """MMLU ``acc`` (micro-average over questions) plus per-subject accuracies, in percent."""
    hcfg = cfg.evaluation.harness
    if hcfg.mmlu_dir is None:
        raise HarnessDataError("evaluation.harness.mmlu_dir is not set")
    found, missing = mmlu_layout(hcfg.mmlu_dir)
    if not found:
        raise HarnessDataError(f"no MMLU subject files under {hcfg.mmlu_dir} (see layout docs)")
    # Imported here: the lm-eval model imports torch and lm-eval, which the suite registry skips.
    from anchorctx.evaluation.lm_eval.model import make_lm

    records: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="anchorctx-mmlu-") as tmp:
        units = list(_mmlu_units(cfg, Path(tmp), found))
        todo = [u for u in units if f"mmlu/{u[0]}" not in done]
        bar = _progress(sum(len(u[2]) for u in todo), "mmlu", progress)
        lm = make_lm(model, tokenizer, batch_size=hcfg.batch_size, **HF_SCORING) if todo else None
        tm = task_manager(Path(tmp)) if todo else None
        for subject, name, ids in units:
            key = f"mmlu/{subject}"
            if key in done:
                records[subject] = done[key]
                continue
            records[subject] = _mmlu_record(
                subject, evaluate_docs(lm, tm, name, ids, hcfg.mmlu_fewshot)
            )
            on_sample(records[subject])
            bar.update(len(ids))
        bar.close()
    return {**_mmlu_summary(records, missing), "reference": reference(tokenizer, **HF_SCORING)}


def _mmlu_summary(records: dict[str, dict[str, Any]], missing: dict[str, str]) -> dict[str, Any]:
    n = sum(r["n"] for r in records.values())
    # Micro-average: every question weighs the same (lm-eval's weight_by_size for mmlu).
    micro = sum(r["acc"] * r["n"] for r in records.values()) / max(1, n)
    scores: dict[str, dict[str, float]] = {"mmlu": {"acc": round(micro, 4)}}
    for subject in sorted(records):
        scores[f"mmlu_{subject}"] = {"acc": round(records[subject]["acc"], 4)}
    return {
        "scores": scores,
        "counts": {"mmlu": n, **{f"mmlu_{s}": r["n"] for s, r in sorted(records.items())}},
        "not_run": {f"mmlu_{s}": reason for s, reason in missing.items()},
        "complete": not missing,
    }


# ------------------------------------------------------------------------------- HellaSwag
def _chunks(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def _chunk_key(ids: list[int]) -> str:
    return f"hellaswag/{ids[0]:06d}-{ids[-1]:06d}"


def _hellaswag_record(ids: list[int], rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "key": _chunk_key(ids),
        "n": len(rows),
        "doc_ids": [int(r["doc_id"]) for r in rows],
        "acc": [float(r["acc"]) for r in rows],
        "acc_norm": [float(r["acc_norm"]) for r in rows],
    }


def run_suite_hellaswag(
    model: Any,
    tokenizer: Any,
    cfg: ExperimentConfig,
    *,
    done: dict[str, dict[str, Any]],
    on_sample: OnSample,
    progress: bool = True,
) -> dict[str, Any]:
    """HellaSwag ``acc_norm`` (and ``acc``) on the validation split, zero-shot, in percent."""
    hcfg = cfg.evaluation.harness
    if hcfg.hellaswag_dir is None:
        raise HarnessDataError("evaluation.harness.hellaswag_dir is not set")
    path = hellaswag_file(hcfg.hellaswag_dir)
    n = count_records(path, HELLASWAG_KEY, "HellaSwag validation")
    chunks = _chunks(_limit(n, hcfg.limit), HELLASWAG_CHUNK)
    # Imported here: the lm-eval model imports torch and lm-eval, which the suite registry skips.
    from anchorctx.evaluation.lm_eval.model import make_lm

    records = []
    with tempfile.TemporaryDirectory(prefix="anchorctx-hellaswag-") as tmp:
        todo = [c for c in chunks if _chunk_key(c) not in done]
        bar = _progress(sum(map(len, todo)), "hellaswag", progress)
        if todo:
            name = write_hellaswag_yaml(Path(tmp), path)
            lm = make_lm(model, tokenizer, batch_size=hcfg.batch_size, **HF_SCORING)
            tm = task_manager(Path(tmp))
        for ids in chunks:
            if _chunk_key(ids) in done:
                records.append(done[_chunk_key(ids)])
                continue
            records.append(_hellaswag_record(ids, evaluate_docs(lm, tm, name, ids, 0)))
            on_sample(records[-1])
            bar.update(len(ids))
        bar.close()
    n = sum(r["n"] for r in records)
    mean = {
        m: round(100 * sum(sum(r[m]) for r in records) / max(1, n), 4) for m in ("acc", "acc_norm")
    }
    return {
        "scores": {"hellaswag": mean},
        "counts": {"hellaswag": n},
        "not_run": {},
        "reference": reference(tokenizer, **HF_SCORING),
    }
