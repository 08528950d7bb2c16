"""What a training run will cost before it starts: memory per GPU, step time, GPU-hours.

Memory is :func:`anchorctx.training.memory.predict` for the config's model shape, row length,
sequence-parallel degree and ``training.memory`` options. Step time is a FLOP-rate model fitted
to the project's own measured training steps (docs/benchmarks/2026-11-22-training-step.md;
docs/benchmarks/2026-11-24-plan-model.md lists every constant):

- matmul work ``W`` per GPU and row: ``6·N·t`` (forward and backward of every parameter that
  multiplies, ``N`` = decoder layers + LM head, ``t = T / SP`` tokens per GPU) plus ``2·N_dec·t``
  for the layers activation checkpointing recomputes, plus one more MLP forward with the tiled
  MLP and one more LM-head forward with the tiled loss; it runs at ``R_mm``, the rate the
  measured steps achieved outside attention (:func:`matmul_rate`, one per ``training.kernels``);
- attention, per layer and head, ``F = 4·d·pairs`` useful forward FLOPs (``pairs = T²/2`` for
  ``full``; for the document masks the mean attended pairs of the packed dataset's rows the run
  reads when ``prepare-data`` has written it, :func:`document_lengths`, else ``T·D/2``, ``D`` the
  token-weighted mean document length of the measured rows, :func:`doc_tokens`), forward and
  backward ``3.5·F`` at the kernel's measured forward+backward rate plus ``F`` recomputed at its
  forward rate (section 1), the rates of the kernels ``auto`` will run
  (:func:`attention_kernels`: FlashAttention-4 on Hopper where it is installed, else cuDNN and
  the Triton anchor kernel); Ulysses gives each GPU ``1/SP`` of the heads;
- ``training.kernels=liger`` fuses the rotary embedding: :func:`rope_saving_seconds` less per
  row than the liger steps ``R_mm`` was fitted on (they ran transformers' RoPE);
- communication (Ulysses' all-to-alls, ZeRO's gathers and reductions) and the update:
  :mod:`anchorctx.training.layout_plan`, which also chooses the DP × SP split and ZeRO stage;
- optimizer offload: torch's AdamW over the rank's ``P/N`` fp32 parameters on the host CPU.

The fit is on one H200; another GPU kind scales it by a measured (H100) or estimated (A100,
from its dense bf16 peak) factor, see :data:`GPUS`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from anchorctx.training import layout_plan, memory
from anchorctx.training.memory import GIB, RESERVED_FRACTION, Options, Shape

if TYPE_CHECKING:
    from anchorctx.experiment import ExperimentConfig


class PlanError(ValueError):
    """A plan that cannot be made or a run that cannot fit; the message names the fix."""

    exit_code = 2  # a config or command-line mistake (anchorctx.cli)


# ------------------------------------------------------------------------------ GPU kinds
@dataclass(frozen=True)
class GpuKind:
    name: str
    memory_gib: float  # what the device reports
    peak_tflops: float  # dense bf16
    train: float  # training step time relative to the H200 fit
    prefill: float  # evaluation prefill time relative to the H200 fit (evaluation.sharding)
    decode: float  # evaluation decode time per token relative to the H200 fit
    estimate: bool  # True where the factors are not measured on this kind
    source: str


GPUS: dict[str, GpuKind] = {
    "h200": GpuKind(
        "H200",
        139.8,
        989.4,
        1.0,
        1.0,
        1.0,
        False,
        "fitted on H200s: one GPU's kernels and steps, the 2- and 4-GPU layouts "
        "(docs/PERFORMANCE.md, tests/test_layout_plan.py)",
    ),
    # Measured on both kinds: the 128K 4-layer step with liger, H100 2.09 / 6.47 s (anchor /
    # full) against H200 2.026 / 6.436 s (docs/benchmarks/2026-11-22-training-step.md,
    # 2026-11-24): 1.018; static-engine prefill at 32K 1.398 s (H100,
    # docs/benchmarks/2026-11-24-owned-decoder-h100.md, "The owned decoder", 2026-11-24) against
    # 1.351 s (H200): 1.035; fused decode at 32K, batch 1, 11.53 ms against 8.32 ms: 1.386.
    "h100": GpuKind(
        "H100",
        79.2,
        989.4,
        1.018,
        1.035,
        1.386,
        False,
        "H200 fit scaled by H100/H200 step, prefill and decode times measured 2026-11-24",
    ),
    # Not measured: compute-bound parts (training, prefill) scale by the dense bf16 peak,
    # 989.4 / 312 TFLOP/s; decode by memory bandwidth, the H200's measured 4.25 TB/s copy
    # bandwidth (section 4) against the A100-80G's 2.039 TB/s spec times the fraction of its spec
    # the H100 reached (3.00 of 3.35 TB/s, 2026-11-24): 4.25 / 1.83 = 2.33.
    "a100-80g": GpuKind(
        "A100-80G",
        79.2,
        312.0,
        989.4 / 312.0,
        989.4 / 312.0,
        4.25 / (2.039 * 3.00 / 3.35),
        True,
        "estimate: H200 fit scaled by dense bf16 peak (compute) and memory bandwidth (decode)",
    ),
}

# Host memory per GPU of the machines the memory model was checked on (128 GiB per GPU).
DEFAULT_HOST_GIB = 128.0


# ------------------------------------------------------------------------------ model shape
# Shapes known by name, for a config whose model.path is not on this machine.
KNOWN_SHAPES = {"llama2-7b": memory.LLAMA2_7B, "llama3-8b": memory.LLAMA3_8B}
_NAME_KEYS = {"llama27b": "llama2-7b", "llama38b": "llama3-8b"}


def _shape_from_json(data: dict[str, Any]) -> Shape:
    c = data.get("text_config") or data
    heads = c["num_attention_heads"]
    return Shape(
        layers=c["num_hidden_layers"],
        hidden=c["hidden_size"],
        intermediate=c["intermediate_size"],
        heads=heads,
        kv_heads=c.get("num_key_value_heads") or heads,
        vocab=c["vocab_size"],
        head_dim=c.get("head_dim"),
    )


def model_shape(cfg: ExperimentConfig, name: str | None = None) -> tuple[Shape, str]:
    """The model's shape and where it came from: ``name`` (a key of :data:`KNOWN_SHAPES`), the
    model directory's ``config.json``, ``model.tiny``, or the directory's name."""
    if name is not None:
        if name not in KNOWN_SHAPES:
            raise PlanError(f"unknown --shape {name}; known: {', '.join(KNOWN_SHAPES)}")
        return KNOWN_SHAPES[name], f"--shape {name}"
    m = cfg.model
    if m.tiny is not None:
        t = m.tiny
        vocab = t.vocab_size
        if vocab is None:
            # Imported here: transformers costs seconds; only a tiny model without vocab_size
            # needs its tokenizer.
            from anchorctx.models.loading import load_tokenizer

            try:
                vocab = len(load_tokenizer(m))
            except (OSError, ValueError) as err:  # ModelLoadError: not written yet
                raise PlanError(
                    f"model.tiny has no vocab_size and its tokenizer cannot be read ({err}); "
                    "set model.tiny.vocab_size or write the tokenizer first (prepare-data)"
                ) from err
        shape = Shape(
            t.num_hidden_layers,
            t.hidden_size,
            t.intermediate_size,
            t.num_attention_heads,
            t.num_key_value_heads,
            vocab,
            t.head_dim,
        )
        return shape, "model.tiny"
    path = Path(cast(Path, m.path))  # ModelConfig holds exactly one of path and tiny
    if (path / "config.json").is_file():
        return _shape_from_json(json.loads((path / "config.json").read_text())), str(
            path / "config.json"
        )
    key = "".join(ch for ch in path.name.lower() if ch.isalnum()).removeprefix("meta")
    for part, known in _NAME_KEYS.items():
        if key.startswith(part):
            return KNOWN_SHAPES[known], f"{known} (named by model.path; its config.json is absent)"
    raise PlanError(
        f"model.path {path} has no config.json to read the model's shape from; pass --shape "
        f"{' or '.join(KNOWN_SHAPES)}"
    )


# ------------------------------------------------------------------------------ layout
def choose_sp(want: int, shape: Shape, world: int) -> int:
    """The sequence-parallel degree on ``world`` GPUs: ``want`` (the config's), or the largest
    divisor of ``world`` below it that the model's heads allow (Ulysses splits q heads; KV heads are split
    or replicated), so a config written for 8 GPUs plans on fewer."""
    for sp in range(min(want, world), 0, -1):
        heads_ok = shape.heads % sp == 0
        kv_ok = shape.kv_heads % sp == 0 or sp % shape.kv_heads == 0
        if world % sp == 0 and heads_ok and kv_ok:
            return sp
    return 1


def heads_problem(shape: Shape, sp: int) -> str | None:
    """Why Ulysses cannot split ``shape``'s heads over ``sp`` GPUs, in training's own words
    (:func:`anchorctx.training.plan.check_heads`); None when it can."""
    # Imported here: plan.py resolves devices through torch, which only a plan needs.
    from anchorctx.training.plan import TrainingError, check_head_counts

    try:
        check_head_counts(shape.heads, shape.kv_heads or shape.heads, sp)
    except TrainingError as err:
        return str(err)
    return None


def layout(cfg: ExperimentConfig, shape: Shape, gpus: int, nodes: int):
    """:func:`~anchorctx.training.plan.plan_parallelism`'s layout on ``gpus × nodes`` GPUs."""
    # Imported here: plan.py resolves devices through torch, which only a plan that gets this
    # far needs.
    from anchorctx.training.plan import TrainingError, default_zero_stage, plan_parallelism

    world = gpus * nodes
    t = cfg.training
    want = t.sequence_parallel
    if want != "auto" and want <= world:
        # On at least as many GPUs as it names, the config's SP is run as written: refused
        # exactly as training refuses it (plan_parallelism below: the process count).
        if problem := heads_problem(shape, want):
            raise PlanError(problem)
        sp = want
    else:
        # A config written for more GPUs plans on fewer (choose_sp); an unresolved auto (the
        # layout plan found nothing that fits): one row per GPU.
        sp = choose_sp(1 if want == "auto" else want, shape, world)
    # Planned as on CUDA, on this (perhaps GPU-less) machine: the device and engine only select
    # CPU defaults in plan_parallelism; the layout rules are what is used.
    planned = cfg.model_copy(
        update={
            "training": t.model_copy(
                update={
                    "device": "cpu",
                    "engine": "sdpa",
                    "nproc": gpus,
                    "nnodes": nodes,
                    "sequence_parallel": sp,
                }
            )
        }
    )
    try:
        par = plan_parallelism(planned, world)
    except TrainingError as err:
        raise PlanError(str(err)) from err
    zero = t.zero_stage if t.zero_stage is not None else default_zero_stage(cfg, "cuda", world)
    return dataclasses.replace(par, device="cuda", engine=t.engine, zero_stage=zero)


def memory_options(
    cfg: ExperimentConfig, shape: Shape, world: int, sp: int, zero: int | None = None
) -> Options:
    """The memory model's options of the run: ``training.memory`` on ``world`` ranks (ZeRO
    ``zero``, default the config's stage, else 3); a run without activation checkpointing keeps
    every layer's activations."""
    opt = Options.of_run(cfg.training, gpus=world, sp=sp, zero=zero)
    if not cfg.training.activation_checkpointing:
        opt = dataclasses.replace(opt, keep_activations=shape.layers)
    return opt


def row_tokens(cfg: ExperimentConfig, sp: int) -> int:
    """Tokens of one training row (padded to a multiple of SP, as training pads it)."""
    return math.ceil(cfg.data.seq_len / sp) * sp


# ------------------------------------------------------------------------------ step time
# Useful attention TFLOP/s of the kernels `auto` picks (one H200,
# docs/benchmarks/2026-11-22-attention-engines.md and 2026-11-24-attention-triton.md, heavy-tailed
# rows, 2026-11-22 and 2026-11-24): by T in tokens, (forward, forward+backward). Dense causal cuDNN
# for `full`; document masks: intra_doc flex forward, anchor triton / intra_doc flex
# forward+backward (equal within 1% on these rows).
DENSE_RATES = {32768: (594.0, 552.0), 65536: (595.0, 552.0), 131072: (559.0, 538.0)}
DOC_RATES = {32768: (340.0, 316.0), 65536: (364.0, 336.0), 131072: (405.0, 387.0)}
# FlashAttention-4 (engine fa4), one H200, heavy-tailed rows, 32 query and 8 KV heads
# (docs/benchmarks/2026-11-28-attention-fa4.md, 2026-11-28): dense causal for `full`; the
# anchor's gathered varlen for the document masks.
FA4_DENSE_RATES = {32768: (647.0, 602.0), 131072: (636.0, 610.0)}
FA4_DOC_RATES = {32768: (481.0, 406.0), 131072: (617.0, 561.0)}
#: (dense rates, document-mask rates) of the attention kernels ``auto`` runs
ATTENTION_RATES = {
    "cudnn-triton": (DENSE_RATES, DOC_RATES),
    "fa4": (FA4_DENSE_RATES, FA4_DOC_RATES),
}
#: GPU kinds with FlashAttention-4 training kernels (sm90; the A100 has none)
FA4_GPUS = ("H100", "H200")

