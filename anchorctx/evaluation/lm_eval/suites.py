"""lm-eval's long-context tasks as suites: ``lm_eval:<task or group>`` (RULER, LongBench v2,
BABILong, InfiniteBench), run in-process through the lm-eval model ``anchorctx``, from local files.

The reference is lm-eval's own task definitions (``lm_eval/tasks/<family>/``, the installed
release, pinned 0.4.13): prompts, few-shot examples, generation settings, answer extraction,
metrics and group aggregation are lm-eval's. Each run writes, into a temporary directory, one
task YAML per lm-eval task that ``include``\\ s lm-eval's own file and overrides only where the
documents come from (a local file in the layout the dataset publishes); lm-eval's source is never
changed. The model is :class:`~anchorctx.evaluation.lm_eval.model.AnchorctxLM` on the already
loaded checkpoint: greedy, the project's anchor rule (one anchor token at position 0; truncation
keeps it, ``evaluation.lm_eval.keep_anchor``), the static decoder where the model supports it.

Where each family's documents come from (``evaluation.lm_eval.<family>``):

- ``longbench2``: ``data_path`` = THUDM/LongBench-v2 ``data.json``. lm-eval reads
  ``recursal/longbench-v2`` (the same questions, one dataset config per sub-domain, the four
  choices as a list ``choices``); each task gets the records of its sub-domain
  (:data:`LONGBENCH2_CONFIGS`), ``choices = [choice_A, choice_B, choice_C, choice_D]``, the
  other fields as they are.
- ``babilong``: ``data_dir`` = RMT-team/babilong-1k-samples, ``<length>/qa<N>-00000-of-00001.parquet``
  (lm-eval's loader reads dataset config ``<length>``, split ``qa<N>``).
- ``infinitebench``: ``data_dir`` = xinrongzhang2022/InfiniteBench, one ``<task>.jsonl`` per task
  (lm-eval's split ``X_en`` is the file ``X_eng.jsonl``), read with lm-eval's declared features.
- ``ruler``: lm-eval generates RULER samples itself with the checkpoint's tokenizer; its essay
  haystack (Hugging Face dataset ``baber/paul_graham_essays``, a local copy, or RULER's
  ``PaulGrahamEssays.json``: ``essay_path``), SQuAD v2
  (``dev-v2.0.json``: ``squad_path``) and HotpotQA (``hotpot_dev_distractor_v1.json``:
  ``hotpotqa_path``) are downloaded inside its task code, so those tasks get a loader that reads
  the local file and hands it to lm-eval's own sample generators; ``nltk_data`` holds NLTK's
  ``punkt_tab`` (lm-eval's NIAH module downloads it at import otherwise).

Units (resume and sharding): one per lm-eval task, and per length for RULER and BABILong; a unit's
record holds its per-document metrics. Scores are lm-eval's metrics in percent:
``{task: {length or metric: score}}``; a group's score is lm-eval's aggregation of its tasks
(``aggregate_metric_list``: weighted by size or not), per length; a group without one (e.g.
``infinitebench``) reports its tasks only, as lm-eval does.

A missing data file is one :class:`LmEvalDataError` naming the file, the config key and where
the file comes from, raised before the model loads (the suites' ``preflight``).

Nothing here imports lm-eval, torch or datasets at module import (the suite registry imports
this module); the runner and the loaders import them when they run.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from anchorctx.evaluation.lm_eval.call import (
    LM_EVAL_VERSION,
    LmEvalDataError,
    evaluate,
    reference,
    task_manager,
    tasks_dir,
)
from anchorctx.evaluation.settings import LM_EVAL_PREFIX, LM_EVAL_TASKS, lm_eval_family

if TYPE_CHECKING:
    from anchorctx.experiment import ExperimentConfig

log = logging.getLogger(__name__)
OnSample = Callable[[dict[str, Any]], None]
_MODULE = __name__  # what the YAMLs' ``!function`` tags import

# Where each family's files come from: (Hugging Face dataset repo, what to download).
SOURCES = {
    "longbench2": "the Hugging Face dataset THUDM/LongBench-v2, file data.json",
    "babilong": "the Hugging Face dataset RMT-team/babilong-1k-samples, file {file}",
    "infinitebench": "the Hugging Face dataset xinrongzhang2022/InfiniteBench, file {file}",
    "essays": "the Hugging Face dataset baber/paul_graham_essays (its files as published) or "
    "RULER's PaulGrahamEssays.json",
    "squad": "SQuAD v2 dev-v2.0.json (https://rajpurkar.github.io/SQuAD-explorer/dataset/"
    "dev-v2.0.json)",
    "hotpotqa": "HotpotQA hotpot_dev_distractor_v1.json (lm-eval pins the Hugging Face mirror "
    "namlh2004/hotpotqa)",
    "punkt": "NLTK's punkt_tab (python -m nltk.downloader -d DIR punkt_tab)",
}

# THUDM/LongBench-v2 data.json (domain kind, sub_domain) -> lm-eval's dataset_name (the
# recursal/longbench-v2 config). Keys are lower-cased with everything but letters removed.
LONGBENCH2_CONFIGS = {
    ("single", "academic"): "academic_single",
    ("single", "literary"): "literary",
    ("single", "legal"): "legal_single",
    ("single", "financial"): "financial_single",
    ("single", "governmental"): "government_single",
    ("single", "detective"): "detective",
    ("single", "eventordering"): "event_ordering",
    ("multi", "academic"): "academic_multi",
    ("multi", "legal"): "legal_multi",
    ("multi", "financial"): "financial_multi",
    ("multi", "governmental"): "government_multi",
    ("multi", "multinews"): "multinews",
    ("", "userguideqa"): "user_guide_qa",
    ("", "newlanguagetranslation"): "new_language_translation",
    ("", "manyshotlearning"): "manyshot_learning",
    ("", "agenthistoryqa"): "agent_history_qa",
    ("", "dialoguehistoryqa"): "dialogue_history_qa",
    ("", "coderepoqa"): "code_repo_qa",
    ("", "tableqa"): "table_qa",
    ("", "knowledgegraphreasoning"): "graph_reasoning",
}
LONGBENCH2_FIELDS: tuple[str, ...] = (
    "_id",
    "domain",
    "sub_domain",
    "question",
    "context",
    "answer",
)
LONGBENCH2_FIELDS += tuple(f"choice_{c}" for c in "ABCD")
# RULER tasks whose haystack or questions lm-eval downloads, and the parameters lm-eval's
# niah_utils gives generate_samples for the essay haystack ones (templates and generators are
# lm-eval's; tests/test_lm_eval_suites.py checks this table against lm-eval's functions).
RULER_ESSAY_TASKS: dict[str, dict[str, Any]] = {
    "niah_single_2": {"type_needle_k": "words", "type_needle_v": "numbers"},
    "niah_single_3": {"type_needle_k": "words", "type_needle_v": "uuids"},
    "niah_multikey_1": {"type_needle_k": "words", "type_needle_v": "numbers", "num_needle_k": 4},
    "niah_multiquery": {"type_needle_k": "words", "type_needle_v": "numbers", "num_needle_q": 4},
    "niah_multivalue": {"type_needle_k": "words", "type_needle_v": "numbers", "num_needle_v": 4},
}
RULER_QA_TASKS = {"ruler_qa_squad": "squad", "ruler_qa_hotpot": "hotpotqa"}
QA_SAMPLES = 500  # lm-eval's qa_utils.get_dataset: generate_samples(num_samples=500, ...)


# ------------------------------------------------------------------------- lm-eval's files
class _TagLoader(yaml.SafeLoader):
    """Reads lm-eval's YAMLs as data: ``!function x.y`` stays the string ``x.y``."""


