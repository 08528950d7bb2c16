"""Capture the query/key tensors a model's attention kernel receives, after RoPE.

The probe is an attention implementation registered with transformers' ``AttentionInterface``
(the public registry the project's own attention uses). It hands ``(layer, q, k, scaling)`` to
the active handler and then computes the layer's output with transformers' stock SDPA
attention, so the forward pass is numerically the stock model's. Because it sits at the
attention-function boundary, the captured q/k are exactly the kernel's inputs: rotated by the
model's own rotary module, in the model's dtype, after any cast (``+rope_fp32`` casts the
float32-rotated q/k to bf16 before the probe sees them). Nothing in transformers is patched and
the q/k projections are not recomputed.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

PROBE = "anchorctx_probe"

# handler(layer_idx, query [B, H, T, D], key [B, H_kv, T, D], scaling)
Handler = Callable[[int, torch.Tensor, torch.Tensor, float], None]
_HANDLER: contextvars.ContextVar[Handler | None] = contextvars.ContextVar(
    "anchorctx_probe_handler", default=None
)


def _probe_attention(module, query, key, value, attention_mask, **kwargs):
    handler = _HANDLER.get()
    if handler is not None:
        scaling = kwargs.get("scaling")
        handler(module.layer_idx, query, key, module.scaling if scaling is None else scaling)
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


def register() -> str:
    """Register the probe (idempotent) with SDPA's mask builder; return its name."""
    AttentionInterface.register(PROBE, _probe_attention)
    AttentionMaskInterface.register(PROBE, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return PROBE


@contextlib.contextmanager
def capture(handler: Handler) -> Iterator[None]:
    """Route every probed attention call inside the block to ``handler``."""
    token = _HANDLER.set(handler)
    try:
        yield
    finally:
        _HANDLER.reset(token)