# Liger's fused RoPE (training.kernels=liger, 2026-11-28) against transformers' RoPE, which the
# liger rows of STEP_ROWS ran: seconds saved per element of q and k per layer, forward and
# backward. Fitted on 2× H200, full-depth 7B, 16K tokens a GPU, all layers kept: Triton anchor
# 1.389 s against the plan's 1.472 with transformers' RoPE, cuDNN full 1.696 against 1.803
# (docs/benchmarks/2026-11-28-attention-fa4.md): 0.095 s over 4.3e9 elements.
ROPE_SAVED_S_PER_ELEMENT = 2.2e-11


def attention_kernels(gpu: GpuKind) -> str:
    """The attention kernels ``engine: auto`` runs on ``gpu`` when it trains from this
    environment: ``fa4`` on Hopper with flash-attn-4 installed, else ``cudnn-triton``."""
    return "fa4" if gpu.name in FA4_GPUS and fa4_installed() else "cudnn-triton"


@functools.cache
def fa4_installed() -> bool:
    """flash-attn-4 is importable here (looked up once: the layout search asks per candidate)."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ImportError:  # no flash_attn package at all
        return False


def rope_saving_seconds(shape: Shape, t: float, keep: int) -> float:
    """Time the fused RoPE saves on one row of ``t`` tokens a GPU (q and k of every layer, its
    forward again in the layers activation checkpointing recomputes: a third of the total)."""
    head_dim = shape.head_dim or shape.hidden // shape.heads
    elements = t * (shape.heads + shape.kv_heads) * head_dim * shape.layers
    recomputed = (shape.layers - min(keep, shape.layers)) / shape.layers
    return ROPE_SAVED_S_PER_ELEMENT * elements * (1 + recomputed / 3)


def _interpolate(table: dict[int, Any], length: int) -> Any:
    """Linear in log length between the measured lengths, clamped outside them."""
    keys = sorted(table)
    if length <= keys[0]:
        return table[keys[0]]
    if length >= keys[-1]:
        return table[keys[-1]]
    hi = next(k for k in keys if k >= length)
    lo = keys[keys.index(hi) - 1]
    w = math.log(length / lo) / math.log(hi / lo)
    a, b = table[lo], table[hi]
    if isinstance(a, tuple):
        return tuple(x + w * (y - x) for x, y in zip(a, b, strict=True))
    return a + w * (b - a)


@dataclass(frozen=True)
class StepRow:
    """One measured training step (docs/benchmarks/2026-11-22-training-step.md, one H200, 4 layers
    of the Llama-2-7B width, heavy-tailed documents, one row per step)."""

    tokens: int
    variant: str
    kernels: str
    keep: int  # layers kept (not recomputed)
    tiled_loss: bool
    step_s: float
    tflops: float  # the bench's model TFLOP/s (6·N·t + 3·attention forward) = MFU × 989.4


BENCH_SHAPE = Shape(layers=4, hidden=4096, intermediate=11008, heads=32, kv_heads=32, vocab=32000)
STEP_ROWS = (
    # Section 2's first table (2026-11-22).
    StepRow(32768, "full", "torch", 0, False, 0.798, 364.0),
    StepRow(32768, "anchor", "torch", 0, False, 0.575, 337.0),
    StepRow(65536, "full", "torch", 0, False, 2.110, 375.0),
    StepRow(65536, "anchor", "torch", 0, False, 1.123, 347.0),
    # Section 2, "Re-run with auto choosing triton" and "Selective checkpointing" (2026-11-24).
    StepRow(131072, "full", "torch", 0, False, 6.601, 368.0),
    StepRow(131072, "anchor", "torch", 0, False, 2.230, 358.0),
    StepRow(131072, "full", "torch", 2, False, 5.895, 0.416 * 989.4),
    StepRow(131072, "anchor", "torch", 2, False, 1.990, 0.405 * 989.4),
    StepRow(131072, "full", "torch", 3, True, 5.599, 0.438 * 989.4),
    StepRow(131072, "anchor", "torch", 3, True, 1.942, 0.415 * 989.4),
    StepRow(131072, "full", "torch", 4, True, 5.234, 0.469 * 989.4),
    StepRow(131072, "anchor", "torch", 4, True, 1.817, 0.444 * 989.4),
    StepRow(131072, "full", "liger", 0, False, 6.436, 0.381 * 989.4),
    StepRow(131072, "anchor", "liger", 0, False, 2.026, 0.398 * 989.4),
    StepRow(131072, "full", "liger", 4, True, 5.093, 0.471 * 989.4),
    StepRow(131072, "anchor", "liger", 4, True, 1.660, 0.486 * 989.4),
)

# The offloaded optimizer's step over 1e9 fp32 parameters on a GPU host's CPU, 16 cores
# (measured 2026-11-24, one H200 host): torch's AdamW (foreach) and DeepSpeed's compiled
# DeepSpeedCPUAdam (training.memory.cpu_adam).
CPU_ADAM_S_PER_GPARAM = {"torch": 1.36, "deepspeed": 0.22}


def _decoder_params(shape: Shape) -> int:
    return shape.layers * shape.layer_params


def _head_params(shape: Shape) -> int:
    return shape.vocab * shape.hidden


def _mlp_params(shape: Shape) -> int:
    return shape.layers * 3 * shape.hidden * shape.intermediate


def matmul_flops(shape: Shape, t: float, keep: int, tiled_mlp: bool, tiled_loss: bool) -> float:
    """Matmul FLOPs of one row on one GPU (``t`` tokens there); ``keep`` layers not recomputed."""
    dec, head = _decoder_params(shape), _head_params(shape)
    recomputed = dec * (shape.layers - min(keep, shape.layers)) / shape.layers
    flops = 6 * (dec + head) * t + 2 * recomputed * t
    if tiled_mlp:
        flops += 2 * _mlp_params(shape) * t
    if tiled_loss:
        flops += 2 * head * t
    return flops


def full_attention_forward(shape: Shape, tokens: int) -> float:
    """Useful forward FLOPs of causal attention over ``tokens``, all layers and heads."""
    q_width = shape.heads * (shape.head_dim or shape.hidden // shape.heads)
    return 4 * q_width * shape.layers * tokens * tokens / 2


def measured_doc_tokens() -> dict[int, float]:
    """The token-weighted mean document length ``D`` of the measured rows, by T: the bench's
    attention FLOPs of the anchor row over the full row's at the same T (``D / T``)."""
    out = {}
    for row in STEP_ROWS:
        if row.variant != "anchor" or row.keep or row.kernels != "torch":
            continue
        t = row.tokens
        linear = 6 * (_decoder_params(BENCH_SHAPE) + _head_params(BENCH_SHAPE)) * t
        attn_fwd = (row.tflops * 1e12 * row.step_s - linear) / 3
        out[t] = t * attn_fwd / full_attention_forward(BENCH_SHAPE, t)
    return out


def doc_tokens(tokens: int) -> float:
    """``D`` at a row of ``tokens`` (interpolated in log T between the measured rows)."""
    return min(float(tokens), _interpolate(measured_doc_tokens(), tokens))


def attention_seconds(
    shape: Shape,
    tokens: int,
    variant: str,
    sp: int,
    keep: int,
    peak_scale: float = 1.0,
    pairs: float | None = None,
    kernels: str = "cudnn-triton",
) -> float:
    """Attention time of one row on one GPU (1/SP of the heads) at the H200's rates of
    ``kernels`` (a key of :data:`ATTENTION_RATES`). ``pairs``: the attended (query, key)
    pairs of a document-masked row (default ``T·D/2``, ``D`` = :func:`doc_tokens`;
    :func:`document_lengths` reads them from the packed dataset)."""
    full = full_attention_forward(shape, tokens)
    dense_rates, doc_rates = ATTENTION_RATES[kernels]
    if variant == "full":
        fwd = full
        rate_f, rate_fb = _interpolate(dense_rates, tokens)
    else:
        if pairs is None:
            pairs = tokens * doc_tokens(tokens) / 2
        fwd = full * pairs / (tokens * tokens / 2)
        rate_f, rate_fb = _interpolate(doc_rates, tokens)
    fwd /= sp
    recomputed = fwd * (shape.layers - min(keep, shape.layers)) / shape.layers
    return (3.5 * fwd / rate_fb + recomputed / rate_f) / 1e12


