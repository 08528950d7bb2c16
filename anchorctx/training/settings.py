"""The ``training`` section: attention variant and engine, parallelism, optimiser, schedule,
long-row memory options and checkpoint saving. Read by :mod:`anchorctx.training`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from anchorctx.attention.names import ENGINE_NAMES, VARIANTS
from anchorctx.config import Device, Strict

# Built from the one list of names (anchorctx.attention.names), which the layouts and the engine
# registry are checked against, so a name valid here is one the attention layer runs.
# mypy cannot read a Literal built from a tuple (it sees Any); pydantic validates it at runtime.
Variant = Literal[VARIANTS]  # type: ignore[valid-type]
Engine = Literal[ENGINE_NAMES]  # type: ignore[valid-type]

MAX_GLOBAL_BATCH = 1 << 20
"""Most sequences per optimiser step: ~1000x the largest published LLM batches (4M-16M tokens
of 4K-16K rows); beyond it a value is a typo (``1e9``), not a plan."""

MAX_STEPS = 100_000_000
"""Most optimiser steps: 100x a long pretraining run; beyond it a value is a typo."""

# An Adam beta: the decay rate of a moment estimate, in [0, 1).
Beta = Annotated[float, Field(ge=0, lt=1)]


class SaveConfig(Strict):
    every: int = Field(10, gt=0, description="Save every N steps ...")
    last: int | None = Field(50, gt=0, description="... within the last N steps (None: whole run).")
    keep: int | None = Field(None, gt=0, description="Keep only the newest N checkpoints.")
    resume_every: int | None = Field(
        50, gt=0, description="Write resume state every N steps (also at checkpoints and the end)."
    )
    resume: bool = Field(
        True,
        description="Write resume state at all (false: model checkpoints only, so the run cannot "
        "be resumed; for rehearsals whose disk cannot hold a 7B model's fp32 optimizer state, "
        "about 12 bytes per parameter).",
    )


class MemoryConfig(Strict):
    """Long-row memory options (DeepSpeed's ALST pieces; see anchorctx.training.tiling). With
    ``auto`` (the default) a CUDA run turns on those the memory and step-time models say make
    the fastest step that fits; the values below are what a run without ``auto`` (or on CPU)
    uses, and one turned on here stays on. They recompute work or move data, and change results
    by float rounding."""

    auto: bool = Field(
        True,
        description="CUDA runs: turn on whichever options below (and training.kernels=liger, "
        "when installed) make the fastest predicted combination that fits the GPU and host "
        "(anchorctx.training.memory_choice; the start-up line and memory_choice.json say what "
        "and why); options turned on here stay on. false: the values below as they are. "
        "`training.memory: auto` is the same as the defaults.",
    )

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
    pin_offload: bool = Field(
        False,
        description="Page-lock the host gradient buffers of the offloaded optimizer (DeepSpeed's "
        "offload_optimizer.pin_memory): faster copies to the host, paid for at the engine's start "
        "and in host memory. Full-depth 7B at 256K on one H200 (125 GiB host) under ZeRO-3: 39.5 "
        "-> 35.3 s a step, 75 s more to start, 7 GiB more host memory (2 GiB left); under ZeRO-2 "
        "it ran that host out of memory (docs/PERFORMANCE.md). Not chosen by memory.auto. "
        "Only with offload_optimizer.",
    )
    cpu_adam: Literal["auto", "deepspeed", "torch"] = Field(
        "auto",
        description="What steps the offloaded optimizer state on the host: DeepSpeed's compiled "
        "DeepSpeedCPUAdam (C++ with SIMD, JIT-built once into TORCH_EXTENSIONS_DIR: 0.22 s per "
        "1B parameters on a 16-core GPU host) or torch's AdamW (1.36 s; no compiler needed). "
        "auto: deepspeed for CUDA runs, torch for CPU runs. Only with offload_optimizer.",
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


# DeepSpeed's zero_optimization settings the layout plan runs each stage with (CommConfig's
# fields; a field the config sets wins). ZeRO-2 overlaps its gradient reduce-scatter with
# backward (DeepSpeed leaves overlap_comm off below stage 3): docs/benchmarks/
# 2026-11-28-layout-2gpu.md. Here, beside the fields, so that DeepSpeed's config reads it without
# the layout plan's models.
COMM_SETTINGS: dict[int, dict[str, Any]] = {
    2: {"overlap_comm": True},
    3: {},
}


class CommConfig(Strict):
    """DeepSpeed's communication settings (``zero_optimization``'s overlap and bucket sizes) and
    the inter-node bandwidth the layout plan assumes. ``None`` (the default): the layout plan's
    choice for the ZeRO stage it picks (anchorctx.training.layout_plan.COMM_SETTINGS; the start-up
    line and layout_choice.json say what); a value set here is used as it is."""

    overlap_comm: bool | None = Field(
        None,
        description="Overlap ZeRO's gradient reduction (and ZeRO-3's parameter gathers) with "
        "backward compute, in double buffers of reduce_bucket_size.",
    )
    reduce_bucket_size: int | None = Field(
        None, gt=0, description="Elements reduced per gradient reduce-scatter call."
    )
    allgather_bucket_size: int | None = Field(
        None, gt=0, description="ZeRO-1/2: elements per all-gather of the updated weights."
    )
    prefetch_bucket_size: int | None = Field(
        None,
        gt=0,
        description="ZeRO-3: elements of the next layers' weights gathered ahead of their use.",
    )
    param_persistence_threshold: int | None = Field(
        None,
        ge=0,
        description="ZeRO-3: parameters of at most this many elements stay whole on every GPU "
        "(never gathered).",
    )
    max_live_parameters: int | None = Field(
        None, gt=0, description="ZeRO-3: most gathered elements held on a GPU at once."
    )
    inter_node_gb_per_s: float | None = Field(
        None,
        gt=0,
        description="For the layout plan: the bus bandwidth between nodes per GPU, GB/s. None: "
        "45 (one 400 Gb/s InfiniBand NIC per GPU at NCCL's usual ~90% of line rate); set your "
        "cluster's (nccl-tests' all_gather_perf busbw across nodes).",
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
    boundary_targets: Literal["all", "within_document"] = Field(
        "all",
        description="Targets that cross a document boundary: 'all' (AnchorContext: every next "
        "token is a target, for every variant) or 'within_document' (dropped for the "
        "document-masked variants, whose mask makes them unpredictable; docs/FIDELITY.md).",
    )
    device: Device = "auto"
    nproc: int | None = Field(
        None,
        ge=1,
        description="Processes per node. Default: visible GPUs; sequence_parallel on CPU.",
    )
    nnodes: int = Field(1, ge=1)
    hostfile: Path | None = None
    sequence_parallel: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="GPUs that share one row (Ulysses); the data-parallel size is the process "
        "count over it. auto: on CPU 1; on GPUs the layout plan's choice, the fastest predicted "
        "DP × SP split whose memory fits (anchorctx.training.layout_plan).",
    )
    zero_stage: int | None = Field(
        None,
        ge=0,
        le=3,
        description="Default: 0 on CPU; on GPUs the layout plan's choice, the fastest predicted "
        "stage that fits (anchorctx.training.layout_plan; 2 on one GPU stepping an offloaded "
        "optimizer).",
    )
    comm: CommConfig = Field(default_factory=CommConfig)
    steps: int = Field(2000, gt=0, le=MAX_STEPS)
    global_batch_size: int = Field(
        8,
        gt=0,
        le=MAX_GLOBAL_BATCH,
        description="Sequences per optimiser step: a multiple of micro_batch_size × the "
        "data-parallel size (nproc × nnodes / sequence_parallel).",
    )
    micro_batch_size: int = Field(1, gt=0, description="Sequences per rank per forward.")
    lr: float = Field(2e-5, gt=0, le=1, description="Peak learning rate (AdamW).")
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description="Learning rate after the warmup: 'constant' (AnchorContext's, the paper's "
        "code) or 'cosine' (down to a tenth of lr at the last step, training.engine.COSINE_FLOOR; "
        "for pretraining from scratch, where the anneal lowers the final loss).",
    )
    betas: tuple[Beta, Beta] = Field((0.9, 0.95), description="AdamW betas, each in [0, 1).")
    weight_decay: float = Field(0.1, ge=0)
    weight_decay_on: Literal["all", "matrices"] = Field(
        "all",
        description="Parameters weight_decay applies to: 'all' (AnchorContext's AdamW, the "
        "paper's code) or 'matrices' (norms and biases undecayed).",
    )
    grad_clip: float = Field(1.0, ge=0)
    precision: Literal["bf16", "fp32"] = "bf16"
    deterministic: bool = Field(
        False,
        description="Bit-identical reruns: the same config, seed and GPU kind give the same "
        "checkpoints. Turns on torch's deterministic algorithms (an op without one is an "
        "error naming it), cuBLAS' fixed workspace and cuDNN's deterministic mode; attention "
        "engine 'auto' takes only engines whose backward is deterministic, and a named one "
        "without is an error (anchorctx.training.determinism). Costs step time "
        "(docs/REPRODUCTION.md, 'Deterministic training').",
    )
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

    @field_validator("memory", mode="before")
    @classmethod
    def _memory_auto(cls, value: Any) -> Any:
        return {} if value == "auto" else value  # `training.memory: auto`: every option open

    @model_validator(mode="after")
    def _batch_fits(self) -> TrainingConfig:
        if self.micro_batch_size > self.global_batch_size:
            raise ValueError(
                f"micro_batch_size={self.micro_batch_size} is larger than "
                f"global_batch_size={self.global_batch_size} (sequences per optimiser step)"
            )
        return self

    def layout_problem(self) -> str | None:
        """Why this section's batch sizes cannot be split over its processes, as far as the
        config alone tells (training.plan.plan_parallelism checks the real world size; the
        messages are its own): ``None`` when they can. The process count is ``nproc × nnodes``
        when nproc is set, one per SP rank on CPU, and unknown (the visible GPUs) otherwise,
        when only the micro batch is checked."""
        sp = self.sequence_parallel
        if sp == "auto":
            if self.device != "cpu":  # the layout plan splits the real world size at launch
                return self._micro_problem()
            sp = 1
        if self.nproc is not None:
            world: int | None = self.nproc * self.nnodes
        elif self.device == "cpu":
            world = sp * self.nnodes
        else:
            world = None
        if world is not None and sp > world:
            return (
                f"training.sequence_parallel={sp} needs at least {sp} processes, but the run "
                f"has {world} (training.nproc × training.nnodes); raise nproc or lower "
                "sequence_parallel"
            )
        if world is not None and world % sp:
            return (
                f"{world} processes cannot be split into sequence-parallel groups of {sp}: the "
                "process count (training.nproc × training.nnodes) must be a multiple of "
                "training.sequence_parallel"
            )
        if world is None:  # the data-parallel size is known only at launch
            return self._micro_problem()
        dp = world // sp
        per_step = self.micro_batch_size * dp
        if self.global_batch_size % per_step:
            return (
                f"training.global_batch_size={self.global_batch_size} is not divisible by "
                f"micro_batch_size × data-parallel size = {self.micro_batch_size} × {dp} = "
                f"{per_step}; choose a multiple of {per_step}"
            )
        return None

    def _micro_problem(self) -> str | None:
        if self.global_batch_size % self.micro_batch_size:
            return (
                f"training.global_batch_size={self.global_batch_size} is not divisible by "
                f"training.micro_batch_size={self.micro_batch_size}; choose a multiple of "
                f"{self.micro_batch_size} × the data-parallel size"
            )
        return None

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
