"""Attention-difference metrics of the paper's Section 2 (Eq. 4 and Eq. 5), on captured q/k.

Every metric is evaluated in float64/float32 from the q/k tensors the model produced, so the
metric itself adds no bf16 rounding: a difference measures the model's q/k (RoPE rounding and
everything it propagated from earlier layers), not the arithmetic of the measurement.
"""

from __future__ import annotations

import torch

# Working-set budget of one chunk of [B, heads, T, T] float32 matrices (two probability
# matrices and their difference are alive at once).
_CHUNK_BYTES = 1 << 30


def expand_kv(key: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Repeat grouped K/V heads to the query heads: [B, H_kv, T, D] -> [B, H, T, D]."""
    groups = num_heads // key.shape[1]
    return key if groups == 1 else key.repeat_interleave(groups, dim=1)


def causal_probs(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal softmax(q kᵀ · scaling) in float32: q, k [B, h, T, D] -> [B, h, T, T]."""
    t = query.shape[-2]
    logits = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scaling
    future = torch.ones(t, t, dtype=torch.bool, device=query.device).triu(1)
    return logits.masked_fill_(future, float("-inf")).softmax(dim=-1)


def key_abs_diff(
    q1: torch.Tensor, k1: torch.Tensor, q2: torch.Tensor, k2: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Σ_heads Σ_queries |A1 − A2| per key token: q [B, H, T, D], k [B, H_kv, T, D] -> [B, T].

    A1, A2 are the causal attention probabilities from (q1, k1) and (q2, k2). Heads are
    processed in chunks so that a 32-head layer at 8K tokens stays within about 1 GiB.
    """
    b, h, t, _ = q1.shape
    k1, k2 = expand_kv(k1, h), expand_kv(k2, h)
    step = max(1, _CHUNK_BYTES // (3 * 4 * b * t * t))
    total = torch.zeros(b, t, dtype=torch.float64, device=q1.device)
    for s in range(0, h, step):
        a1 = causal_probs(q1[:, s : s + step], k1[:, s : s + step], scaling)
        a2 = causal_probs(q2[:, s : s + step], k2[:, s : s + step], scaling)
        # [B, h, T, T] -> [B, T]; a float32 sum of ≤ T·h non-negative terms is accurate to
        # ~1e-6 relative, far below any difference reported; layers accumulate in float64.
        total += (a1 - a2).abs_().sum(dim=(1, 2)).double()
    return total


def first_token_logits(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention logits of every query on key token 0: q [B, H, T, D], k [B, H_kv, T, D] -> [B, H, T]."""
    k0 = expand_kv(key[:, :, :1], query.shape[1])[:, :, 0]  # [B, H, D]
    return torch.einsum("bhtd,bhd->bht", query.float(), k0.float()) * scaling


def column_normalizer(t: int, device: torch.device | None = None) -> torch.Tensor:
    """n = [1/T, 1/(T−1), …, 1]: key j is visible to T − j queries under the causal mask."""
    return 1.0 / torch.arange(t, 0, -1, dtype=torch.float64, device=device)
