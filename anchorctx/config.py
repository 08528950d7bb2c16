"""The one typed experiment config.

Every setting of an experiment lives in exactly one place in this tree. YAML files in
``configs/`` are validated against it; ``--set a.b=value`` overrides are applied to the raw
mapping *before* validation, so a typo in a key is an error that names the valid keys, never a
silent default. ``extra="forbid"`` everywhere.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from anchorctx.io import atomic_write_text

Variant = Literal["full", "intra_doc", "intra_doc_reset", "anchor"]
Engine = Literal[
    "auto", "sdpa", "flex", "varlen", "flash_attn", "flex_merge", "flex_copy", "triton"
]
VARIANTS: tuple[str, ...] = ("full", "intra_doc", "intra_doc_reset", "anchor")
ENGINES: tuple[str, ...] = (
    "auto", "sdpa", "flex", "varlen", "flash_attn", "flex_merge", "flex_copy", "triton",
)  # fmt: skip

# The paper's Figure 1 / Eq. 4 shift list (Δ1 values, with Δ2 = 16).
PAPER_SHIFTS = [0, 2, 4, 6, 8, 10, 12, 14, 15, 16, 17, 18, 20, 22, 50, 100, 200, 500, 1000, 2000]


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key and the valid ones."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


# --------------------------------------------------------------------------------------- model
class TinyModelConfig(Strict):
    """A randomly initialised model defined in the config (demo, tests, benchmarks)."""

    architecture: Literal["llama", "mistral", "qwen2"] = "llama"
    hidden_size: int = Field(64, gt=0)
    intermediate_size: int = Field(128, gt=0)
    num_hidden_layers: int = Field(2, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_key_value_heads: int = Field(2, gt=0)
    head_dim: int | None = None
    vocab_size: int | None = Field(None, description="Default: the tokenizer's length.")
    init_seed: int = 0

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        return self


class ModelConfig(Strict):
    path: Path | None = Field(None, description="Local Hugging Face model directory.")
    tiny: TinyModelConfig | None = Field(None, description="In-config random model (demo/tests).")
    tokenizer: Path | None = Field(
        None, description="Tokenizer directory. Default: model.path. Required with model.tiny."
    )
    rope_theta: float | None = Field(None, gt=0, description="RoPE base override (Table 1).")
    max_position_embeddings: int | None = Field(
        None, gt=0, description="Default when rope_theta is overridden: data.seq_len."
    )
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    rope_fp32: bool = Field(
        False,
        description="Apply RoPE to q/k in float32 inside a bf16 model, rounding the rotated q/k "
        "to bf16 once (anchorctx.models.rope.enable_fp32_rope). A no-op in float32.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.path is None) == (self.tiny is None):
            raise ValueError("set exactly one of model.path or model.tiny")
        if self.tiny is not None and self.tokenizer is None:
            raise ValueError("model.tiny needs model.tokenizer (e.g. the demo corpus tokenizer)")
        return self

    @property
    def tokenizer_path(self) -> Path:
        return self.tokenizer if self.tokenizer is not None else self.path  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------- data
class SourceConfig(Strict):
    path: Path = Field(description="A file, a directory, or a glob of SlimPajama-layout files.")
    format: Literal["auto", "jsonl", "jsonl.zst", "parquet", "hf"] = "auto"
    text_field: str = "text"
    domain_field: str = Field("meta.redpajama_set_name", description="Dotted path in a record.")
    domain: str | None = Field(None, description="Fixed domain for every record of this source.")


class UpsampleConfig(Strict):
    """Length upsampling. ``mixture: upsampled`` is Fu et al. 2024's per-source rule (the
    paper's data); ``mixture: long_share`` an earlier project rule that uses ``long_share``."""

    threshold: int = Field(
        4096,
        gt=0,
        description="Documents with fewer tokens than this are 'short' (Fu et al.: 4096).",
    )
    keep_short: float = Field(
        0.1, gt=0, le=1,
        description="upsampled: probability of keeping a short document (--down_sample_ratio 0.1).",
    )  # fmt: skip
    shares: Literal["auto", "slimpajama", "corpus"] | dict[str, float] = Field(
        "auto",
        description="upsampled: per-source token budget shares. 'slimpajama': the reference's "
        "SLIMPAJAMA_ORIGINAL_MIX; 'corpus': this corpus' own token shares; 'auto': slimpajama "
        "when every domain is a SlimPajama source name, else corpus; or explicit shares.",
    )
    long_share: float = Field(
        0.7, gt=0, lt=1,
        description="long_share only: target share of tokens from long documents, per domain.",
    )  # fmt: skip


class DemoCorpusConfig(Strict):
    """Generate the seeded synthetic demo corpus and tokenizer here when missing."""

    dir: Path = Path(".demo/corpus")
    seed: int = 0
    docs_per_domain: int = Field(40, gt=0)


class DataConfig(Strict):
    demo_corpus: DemoCorpusConfig | None = Field(
        None, description="Demo/tests only: write the synthetic corpus to demo_corpus.dir first."
    )
    sources: list[SourceConfig] = Field(default_factory=list)
    seq_len: int = Field(65536, gt=1)
    token_budget: int | None = Field(None, gt=0, description="Tokens to sample; None: all input.")
    mixture: Literal["original", "upsampled", "long_share"] | dict[str, float] = Field(
        "original",
        description="'original' (natural shares), 'upsampled' (Fu et al. 2024 per-source "
        "upsampling, the paper's data), 'long_share' (an earlier project rule), or shares.",
    )
    upsample: UpsampleConfig = Field(default_factory=UpsampleConfig)
    separator: str = Field(
        "none",
        description="After each document: 'none' (AnchorContext: documents concatenated with no "
        "separator and no BOS; a row's only anchor is at index 0), 'eos' (the tokenizer's EOS "
        "token; for tokenizers whose anchor is EOS, e.g. Qwen, the anchor id then recurs inside "
        "rows), or literal text.",
    )
    domain_tags: bool = False
    tag_template: str = "{domain}\n"
    interleave_chunks: bool = False
    chunks_per_document: tuple[int, int] = (2, 3)
    on_bad_input: Literal["error", "skip"] = "error"
    num_workers: int = Field(1, ge=1)
    tokenize_batch_size: int = Field(256, ge=1)
    output_dir: Path | None = Field(
        None, description="Default: <run_root>/<name>/data/<data fingerprint>."
    )

    @model_validator(mode="after")
    def _chunk_range(self) -> DataConfig:
        lo, hi = self.chunks_per_document
        if not 1 <= lo <= hi:
            raise ValueError(
                f"chunks_per_document must be (min, max) with 1 <= min <= max, got {(lo, hi)}"
            )
        return self


# ------------------------------------------------------------------------------------ training
class SaveConfig(Strict):
    every: int = Field(10, gt=0, description="Save every N steps ...")
    last: int | None = Field(50, gt=0, description="... within the last N steps (None: whole run).")
    keep: int | None = Field(None, gt=0, description="Keep only the newest N checkpoints.")
    resume_every: int | None = Field(
        50, gt=0, description="Write resume state every N steps (also at checkpoints and the end)."
    )


class MemoryConfig(Strict):
    """Long-row memory options (DeepSpeed's ALST pieces; see anchorctx.training.tiling). Each is
    off by default: they recompute work or move data, and change results by float rounding."""

    tiled_mlp: bool = Field(
        False,
        description="Run each decoder MLP in sequence tiles of hidden_size tokens (DeepSpeed "
        "TiledMLP): [T, intermediate] activations never exist whole; the MLP forward runs once "
        "more in backward.",
    )
    tiled_loss: bool = Field(
        False,
        description="LM head and cross-entropy in sequence tiles of <= 1 GiB fp32 logits "
        "(DeepSpeed sequence_tiled_compute): T x vocab logits never exist whole; the head runs "
        "once more in backward.",
    )
    offload_optimizer: bool = Field(
        False,
        description="ZeRO optimizer state (fp32 weights, Adam moments, fp32 gradients) in CPU "
        "memory, stepped there. Needs zero_stage >= 1.",
    )
    offload_checkpoints: bool = Field(
        False,
        description="Keep each checkpointed layer's input ([T, hidden]) in CPU memory until "
        "backward (DeepSpeed cpu_checkpointing). Needs activation_checkpointing.",
    )
    keep_activations: int = Field(
        0,
        ge=0,
        description="Selective checkpointing: with activation_checkpointing, the last N decoder "
        "layers keep their forward activations for backward instead of recomputing them (each "
        "kept layer costs about one layer's working set of memory and saves its forward's "
        "recomputation).",
    )
    init_on_device: bool = Field(
        False,
        description="Build a model.tiny model directly on the training device (its random "
        "weights then come from that device's generator) instead of on the CPU and copying it: "
        "a 7B-shaped model reaches its first step in seconds instead of minutes.",
    )


class TrainingConfig(Strict):
    attention: Variant = "anchor"
    engine: Engine = "auto"
    kernels: Literal["torch", "liger"] = Field(
        "torch",
        description="RMSNorm and SwiGLU: transformers' own modules (torch), or Liger-Kernel's "
        "fused Triton kernels in their place (liger: CUDA, pip install liger-kernel; the same "
        "arithmetic up to float rounding, docs/FIDELITY.md).",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    nproc: int | None = Field(
        None,
        ge=1,
        description="Processes per node. Default: visible GPUs; sequence_parallel on CPU.",
    )
    nnodes: int = Field(1, ge=1)
    hostfile: Path | None = None
    sequence_parallel: int = Field(1, ge=1)
    zero_stage: int | None = Field(None, ge=0, le=3, description="Default: 3 on GPU, 0 on CPU.")
    steps: int = Field(2000, gt=0)
    global_batch_size: int = Field(8, gt=0, description="Sequences per optimiser step.")
    micro_batch_size: int = Field(1, gt=0)
    lr: float = Field(2e-5, gt=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description="Learning rate after the warmup: 'constant' (AnchorContext's, the paper's "
        "code) or 'cosine' (down to a tenth of lr at the last step, training.engine.COSINE_FLOOR; "
        "for pretraining from scratch, where the anneal lowers the final loss).",
    )
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(0.1, ge=0)
    weight_decay_on: Literal["all", "matrices"] = Field(
        "all",
        description="Parameters weight_decay applies to: 'all' (AnchorContext's AdamW, the "
        "paper's code) or 'matrices' (norms and biases undecayed).",
    )
    grad_clip: float = Field(1.0, ge=0)
    precision: Literal["bf16", "fp32"] = "bf16"
    activation_checkpointing: bool = True
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    save: SaveConfig = Field(default_factory=SaveConfig)
    log_every: int = Field(1, gt=0)
    peak_tflops: float | None = Field(
        None, gt=0, description="Per-device peak for MFU. Default: known GPUs' dense bf16 peak."
    )
    master_port: int | None = Field(
        None, gt=0, lt=65536, description="Rendezvous port of launched runs. Default: a free one."
    )

    @model_validator(mode="after")
    def _memory_needs(self) -> TrainingConfig:
        if self.memory.offload_checkpoints and not self.activation_checkpointing:
            raise ValueError(
                "memory.offload_checkpoints needs activation_checkpointing=true (it offloads the "
                "checkpointed layer inputs)"
            )
        if self.memory.offload_optimizer and self.zero_stage == 0:
            raise ValueError("memory.offload_optimizer needs ZeRO: set zero_stage to 1, 2 or 3")
        if self.memory.keep_activations and not self.activation_checkpointing:
            raise ValueError(
                "memory.keep_activations needs activation_checkpointing=true (without it every "
                "layer keeps its activations)"
            )
        return self


# ---------------------------------------------------------------------------------- evaluation
class RulerConfig(Strict):
    tasks: list[str] | None = Field(None, description="Default: all 13 RULER tasks.")
    exclude: list[str] = Field(default_factory=list, description="Paper (Llama-2): cwe, mk3.")
    lengths: list[int] = Field(default_factory=lambda: [4096, 8192, 16384, 32768, 65536, 131072])
    num_samples: int = Field(500, gt=0)
    seed: int = 42
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
    datasets: list[str] | None = Field(None, description="Default: the English datasets.")
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
    mmlu_fewshot: int = 5
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
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    work_pool: str | None = Field(
        None, description="Prefect work pool whose workers (`anchorctx eval-worker POOL`, one per "
        "GPU, on any number of nodes) run the evaluation shards; None: this host's GPUs."
    )  # fmt: skip
    shards: int | None = Field(
        None, gt=0, description="Shards per (checkpoint, suite) on the work pool. Default: the "
        "pool's online workers."
    )  # fmt: skip
    overlap: Literal["auto", "off"] = Field(
        "auto", description="full-experiment on a host with more GPUs than training takes "
        "(training.nproc on one node): evaluate each finished arm on the other GPUs while the next "
        "arm trains, and on every GPU once training ends (auto). off: evaluate each arm after it "
        "trains. One GPU, CPU or a work pool: always the latter."
    )  # fmt: skip


# ------------------------------------------------------------------------------------ analysis
class RopePrecisionConfig(Strict):
    """The BF16 RoPE precision study (paper Section 2, Figure 1; ``anchorctx rope-precision``)."""

    shifts: list[int] = Field(
        default_factory=lambda: list(PAPER_SHIFTS), description="Δ1 values of Eq. 4 (≥ 0)."
    )
    delta2: int = Field(16, ge=0, description="Reference shift Δ2 of Eq. 4.")
    compare_shift: int = Field(
        0, ge=0, description="Δ1 of the per-token split (Fig. 1 middle) and of D_logit (Eq. 5)."
    )
    seq_len: int = Field(4096, gt=1, description="Tokens per sequence for the shift curve.")
    num_sequences: int = Field(50, gt=0)
    lengths: list[int] = Field(
        default_factory=lambda: [64, 128, 256, 512, 1024, 2048, 4096, 8192],
        description="Sequence lengths of the first-token logit difference (Fig. 1 right).",
    )
    precisions: list[Literal["bf16", "fp32", "bf16_rope_fp32"]] = Field(
        default_factory=lambda: ["bf16", "bf16_rope_fp32", "fp32"],
        description="bf16_rope_fp32: bf16 model with model.rope_fp32 (RoPE applied in fp32).",
    )
    text_files: list[Path] = Field(
        default_factory=list, description="Text inputs; default: the packed dataset."
    )
    random_init: bool = Field(False, description="Ignore model.path weights: random init.")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    in_report: bool = Field(
        False,
        description="full-experiment (and `anchorctx report`) also runs the study on the "
        "experiment's model and shows its figure in the report; off by default because at "
        "the paper's settings it takes GPU-hours.",
    )

    @model_validator(mode="after")
    def _valid_positions(self) -> RopePrecisionConfig:
        if not self.shifts or min(self.shifts) < 0:
            raise ValueError(f"shifts must be a non-empty list of values >= 0 (got {self.shifts})")
        if not self.lengths or min(self.lengths) < 2:
            raise ValueError(
                f"lengths must be a non-empty list of values >= 2 (got {self.lengths})"
            )
        if not self.precisions or len(set(self.precisions)) != len(self.precisions):
            raise ValueError(f"precisions must be non-empty and distinct (got {self.precisions})")
        return self


class AnalysisConfig(Strict):
    rope_precision: RopePrecisionConfig = Field(default_factory=RopePrecisionConfig)


# ------------------------------------------------------------------------------------ tracking
TrackingBackend = Literal["tensorboard", "mlflow", "wandb"]


class TensorBoardConfig(Strict):
    log_dir: Path | None = Field(
        None,
        description="One folder for every run: <log_dir>/<name>/<variant or 'report'>. Default: "
        "<run_dir>/tensorboard per arm, <experiment_dir>/tensorboard for the report.",
    )


class MlflowConfig(Strict):
    tracking_uri: str | None = Field(
        None,
        description="Default: MLFLOW_TRACKING_URI, else a local store sqlite:///<run_root>/mlflow.db "
        "(MLflow 3 refuses plain file stores) with artifacts in <run_root>/mlartifacts.",
    )
    experiment: str | None = Field(None, description="MLflow experiment. Default: name.")


class WandbConfig(Strict):
    project: str | None = Field(None, description="Default: name.")
    entity: str | None = None
    mode: Literal["offline", "online", "disabled"] | None = Field(
        None, description="Default: WANDB_MODE, else offline (files under <run_dir>/wandb)."
    )


class TrackingConfig(Strict):
    """Experiment trackers every stage logs to (training, evaluation, report); rank 0 only.

    ``tracking: [tensorboard, mlflow]`` in YAML is short for ``tracking: {backends: [...]}``.
    """

    backends: list[TrackingBackend] = Field(default_factory=list)
    tags: list[str] = Field(default_factory=list, description="Extra tags on every tracked run.")
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)

    @model_validator(mode="before")
    @classmethod
    def _list_shorthand(cls, value: Any) -> Any:
        return {"backends": value} if isinstance(value, list) else value

    @model_validator(mode="after")
    def _distinct(self) -> TrackingConfig:
        if len(set(self.backends)) != len(self.backends):
            raise ValueError(f"tracking backends must be distinct (got {self.backends})")
        return self


