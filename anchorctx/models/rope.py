"""RoPE in float32 inside a bfloat16 model (``model.rope_fp32``).

What stock transformers does (Llama, Mistral, Qwen2 in transformers 4.5x-5.x): the model-level
``*RotaryEmbedding`` computes ``positions * inv_freq`` and ``cos``/``sin`` in float32, then casts
them to the activation dtype (``cos.to(x.dtype)``); every attention layer then computes
``q * cos + rotate_half(q) * sin`` in bfloat16. So a bf16 model rounds ``cos``/``sin`` to 8
significant bits and rounds again after each product and after the sum: the rotated q/k carry
position-dependent rounding error, which is what breaks RoPE's relative-position property
(Wang et al., Section 2). The authors' code keeps that bf16 path.

``enable_fp32_rope(model)`` changes two things, both through public extension points and
without touching library source:

1. each rotary-embedding submodule is replaced by :class:`Fp32RotaryEmbedding`, a wrapper that
   returns float32 ``cos``/``sin``. PyTorch type promotion then evaluates the whole rotation
   ``q * cos + rotate_half(q) * sin`` in float32 (bf16 q promoted exactly), so the rotated q/k
   are rounded to bf16 once (instead of after each product and after the sum) and the
   trigonometric factors are not rounded at all.
   The wrapper also keeps ``inv_freq`` in float32: a whole-module cast such as
   ``module.bfloat16()`` (DeepSpeed's bf16 engine without ZeRO-3 does this) would otherwise
   round the frequencies themselves to bf16, an error that grows linearly with position.
2. the rotated q/k now arrive at the attention function in float32 while v is bf16. The model's
   attention implementation is re-registered under ``"<name>+rope_fp32"`` with transformers'
   ``AttentionInterface`` as a thin wrapper that casts q/k to v's dtype (the single rounding
   above) and calls the original function; the mask function of the original name is
   registered for the new name, so causal/padding masks are built exactly as before.

The attention kernels, their memory and speed are unchanged; the rotation costs two float32
temporaries of q/k's size per layer. In a float32 model the option is a bit-exact no-op.

Integration: call it after the attention implementation is final, e.g. at the end of
``load_model``::

    if model_cfg.rope_fp32:
        from anchorctx.models.rope import enable_fp32_rope
        model = enable_fp32_rope(model)

Anything that later wraps the model's attention by name (DeepSpeed ALST
``register_with_transformers(core_attn_implementation=...)``) must pass
``anchorctx.attention.hf.attention_name(model)`` (the ``+rope_fp32`` name), not the original.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from anchorctx.attention.hf import attention_name, select_attention

SUFFIX = "+rope_fp32"
_ROPE_BUFFERS = ("inv_freq", "original_inv_freq")


class Fp32RotaryEmbedding(nn.Module):
    """Wraps a transformers rotary-embedding module so that it returns float32 cos/sin.

    The wrapped module only reads ``x`` for its device and dtype; it is called with an empty
    float32 tensor on ``x``'s device so that it skips its final cast to the activation dtype
    (no copy of the hidden states is made).
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        # Plain attributes, not buffers: ``module.to(dtype)`` must not round them.
        self._fp32_buffers = {
            name: getattr(inner, name).detach().to(torch.float32).clone()
            for name in _ROPE_BUFFERS
            if isinstance(getattr(inner, name, None), torch.Tensor)
        }

    def _restore_fp32_frequencies(self) -> None:
        for name, value in self._fp32_buffers.items():
            current = getattr(self.inner, name)
            if current.dtype != torch.float32:
                setattr(self.inner, name, value.to(current.device))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, **kwargs: Any):
        self._restore_fp32_frequencies()
        probe = x.new_empty((*x.shape[:-1], 0), dtype=torch.float32)
        cos, sin = self.inner(probe, position_ids, **kwargs)
        return cos, sin


def _rotary_modules(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, module) for every rotary-embedding submodule of the model."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, Fp32RotaryEmbedding) or (
                type(child).__name__.endswith("RotaryEmbedding") and hasattr(child, "inv_freq")
            ):
                found.append((parent, name, child))
    return found


def _cast_qk_to_value_dtype(base: Callable[..., Any]) -> Callable[..., Any]:
    def attention(module, query, key, value, attention_mask, **kwargs):
        # The one rounding of the float32-rotated q/k to the activation dtype.
        return base(
            module, query.to(value.dtype), key.to(value.dtype), value, attention_mask, **kwargs
        )

    attention.__name__ = f"{getattr(base, '__name__', 'attention')}_rope_fp32"
    return attention


def _register_wrapped_attention(model: nn.Module, base_name: str) -> str:
    if "flash" in base_name:
        raise ValueError(
            f"model.rope_fp32 cannot wrap attn_implementation={base_name!r}: transformers treats "
            "flash-attention names specially. Use the anchorctx attention "
            "(training.engine: flash_attn) or sdpa with model.rope_fp32."
        )
    if base_name == "eager":  # not in the registry: each modelling file defines its own
        base = getattr(sys.modules[type(model).__module__], "eager_attention_forward", None)
        if base is None:
            raise ValueError(f"{type(model).__module__} defines no eager_attention_forward")
    elif base_name in ALL_ATTENTION_FUNCTIONS.valid_keys():
        base = ALL_ATTENTION_FUNCTIONS[base_name]
    else:
        raise ValueError(
            f"attention implementation {base_name!r} is not registered with transformers"
        )
    name = base_name + SUFFIX
    AttentionInterface.register(name, _cast_qk_to_value_dtype(base))
    if base_name in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base_name])
    return name


def is_fp32_rope(model: nn.Module) -> bool:
    """Whether :func:`enable_fp32_rope` is active on ``model``."""
    return any(isinstance(m, Fp32RotaryEmbedding) for m in model.modules())


def enable_fp32_rope(model: nn.Module) -> nn.Module:
    """Compute RoPE in float32 inside a bf16/fp16 model (see the module docstring).

    Idempotent; returns the same model object. Raises ``ValueError`` when the model has no
    rotary-embedding submodule or uses an attention implementation that cannot be wrapped.
    """
    if is_fp32_rope(model):
        return model
    rotary = _rotary_modules(model)
    if not rotary:
        raise ValueError(
            f"{type(model).__name__} has no *RotaryEmbedding submodule with inv_freq: "
            "model.rope_fp32 supports RoPE models such as Llama, Mistral and Qwen2"
        )
    base_name = attention_name(model) or "sdpa"
    select_attention(model, _register_wrapped_attention(model, base_name))
    for parent, attr, module in rotary:
        setattr(parent, attr, Fp32RotaryEmbedding(module))
    return model


def disable_fp32_rope(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_fp32_rope` (restore the rotary modules and the attention name)."""
    if not is_fp32_rope(model):
        return model
    for parent, attr, module in _rotary_modules(model):
        if isinstance(module, Fp32RotaryEmbedding):
            setattr(parent, attr, module.inner)
    name = attention_name(model)
    if name.endswith(SUFFIX):
        select_attention(model, name[: -len(SUFFIX)])
    return model
