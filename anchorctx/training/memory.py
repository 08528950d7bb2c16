"""Per-GPU memory of one training step, by component, and the longest row that fits.

The model counts bytes; it is arithmetic on the model's shape and the run's options, checked
against measured peaks in docs/PERFORMANCE.md. Symbols: ``P`` parameters, ``N`` ranks that
ZeRO-3 shards over (DP × SP), ``t = T / SP`` tokens per rank, ``H`` hidden, ``I`` MLP width,
``Hkv`` KV width (kv heads × head dim), ``V`` vocabulary, ``L`` layers. bf16 weights and
activations (2 bytes), fp32 optimizer state.

Persistent (held through the whole step):

- parameters: ``2P/N`` (ZeRO-3 partitions) plus two gathered decoder layers (the one
  computing and the one prefetched);
- gradients: ``2P/N`` bf16 partitions plus DeepSpeed's reduce bucket (5e8 elements); with
  optimizer offload only the bucket stays on the GPU (the fp32 gradients live on the CPU);
- optimizer state: ``12P/N`` (fp32 master weights and two Adam moments), 0 with offload;
- checkpointed activations: each layer's input, ``L · t · H · 2``, 0 with checkpoint offload;
- kept activations (``memory.keep_activations``, K layers not checkpointed): each such layer's
  forward tensors that backward reads, :data:`KEPT_UNITS` ``[t, H]``, :data:`KV_UNITS`
  ``[t, Hkv]`` and :data:`KEPT_MLP_UNITS` ``[t, I]`` (its input is among them, so it leaves
  the checkpointed count).

Transient, the largest of the phases (the logits are freed before the layers' backward runs;
kept layers' tensors are held until their backward, which comes first):

- logits phase: ``t · V`` elements × :data:`LOGIT_BYTES` (bf16 logits, the fp32 log-softmax,
  its fp32 gradient and the bf16 gradient); tiled: one tile's worth plus the hidden states and
  their gradient;
- one layer's working set during its recomputation and backward: :data:`ATTN_UNITS` tensors of
  ``t × H`` (two RMSNorms with their fp32 copies, q, k, v and their rotated copies, attention
  output, projections, residuals and the gradients in flight; Ulysses adds the all-to-all
  copies), and :data:`MLP_UNITS` tensors of ``t × I`` (gate, up, activation, product, two
  gradients) — of one tile only with the tiled MLP — plus :data:`FITTED_UNITS` ``[t, H]``
  tensors fitted to a measurement.

Host (per rank): ``16P/N`` offloaded optimizer state (fp32 weights, gradients, two moments),
the offloaded checkpoints, and :data:`HOST_PROCESS_BYTES` for the process itself.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
BF16 = 2
REDUCE_BUCKET = 5e8 * BF16  # DeepSpeed's default reduce_bucket_size (elements) in bf16
LOGIT_BYTES = 12  # per logit: bf16 logits 2 + fp32 log-softmax 4 + fp32 grad 4 + bf16 grad 2
ATTN_UNITS = 14  # [t, H] bf16 tensors live in one layer's backward (see module docstring)
KV_UNITS = 3  # [t, Hkv] tensors: k, v, rotated k
ULYSSES_UNITS = 4  # all-to-all copies of q, k, v (head-sharded layout) and the output
MLP_UNITS = 6  # [t, I] tensors: gate, up, act(gate), product, two gradients
# A layer that is not checkpointed keeps, for its backward: its input, the two RMSNorm outputs
# and their fp32 copies (2 units each), q and rotated q, the attention output and the residual
# ([t, H]: 11), k, v and rotated k ([t, Hkv]), and gate, up, act(gate), product ([t, I]).
KEPT_UNITS = 11
KEPT_MLP_UNITS = 4
# training.kernels=liger: the fused RMSNorm keeps no fp32 copies (4 [t, H] units of two norms
# fewer, in a layer's working set and in a kept layer) and the fused SwiGLU no act(gate) (one
# [t, I] unit fewer).
FUSED_NORM_UNITS = 4
FUSED_MLP_UNITS = 1
# Fitted to the fused kernels' measured peaks, on top of the counts above (least squares over
# eight rows of the 4-layer Llama-2-7B-wide model with tiled loss: H100 at 64K with 1-4 kept
# layers and at 128K with 1-3, 2026-11-27; H200 at 128K with 4, 2026-11-24;
# docs/benchmarks/2026-11-27-memory-model-refit.md). After the fit every row is within 0.05 GiB;
# before it, 3.4-15.3 GiB over.
# - A kept layer holds FUSED_KEPT_FITTED_UNITS [t, H] tensors fewer: 7.54 and 15.08 GiB a kept
#   layer at 64K and 128K, where the count gives 8.53 and 17.06.
# - A layer's working set is FUSED_WORKING_FITTED_UNITS [t, H] smaller (about 3 [t, I] and
#   1 [t, H] for this shape: the fused SwiGLU's backward writes its gradients in place).
# A constant term besides (fitted: 0.05 GiB) does not improve the fit. The one liger row that
# peaks in the logits phase (H200, 128K, nothing kept, plain loss) measured 69.9 GiB against
# 68.5 predicted, within the 6% the plans keep in reserve (RESERVED_FRACTION). Fitted on one
# shape: other MLP ratios are extrapolations.
FUSED_KEPT_FITTED_UNITS = 2
FUSED_WORKING_FITTED_UNITS = 9.35
# Fitted, not counted: the one-H200 measurement (7B shape, 256K tokens, tiled MLP and loss,
# optimizer offload; 2026-11-23) peaked at 121.7 GiB against 112.7 GiB counted; the 9 GiB
# difference is charged to the one term that scales with t there, as 4.5 more [t, H] tensors.
FITTED_UNITS = 4.5
# ZeRO-3 beyond its partition and two gathered layers: the measured full-depth 7B peaks on
# 4× H200 (2026-11-28, ../REFERENCE.md) sat 4.4 (8K tokens a GPU) and 6.5 GiB (16K) above the
# count under ZeRO-3, while ZeRO-2 at 16K sat within 0.3 GiB of its own count: gathered weights
# held for reuse (stage3_max_live_parameters) and the allocator's blocks between gathers. One
# rank gathers nothing: the one-GPU fits below were ZeRO-3 and need no such term.
ZERO3_FITTED_BYTES = 5.0 * GIB
# ZeRO-2 on several GPUs peaks below the count: four full-depth 7B rows on 2× H200 (SP 2 at 8K
# and 16K tokens a GPU, DP 2 at 16K and 32K, overlap_comm on; 2026-11-28) sat 2.8-6.8 GiB
# (mean 4.85) under it: gradients are released into the reduce bucket as backward produces
# them, so the whole bf16 gradient the count holds is never resident at once. The smallest gap
# is taken, not the mean: with the mean, auto kept two layers more on 32K rows, peaked at 131.9
# of 139.8 GiB, and the allocator working at the edge cost 8% of the step
# (docs/benchmarks/2026-11-28-layout-2gpu.md). As a share of the bf16 gradient (2P bytes, 12.55
# GiB there), so that it scales with the model: 2.8 / 12.55.
ZERO2_RELEASED = 2.8 / 12.55
# Host memory of one training process beside its offloaded tensors (CUDA and NCCL state, torch,
# DeepSpeed's staging buffers): the same measurement's 116.9 GiB resident less 100.4 counted.
HOST_PROCESS_BYTES = 16.5 * GIB
# Memory a run cannot use: the CUDA context, NCCL buffers and the caching allocator's
# fragmentation; 6% is what the measured runs left between their peak and the device's size.
RESERVED_FRACTION = 0.06


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's dimensions (Llama layout: gated MLP, untied head)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int | None = None

    @property
    def kv_width(self) -> int:
        return self.kv_heads * (self.head_dim or self.hidden // self.heads)

    @property
    def layer_params(self) -> int:
        h, q = self.hidden, self.heads * (self.head_dim or self.hidden // self.heads)
        return h * q * 2 + 2 * h * self.kv_width + 3 * h * self.intermediate + 2 * h

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + 2 * self.vocab * self.hidden + self.hidden

    @classmethod
    def from_hf(cls, config) -> Shape:
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        return cls(
            layers=c.num_hidden_layers,
            hidden=c.hidden_size,
            intermediate=c.intermediate_size,
            heads=c.num_attention_heads,
            kv_heads=c.num_key_value_heads,
            vocab=c.vocab_size,
            head_dim=getattr(c, "head_dim", None),
        )


LLAMA2_7B = Shape(layers=32, hidden=4096, intermediate=11008, heads=32, kv_heads=32, vocab=32000)
LLAMA3_8B = Shape(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256)


@dataclass(frozen=True)
class Options:
    """The run's layout and ``training.memory`` options that change memory."""

    gpus: int = 1  # ranks ZeRO-3 shards over (DP × SP)
    sp: int = 1
    tiled_mlp: bool = False
    tiled_loss: bool = False
    offload_optimizer: bool = False
    offload_checkpoints: bool = False
    keep_activations: int = 0  # last layers not checkpointed
    kernels: str = "torch"  # training.kernels
    cpu_adam: str = "deepspeed"  # what steps an offloaded optimizer (the plans model CUDA runs)
    zero: int = 3  # ZeRO stage: 3 partitions the bf16 weights, 2 keeps them whole on every GPU

    @classmethod
    def of_run(cls, training, gpus: int, sp: int, zero: int | None = None) -> Options:
        """The options of a run's ``training`` section on ``gpus`` ranks with SP ``sp`` (and
        ZeRO stage ``zero``, default the section's, else 3)."""
        m = training.memory
        if zero is None:
            zero = training.zero_stage if training.zero_stage is not None else 3
        return cls(
            zero=zero,
            gpus=gpus,
            sp=sp,
            tiled_mlp=m.tiled_mlp,
            tiled_loss=m.tiled_loss,
            offload_optimizer=m.offload_optimizer,
            offload_checkpoints=m.offload_checkpoints,
            keep_activations=m.keep_activations,
            kernels=training.kernels,
            cpu_adam=cpu_adam(m, "cuda"),
        )


