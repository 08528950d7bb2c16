"""Dense reference engine: ``scaled_dot_product_attention`` with a boolean mask.

Exact (forward and backward) on every device; materialises one T×T boolean mask per batch, so
it is meant for CPU training, tests and short rows. ``full`` needs no mask at all and uses the
causal kernels (cuDNN / FlashAttention on GPU), which makes it the fastest full-attention
engine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from anchorctx.attention.engines.base import AttentionCall, AutoRanks, Capabilities, Engine


class SdpaEngine(Engine):
    name = "sdpa"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        backward_devices=frozenset({"cpu", "cuda"}),
        dtypes=None,
        # Under torch's deterministic mode SDPA leaves out cuDNN's attention and runs the
        # flash and memory-efficient backwards without split-key atomics.
        deterministic_backward=frozenset({"cpu", "cuda"}),
    )
    # ``full`` is plain causal attention: dense cuDNN/FlashAttention beats every sparse kernel
    # there. Off CUDA it is the only choice (exact, with backward; flex on CPU is unfused), and
    # the last resort everywhere else.
    auto = AutoRanks(full=10, mixed=50, masked=60, other=10)

    def forward(self, call: AttentionCall) -> torch.Tensor:
        q, k, v = call.q, call.k, call.v
        gqa = q.shape[1] != k.shape[1]
        if all(row.variant == "full" for row in call.rows):
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=call.scale, enable_gqa=gqa
            )
        mask = _batch_mask(call)  # [B or 1, 1, T, T], broadcast over heads
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=call.scale, enable_gqa=gqa
        )


def _batch_mask(call: AttentionCall) -> torch.Tensor:
    device = call.q.device
    key = ("sdpa_mask", str(device))
    if key not in call.cache:
        rows = call.rows[:1] if call.shared else call.rows
        call.cache[key] = torch.stack([row.mask(device) for row in rows])[:, None]
    return call.cache[key]