# ---------------------------------------------------------------------------------- pretrain
# The layout of a checkpoint directory name (anchorctx.models.checkpoints.checkpoint_name; the
# config layer imports nothing above io, and a test keeps the two equal).
_CHECKPOINT_DIR, _CHECKPOINT_NAME = "checkpoints", "step-{step:06d}"
# Sections that do not change a pretrained model: the pretraining run's directory name hashes
# the rest (evaluation, analysis and tracking settings of the arms never re-pretrain).
_NOT_PRETRAINING = ("evaluation", "analysis", "tracking", "variants", "variant")


class PretrainCorpusConfig(Strict):
    """The generated retrieval-bearing documents (anchorctx.demo.pretrain_corpus)."""

    dir: Path = Path(".demo/pretrain")
    seed: int = 0
    documents: int = Field(2000, gt=0, description="Documents, the five kinds in turn.")
    task_format_documents: int = Field(
        0, ge=0,
        description="Documents in RULER's task formats besides the five kinds, written by the "
        "project's RULER generator with this corpus' seed over pseudo-word haystacks, fitted "
        "to the pretraining length with model.tokenizer (anchorctx.demo.pretrain_corpus). 0: none.",
    )  # fmt: skip
    english_haystack_share: float = Field(
        0.0, ge=0, le=1,
        description="Share of the essay-haystack tasks' task-format documents written over "
        "English-word prose (RULER's word lists in the corpus' own templates) instead of "
        "pseudo-word prose. 0: none (docs/REPRODUCTION.md, run 6, measured 0.5).",
    )  # fmt: skip