def cpu_adam(memory, device: str) -> str:
    """The optimizer ``training.memory.cpu_adam`` names for a run on ``device``: ``deepspeed``
    or ``torch``."""
    if memory.cpu_adam != "auto":
        return memory.cpu_adam
    return "deepspeed" if device == "cuda" else "torch"


def predict(shape: Shape, seq_len: int, opt: Options) -> dict[str, float]:
    """Bytes per GPU of each component at ``seq_len`` tokens per row (one row per step), the
    GPU peak (``peak``) and the CPU memory one rank's offloads take (``cpu``)."""
    # Imported here: tiling imports torch, which the memory model skips; looked up at call time, so
    # tests can substitute the tile sizes.
    from anchorctx.training.tiling import LOSS_TILE_BYTES, mlp_tiles

    n, t, h = opt.gpus, seq_len / opt.sp, shape.hidden
    p = shape.params
    if opt.zero >= 3:
        weights = 2 * p / n + 2 * shape.layer_params * BF16
        weights += ZERO3_FITTED_BYTES if n > 1 else 0.0  # one rank gathers nothing
    else:  # ZeRO-0/1/2: every GPU holds the whole bf16 model
        weights = 2 * p - (ZERO2_RELEASED * 2 * p if opt.zero == 2 and n > 1 else 0.0)
    state = 12 * p / n if opt.zero >= 1 else 12 * p
    grads = 2 * p / n if opt.zero >= 2 else 2 * p
    kept = min(opt.keep_activations, shape.layers)
    ckpt = (shape.layers - kept) * t * h * BF16
    fused = opt.kernels == "liger"
    fused_norm, fused_mlp = (FUSED_NORM_UNITS, FUSED_MLP_UNITS) if fused else (0, 0)
    fused_kept = fused_norm + (FUSED_KEPT_FITTED_UNITS if fused else 0)
    kept_bytes = (
        kept
        * (
            (KEPT_UNITS - fused_kept) * t * h
            + KV_UNITS * t * shape.kv_width
            + (KEPT_MLP_UNITS - fused_mlp) * t * shape.intermediate
        )
        * BF16
    )
    if opt.tiled_loss:
        tile_tokens = min(t, LOSS_TILE_BYTES / (4 * shape.vocab))
        logits = tile_tokens * shape.vocab * LOGIT_BYTES + 2 * t * h * BF16
    else:
        logits = t * shape.vocab * LOGIT_BYTES
    attn_units = ATTN_UNITS - fused_norm + FITTED_UNITS + (ULYSSES_UNITS if opt.sp > 1 else 0)
    mlp_tokens = t / mlp_tiles(int(t), h) if opt.tiled_mlp else t
    layer = (attn_units * t * h + KV_UNITS * t * shape.kv_width) * BF16
    layer += (MLP_UNITS - fused_mlp) * mlp_tokens * shape.intermediate * BF16
    if fused:
        layer -= FUSED_WORKING_FITTED_UNITS * t * h * BF16
    out = {
        "parameters": weights,
        "gradients": REDUCE_BUCKET + (0 if opt.offload_optimizer else grads),
        "optimizer_state": 0.0 if opt.offload_optimizer else state,
        "checkpointed_activations": 0.0 if opt.offload_checkpoints else ckpt,
        "kept_activations": kept_bytes,
        "layer_working_set": layer,
        "logits": logits,
    }
    base = sum(
        v for k, v in out.items() if k not in ("layer_working_set", "logits", "kept_activations")
    )
    # Backward meets the kept (last) layers first: the logits phase and the kept layers'
    # backward hold every kept tensor (a kept layer's working set includes its own kept
    # tensors), the checkpointed layers' backward none of them.
    kept_one = kept_bytes / kept if kept else 0.0
    out["peak"] = base + max(kept_bytes + logits, kept_bytes + layer - kept_one, layer)
    offloaded = (16 * p / n if opt.offload_optimizer else 0.0) + (
        ckpt if opt.offload_checkpoints else 0.0
    )
    out["cpu"] = offloaded + (HOST_PROCESS_BYTES if offloaded else 0.0)
    return out


