"""The ``evaluation`` section: suites (RULER, LongBench, MMLU, HellaSwag, perplexity, lm-eval's
long-context tasks), their data and sizes, generation engine, device and the work pool. Read by
:mod:`anchorctx.evaluation`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, PositiveInt

from anchorctx.attention.names import ENGINE_NAMES, VARIANTS
from anchorctx.config import Device, Dtype, Seed, Strict

# mypy cannot read a Literal built from a tuple (it sees Any); pydantic validates it at runtime.
PerplexityAttention = Literal[("checkpoint", *VARIANTS)]  # type: ignore[valid-type]
PerplexityEngine = Literal[ENGINE_NAMES]  # type: ignore[valid-type]


class RulerConfig(Strict):
    tasks: list[str] | None = Field(None, description="Default: all 13 RULER tasks.")
    exclude: list[str] = Field(default_factory=list, description="Paper (Llama-2): cwe, mk3.")
    lengths: list[PositiveInt] = Field(
        default_factory=lambda: [4096, 8192, 16384, 32768, 65536, 131072]
    )
    num_samples: int = Field(500, gt=0)
    seed: Seed = 42
    essay_path: Path | None = None
    squad_path: Path | None = None
    hotpotqa_path: Path | None = None
    english_words_path: Path | None = Field(
        None,
        description="RULER's scripts/data/synthetic/json/english_words.json (git LFS): CWE's word "
        "source beyond the wonderwords lists (needed near 128K; without it such lengths fail).",
    )
    nltk_data: Path | None = Field(
        None,
        description="Directory in NLTK's data layout holding tokenizers/punkt_tab/english (the "
        "pretrained English Punkt model RULER splits essays with; `python -m nltk.downloader -d "
        "DIR punkt_tab`). Default: NLTK's own search path. Missing model: an error.",
    )
    fit: Literal["ruler", "tight"] = Field(
        "ruler",
        description="Sample length rule. 'ruler': RULER's (an overflowing sample drops whole "
        "haystack steps; 4K samples are 2.3K-4.1K tokens). 'tight': shrink it to the largest "
        "size that fits (all samples near the target; a deviation from the reference).",
    )
    sample_store: bool = Field(
        True,
        description="Keep the generated samples in <run_root>/<name>/ruler-samples (JSON, one "
        "file per task, length and sample identity), so every evaluation process of the "
        "experiment (each arm, shard and re-run) reads them instead of generating them again "
        "(1504 samples at 2K-16K cost 34.5 s of CPU). Disk: about the prompts' text, ~10 GB for "
        "the paper's 13 tasks x 6 lengths x 500 samples. Scores do not depend on it.",
    )


class LongBenchConfig(Strict):
    data_dir: Path | None = None
    datasets: list[str] | None = Field(
        None,
        description="Default: LongBench pred.py's 21 datasets, the 5 Chinese ones included "
        "(multifieldqa_zh, dureader and vcsum are scored with jieba).",
    )
    max_length: int | None = Field(
        None,
        gt=1,
        description="LongBench's per-model max_length (config/model2maxlen.json): prompts longer "
        "than this many tokens (anchor included) keep their first and last int(max_length/2). "
        "The reference lists 3500 for 4K models, 7500 for 8K, 15500 for 16K, 31500 for 32K. "
        "Default: that convention (1000*K - 500 for a K*1024-position model).",
    )
    limit: int | None = Field(None, gt=0, description="Samples per dataset (None: all).")


class HarnessConfig(Strict):
    mmlu_dir: Path | None = None
    hellaswag_dir: Path | None = None
    mmlu_fewshot: int = Field(5, ge=0)
    limit: int | None = Field(None, gt=0)
    batch_size: int = Field(8, gt=0)


class PerplexityConfig(Strict):
    """Suite ``perplexity`` (paper Figure 4): token-level perplexity, exp(mean NLL over the
    predicted tokens), of held-out rows packed as training packs them, computed with the
    attention the checkpoint was trained with (:mod:`anchorctx.evaluation.perplexity`)."""

    data_path: Path | None = Field(
        None,
        description="Held-out documents: a .jsonl, .jsonl.zst or .parquet file, one document per "
        "record (its text in text_field), kept out of data.sources. Packed in file order into "
        "rows of each length as prepare-data packs (the anchor at index 0, data.separator after "
        "each document).",
    )
    text_field: str = Field("text", description="Dotted path of a record's text.")
    lengths: list[PositiveInt] | None = Field(
        None,
        description="Row lengths in tokens (model inputs; each row holds one more token, the "
        "last target). Default: data.seq_len, the length the arms train at.",
    )
    rows: int = Field(8, gt=0, description="Rows per length: the first N rows the file fills.")
    attention: PerplexityAttention = Field(
        "checkpoint",
        description="Attention variant of the rows. checkpoint: the one its anchorctx.json "
        "records (the arm's training attention; full for a checkpoint without one, a base "
        "model). Or full, intra_doc, intra_doc_reset, anchor.",
    )
    engine: PerplexityEngine = Field(
        "auto", description="Attention engine (training.engine's names); auto: sdpa on a CPU."
    )


# lm-eval 0.4.13's long-context task families (lm_eval/tasks/<family>/): every group and task a
# suite ``lm_eval:<name>`` may name (tests/test_lm_eval_suites.py checks them against lm-eval).
LM_EVAL_TASKS: dict[str, tuple[str, ...]] = {
    "ruler": (
        "ruler",
        *(f"niah_single_{i}" for i in (1, 2, 3)),
        *(f"niah_multikey_{i}" for i in (1, 2, 3)),
        "niah_multiquery",
        "niah_multivalue",
        *(f"ruler_{t}" for t in ("vt", "cwe", "fwe", "qa_squad", "qa_hotpot")),
    ),
    "longbench2": (
        "longbench2",
        *(
            f"longbench2_{t}"
            for t in [
                "single",
                "multi",
                "incontext",
                "history",
                "structured",
                "govt_single",
                "legal_single",
                "lit_single",
                "fin_single",
                "event_order",
                "academic_single",
                "detective",
                "govt_multi",
                "academic_multi",
                "fin_multi",
                "news_multi",
                "legal_multi",
                "user_guide",
                "translate",
                "many_shot",
                "agent_history",
                "dialogue_history",
                "graph",
                "table",
                "code",
            ]
        ),
    ),
    "babilong": ("babilong", "babilong_longctx", *(f"babilong_qa{i}" for i in range(1, 21))),
    "infinitebench": (
        "infinitebench",
        *(
            f"infinitebench_{t}"
            for t in [
                "passkey",
                "kv_retrieval",
                "number_string",
                "code_run",
                "code_debug",
                "math_find",
                "longdialogue_qa_en",
                "longbook_qa_en",
                "longbook_sum_en",
                "longbook_choice_en",
                "longbook_qa_chn",
            ]
        ),
    ),
}
LM_EVAL_PREFIX = "lm_eval:"


def lm_eval_family(task: str) -> str | None:
    """The family (``evaluation.lm_eval`` sub-section) of an lm-eval task or group name."""
    return next((f for f, names in LM_EVAL_TASKS.items() if task in names), None)


PROJECT_SUITES = ("ruler", "longbench", "mmlu", "hellaswag", "perplexity")


def suite_name(name: str) -> str:
    """``name`` if it is a suite (a project suite or ``lm_eval:<task>``), else a ValueError
    listing the nearest names."""
    if name in PROJECT_SUITES:
        return name
    task = name.removeprefix(LM_EVAL_PREFIX)
    if not name.startswith(LM_EVAL_PREFIX) or lm_eval_family(task) is None:
        near = [f"lm_eval:{t}" for ts in LM_EVAL_TASKS.values() for t in ts if t[:4] == task[:4]]
        raise ValueError(
            f"{name!r} is not a suite: expected ruler, longbench, mmlu, hellaswag, perplexity or "
            "lm_eval:<task> with <task> one of lm-eval's long-context tasks or groups ("
            + (", ".join(near[:6]) if near else ", ".join(f"lm_eval:{f}" for f in LM_EVAL_TASKS))
            + ")"
        )
    return name


def suite_argument(name: str) -> str:
    """:func:`suite_name` as a command-line option's ``type`` (its error, argparse's)."""
    try:
        return suite_name(name)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


# A suite: the project's own, or ``lm_eval:<task or group>`` (lm-eval's task definitions).
SuiteName = Annotated[str, AfterValidator(suite_name)]


class LmEvalRulerConfig(Strict):
    lengths: list[Literal[4096, 8192, 16384, 32768, 65536, 131072]] = Field(
        default_factory=lambda: [4096],  # type: ignore[arg-type]  # mypy infers a plain list, not the Literal items
        description="lm-eval's RULER max_seq_lengths (task metadata): the sample lengths, one "
        "score per length. Only the lengths lm-eval's task files score (metric_list).",
    )
    nltk_data: Path | None = Field(
        None,
        description="Directory in NLTK's layout holding tokenizers/punkt_tab (lm-eval's NIAH "
        "tasks split essays with it and would otherwise download it). Default: NLTK's path.",
    )
    essay_path: Path | None = Field(
        None,
        description="The essay haystack of niah_single_2/3, niah_multikey_1, niah_multiquery, "
        "niah_multivalue: a local copy of the Hugging Face dataset repo baber/paul_graham_essays "
        "(the directory, as published; what lm-eval downloads), or RULER's PaulGrahamEssays.json "
        '({"text": ...}, the file evaluation.ruler.essay_path reads), or a .jsonl/.parquet file '
        "with a text column.",
    )
    squad_path: Path | None = Field(
        None,
        description="SQuAD v2 dev-v2.0.json (rajpurkar.github.io/SQuAD-explorer/dataset/"
        "dev-v2.0.json), ruler_qa_squad's documents and questions.",
    )
    hotpotqa_path: Path | None = Field(
        None,
        description="hotpot_dev_distractor_v1.json (HotpotQA; lm-eval pins the Hugging Face "
        "mirror namlh2004/hotpotqa), ruler_qa_hotpot's documents and questions.",
    )


class LmEvalLongBench2Config(Strict):
    data_path: Path | None = Field(
        None,
        description="data.json of the Hugging Face dataset THUDM/LongBench-v2 (503 questions; "
        "lm-eval's task files read the same questions as recursal/longbench-v2, one config per "
        "sub-domain).",
    )


class LmEvalBabilongConfig(Strict):
    data_dir: Path | None = Field(
        None,
        description="Local copy of the Hugging Face dataset RMT-team/babilong-1k-samples (the "
        "repo lm-eval loads): <length>/qa<N>-00000-of-00001.parquet.",
    )
    lengths: list[Literal["0k", "1k", "2k", "4k", "8k", "16k", "32k", "64k", "128k"]] = Field(
        default_factory=lambda: ["4k"],  # type: ignore[arg-type]  # mypy infers a plain list, not the Literal items
        description="Context lengths (lm-eval's max_seq_lengths metadata, the dataset's config "
        "names), one score per length.",
    )


class LmEvalInfiniteBenchConfig(Strict):
    data_dir: Path | None = Field(
        None,
        description="Local copy of the Hugging Face dataset xinrongzhang2022/InfiniteBench: one "
        "<task>.jsonl per task (passkey.jsonl, kv_retrieval.jsonl, longbook_choice_eng.jsonl, ...).",
    )


class LmEvalConfig(Strict):
    """lm-eval's long-context tasks (suites ``lm_eval:<task>``), run in-process through the
    lm-eval model ``anchorctx`` from local files (docs/FIDELITY.md)."""

    ruler: LmEvalRulerConfig = Field(default_factory=LmEvalRulerConfig)
    longbench2: LmEvalLongBench2Config = Field(default_factory=LmEvalLongBench2Config)
    babilong: LmEvalBabilongConfig = Field(default_factory=LmEvalBabilongConfig)
    infinitebench: LmEvalInfiniteBenchConfig = Field(default_factory=LmEvalInfiniteBenchConfig)
    limit: int | None = Field(
        None, gt=0, description="Documents per lm-eval task (and length); None: all."
    )
    batch_size: int = Field(1, gt=0, description="Rows per batch of the anchorctx lm-eval model.")
    max_length: int | None = Field(
        None,
        gt=1,
        description="The model's token budget in lm-eval (prompt + new tokens; longer prompts are "
        "cut from the left, anchor kept). Default: the model's max_position_embeddings.",
    )
    keep_anchor: bool = Field(
        True,
        description="Truncation keeps the anchor at position 0 (the project's rule). false: "
        "truncate as lm-eval's hf model does, anchor dropped.",
    )


class EvaluationConfig(Strict):
    suites: list[SuiteName] = Field(
        default_factory=lambda: ["ruler"],
        description="Suites per checkpoint: ruler, longbench, mmlu, hellaswag, perplexity (the "
        "project's), "
        "and lm-eval's long-context tasks as lm_eval:<task or group>, e.g. lm_eval:ruler, "
        "lm_eval:longbench2, lm_eval:babilong, lm_eval:infinitebench_passkey (data: "
        "evaluation.lm_eval).",
    )
    ruler: RulerConfig = Field(default_factory=RulerConfig)
    longbench: LongBenchConfig = Field(default_factory=LongBenchConfig)
    harness: HarnessConfig = Field(default_factory=HarnessConfig)
    lm_eval: LmEvalConfig = Field(default_factory=LmEvalConfig)
    perplexity: PerplexityConfig = Field(default_factory=PerplexityConfig)
    last_k: int = Field(5, gt=0, description="Average over the last k checkpoints (paper: 5).")
    demo_fixtures: Path | None = Field(
        None, description="Demo/tests only: write synthetic evaluation data files here if missing."
    )
    heldout_data: Path | None = Field(
        None,
        description="Write generated held-out evaluation data here if missing (anchorctx.demo."
        "heldout_eval: a long essay and 400 SQuAD paragraphs for RULER up to 16K, 400 MMLU- and "
        "HellaSwag-style items); the config's ruler/harness paths name its files.",
    )
    data_seed: Seed | None = Field(
        None,
        description="Seed of the generated evaluation data (demo_fixtures, heldout_data). None: "
        "the experiment's seed. An arm that overrides seed (variants[].seeds) gets the "
        "experiment's here, so every arm reads the same data.",
    )
    batch_size: int = Field(1, gt=0, description="Generation batch size.")
    engine: Literal["auto", "hf", "static"] = Field(
        "auto",
        description="Generation engine of RULER and LongBench: hf = transformers generate, "
        "static = static KV cache with a CUDA-graph decode step, auto = static where the model "
        "supports it.",
    )
    # Off by default: the deterministic decode kernel (compiled FlexAttention) cost 1.11x (32K)
    # and 1.21x (128K) cuDNN's decode time per token on a 7B model at batch 1, 1.86x at 32K x 4
    # rows (H200, docs/benchmarks/2026-11-23-decode-attention-determinism.md); the default is the
    # fast kernel.
    deterministic_decode: bool = Field(
        False,
        description="Static engine: decode with a run-to-run deterministic attention kernel, so "
        "records are identical across runs and shardings (slower decode; see "
        "docs/PERFORMANCE.md).",
    )
    device: Device = "auto"
    dtype: Dtype = "bfloat16"
    work_pool: str | None = Field(
        None,
        description="Prefect work pool whose workers (`anchorctx eval-worker POOL`, one per "
        "GPU, on any number of nodes) run the evaluation shards; None: this host's GPUs.",
    )
    shards: int | None = Field(
        None,
        gt=0,
        description="Shards per (checkpoint, suite) on the work pool. Default: the "
        "pool's online workers.",
    )
    overlap: Literal["auto", "off"] = Field(
        "auto",
        description="full-experiment on a host with more GPUs than training takes "
        "(training.nproc on one node): evaluate each finished arm on the other GPUs while the next "
        "arm trains, and on every GPU once training ends (auto). off: evaluate each arm after it "
        "trains. One GPU, CPU or a work pool: always the latter.",
    )