class PretrainConfig(Strict):
    """Pretrain the base model from scratch before the arms (full-experiment's ``pretrain``
    stage): ``model.tiny`` trained with full attention on ``data.sources`` plus the generated
    retrieval corpus, by the ordinary training loop. Every arm then starts from its last
    checkpoint (``model.path``; the arms' ``model.tiny`` is dropped). The pretraining run is
    ``<run_root>/<name>/pretrain-<hash of its config>/``: a second run reuses it, and its last
    checkpoint is a Hugging Face model directory usable as any config's ``model.path``."""

    corpus: PretrainCorpusConfig = Field(default_factory=PretrainCorpusConfig)
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Dotted overrides that turn the experiment's config into the pretraining "
        "run's, e.g. {'data.seq_len': 2048, 'training.steps': 3000, 'training.lr': 1e-3}. "
        "Applied after the fixed changes: attention full, model.rope_theta and "
        "max_position_embeddings unset (the model's own RoPE base), no domain tags.",
    )


# ---------------------------------------------------------------------------------- experiment
class VariantSpec(Strict):
    """One arm of an experiment: a name, an attention variant, and dotted overrides."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    attention: Variant
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="Dotted keys, e.g. {'data.domain_tags': true}."
    )


class ExperimentConfig(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    run_root: Path = Path("runs")
    seed: int = 0
    model: ModelConfig
    data: DataConfig = Field(default_factory=DataConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    analysis: AnalysisConfig = Field(default_factory=AnalysisConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    pretrain: PretrainConfig | None = Field(
        None, description="Pretrain model.tiny from scratch first; the arms start from it."
    )
    variants: list[VariantSpec] = Field(
        default_factory=list, description="Arms of full-experiment; empty: training.attention."
    )
    variant: str | None = Field(None, description="Run name under the experiment (set per arm).")

    # -- derived paths ------------------------------------------------------------------
    @property
    def variant_name(self) -> str:
        return self.variant or self.training.attention

    @property
    def experiment_dir(self) -> Path:
        return self.run_root / self.name

    @property
    def run_dir(self) -> Path:
        """``<run_root>/<experiment>/<variant>/`` (docs/ARCHITECTURE.md, run directory contract)."""
        return self.experiment_dir / self.variant_name

    def for_variant(self, spec: VariantSpec) -> ExperimentConfig:
        """The config of one experiment arm: overrides applied, attention and name set."""
        raw = self.model_dump(mode="json")
        raw["variants"] = []
        for key, value in spec.overrides.items():
            _set_dotted(raw, key, value, what=f"variant {spec.name!r} override {key!r}")
        raw["training"]["attention"] = spec.attention
        raw["variant"] = spec.name
        if self.pretrain is not None:  # the arm continues training the pretrained base model
            raw["model"].update(path=str(self.base_model_path), tiny=None, tokenizer=None)
            raw["pretrain"] = None
        return _validate(raw, source=f"variant {spec.name!r}")

    def arms(self) -> list[ExperimentConfig]:
        """Every arm of the experiment (a single arm when ``variants`` is empty)."""
        if self.variants:
            return [self.for_variant(v) for v in self.variants]
        if self.pretrain is not None:
            name = self.variant_name
            return [self.for_variant(VariantSpec(name=name, attention=self.training.attention))]
        return [self]

    # -- pretraining ---------------------------------------------------------------------
    def pretraining(self) -> ExperimentConfig:
        """The pretraining run's config (``pretrain`` section): see :class:`PretrainConfig`.
        It keeps the ``pretrain`` section, so the commands that run it write its corpus."""
        if self.pretrain is None:
            raise ConfigError(f"{self.name}: no pretrain section: nothing to pretrain")
        if self.model.tiny is None:
            raise ConfigError("pretrain needs model.tiny (the model to pretrain), not model.path")
        raw = self.model_dump(mode="json")
        raw["variants"], raw["variant"] = [], None
        raw["training"]["attention"] = "full"
        raw["model"].update(rope_theta=None, max_position_embeddings=None)
        raw["data"]["domain_tags"] = False
        corpus = str(self.pretrain.corpus.dir / "data")  # pretrain_corpus' layout
        if corpus not in {src["path"] for src in raw["data"]["sources"]}:
            raw["data"]["sources"] = [*raw["data"]["sources"], {"path": corpus}]
        for key, value in self.pretrain.overrides.items():
            _set_dotted(raw, key, value, what=f"pretrain override {key!r}")
        identity = {k: v for k, v in raw.items() if k not in _NOT_PRETRAINING}
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
        # The base model is evaluated at the lengths it was trained for (RULER beyond its
        # pretraining length measures nothing but its RoPE base); none of them: no RULER.
        ev = raw["evaluation"]
        fits = [n for n in ev["ruler"]["lengths"] if n <= raw["data"]["seq_len"]]
        if fits:
            ev["ruler"]["lengths"] = fits
        else:
            ev["suites"] = [s for s in ev["suites"] if s != "ruler"]
        raw["variant"] = f"pretrain-{digest[:10]}"
        return _validate(raw, source="pretrain")

    @property
    def base_model_path(self) -> Path:
        """The pretraining run's last checkpoint: the arms' ``model.path``."""
        pre = self.pretraining()
        return pre.run_dir / _CHECKPOINT_DIR / _CHECKPOINT_NAME.format(step=pre.training.steps)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def fingerprint(self, *sections: str) -> str:
        """Content hash of the whole config or of the named top-level sections."""
        dumped = self.model_dump(mode="json")
        if sections:
            dumped = {s: dumped[s] for s in sections}
        return hashlib.sha256(json.dumps(dumped, sort_keys=True).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------ loading and overrides
def load_config(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read a YAML config, apply ``a.b=value`` overrides, validate.

    Relative paths inside the file stay relative to the working directory (like every CLI).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    return config_from_dict(raw, overrides, source=str(path))


def config_from_dict(
    raw: dict[str, Any], overrides: list[str] | None = None, source: str = "config"
) -> ExperimentConfig:
    raw = copy.deepcopy(raw)
    for item in overrides or []:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like a.b=value")
        _check_key(key.strip())
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as err:
            raise ConfigError(
                f"override {item!r}: invalid YAML value ({_first_line(err)})"
            ) from None
        _set_dotted(raw, key.strip(), value, what=f"override {key.strip()!r}")
    cfg = _validate(raw, source)
    # Every arm's overrides are checked now, not when that arm first runs: a typo in a variant
    # fails `config`, a single-arm run and the whole experiment alike.
    for spec in cfg.variants:
        cfg.for_variant(spec)
    return cfg


def _first_line(err: Exception) -> str:
    return " ".join(str(err).split())


def _validate(raw: dict[str, Any], source: str) -> ExperimentConfig:
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(f"{source}: " + _explain(err)) from None


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(_unknown_key_message(loc))
        else:
            lines.append(f"{loc or '<root>'}: {e['msg']} (got {_short(e.get('input'))})")
    return "; ".join(lines)  # one line: CLI errors are single lines


def _short(value: Any, limit: int = 120) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _model_at(dotted: str) -> tuple[type[BaseModel] | None, str]:
    """Walk the model classes along a dotted key; return the parent model of the last part."""
    model: type[BaseModel] | None = ExperimentConfig
    parts = dotted.split(".")
    for part in parts[:-1]:
        if model is None:
            return None, parts[-1]
        field = model.model_fields.get(part)
        if field is None:
            return model, part
        model = _sub_model(field.annotation)
    return model, parts[-1]


def _sub_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _unknown_key_message(dotted: str) -> str:
    model, last = _model_at(dotted)
    if model is None:
        return f"unknown key {dotted!r}"
    valid = sorted(model.model_fields)
    near = difflib.get_close_matches(last, valid, n=1)
    hint = f" Did you mean {near[0]!r}?" if near else ""
    return f"unknown key {dotted!r}.{hint} Valid keys here: {', '.join(valid)}"


def _check_key(dotted: str) -> None:
    """Reject an override whose key does not exist in the schema (dict-valued leaves excepted)."""
    model: type[BaseModel] | None = ExperimentConfig
    for part in dotted.split("."):
        if model is None:  # inside a free-form mapping (e.g. data.mixture, variant overrides)
            return
        if part.isdigit():  # list index into a list of models, e.g. data.sources.0.path
            continue
        field = model.model_fields.get(part)
        if field is None:
            raise ConfigError(_unknown_key_message(dotted))
        model = _sub_model(field.annotation)


def _set_dotted(raw: dict[str, Any], dotted: str, value: Any, what: str = "") -> None:
    node: Any = raw
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            index = _list_index(node, part, ".".join(parts[:i]), what or repr(dotted))
            if last:
                node[index] = value
            else:
                node = node[index]
            continue
        if last:
            node[part] = value
            return
        if not isinstance(node.get(part), dict | list):
            node[part] = {}
        node = node[part]


def _list_index(node: list, part: str, where: str, what: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(
            f"{what}: {where} is a list of {len(node)} entr{'y' if len(node) == 1 else 'ies'}; "
            f"{part!r} is not an index into it (use 0..{len(node) - 1})"
        )
    return int(part)


def dump_config(cfg: ExperimentConfig, path: Path) -> None:
    """Write the resolved config atomically (``config.yaml`` beside every run's outputs)."""
    atomic_write_text(path, cfg.to_yaml())
