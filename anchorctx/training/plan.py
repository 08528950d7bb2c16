"""The parallel layout of a run and every check that can fail before a GPU is touched.

World = ``nproc × nnodes`` processes, split into data-parallel (DP) × sequence-parallel (SP)
groups: ranks ``[i·SP, (i+1)·SP)`` hold one model replica's sequence shards (DeepSpeed's ALST
group layout), so DP = world / SP. A global batch of ``G`` sequences is
``micro × accumulation × DP``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anchorctx.models.loading import anchor_token_id, resolve_device, tokenizer_fingerprint

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from anchorctx.experiment import ExperimentConfig


class TrainingError(ValueError):
    """A training setup that cannot work; the message names the setting and the fix."""

    exit_code = 2  # a config or command-line mistake (anchorctx.cli)


class ResumeStateError(TrainingError):
    """The resume state on disk is incomplete or corrupt; the message names the file."""

    exit_code = 1  # the files are bad, not the command


class ResumeDataError(TrainingError):
    """``--resume`` would train on other data than the resume state was trained on (an input
    file changed); the message names both dataset fingerprints and the data."""

    exit_code = 1  # the files changed, not the command


class TrainingStopped(RuntimeError):
    """Training stopped at run time (a non-finite loss or gradient norm); the message names
    the step and the last good checkpoint."""

    exit_code = 1


@dataclass(frozen=True)
class Parallelism:
    world: int
    sp: int
    dp: int
    micro: int
    accum: int
    device: str  # "cpu" | "cuda"
    zero_stage: int
    engine: str

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.dp

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def processes_per_node(cfg: ExperimentConfig, device: str) -> int:
    """``training.nproc``; default: every visible GPU, or one CPU process per SP rank."""
    if cfg.training.nproc is not None:
        return cfg.training.nproc
    if device == "cuda":
        # Imported here: torch costs seconds to import, which planning on CPU skips.
        import torch

        return torch.cuda.device_count()
    sp = cfg.training.sequence_parallel
    return 1 if sp == "auto" else sp


def resolve_engine(cfg: ExperimentConfig, device: str) -> str:
    engine = cfg.training.engine
    if device == "cpu" and engine == "auto":
        return "sdpa"  # the only engine with a CPU backward
    if device == "cpu" and engine != "sdpa":
        raise TrainingError(
            f"training.engine={engine} has no CPU backward; use training.engine=sdpa on CPU"
        )
    return engine


def default_zero_stage(cfg: ExperimentConfig, device: str, world: int) -> int:
    """``training.zero_stage`` unset: none on CPU; on GPUs ZeRO-3 (weights partitioned over the
    ranks), except one GPU stepping an offloaded optimizer. One rank partitions nothing, and
    there ZeRO-2 gave the same peak while ZeRO-3's per-module hooks and its synchronous
    gradient copies to the host cost 10% of the full-depth 7B step at 256K on an H200 (35.5
    against 39.5 s, the same losses; docs/benchmarks/2026-11-27-zero2-one-gpu-256k.md)."""
    if device != "cuda":
        return 0
    return 2 if world == 1 and cfg.training.memory.offload_optimizer else 3


def plan_parallelism(cfg: ExperimentConfig, world: int | None = None) -> Parallelism:
    """DP × SP layout, accumulation steps and ZeRO stage; ``world`` overrides the config's."""
    t = cfg.training
    device = resolve_device(t.device, "training.device")
    if world is None:
        world = processes_per_node(cfg, device) * t.nnodes
    # auto: the launcher writes the layout plan's choice into the config before any rank plans
    # (training.memory_choice.for_launch); unresolved (CPU, or nothing fits) it is one row a rank.
    sp = 1 if t.sequence_parallel == "auto" else t.sequence_parallel
    if sp > world:
        raise TrainingError(
            f"training.sequence_parallel={sp} needs at least {sp} processes, but the run has "
            f"{world} (training.nproc × training.nnodes); raise nproc or lower sequence_parallel"
        )
    if world % sp:
        raise TrainingError(
            f"{world} processes cannot be split into sequence-parallel groups of {sp}: "
            "the process count must be a multiple of training.sequence_parallel"
        )
    dp = world // sp
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        raise TrainingError(
            f"training.global_batch_size={t.global_batch_size} is not divisible by "
            f"micro_batch_size × data-parallel size = {t.micro_batch_size} × {dp} = {per_step}; "
            f"choose a multiple of {per_step}"
        )
    stage = t.zero_stage if t.zero_stage is not None else default_zero_stage(cfg, device, world)
    return Parallelism(
        world=world,
        sp=sp,
        dp=dp,
        micro=t.micro_batch_size,
        accum=t.global_batch_size // per_step,
        device=device,
        zero_stage=stage,
        engine=resolve_engine(cfg, device),
    )