def matmul_rate(kernels: str) -> float:
    """FLOP/s the measured steps achieved outside attention, fitted over :data:`STEP_ROWS` of
    ``kernels`` (their matmul FLOPs over their time less the attention model's)."""
    work = spent = 0.0
    for row in STEP_ROWS:
        if row.kernels != kernels:
            continue
        work += matmul_flops(BENCH_SHAPE, row.tokens, row.keep, False, row.tiled_loss)
        spent += row.step_s - attention_seconds(BENCH_SHAPE, row.tokens, row.variant, 1, row.keep)
    return work / spent


def row_seconds(
    shape: Shape,
    tokens: int,
    variant: str,
    opt: Options,
    gpu: GpuKind,
    checkpointing: bool = True,
    pairs: float | None = None,
    attention: str | None = None,
) -> float:
    """Seconds of one row's forward and backward on each of its SP GPUs (``pairs``: see
    :func:`attention_seconds`; ``attention``: its kernels, default :func:`attention_kernels`)."""
    keep = opt.keep_activations if checkpointing else shape.layers
    t = tokens / opt.sp
    rest = matmul_flops(shape, t, keep, opt.tiled_mlp, opt.tiled_loss) / matmul_rate(opt.kernels)
    if opt.kernels == "liger":
        rest -= rope_saving_seconds(shape, t, keep)
    kernels = attention or attention_kernels(gpu)
    attn = attention_seconds(shape, tokens, variant, opt.sp, keep, pairs=pairs, kernels=kernels)
    return (rest + attn) * gpu.train


def step_seconds(
    shape: Shape, tokens: int, variant: str, opt: Options, gpu: GpuKind, **kw
) -> float:
    """One optimizer step on each GPU: the sum of :func:`step_parts`."""
    return sum(step_parts(shape, tokens, variant, opt, gpu, **kw).values())


# What each of step_parts' parts is, as `anchorctx plan` names them.
STEP_PARTS = {
    "compute": "the rows' forward and backward",
    "ulysses": "Ulysses' all-to-alls",
    "zero3_gather": "ZeRO-3's gathers",
    "grad_reduce": "gradient reduction",
    "overhead": "per-layer hooks and launches",
    "param_gather": "updated weights' all-gather",
    "update": "the update",
}


