"""FlexAttention engine: a block-sparse mask built from document ids, never T×T.

The BlockMask is derived at tile granularity (``BLOCK`` × ``BLOCK`` tiles): a tile is visited
iff some query of the q-tile and some key of the kv-tile share a document (plus the anchor
column), and it is *full* (no ``mask_mod`` evaluated) iff both tiles lie entirely inside one
document. Tile-level presence comes from a [tiles × documents] matrix, so the cost is
O(T/BLOCK · documents), not O(T²). The mask is built once per batch and cached, so every layer
reuses it. On CUDA the kernel is the compiled ``flex_attention``; on CPU only the (unfused)
forward exists.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from anchorctx.attention.engines.base import AttentionCall, Capabilities, Engine
from anchorctx.attention.layout import Layout

BLOCK = 128


def flex_available() -> tuple[bool, str]:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError as err:  # torch < 2.5
        return False, f"torch.nn.attention.flex_attention missing ({err})"
    return True, ""


@functools.cache
def _compiled_flex():
    # dynamic=False: one kernel per sequence length; packed rows have a fixed length, so the
    # whole run compiles once (plus once for backward).
    return torch.compile(flex_attention, dynamic=False)


class FlexEngine(Engine):
    name = "flex"
    alternative = "sdpa"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        backward_devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
    )

    def available(self) -> tuple[bool, str]:
        return flex_available()

    def forward(self, call: AttentionCall) -> torch.Tensor:
        block_mask = cached_block_mask(call)
        fn = _compiled_flex() if call.q.is_cuda else flex_attention
        gqa = call.q.shape[1] != call.k.shape[1]
        return fn(call.q, call.k, call.v, block_mask=block_mask, scale=call.scale, enable_gqa=gqa)


class FlexAnchorEngine(Engine):
    """What the exact anchor engines built on FlexAttention (flex_merge, flex_copy) share: they
    run where FlexAttention does, backward on CPU too (their CPU path is their own dense exact
    one, not FlexAttention's), and fall back to the plain flex engine."""

    alternative = "flex"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        backward_devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
    )

    def available(self) -> tuple[bool, str]:
        return flex_available()


def cached_block_mask(call: AttentionCall, block: int = BLOCK) -> Any:
    key = ("flex_block_mask", str(call.q.device), block)
    if key not in call.cache:
        call.cache[key] = build_block_mask(
            call.rows, call.q.device, block=block, shared=call.shared
        )
    return call.cache[key]


def build_block_mask(
    rows: tuple[Layout, ...], device: torch.device, *, block: int = BLOCK, shared: bool = False
) -> Any:
    """BlockMask of rows of equal length.

    ``shared``: all rows have the same layout; the tile tables get batch dim 1 (broadcast), the
    token-level tables still one row per batch row (the kernel passes the real row index).
    """
    t = rows[0].seq_len
    tile_rows = rows[:1] if shared else rows
    tiles = [_tile_classes(row.to(device), block) for row in tile_rows]
    partial = torch.stack([p for p, _ in tiles])[:, None]  # [B or 1, 1, nq, nkv]
    full = torch.stack([f for _, f in tiles])[:, None]
    docs = torch.stack([_padded_docs(row.to(device), block) for row in rows])  # [B, T_pad]
    variants = [row.variant for row in rows]
    return BlockMask.from_kv_blocks(
        *_ordered(partial), *_ordered(full), BLOCK_SIZE=block,
        mask_mod=_mask_mod(docs, variants, device), seq_lengths=(t, t),
    )  # fmt: skip


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile booleans [B, H, nq, nkv] -> (counts [B, H, nq], indices [B, H, nq, nkv]) int32."""
    counts = dense.sum(-1, dtype=torch.int32)
    # Stable descending sort puts the visited kv tiles first, in ascending order.
    indices = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts, indices.to(torch.int32)


def _padded_docs(layout: Layout, block: int) -> torch.Tensor:
    t = layout.seq_len
    padded = torch.full((_ceil(t, block) * block,), -1, dtype=torch.int32, device=layout.device)
    padded[:t] = layout.doc_ids
    return padded


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _tile_classes(layout: Layout, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) tile booleans [nq, nkv] of one row."""
    t, device = layout.seq_len, layout.device
    n = _ceil(t, block)
    lower = torch.ones(n, n, dtype=torch.bool, device=device).tril_()
    strictly_lower = lower.tril(-1)
    complete = torch.arange(n, device=device) < t // block  # tiles without padding
    if layout.variant == "full":
        visited = lower
        full = strictly_lower & complete[:, None]
    else:
        _, dense_doc = torch.unique(layout.doc_ids, return_inverse=True)
        presence = torch.zeros(n, int(dense_doc.max()) + 1, device=device)  # [tiles, docs]
        presence[torch.arange(t, device=device) // block, dense_doc] = 1.0
        # Tiles i >= j share a document => some kv <= q pair in them is allowed (the
        # diagonal tile always has q == kv). Counts are small integers: exact in fp32.
        visited = ((presence @ presence.T) > 0) & lower
        single = (presence.sum(1) == 1) & complete
        tile_doc = torch.where(single, presence.argmax(1), -1)
        full = strictly_lower & single[:, None] & (tile_doc[:, None] == tile_doc[None, :])
        if layout.variant == "anchor":
            visited[:, 0] = True
    return visited & ~full, full


def _mask_mod(docs: torch.Tensor, variants: list[str], device: torch.device):
    """Token-level rule inside partial tiles; ``docs`` [B, T_pad].

    One function body for every variant (the variant is data, not code), so the compiled
    kernel is shared by all variants and layouts of a length: the tensors it closes over are
    lifted as kernel inputs, and a new batch does not recompile.
    """
    is_full = torch.tensor([v == "full" for v in variants], device=device)
    is_anchor = torch.tensor([v == "anchor" for v in variants], device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        same = docs[b, q_idx] == docs[b, kv_idx]
        return (kv_idx <= q_idx) & (same | is_full[b] | (is_anchor[b] & (kv_idx == 0)))

    return mask_mod