# ------------------------------------------------------------------------------ config checks
def check_model_source(cfg: ExperimentConfig) -> None:
    path = cfg.model.path
    if path is None:
        return
    if not Path(path).is_dir():  # its files are checked where it is read (build_hf_config)
        raise TrainingError(f"model.path does not exist: {path} (a local Hugging Face model dir)")


def check_heads(hf_config: PretrainedConfig, sp: int) -> None:
    """Ulysses splits heads across SP ranks: q heads must divide; KV heads may be replicated
    (only when SP > KV heads, and then SP must be a multiple of them)."""
    if sp == 1:
        return
    text = hf_config.get_text_config()
    heads = text.num_attention_heads
    check_head_counts(heads, getattr(text, "num_key_value_heads", None) or heads, sp)


def check_head_counts(heads: int, kv: int, sp: int) -> None:
    """:func:`check_heads` on a model's ``heads`` query and ``kv`` key/value heads."""
    if sp == 1:
        return
    if heads % sp:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise TrainingError(
            f"training.sequence_parallel={sp} does not divide the model's {heads} attention "
            f"heads; use one of {divisors}"
        )
    if kv % sp and sp % kv:
        raise TrainingError(
            f"training.sequence_parallel={sp} and the model's {kv} key/value heads: one must be "
            "a multiple of the other (KV heads are split, or replicated when SP > KV heads)"
        )


def check_dataset(
    cfg: ExperimentConfig, manifest: dict[str, Any], tokenizer: PreTrainedTokenizerBase
) -> None:
    """The packed dataset was made with this tokenizer and is long enough."""
    theirs = _manifest_fingerprint(manifest)
    ours = tokenizer_fingerprint(tokenizer)
    if theirs != ours:
        raise TrainingError(
            f"the packed dataset was tokenised with a different tokenizer (fingerprint {theirs}, "
            f"model tokenizer {ours} from {cfg.model.tokenizer_path}); re-run prepare-data with "
            "this model's tokenizer"
        )
    if manifest.get("anchor_token_id") != anchor_token_id(tokenizer):
        raise TrainingError(
            f"the packed dataset's anchor token id {manifest.get('anchor_token_id')} differs from "
            f"the model tokenizer's {anchor_token_id(tokenizer)}; re-run prepare-data"
        )
    if cfg.data.seq_len > int(manifest["seq_len"]):
        raise TrainingError(
            f"data.seq_len={cfg.data.seq_len} is longer than the packed rows "
            f"({manifest['seq_len']} tokens); re-run prepare-data with this seq_len"
        )


def _manifest_fingerprint(manifest: dict[str, Any]) -> str | None:
    tok = manifest.get("tokenizer")
    if isinstance(tok, dict):
        return tok.get("fingerprint")
    return manifest.get("tokenizer_fingerprint")


def check_vocab(hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    vocab = hf_config.get_text_config().vocab_size
    if len(tokenizer) > vocab:
        raise TrainingError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab}"
        )


# Memory of one step's batches (training.data.BatchPlan.step_data), per token of a padded row:
# every rank builds all G rows of the global batch (int64 ids and targets, 16 bytes, plus the
# int32/uint8 record and target arithmetic while a row is built); its own micro-batches add
# their shard of ids and targets and the full-row layouts (int64 position ids, int32 document
# ids and the masks built from them). Per row: Python and tensor overhead, its sample index.
GLOBAL_ROW_BYTES_PER_TOKEN = 24
LOCAL_LAYOUT_BYTES_PER_TOKEN = 16
ROW_OVERHEAD_BYTES = 1024