def step_parts(
    shape: Shape,
    tokens: int,
    variant: str,
    opt: Options,
    gpu: GpuKind,
    *,
    nodes: int = 1,
    accum: int = 1,
    rows: int = 1,
    checkpointing: bool = True,
    pairs: float | None = None,
    overlap_comm: bool | None = None,
    inter_node_gb_per_s: float | None = None,
    attention: str | None = None,
) -> dict[str, float]:
    """Seconds of one optimizer step on each GPU by part (:data:`STEP_PARTS`): ``accum``
    micro-steps of ``rows`` rows per data-parallel group, each with the communication its compute
    does not hide, then the update (:mod:`anchorctx.training.layout_plan`; an offloaded optimizer
    steps on the host, :func:`optimizer_seconds`). Communication counts only what is exposed.
    ``overlap_comm``: default the plan's setting for ``opt.zero``."""
    keep = opt.keep_activations if checkpointing else shape.layers
    overlap = layout_plan.overlap_of(None, opt.zero) if overlap_comm is None else overlap_comm
    lay = layout_plan.Layout(opt.gpus // nodes, nodes, opt.sp, opt.zero, overlap)
    links, inter = layout_plan.links_for(gpu.name.lower(), inter_node_gb_per_s)
    comm = layout_plan.comm_seconds(shape, tokens, lay, shape.layers - keep, links, inter)
    comm["ulysses"] *= rows
    if opt.offload_optimizer:
        comm["optimizer"] = 0.0
    micro = layout_plan.exposed_parts(comm, overlap)
    row = row_seconds(shape, tokens, variant, opt, gpu, checkpointing, pairs, attention)
    parts = {"compute": accum * rows * row}
    parts |= {k: accum * v for k, v in micro.items()}
    parts["param_gather"] = layout_plan.EXPOSED["param_gather"] * comm["param_gather"]
    parts["update"] = layout_plan.EXPOSED["optimizer"] * comm["optimizer"] + optimizer_seconds(
        shape, opt
    )
    return parts


def optimizer_seconds(shape: Shape, opt: Options) -> float:
    """The host's AdamW step over one rank's partition when the optimizer is offloaded (the
    GPU's own AdamW step is part of the fitted rate)."""
    if not opt.offload_optimizer:
        return 0.0
    return CPU_ADAM_S_PER_GPARAM[opt.cpu_adam] * shape.params / opt.gpus / 1e9


# ------------------------------------------------------------------------------ document lengths
@dataclass(frozen=True)
class DocLengths:
    """Where a document-masked arm's attention work comes from: the attended pairs of the
    packed dataset's rows when it exists, else the measured rows' ``D``."""

    source: str  # "packed dataset" or "assumed"
    detail: str  # what the plan prints after "document lengths: "
    dataset: str | None  # the packed dataset's directory
    rows: int  # rows the mean is over (row reads of the run, repeats counted); 0 when assumed
    pairs: float  # mean attended (query, key) pairs per row
    doc_tokens: float  # D = 2·pairs / T (for an assumed source, the D assumed)


def _k(tokens: float) -> str:
    return f"{tokens / 1000:.1f}K"


def assumed_lengths(tokens: int, why: str = "no packed dataset yet") -> DocLengths:
    d = doc_tokens(tokens)
    return DocLengths("assumed", f"assumed D={_k(d)} ({why})", None, 0, tokens * d / 2, d)


def locate_packed(cfg: ExperimentConfig) -> tuple[Path | None, dict[str, Any], str]:
    """The packed dataset ``prepare-data`` wrote for ``cfg``, the directory training reads
    (:func:`~anchorctx.packing.pipeline.default_output_dir` of its
    :func:`~anchorctx.packing.pipeline.dataset_fingerprint`), and its manifest; else None and
    why not. Nothing is fingerprinted (no tokenizer load) while the experiment has no packed
    dataset on disk."""
    none = "no packed dataset yet"
    if cfg.data.output_dir:
        candidates = [Path(cfg.data.output_dir)]
    else:
        data = cfg.experiment_dir / "data"
        candidates = list(data.iterdir()) if data.is_dir() else []
    if not any((c / "manifest.json").is_file() for c in candidates):
        return None, {}, none
    # Imported here: fingerprinting reads the tokenizer (transformers), which only a plan with a
    # packed dataset on disk needs.
    from anchorctx.packing.pipeline import dataset_fingerprint, default_output_dir

    try:
        fingerprint = dataset_fingerprint(cfg)
    except (ValueError, OSError) as err:  # DataError, ModelLoadError: inputs or tokenizer gone
        return None, {}, f"packed dataset not located: {err}"
    path = default_output_dir(cfg, fingerprint)
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        return None, {}, none
    if manifest.get("fingerprint") != fingerprint or not (path / "state.json").is_file():
        return None, {}, none
    return path, manifest, ""


def row_reads(rows: int, samples: int, seed: int) -> Any:
    """How often the run reads each row: ``samples`` row reads in the order of
    :class:`anchorctx.training.data.BatchPlan` (every row once per whole epoch, then the first
    ones of the next epoch's :func:`~anchorctx.training.data.epoch_permutation`); every row
    once for no steps."""
    import numpy as np

    # Imported here: the training data module imports torch, which only a plan with a packed
    # dataset on disk needs (and plan_parallelism has imported by then).
    from anchorctx.training.data import epoch_permutation

    if samples <= 0:
        return np.ones(rows, dtype=np.int64)
    epochs, rest = divmod(samples, rows)
    reads = np.full(rows, epochs, dtype=np.int64)
    if rest:
        reads[epoch_permutation(seed, epochs, rows)[:rest]] += 1
    return reads


def _dataset_pairs(path: Path, seq_len: int, sp: int) -> Any:
    """The attended pairs of every row training builds from the packed dataset at ``path``
    (:func:`anchorctx.training.data.trained_pairs`), its Arrow files read through ``datasets``
    (:func:`~anchorctx.packing.pipeline.load_packed` checks them against the manifest)."""
    # Imported here: datasets and the training data module (torch) load only for a plan with
    # a packed dataset on disk.
    from anchorctx.packing.pipeline import load_packed
    from anchorctx.training.data import packed_segments, trained_pairs

    return trained_pairs(*packed_segments(load_packed(path)[0]), seq_len, sp)


def document_lengths(
    cfg: ExperimentConfig, tokens: int, sp: int, cache: dict[Any, Any] | None = None
) -> DocLengths:
    """The attention work of ``cfg``'s document-masked arm: the mean attended pairs over the
    rows the run reads of its packed dataset when that exists (and is of ``data.seq_len``), else
    the measured rows' ``D`` (:func:`assumed_lengths`). ``cache`` shares the datasets located
    and read between the arms of one plan."""
    cache = {} if cache is None else cache
    where: tuple[str | int, ...]
    where = ("locate", cfg.data.model_dump_json(), cfg.seed, str(cfg.model.tokenizer_path))
    where += (str(cfg.experiment_dir),)
    if where not in cache:
        cache[where] = locate_packed(cfg)
    path, manifest, why = cache[where]
    if path is None:
        return assumed_lengths(tokens, why)
    if manifest.get("seq_len") != cfg.data.seq_len:
        return assumed_lengths(
            tokens,
            f"packed dataset {path} has seq_len {manifest.get('seq_len')}, not data.seq_len "
            f"{cfg.data.seq_len}: ignored",
        )
    key = ("pairs", str(path), cfg.data.seq_len, sp)
    if key not in cache:
        try:
            cache[key] = _dataset_pairs(path, cfg.data.seq_len, sp)
        except (OSError, ValueError, KeyError) as err:  # DataError, pyarrow's errors: these kinds
            cache[key] = f"packed dataset {path} not readable: {err}"
    if isinstance(cache[key], str):
        return assumed_lengths(tokens, cache[key])
    per_row = cache[key].of(cfg.training.attention)
    if not len(per_row):
        return assumed_lengths(tokens, f"packed dataset {path} has no rows")
    reads = row_reads(len(per_row), cfg.training.steps * cfg.training.global_batch_size, cfg.seed)
    rows = int(reads.sum())
    pairs = float(reads @ per_row) / rows
    d = 2 * pairs / tokens
    return DocLengths(
        "packed dataset",
        f"packed dataset {path}, {rows} rows (D={_k(d)})",
        str(path),
        rows,
        pairs,
        d,
    )


# ------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class ArmPlan:
    name: str
    variant: str
    steps: int
    step_s: float
    gpu_hours: float
    # The document-masked arms' attention work (None for full: causal pairs T²/2).
    document_lengths: DocLengths | None = None
    parts: dict[str, float] = dataclasses.field(default_factory=dict)  # step_parts' split


@dataclass(frozen=True)
class TrainingPlan:
    gpu: str
    gpu_estimate: bool
    gpus: int
    nodes: int
    shape: Shape
    shape_source: str
    seq_len: int
    sp: int
    dp: int
    micro: int
    accum: int
    zero_stage: int
    options: Options
    memory_gib: dict[str, float]
    usable_gib: float
    host_gib: float
    arms: tuple[ArmPlan, ...]

    @property
    def gpu_hours(self) -> float:
        return sum(a.gpu_hours for a in self.arms)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["gpu_hours"] = self.gpu_hours
        d["shape"]["params"] = self.shape.params
        return d


def _fits(est: dict[str, float], usable_gib: float, host_gib: float) -> bool:
    return est["peak"] <= usable_gib * GIB and est["cpu"] <= host_gib * GIB


def usable_gib(gpu: GpuKind) -> float:
    """GPU memory a run can use (memory.RESERVED_FRACTION kept for context and fragmentation)."""
    return gpu.memory_gib * (1 - RESERVED_FRACTION)


# Single options tried, in order, when a run does not fit: cheapest in time first (the tiled loss
# and the fused kernels cost little, the tiled MLP one MLP forward, offloads host memory and
# copies).
_FIXES = (
    ("training.memory.tiled_loss=true", {"tiled_loss": True}),
    ("training.kernels=liger", {"kernels": "liger"}),
    ("training.memory.keep_activations=0", {"keep_activations": 0}),
    ("training.memory.tiled_mlp=true", {"tiled_mlp": True}),
    ("training.memory.offload_optimizer=true", {"offload_optimizer": True}),
    ("training.memory.offload_checkpoints=true", {"offload_checkpoints": True}),
)
MAX_GPUS = 1024


def _fix_hint(
    cfg: ExperimentConfig, shape: Shape, tokens: int, opt: Options, gpu: GpuKind, host: float
) -> str:
    """What would make the run fit: one option (else the fewest options, in :data:`_FIXES`
    order) on these GPUs, or the fewest GPUs with the config's options."""
    use = usable_gib(gpu)
    applicable = [
        (text, change)
        for text, change in _FIXES
        if any(getattr(opt, k) != v for k, v in change.items())
        and (cfg.training.activation_checkpointing or "keep_activations" not in change)
        and (cfg.training.activation_checkpointing or "offload_checkpoints" not in change)
    ]
    options = None
    for text, change in applicable:
        if _fits(memory.predict(shape, tokens, dataclasses.replace(opt, **change)), use, host):
            options = text
            break
    if options is None:
        chosen, trial = [], opt
        for text, change in applicable:
            trial = dataclasses.replace(trial, **change)
            chosen.append(text)
            if _fits(memory.predict(shape, tokens, trial), use, host):
                options = " ".join(chosen)
                break
    more = None
    for gpus in range(opt.gpus + 1, MAX_GPUS + 1):
        # More GPUs help a row's memory through SP: up to one SP group over all of them.
        want = cfg.training.sequence_parallel
        sp = choose_sp(gpus if want == "auto" else max(want, gpus), shape, gpus)
        trial = dataclasses.replace(opt, gpus=gpus, sp=sp)
        if _fits(memory.predict(shape, math.ceil(tokens / sp) * sp, trial), use, host):
            # The plan picks SP itself up to the config's; beyond it the config must say so.
            planned = sp if want == "auto" else choose_sp(want, shape, gpus)
            extra = "" if sp == planned else f" and training.sequence_parallel={sp}"
            more = f"--gpus {gpus}{extra}"
            break
    hints = [h for h in (options, more) if h]
    return " or ".join(hints) if hints else "a larger GPU or a shorter data.seq_len"


def plan_training(
    cfg: ExperimentConfig,
    gpu: str = "h200",
    gpus: int = 1,
    nodes: int = 1,
    host_gib: float = DEFAULT_HOST_GIB,
    shape_name: str | None = None,
) -> TrainingPlan:
    """Memory, step time and GPU-hours of every arm of ``cfg`` on ``gpus × nodes`` GPUs of kind
    ``gpu``. A run whose predicted peak does not fit is a :class:`PlanError` naming the fix."""
    if gpu not in GPUS:
        raise PlanError(f"unknown --gpu {gpu}; known: {', '.join(GPUS)}")
    kind = GPUS[gpu]
    shape, source = model_shape(cfg, shape_name)
    par = layout(cfg, shape, gpus, nodes)
    tokens = row_tokens(cfg, par.sp)
    opt = memory_options(cfg, shape, par.world, par.sp, par.zero_stage)
    est = memory.predict(shape, tokens, opt)
    use = usable_gib(kind)
    if not _fits(est, use, host_gib):
        where = "GPU" if est["peak"] > use * GIB else "host"
        have = f"{est['peak'] / GIB:.1f} GiB per GPU predicted, {use:.1f} usable"
        if where == "host":
            have = f"{est['cpu'] / GIB:.1f} GiB of host memory per GPU predicted, {host_gib:g}"
        raise PlanError(
            f"{cfg.data.seq_len}-token rows do not fit {par.world}×{kind.name} (SP {par.sp}; "
            f"{have}): needs {_fix_hint(cfg, shape, tokens, opt, kind, host_gib)}"
        )
    arms = []
    read: dict[Any, Any] = {}  # packed datasets located and read, shared by the arms
    for arm in cfg.arms():
        t = arm.training
        arm_opt = memory_options(arm, shape, par.world, par.sp, par.zero_stage)
        lengths = None
        if t.attention != "full":
            lengths = document_lengths(arm, tokens, par.sp, read)
        parts = step_parts(
            shape,
            tokens,
            t.attention,
            arm_opt,
            kind,
            nodes=nodes,
            accum=par.accum,
            rows=par.micro,
            checkpointing=t.activation_checkpointing,
            pairs=lengths.pairs if lengths else None,
            overlap_comm=layout_plan.overlap_of(t.comm, par.zero_stage),
            inter_node_gb_per_s=t.comm.inter_node_gb_per_s,
        )
        step = sum(parts.values())
        hours = t.steps * step * par.world / 3600
        arms.append(ArmPlan(arm.variant_name, t.attention, t.steps, step, hours, lengths, parts))
    return TrainingPlan(
        gpu=gpu,
        gpu_estimate=kind.estimate,
        gpus=gpus,
        nodes=nodes,
        shape=shape,
        shape_source=source,
        seq_len=tokens,
        sp=par.sp,
        dp=par.dp,
        micro=par.micro,
        accum=par.accum,
        zero_stage=par.zero_stage,
        options=opt,
        memory_gib=memory.summary(est),
        usable_gib=round(use, 2),
        host_gib=host_gib,
        arms=tuple(arms),
    )