_TagLoader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def _read_yaml(path: Path) -> dict[str, Any]:
    cfg = yaml.load(path.read_text(encoding="utf-8"), Loader=_TagLoader)
    if "include" not in cfg:
        return cfg
    merged = _read_yaml(path.parent / cfg.pop("include"))
    return {**merged, **cfg}


@cache
def _index(family: str) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Task or group name -> (its YAML file, its config with includes merged)."""
    out: dict[str, tuple[Path, dict[str, Any]]] = {}
    for path in sorted((tasks_dir() / family).glob("*.yaml")):
        cfg = _read_yaml(path)
        name = cfg.get("group") or cfg.get("task")
        if isinstance(name, str):
            out[name] = (path, cfg)
    return out


def _entry(task: str) -> tuple[Path, dict[str, Any]]:
    family = lm_eval_family(task) or next((f for f in LM_EVAL_TASKS if task in _index(f)), None)
    index = _index(family) if family else {}
    if task not in index:
        raise LmEvalDataError(
            f"lm-eval {LM_EVAL_VERSION} has no task or group {task!r} (expected a file under "
            f"{tasks_dir() / str(family)}); check the installed lm-eval"
        )
    return index[task]


def is_group(task: str) -> bool:
    return "group" in _entry(task)[1]


@cache
def _tags(family: str) -> dict[str, list[str]]:
    """Tag -> its tasks (a group may list a tag: its tasks are the group's direct members)."""
    out: dict[str, list[str]] = {}
    for name, (_, cfg) in _index(family).items():
        tags = cfg.get("tag") or []
        for tag in [tags] if isinstance(tags, str) else tags:
            out.setdefault(tag, []).append(name)
    return out


def children(group: str) -> list[str]:
    """A group's members as lm-eval builds them: tasks and groups, tags expanded."""
    tags = _tags(str(lm_eval_family(group)))
    return [t for member in _entry(group)[1]["task"] for t in tags.get(member, [member])]


def leaves(task: str) -> list[str]:
    """The lm-eval tasks a task or group name runs, in lm-eval's order."""
    if not is_group(task):
        return [task]
    return [leaf for child in children(task) for leaf in leaves(child)]


# ---------------------------------------------------------------------------------- units
@dataclass(frozen=True)
class Unit:
    """One lm-eval task at one length (RULER, BABILong) or whole: one record, one run."""

    task: str
    length: int | str | None = None

    @property
    def key(self) -> str:
        return self.task if self.length is None else f"{self.task}/{self.length}"


def suite_task(suite: str) -> str:
    return suite.removeprefix(LM_EVAL_PREFIX)


def units(cfg: ExperimentConfig, suite: str) -> list[Unit]:
    task = suite_task(suite)
    family = lm_eval_family(task)
    lengths: list[Any] = [None]
    if family == "ruler":
        lengths = list(cfg.evaluation.lm_eval.ruler.lengths)
    elif family == "babilong":
        lengths = list(cfg.evaluation.lm_eval.babilong.lengths)
    return [Unit(leaf, length) for leaf in leaves(task) for length in lengths]


def unit_cost(unit: Unit) -> float:
    """Relative cost of a unit for balancing shards: its length in thousands of tokens where
    it has one (RULER, BABILong), else 1."""
    if isinstance(unit.length, int):
        return unit.length / 1024
    if isinstance(unit.length, str):
        return max(0.5, float(unit.length.removesuffix("k") or 0))
    return 1.0


# ---------------------------------------------------------------------------------- inputs
def _missing(path: Path, key: str, source: str) -> LmEvalDataError:
    return LmEvalDataError(f"missing {path} ({key}): {source}")


def _babilong_file(root: Path, length: str, split: str) -> Path:
    return root / length / f"{split}-00000-of-00001.parquet"


def _infinitebench_file(root: Path, split: str) -> Path:
    return root / f"{split[:-3]}_eng.jsonl" if split.endswith("_en") else root / f"{split}.jsonl"


def unit_inputs(cfg: ExperimentConfig, unit: Unit) -> dict[str, Path]:
    """The local files a unit reads: config key -> path (the key names the setting)."""
    lm = cfg.evaluation.lm_eval
    family = lm_eval_family(unit.task)
    leaf = _entry(unit.task)[1]
    if family == "longbench2":
        return _given({"evaluation.lm_eval.longbench2.data_path": lm.longbench2.data_path})
    if family == "babilong":
        key = "evaluation.lm_eval.babilong.data_dir"
        root = _given({key: lm.babilong.data_dir})[key]
        return {key: _babilong_file(root, str(unit.length), leaf["test_split"])}
    if family == "infinitebench":
        key = "evaluation.lm_eval.infinitebench.data_dir"
        root = _given({key: lm.infinitebench.data_dir})[key]
        return {key: _infinitebench_file(root, leaf["test_split"])}
    if unit.task in RULER_ESSAY_TASKS:
        return _given({"evaluation.lm_eval.ruler.essay_path": lm.ruler.essay_path})
    if unit.task in RULER_QA_TASKS:
        name = RULER_QA_TASKS[unit.task]
        return _given({f"evaluation.lm_eval.ruler.{name}_path": getattr(lm.ruler, f"{name}_path")})
    return {}


def _given(paths: dict[str, Path | None]) -> dict[str, Path]:
    for key, path in paths.items():
        if path is None:
            raise LmEvalDataError(
                f"{key} is not set: lm-eval's task reads it (see its description in "
                "`anchorctx config --help` or docs/FIDELITY.md)"
            )
    return {k: Path(v) for k, v in paths.items() if v is not None}


def _source(key: str, path: Path) -> str:
    for family in ("longbench2", "babilong", "infinitebench"):
        if f".{family}." in key:
            return SOURCES[family].format(file=path.relative_to(path.parent.parent).as_posix())
    for name, source in (("essay_path", "essays"), ("squad", "squad"), ("hotpotqa", "hotpotqa")):
        if f".{name}" in key:
            return SOURCES[source]
    return key


def inputs(cfg: ExperimentConfig, suite: str) -> dict[str, Path]:
    """Every local file or directory the suite reads (for its fingerprint), by config key (a
    file under a data directory is keyed ``<key>/<relative path>``)."""
    out: dict[str, Path] = {}
    for unit in units(cfg, suite):
        for key, path in unit_inputs(cfg, unit).items():
            root = getattr_path(cfg, key)
            name = key if path == root else f"{key}/{path.relative_to(root).as_posix()}"
            out[name] = path
    return out


def getattr_path(cfg: ExperimentConfig, key: str) -> Path:
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return Path(obj)


def check_data(cfg: ExperimentConfig, suite: str) -> None:
    """Before the model loads: every file the suite reads exists (and, for LongBench v2, every
    sub-domain it needs has questions); else one error naming the file and its source."""
    lm = cfg.evaluation.lm_eval
    all_units = units(cfg, suite)
    for unit in all_units:
        for key, path in unit_inputs(cfg, unit).items():
            if not path.exists():
                raise _missing(path, key, _source(key, path))
            if path.is_dir() and not any(path.iterdir()):
                raise LmEvalDataError(f"{path} ({key}) is empty: expected {_source(key, path)}")
    if lm_eval_family(suite_task(suite)) == "ruler" and any(
        u.task.startswith("niah_") for u in all_units
    ):
        _punkt(lm.ruler.nltk_data)
    if lm_eval_family(suite_task(suite)) == "longbench2":
        data_path = lm.longbench2.data_path
        assert data_path is not None  # unit_inputs checked it
        by_config = longbench2_records(data_path)
        for unit in all_units:
            name = _entry(unit.task)[1]["dataset_name"]
            if not by_config.get(name):
                raise LmEvalDataError(
                    f"{data_path} (evaluation.lm_eval.longbench2.data_path) has no question of "
                    f"{unit.task} (sub-domain {name!r}): is it THUDM/LongBench-v2's data.json?"
                )


def _punkt(nltk_data: Path | None) -> None:
    """NLTK's punkt_tab is found (in ``nltk_data`` or NLTK's own path): lm-eval's NIAH module
    would download it at import otherwise. ``nltk_data`` joins NLTK's search path."""
    # Imported here: nltk is needed only by RULER's NIAH tasks.
    import nltk

    if nltk_data is not None and str(nltk_data) not in nltk.data.path:
        nltk.data.path.insert(0, str(nltk_data))
    try:
        nltk.data.find("tokenizers/punkt_tab")
    except LookupError:
        where = f"under {nltk_data}" if nltk_data else "on NLTK's data path"
        raise LmEvalDataError(
            f"no tokenizers/punkt_tab {where} (evaluation.lm_eval.ruler.nltk_data): "
            f"{SOURCES['punkt']}"
        ) from None


# ------------------------------------------------------------------------------ loaders
def _norm(text: Any) -> str:
    return re.sub(r"[^a-z]", "", str(text).lower())


@cache
def _longbench2_cached(path: str, size: int, mtime: int) -> dict[str, list[dict[str, Any]]]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise LmEvalDataError(f"{path}: not THUDM/LongBench-v2's data.json ({err})") from None
    if not isinstance(data, list):
        raise LmEvalDataError(f"{path}: expected a JSON list of questions (data.json)")
    out: dict[str, list[dict[str, Any]]] = {}
    for i, rec in enumerate(data):
        missing = [f for f in LONGBENCH2_FIELDS if not isinstance(rec, dict) or f not in rec]
        if missing:
            raise LmEvalDataError(f"{path} record {i}: no field {missing[0]!r} (data.json)")
        domain = _norm(rec["domain"])
        kind = "single" if "single" in domain else "multi" if "multi" in domain else ""
        name = LONGBENCH2_CONFIGS.get((kind, _norm(rec["sub_domain"])))
        if name is None:
            raise LmEvalDataError(
                f"{path} record {rec['_id']}: unknown domain/sub_domain "
                f"{rec['domain']!r}/{rec['sub_domain']!r} (not a LongBench v2 sub-domain)"
            )
        choices = [rec[f"choice_{c}"] for c in "ABCD"]
        out.setdefault(name, []).append({**rec, "choices": choices})
    return out


def longbench2_records(path: Path) -> dict[str, list[dict[str, Any]]]:
    """THUDM/LongBench-v2 data.json by lm-eval dataset_name, in file order, each record with
    ``choices`` (the four choice fields as lm-eval's recursal/longbench-v2 has them)."""
    st = path.stat()
    return _longbench2_cached(str(path.resolve()), st.st_size, st.st_mtime_ns)


def _features(spec: Mapping[str, Any] | None) -> Any:
    """lm-eval's ``features`` declaration ({name: {dtype, sequence}}) as ``datasets.Features``."""
    # Imported here: datasets is heavy; only loaders running under lm-eval need it.
    import datasets

    if not spec:
        return None
    return datasets.Features(
        {
            name: datasets.Sequence(datasets.Value(f["dtype"]))
            if f.get("sequence")
            else datasets.Value(f["dtype"])
            for name, f in spec.items()
        }
    )


def local_dataset(
    anchorctx_format: str,
    anchorctx_files: dict[str, str],
    anchorctx_cache: str,
    features: Mapping[str, Any] | None = None,
    **_: Any,
) -> Any:
    """An lm-eval ``custom_dataset``: the task's split(s) from local files (``json`` or
    ``parquet``), typed with the task's declared ``features``. Other keyword arguments
    (lm-eval's metadata: tokenizer, lengths) are not needed here."""
    # Imported here: datasets is heavy; only loaders running under lm-eval need it.
    import datasets

    return datasets.load_dataset(
        anchorctx_format,
        data_files=anchorctx_files,
        features=_features(features),
        cache_dir=anchorctx_cache,
    )


def essay_texts(path: Path, cache_dir: str | None = None) -> list[str]:
    """The essays of a local essay source, as lm-eval's ``get_haystack("essay")`` reads the
    ``text`` column of baber/paul_graham_essays' ``train`` split. ``path`` is either

    - a directory: a local copy of that Hugging Face dataset repo (its files as published),
      read with ``datasets.load_dataset(path, split="train")``; or
    - a file: RULER's ``PaulGrahamEssays.json`` (``{"text": ...}``, NVIDIA/RULER's
      ``download_paulgraham_essay.py`` output; what ``anchorctx demo-assets --paper`` writes), a
      JSON list of ``{"text": ...}`` records, or a ``.jsonl``/``.parquet`` file with a ``text``
      column.
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise LmEvalDataError(f"{path}: not an essay JSON file ({err})") from None
        if isinstance(data, dict) and isinstance(data.get("text"), str):
            return [data["text"]]
        if isinstance(data, list) and all(
            isinstance(r, dict) and isinstance(r.get("text"), str) for r in data
        ):
            return [r["text"] for r in data]
        raise LmEvalDataError(
            f"{path} (evaluation.lm_eval.ruler.essay_path): expected RULER's PaulGrahamEssays.json "
            '({"text": ...}) or a list of {"text": ...} records'
        )
    # Imported here: datasets is heavy; only loaders running under lm-eval need it.
    import datasets

    if path.is_dir():
        ds = datasets.load_dataset(str(path), split="train", cache_dir=cache_dir)
    else:
        fmt = {".jsonl": "json", ".parquet": "parquet"}.get(path.suffix)
        if fmt is None:
            raise LmEvalDataError(
                f"{path} (evaluation.lm_eval.ruler.essay_path): expected a directory (a copy of "
                "baber/paul_graham_essays) or a .json, .jsonl or .parquet file"
            )
        ds = datasets.load_dataset(fmt, data_files=str(path), split="train", cache_dir=cache_dir)
    if "text" not in ds.column_names:
        raise LmEvalDataError(
            f"{path} (evaluation.lm_eval.ruler.essay_path): no 'text' column ({ds.column_names})"
        )
    return list(ds["text"])


def essay_haystack(texts: list[str]) -> list[str]:
    """lm-eval's ``get_haystack("essay")`` on the given essays: joined by spaces, whitespace
    runs collapsed, split on spaces."""
    return re.sub(r"\s+", " ", " ".join(texts)).split(" ")


def ruler_essay_dataset(
    anchorctx_essays: str, anchorctx_task: str, anchorctx_cache: str, **kwargs: Any
) -> Any:
    """lm-eval's NIAH samples on the essay haystack, with the haystack read from a local essay
    source (:func:`essay_texts`; lm-eval's ``get_haystack("essay")`` reads the Hub otherwise)."""
    # Imported here: lm-eval's RULER modules import nltk, wonderwords and transformers.
    from lm_eval.tasks.ruler import niah_utils
    from lm_eval.tasks.ruler.common_utils import (
        DEFAULT_SEQ_LENGTHS,
        get_tokenizer,
        resolve_tokenizer_name,
    )

    haystack = essay_haystack(essay_texts(Path(anchorctx_essays), anchorctx_cache))
    tokenizer = get_tokenizer(resolve_tokenizer_name(kwargs))
    return niah_utils.download_dataset(
        niah_utils.generate_samples(
            haystack,
            max_seq_length=seq,
            template=niah_utils.TEMPLATE,
            type_haystack="essay",
            num_samples=500,
            TOKENIZER=tokenizer,
            **RULER_ESSAY_TASKS[anchorctx_task],
        )
        for seq in kwargs.pop("max_seq_lengths", DEFAULT_SEQ_LENGTHS)
    )


def read_squad(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """lm-eval's ``qa_utils.read_squad`` on a local dev-v2.0.json (same documents, same order)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = []
    for d in data["data"]:
        more = [index[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            for qa in p["qas"]:
                if not qa["is_impossible"]:
                    qas.append(
                        {
                            "query": qa["question"],
                            "outputs": [a["text"] for a in qa["answers"]],
                            "context": [index[p["context"]]],
                            "more_context": [i for i in more if i != index[p["context"]]],
                        }
                    )
    return qas, docs


def read_hotpotqa(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """lm-eval's ``qa_utils.read_hotpotqa`` on a local hotpot_dev_distractor_v1.json."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = [
        {
            "query": d["question"],
            "outputs": [d["answer"]],
            "context": [index[f"{t}\n{''.join(p)}"] for t, p in d["context"]],
        }
        for d in data
    ]
    return qas, docs


def ruler_qa_dataset(anchorctx_qa: str, anchorctx_path: str, **kwargs: Any) -> Any:
    """lm-eval's ``qa_utils.get_qa_dataset`` with the documents read from a local file."""
    # Imported here: lm-eval's RULER modules import transformers.
    import datasets
    from lm_eval.tasks.ruler import qa_utils
    from lm_eval.tasks.ruler.common_utils import (
        DEFAULT_SEQ_LENGTHS,
        get_tokenizer,
        resolve_tokenizer_name,
    )

    tokenizer = get_tokenizer(resolve_tokenizer_name(kwargs))
    reader = read_squad if anchorctx_qa == "squad" else read_hotpotqa
    qas, docs = reader(Path(anchorctx_path))
    # lm-eval's get_dataset: generate_samples with 500 samples and 32 new tokens. It indexes
    # the first 500 questions, so a file with fewer (a test stand-in; SQuAD v2 dev has 5,928
    # answerable questions, HotpotQA dev 7,405) gets one sample per question instead.
    num_samples = QA_SAMPLES
    if len(qas) < QA_SAMPLES:
        log.warning(
            "%s has %d questions (< %d): one sample per question",
            anchorctx_path,
            len(qas),
            QA_SAMPLES,
        )
        num_samples = len(qas)
    df = (
        qa_utils.generate_samples(
            tokenizer=tokenizer,
            docs=docs,
            qas=qas,
            num_samples=num_samples,
            tokens_to_generate=32,
            max_seq_length=seq,
        )
        for seq in kwargs.pop("max_seq_lengths", DEFAULT_SEQ_LENGTHS)
    )
    rows = list(itertools.chain.from_iterable(df))
    return {"test": datasets.Dataset.from_list(rows, split=datasets.Split.TEST)}


# --------------------------------------------------------------------------- task YAMLs
def _override(cfg: ExperimentConfig, unit: Unit, tmp: Path) -> tuple[dict[str, Any], str | None]:
    """(plain keys, the ``custom_dataset`` function or None) that point one lm-eval task at its
    local files; everything else comes from lm-eval's file."""
    family = lm_eval_family(unit.task)
    leaf = _entry(unit.task)[1]
    cache_dir = str(tmp / "hf_cache")
    files = unit_inputs(cfg, unit)
    if family == "longbench2":
        records = longbench2_records(next(iter(files.values())))[leaf["dataset_name"]]
        path = tmp / "longbench2" / f"{leaf['dataset_name']}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        split = leaf["test_split"]
        kwargs: dict[str, Any] = {"anchorctx_format": "json", "anchorctx_files": {split: str(path)}}
        return {"dataset_kwargs": {**kwargs, "anchorctx_cache": cache_dir}}, "local_dataset"
    if family == "babilong":
        split = leaf["test_split"]
        kwargs = {"anchorctx_format": "parquet", "anchorctx_files": {split: str(*files.values())}}
        return {"dataset_kwargs": {**kwargs, "anchorctx_cache": cache_dir}}, "local_dataset"
    if family == "infinitebench":
        split = leaf["test_split"]
        kwargs = {
            "anchorctx_format": "json",
            "anchorctx_files": {split: str(*files.values())},
            "anchorctx_cache": cache_dir,
            "features": (leaf.get("dataset_kwargs") or {}).get("features"),
        }
        return {"dataset_kwargs": kwargs}, "local_dataset"
    if unit.task in RULER_ESSAY_TASKS:
        kwargs = {"anchorctx_essays": str(*files.values()), "anchorctx_task": unit.task}
        return {"dataset_kwargs": {**kwargs, "anchorctx_cache": cache_dir}}, "ruler_essay_dataset"
    if unit.task in RULER_QA_TASKS:
        kwargs = {"anchorctx_qa": RULER_QA_TASKS[unit.task], "anchorctx_path": str(*files.values())}
        return {"dataset_kwargs": kwargs}, "ruler_qa_dataset"
    return {}, None  # lm-eval generates these samples itself, offline


def write_task_yaml(cfg: ExperimentConfig, unit: Unit, tmp: Path) -> Path:
    """``<tmp>/<task>.yaml``: lm-eval's task file included, its data source overridden."""
    base, _ = _entry(unit.task)
    plain, function = _override(cfg, unit, tmp)
    spec = {"include": str(base), "task": unit.task, "tag": [], **plain}
    text = yaml.safe_dump(spec, sort_keys=False)
    if function is not None:
        text += f"custom_dataset: !function {_MODULE}.{function}\n"
    path = tmp / f"{unit.task}.yaml"
    path.write_text(text, encoding="utf-8")
    return path


# ------------------------------------------------------------------------------- running
def _metadata(unit: Unit, tokenizer: Any) -> dict[str, Any]:
    """lm-eval's task metadata (``--metadata``): the tokenizer RULER sizes samples with, and
    the length RULER (a list of token counts) or BABILong (a dataset config name) is run at."""
    meta: dict[str, Any] = {"tokenizer": str(tokenizer.name_or_path)}
    if isinstance(unit.length, int):
        meta["max_seq_lengths"] = [unit.length]
    elif isinstance(unit.length, str):
        meta["max_seq_lengths"] = unit.length
    return meta


def _metric_names(unit: Unit) -> list[str]:
    names = [m["metric"] for m in _entry(unit.task)[1].get("metric_list", [])]
    return [str(unit.length)] if lm_eval_family(unit.task) == "ruler" else names


def _score_key(unit: Unit, metric: str) -> str:
    """The key a unit's score is reported under: its length where it has one."""
    return metric if unit.length is None else str(unit.length)


def unit_record(unit: Unit, out: dict[str, Any]) -> dict[str, Any]:
    """The per-unit record (one line of the samples file) from ``simple_evaluate``'s output."""
    results = out["results"][unit.task]
    metrics = _metric_names(unit)
    missing = [m for m in metrics if f"{m},none" not in results]
    if missing:
        raise RuntimeError(f"lm-eval reported no {missing[0]!r} for {unit.task}")
    samples = []
    for s in sorted(out["samples"][unit.task], key=lambda s: s["doc_id"]):
        resp = s.get("filtered_resps") or [None]
        samples.append(
            {
                "doc_id": int(s["doc_id"]),
                "prediction": resp[0] if isinstance(resp[0], str) else None,
                **{m: float(s[m]) for m in metrics if m in s},
            }
        )
    return {
        "key": unit.key,
        "task": unit.task,
        "length": unit.length,
        "n": len(samples),
        "scores": {_score_key(unit, m): 100 * float(results[f"{m},none"]) for m in metrics},
        "samples": samples,
    }


def check_vt_tokenizer(tokenizer: Any, tries: int = 8) -> None:
    """lm-eval's ``ruler_vt`` first sizes a one-shot example within 500 tokens, starting at 5
    noise lines: when that first draw (prompt, its answer list and 30 tokens to generate) is
    already over 500 it settles on 0 noise lines, which cannot build a chain, and retries
    forever (``vt_utils.sys_vartrack_w_noise_random``). With a tokenizer that fine (a test
    model's few-thousand-piece vocabulary) the task would hang, so it fails here instead when
    any of ``tries`` such draws is over. Llama/Qwen-sized vocabularies need about half."""
    # Imported here: lm-eval's RULER modules import numpy, transformers and datasets.
    import contextlib
    import io
    import random

    import numpy as np
    from lm_eval.tasks.ruler import vt_utils

    def size() -> int:  # lm-eval's first measurement, as it computes it
        text, answer = vt_utils.generate_input_output(5, 1, 4, is_icl=True)
        return len(tokenizer(text + f" {answer}").input_ids) + 30

    state, np_state = random.getstate(), np.random.get_state()
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its "reduces chain length" prints
            worst = max(size() for _ in range(tries))
    finally:  # lm-eval seeds before it builds samples; leave its streams as they were
        random.setstate(state)
        np.random.set_state(np_state)
    if worst > 500:
        raise RuntimeError(
            f"lm-eval's ruler_vt cannot run with this tokenizer: its smallest one-shot example "
            f"takes up to {worst} tokens with the 30 to generate, over the 500 lm-eval allows "
            "(vt_utils.get_dataset), and lm-eval would then retry forever"
        )


def lm_options(cfg: ExperimentConfig) -> dict[str, Any]:
    """The anchorctx model's options for these suites (``evaluation.lm_eval`` and the decoder
    settings of ``evaluation``); log-probabilities in float32, the model's default."""
    ev, lm = cfg.evaluation, cfg.evaluation.lm_eval
    return {
        "batch_size": lm.batch_size,
        "max_length": lm.max_length,
        "engine": ev.engine,
        "deterministic": ev.deterministic_decode,
        "keep_anchor": lm.keep_anchor,
    }


def evaluate_unit(lm: Any, cfg: ExperimentConfig, unit: Unit, tmp: Path) -> dict[str, Any]:
    """Run one unit through lm-eval's ``simple_evaluate``; returns its record."""
    return unit_record(unit, run_unit(lm, cfg, unit, tmp))


def run_unit(lm: Any, cfg: ExperimentConfig, unit: Unit, tmp: Path) -> dict[str, Any]:
    """``simple_evaluate``'s output for one unit on any lm-eval model ``lm`` (``anchorctx``,
    or lm-eval's own ``hf`` for a comparison): the task YAML on local files, the task metadata
    (``lm.tokenizer``'s name, the length), ``evaluation.lm_eval.limit``, lm-eval's seeds."""
    if unit.task == "ruler_vt":
        check_vt_tokenizer(lm.tokenizer)
    task_dir = tmp / unit.key.replace("/", "@")
    task_dir.mkdir(parents=True, exist_ok=True)
    write_task_yaml(cfg, unit, task_dir)
    manager = task_manager(task_dir, _metadata(unit, lm.tokenizer))
    return evaluate(lm, manager, unit.task, limit=cfg.evaluation.lm_eval.limit)


def suite_runner(suite: str) -> Callable[..., dict[str, Any]]:
    """The runner of suite ``lm_eval:<task>`` (results.SUITES's signature, that of the
    ``run_suite`` functions of ruler and longbench)."""

    def runner(
        model: Any,
        tokenizer: Any,
        cfg: ExperimentConfig,
        *,
        done: Mapping[str, dict[str, Any]],
        on_sample: OnSample,
        progress: bool = True,
    ) -> dict[str, Any]:
        plan = units(cfg, suite)
        records = {u.key: done[u.key] for u in plan if u.key in done}
        todo = [u for u in plan if u.key not in done]
        if todo:
            # Imported here: the lm-eval model imports torch and lm-eval.
            from anchorctx.evaluation.lm_eval.model import make_lm

            if lm_eval_family(suite_task(suite)) == "ruler":
                _punkt(cfg.evaluation.lm_eval.ruler.nltk_data)
            lm = make_lm(model, tokenizer, **lm_options(cfg))
            with tempfile.TemporaryDirectory(prefix="anchorctx-lm-eval-") as tmp:
                for unit in todo:
                    if progress:
                        log.info("%s: %s", suite, unit.key)
                    records[unit.key] = evaluate_unit(lm, cfg, unit, Path(tmp))
                    on_sample(records[unit.key])
        return summarize(suite, [records[u.key] for u in plan if u.key in records], tokenizer)

    return runner


def summarize(suite: str, records: list[dict[str, Any]], tokenizer: Any = None) -> dict[str, Any]:
    """Scores, counts and group aggregates of a suite's unit records."""
    scores: dict[str, dict[str, float]] = {}
    counts: dict[str, dict[str, int]] = {}
    for rec in records:
        for key, value in rec["scores"].items():
            scores.setdefault(rec["task"], {})[key] = round(value, 4)
            counts.setdefault(rec["task"], {})[key] = rec["n"]
    task = suite_task(suite)
    if is_group(task):
        _aggregate(task, scores, counts)
    return {
        "scores": scores,
        "counts": counts,
        "not_run": {},
        "reference": reference(tokenizer, task=task),
    }


def _aggregate(group: str, scores: dict[str, dict[str, float]], counts: dict[str, dict[str, int]]):
    """lm-eval's group score (``aggregate_metric_list``, ``aggregate_subtask_metrics``) of
    ``group`` and its subgroups, per score key; none where lm-eval's group file declares none."""
    for child in children(group):
        if is_group(child):
            _aggregate(child, scores, counts)
    rules = _entry(group)[1].get("aggregate_metric_list") or []
    if not rules:
        return
    weight_by_size = all(r.get("weight_by_size", True) for r in rules)
    keys = dict.fromkeys(k for c in children(group) for k in scores.get(c, {}))
    for key in keys:
        parts = [c for c in children(group) if key in scores.get(c, {})]
        if len(parts) < len(children(group)):
            continue  # a partial group has no score
        values = [scores[c][key] for c in parts]
        sizes = [counts[c][key] for c in parts]
        scores.setdefault(group, {})[key] = round(
            _aggregate_subtask_metrics(values, sizes, weight_by_size), 4
        )
        counts.setdefault(group, {})[key] = sum(sizes)


def _aggregate_subtask_metrics(values: list[float], sizes: list[int], weight: bool) -> float:
    # Imported here: lm-eval imports torch; its aggregation is the reference.
    from lm_eval.api.metrics import aggregate_subtask_metrics

    return aggregate_subtask_metrics(values, sizes, weight_by_size=weight)
