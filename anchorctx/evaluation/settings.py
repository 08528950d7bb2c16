"""The ``evaluation`` section: suites (RULER, LongBench, MMLU, HellaSwag), their data and sizes,
generation engine, device and the work pool. Read by :mod:`anchorctx.evaluation`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveInt

from anchorctx.config import Device, Dtype, Seed, Strict


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


class EvaluationConfig(Strict):
    suites: list[Literal["ruler", "longbench", "mmlu", "hellaswag"]] = Field(
        default_factory=lambda: ["ruler"]
    )
    ruler: RulerConfig = Field(default_factory=RulerConfig)
    longbench: LongBenchConfig = Field(default_factory=LongBenchConfig)
    harness: HarnessConfig = Field(default_factory=HarnessConfig)
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
    batch_size: int = Field(1, gt=0, description="Generation batch size.")
    engine: Literal["auto", "hf", "static"] = Field(
        "auto",
        description="Generation engine of RULER and LongBench: hf = transformers generate, "
        "static = static KV cache with a CUDA-graph decode step, auto = static where the model "
        "supports it.",
    )
    # Off by default: the deterministic decode kernel (compiled FlexAttention) cost 1.11x (32K)
    # and 1.21x (128K) cuDNN's decode time per token on a 7B model at batch 1, 1.86x at 32K x 4
    # rows (H200, docs/PERFORMANCE.md section 4); the default is the fast kernel.
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
