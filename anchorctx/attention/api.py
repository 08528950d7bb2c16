"""``attend``: the one attention entry point used by the model integration, tests and benches."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import torch

from anchorctx.attention.engines import AttentionCall, select_engine
from anchorctx.attention.errors import AttentionError
from anchorctx.attention.layout import Layout, LayoutBatch


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: Layout | Sequence[Layout],
    engine: str = "auto",
    scale: float | None = None,
) -> torch.Tensor:
    """Masked attention of packed rows.

    Args:
        q: [B, H, T, D]; k, v: [B, H_kv, T, D] with ``H % H_kv == 0`` (grouped-query
            attention is inferred from the shapes, so a subset of heads, as under Ulysses
            sequence parallelism, works).
        layout: one :class:`Layout` shared by all rows, or one per row (a ``LayoutBatch``,
            as ``hf.model_inputs`` returns, or a list). Engines' masks and plans are cached
            on the layout / batch, so every layer of a forward reuses them.
        engine: ``auto``, ``sdpa``, ``flex``, ``varlen``, ``flash_attn``, ``flex_merge``,
            ``flex_copy``, ``triton``, ``fa4`` or ``flex_flash`` (flex's block mask on
            FlashAttention-4's kernels through PyTorch's ``BACKEND="FLASH"``; runs when named).
        scale: softmax scale; default ``1/sqrt(D)``.

    Returns:
        [B, H, T, D] (possibly a non-contiguous view).
    """
    _check_shapes(q, k, v)
    batch, cache = _as_batch(layout, q.shape[0])
    if batch.seq_len != q.shape[2]:
        raise AttentionError(
            f"layout describes {batch.seq_len} tokens but q has T={q.shape[2]}; build the layout "
            "from the full row (under sequence parallelism too: attention sees the full sequence)"
        )
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    call = AttentionCall(q=q, k=k, v=v, batch=batch, cache=cache, scale=scale)
    return select_engine(call, engine).forward(call)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise AttentionError(
            f"expected q [B, H, T, D] and k, v [B, H_kv, T, D]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise AttentionError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    b, h, t, d = q.shape
    if k.shape[0] != b or k.shape[2] != t or k.shape[3] != d:
        raise AttentionError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on B, T or D "
            "(q_len != kv_len means a KV cache: use the stock 'sdpa' attention for generation)"
        )
    if h % k.shape[1]:
        raise AttentionError(
            f"query heads H={h} must be a multiple of key/value heads {k.shape[1]}"
        )


def _as_batch(layout: Layout | Sequence[Layout], b: int) -> tuple[LayoutBatch, dict]:
    """(the rows' batch, where to cache per-batch plans)."""
    if isinstance(layout, Layout):
        # One layout for every row: plans are cached on the layout, keyed by batch size.
        key = ("shared_batch", b)
        if key not in layout._cache:
            layout._cache[key] = LayoutBatch([layout] * b)
        batch = layout._cache[key]
        return batch, batch.cache
    batch = layout if isinstance(layout, LayoutBatch) else _recent_batch(layout)
    if len(batch) != b:
        raise AttentionError(f"got {len(batch)} row layouts for a batch of B={b} rows")
    return batch, batch.cache


# A plain list of row layouts passed to every layer of one forward should not rebuild masks per
# layer: recent lists are remembered by the identity of their rows. The cached batch holds the
# rows alive, so an id cannot be reused by another layout while its entry exists.
_RECENT: OrderedDict[tuple[int, ...], LayoutBatch] = OrderedDict()
_RECENT_SIZE = 4


def _recent_batch(rows: Sequence[Layout]) -> LayoutBatch:
    key = tuple(id(row) for row in rows)
    batch = _RECENT.get(key)
    if batch is None:
        batch = LayoutBatch(rows)
        _RECENT[key] = batch
        while len(_RECENT) > _RECENT_SIZE:
            _RECENT.popitem(last=False)
    _RECENT.move_to_end(key)
    return batch