@dataclass(frozen=True)
class StepMemory:
    """Bytes one rank holds for one step's batches: on the host, and on its device (0 on CPU,
    where the micro-batches are host memory too)."""

    host: int
    device: int


def step_memory(par: Parallelism, seq_len: int) -> StepMemory:
    """What :meth:`anchorctx.training.data.BatchPlan.step_data` holds at once for one rank
    (the constants above): the whole global batch's rows on the host, this rank's
    micro-batches on its device."""
    t = padded_length(seq_len, par.sp)
    rows = par.global_batch * (GLOBAL_ROW_BYTES_PER_TOKEN * t + ROW_OVERHEAD_BYTES)
    local = par.accum * par.micro * (16 * (t // par.sp) + LOCAL_LAYOUT_BYTES_PER_TOKEN * t)
    if par.device == "cuda":
        return StepMemory(host=rows, device=local)
    return StepMemory(host=rows + local, device=0)


# A step's batches may take at most this share of the memory they live in: the rest is the
# model's, the optimizer's and the process's (training.memory models those on the GPU).
BATCH_MEMORY_SHARE = 0.5


def host_available_bytes() -> int:
    """Host memory available now (psutil, DeepSpeed's own dependency)."""
    # Imported here: psutil is needed only once a run is planned.
    import psutil

    return int(psutil.virtual_memory().available)


def device_total_bytes() -> int | None:
    """Memory of this process's GPU; None where CUDA is not initialised yet (the launcher, which
    must not create a CUDA context on GPU 0 for the whole run: each rank checks after
    ``init_distributed``)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def check_batch_memory(cfg: ExperimentConfig, par: Parallelism) -> None:
    """Refuse a batch plan whose batches cannot fit before anything is allocated: every rank
    builds the whole global batch on the host each step, and its micro-batches on its device
    (:func:`step_memory`). ``training.global_batch_size=1e9`` would otherwise grow past the
    host's memory before step 1."""
    need = step_memory(par, cfg.data.seq_len)
    procs = max(1, min(processes_per_node(cfg, par.device), par.world))
    gib = 1 << 30
    key = f"training.global_batch_size={cfg.training.global_batch_size}"
    rows = f"{par.global_batch} rows of {padded_length(cfg.data.seq_len, par.sp)} tokens"
    host = need.host * procs
    available = host_available_bytes()
    if host > BATCH_MEMORY_SHARE * available:
        raise TrainingError(
            f"{key}: one step's batches need about {host / gib:.1f} GiB of host memory ({rows}, "
            f"built by each of {procs} process(es) on this node), more than "
            f"{BATCH_MEMORY_SHARE:.0%} of the {available / gib:.1f} GiB available; lower "
            "training.global_batch_size (or data.seq_len)"
        )
    total = device_total_bytes() if need.device else None
    if total is not None and need.device > BATCH_MEMORY_SHARE * total:
        raise TrainingError(
            f"{key}: one step's {par.accum} micro-batch(es) need about "
            f"{need.device / gib:.1f} GiB on each GPU, more than {BATCH_MEMORY_SHARE:.0%} "
            f"of its {total / gib:.1f} GiB; lower training.global_batch_size (or raise "
            "micro_batch_size, or use more GPUs)"
        )


def layout_change(saved: dict[str, Any], now: dict[str, Any]) -> str:
    """The fields of two :meth:`Parallelism.to_dict` layouts that differ, in words."""
    names = {
        "world": "processes",
        "sp": "training.sequence_parallel",
        "dp": "data-parallel size",
        "micro": "training.micro_batch_size",
        "accum": "accumulation steps",
        "device": "training.device",
        "zero_stage": "training.zero_stage",
        "engine": "training.engine",
    }
    keys = [k for k in names if saved.get(k) != now.get(k)]
    keys += [
        k for k in sorted(set(saved) | set(now)) if k not in names and saved.get(k) != now.get(k)
    ]
    return ", ".join(f"{names.get(k, k)} {saved.get(k)} -> {now.get(k)}" for k in keys)


def padded_length(seq_len: int, sp: int) -> int:
    """Rows are padded to a multiple of the SP size so every rank holds an equal shard."""
    return math.ceil(seq_len / sp) * sp