@dataclass(frozen=True)
class Machine:
    name: str
    gpus: int
    gpu_gib: float  # memory the device reports
    cpu_gib_per_gpu: float  # host memory per GPU


MACHINES = (
    Machine("1×H100", 1, 79.2, 128),
    Machine("1×H200", 1, 139.8, 128),
    Machine("2×H200", 2, 139.8, 128),
    Machine("8×H100", 8, 79.2, 128),
    Machine("8×H200", 8, 139.8, 128),
)


def fits(shape: Shape, seq_len: int, opt: Options, m: Machine) -> bool:
    est = predict(shape, seq_len, opt)
    gpu_ok = est["peak"] <= m.gpu_gib * GIB * (1 - RESERVED_FRACTION)
    return gpu_ok and est["cpu"] <= m.cpu_gib_per_gpu * GIB


def max_seq_len(shape: Shape, opt: Options, m: Machine, step: int = 1024) -> int:
    """The longest row (a multiple of ``step × SP`` tokens) that fits ``m``; 0 if none."""
    unit = step * opt.sp
    lo, hi = 0, 1
    while fits(shape, hi * unit, opt, m):
        lo, hi = hi, hi * 2
        if hi * unit > 1 << 34:
            break
    while hi - lo > 1:  # invariant: lo fits (or is 0), hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(shape, mid * unit, opt, m) else (lo, mid)
    return lo * unit


def summary(est: dict[str, float]) -> dict[str, float]:
    """The components in GiB, rounded for printing."""
    return {k: round(v / GIB, 2) for k, v in est.items()}
