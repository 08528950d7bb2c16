"""``training.kernels``: fused elementwise kernels for the decoder's RMSNorm, SwiGLU and RoPE.

``torch`` (the default) keeps transformers' modules as they are. ``liger`` puts Liger-Kernel's
fused Triton kernels in their place on the model instance (transformers' source is untouched):
every RMSNorm becomes one kernel forward and one backward instead of the fp32 upcast, mean,
rsqrt, scale and cast that transformers runs as separate kernels, each reading and writing a
[T, hidden] tensor; the MLP's ``silu(gate) * up`` becomes one kernel instead of three over
[T, intermediate]; the rotary embedding of q and k becomes one kernel each way instead of
transformers' ``q·cos + rotate_half(q)·sin`` (a negation, a concatenation, two products and a
sum, each a pass over [T, heads·head_dim], for q and for k, and as many in backward: ~7% of a
16K-token 7B step on an H200, docs/benchmarks/2026-11-28-attention-fa4.md). At 128K tokens
these passes are memory-bound traffic of ~1 GB per [T, 4096] bf16 tensor
(docs/benchmarks/2026-11-22-training-step.md measures what fusing them saves). The arithmetic
is the same up to float rounding (the fused kernels keep the fp32 intermediates in registers;
the fused RoPE rounds its result to bf16 once where transformers rounds the two products and
their sum), so this is an option, off by default (docs/FIDELITY.md).

Liger-Kernel is an optional dependency for CUDA machines (``pip install liger-kernel``), like
flash-attn; it is not in the CPU lock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from anchorctx.training.plan import TrainingError
from anchorctx.training.tiling import decoder_layers

NORMS = ("input_layernorm", "post_attention_layernorm")
#: attention classes whose forward ``fused_rope_forward`` reproduces (projections, RoPE, the
#: registered attention function, output projection), and whether that forward passes
#: ``sliding_window`` to the attention function (Mistral's and Qwen2's do)
ROPE_FUSED_CLASSES = {"LlamaAttention": False, "MistralAttention": True, "Qwen2Attention": True}


def use_kernels(model, kernels: str) -> int:
    """Apply ``training.kernels`` to ``model`` (before DeepSpeed wraps it); returns the modules
    changed."""
    if kernels == "torch":  # the config admits torch and liger
        return 0
    try:
        # Imported here: optional, CUDA only.
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
    except ImportError as err:
        raise TrainingError(
            "training.kernels=liger needs Liger-Kernel on a CUDA machine (pip install "
            f"liger-kernel): {err}"
        ) from err

    def fused_norm(old):
        eps = getattr(old, "variance_epsilon", None) or getattr(old, "eps", None)
        if eps is None or getattr(old, "weight", None) is None:
            raise TrainingError(f"training.kernels=liger: {type(old).__name__} is not an RMSNorm")
        # "llama" casting: normalise in fp32, cast to the input dtype, then scale by the weight,
        # as transformers' LlamaRMSNorm (and Mistral's, Qwen2's) does. The weight Parameter is
        # the model's own object, so loading, ZeRO partitioning and checkpoints see no change.
        new = LigerRMSNorm(old.weight.shape[0], eps=eps, casting_mode="llama", in_place=False)
        new.weight = old.weight
        return new

    def fused_swiglu(self, x):
        # x: [B, T, hidden] -> gate, up: [B, T, intermediate] -> [B, T, hidden]
        return self.down_proj(LigerSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))

    if model.config.get_text_config().hidden_act not in ("silu", "swish"):
        raise TrainingError("training.kernels=liger: the fused SwiGLU needs hidden_act silu")
    decoder = model.get_decoder()
    changed = 0
    attention_classes: dict[type, type] = {}
    if hasattr(decoder, "norm"):
        decoder.norm = fused_norm(decoder.norm)
        changed += 1
    classes: dict[type, type] = {}
    for layer in decoder_layers(model):
        for name in NORMS:
            setattr(layer, name, fused_norm(getattr(layer, name)))
            changed += 1
        mlp = layer.mlp
        # A subclass, not an instance attribute: tiled MLP (training.memory.tiled_mlp) runs the
        # class's forward inside each tile, so the two compose.
        cls = type(mlp)
        if cls not in classes:
            classes[cls] = type(f"Liger{cls.__name__}", (cls,), {"forward": fused_swiglu})
        mlp.__class__ = classes[cls]
        changed += 1
        changed += _fuse_rope(layer.self_attn, attention_classes)
    return changed


def rope_function() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """Liger's fused rotary embedding: (q [B, H, T, D], k [B, H_kv, T, D], cos, sin [B or 1,
    T, D]) -> (q, k) rotated, written into the projections' outputs (which no backward reads)."""
    # Imported here: optional, CUDA only (use_kernels checked the package imports).
    from liger_kernel.ops.rope import LigerRopeFunction

    return LigerRopeFunction.apply


def _fuse_rope(attention: torch.nn.Module, classes: dict[type, type]) -> int:
    """Give ``attention`` a forward with the fused RoPE (a subclass, like the MLP's); 0 when its
    class is not one whose forward :func:`fused_rope_forward` reproduces."""
    cls = type(attention)
    if cls.__name__ not in ROPE_FUSED_CLASSES:
        return 0
    if cls not in classes:
        body = {"forward": fused_rope_forward, "passes_window": ROPE_FUSED_CLASSES[cls.__name__]}
        classes[cls] = type(f"Liger{cls.__name__}", (cls,), body)
    attention.__class__ = classes[cls]
    return 1


def fused_rope_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kw):
    """The model's own attention forward for training (no KV cache) with RoPE fused; with a
    cache, or an attention implementation the registry does not hold, the class's own forward
    runs unchanged."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = self.config._attn_implementation
    cached = kw.get("cache") is not None or kw.get("past_key_values") is not None
    if cached or position_embeddings is None or impl not in ALL_ATTENTION_FUNCTIONS:
        parent: Any = super(type(self), self)
        return parent.forward(hidden_states, position_embeddings, attention_mask, **kw)
    for name in ("cache", "past_key_values"):  # None here; the model's forward takes them by name
        kw.pop(name, None)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    # [B, T, heads·D] -> [B, heads, T, D]: views of the projections' outputs
    q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = rope_function()(q, k, cos, sin)
    if self.passes_window:  # Mistral reads it from the config, Qwen2 per layer
        kw["sliding_window"] = getattr(self, "sliding_window", self.config.sliding_window)
    out, weights = ALL_ATTENTION_FUNCTIONS[impl](
        self,
        q,
        k,
        v,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **kw,
    )
    # [B, T, heads, D] -> [B, T, heads·D]
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights
