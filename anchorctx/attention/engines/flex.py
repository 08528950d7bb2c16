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
from typing import Any, ClassVar

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from anchorctx.attention.engines.base import AttentionCall, AutoRanks, Capabilities, Engine
from anchorctx.attention.engines.cost import TileCounts
from anchorctx.attention.layout import Layout

BLOCK = 128

# Cost rule (engines/cost.py). Anchor flex over intra_doc flex - 1: 0.38 (x = 0.066), 0.77
# (0.118), 1.32-1.45 (0.243): a line through the first two. Where the chain is hidden (long
# documents at 128K) the excess is still 1.3 (heavy-tailed), 1.4 (one book) and 3.6 (web + book)
# tiles per query tile: PHI = 2.
KAPPA = 7.6
THETA = 0.12
PHI = 2.0


def flex_available() -> tuple[bool, str]:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError as err:  # torch < 2.5
        return False, f"torch.nn.attention.flex_attention missing ({err})"
    return True, ""


@functools.cache
def compiled_flex():
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
        # The compiled backward computes dQ and dK/dV in separate programs, each summing over
        # its blocks in a fixed order (no atomics).
        deterministic_backward=frozenset({"cuda"}),
    )
    # First among equal costs: on intra_doc rows triton and flex_merge cost what flex does
    # (triton's intra_doc speed was measured only through its anchor rows, and flex_merge adds
    # a log-sum-exp output).
    auto = AutoRanks(full=40, mixed=30, masked=10)
    # FlexAttention's kernel_options (None: its defaults, the Triton templates)
    kernel_options: ClassVar[dict[str, str] | None] = None

    def available(self) -> tuple[bool, str]:
        return flex_available()

    def cost(self, tiles: TileCounts) -> float:
        """``U``; anchor rows add ``max(φ·n_q, κ·n_q - θ·U)``: an extra key tile per query
        tile, and in backward the anchor's tile accumulates dK/dV of every query tile in one
        program per KV head, a serial chain that the rest of the work hides only when ``U`` is
        large against ``n_q`` (long documents)."""
        u, nq = tiles.u, tiles.n_q
        return u + max(PHI * nq, KAPPA * nq - THETA * u) if nq else u

    def forward(self, call: AttentionCall) -> torch.Tensor:
        block_mask = cached_block_mask(call)
        fn = compiled_flex() if call.q.is_cuda else flex_attention
        gqa = call.q.shape[1] != call.k.shape[1]
        options = {"kernel_options": dict(self.kernel_options)} if self.kernel_options else {}
        return fn(
            call.q,
            call.k,
            call.v,
            block_mask=block_mask,
            scale=call.scale,
            enable_gqa=gqa,
            **options,
        )


def flash_backend_problem() -> str | None:
    """Why FlexAttention cannot run on FlashAttention-4 here (None: it can): the installed
    PyTorch must take ``kernel_options={"BACKEND": "FLASH"}`` and ``flash_attn.cute`` (the
    ``[flash4]`` extra) must import."""
    from torch.nn.attention import flex_attention as fa

    options = getattr(fa, "FlexKernelOptions", None)
    if options is None or "BACKEND" not in getattr(options, "__annotations__", {}):
        return f"torch {torch.__version__} has no FlexAttention BACKEND option (2.10 or newer)"
    from anchorctx.attention.engines.flash4 import import_problem

    problem = import_problem()
    if problem is not None:
        return f"flash_attn.cute does not import ({problem}): pip install 'anchorctx[flash4]'"
    return None


class FlexFlashEngine(FlexEngine):
    """The flex engine's block mask and mask_mod run by FlashAttention-4's CuTe kernels instead
    of Flex's Triton templates (PyTorch's ``BACKEND="FLASH"``, experimental there): Hopper and
    Blackwell, half precision. Runs when named (``auto`` does not take it until it is measured
    beside ``flex`` and ``fa4``)."""

    name = "flex_flash"
    alternative = "flex"
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        backward_devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.bfloat16, torch.float16}),
        max_head_dim=128,  # FA4's limit on Blackwell, as the fa4 engine declares
    )
    auto = AutoRanks()
    kernel_options: ClassVar[dict[str, str] | None] = {"BACKEND": "FLASH"}

    def available(self) -> tuple[bool, str]:
        ok, why = flex_available()
        if not ok:
            return ok, why
        problem = flash_backend_problem()
        return (False, problem) if problem else (True, "")

    def check(self, call: AttentionCall) -> None:
        super().check(call)
        from anchorctx.attention.engines.flash4 import require_arch

        require_arch(self.name, call.q.device, "use engine='flex'")


class FlexAnchorEngine(Engine):
    """What the exact anchor engines built on FlexAttention (flex_merge, flex_copy) share: they
    run where FlexAttention does, backward on CPU too (their CPU path is their own dense exact
    one, not FlexAttention's), and fall back to the plain flex engine."""

    alternative = "flex"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        backward_devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
        # Flex's backward (above) and the anchor column's dense parts, merged in a fixed order.
        deterministic_backward=frozenset({"cpu", "cuda"}),
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
        *ordered(partial),
        *ordered(full),
        BLOCK_SIZE=block,
        mask_mod=_mask_mod(docs, variants, device),
        seq_lengths=(t, t),
    )


def ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile booleans [B, H, nq, nkv] -> (counts [B, H, nq], indices [B, H, nq, nkv]) int32."""
    counts = dense.sum(-1, dtype=torch.int32)
    # Stable descending sort puts the visited kv tiles first, in ascending order.
    indices = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts, indices.to(torch.int32)


def _padded_docs(layout: Layout, block: int) -> torch.Tensor:
    t = layout.seq_len
    padded = torch.full((ceil(t, block) * block,), -1, dtype=torch.int32, device=layout.device)
    padded[:t] = layout.doc_ids
    return padded


def ceil(a: int, b: int) -> int:
    return -(-a // b)


def _tile_classes(layout: Layout, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) tile booleans [nq, nkv] of one row: the intra-document tiles, plus the
    anchor's column on anchor rows (key tile 0 is partial for every query tile it is not full
    for)."""
    partial, full = tile_classes(row_docs(layout, layout.device), block, block)
    if layout.variant == "anchor":
        partial[:, 0] = ~full[:, 0]
    return partial, full


def row_docs(layout: Layout, device: torch.device) -> torch.Tensor:
    """Document ids a tile mask compares (int32 [T]); one document on ``full`` rows."""
    docs = layout.doc_ids.to(device=device, dtype=torch.int32)
    return torch.zeros_like(docs) if layout.variant == "full" else docs


def tile_classes(docs: torch.Tensor, bm: int, bn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) booleans [n_q_tiles, n_kv_tiles] of one row's intra-document causal mask.

    ``docs`` int [T]. A (query tile, key tile) pair is visited iff some key is not after some
    query and both share a document; it is full iff every key precedes every query and both
    tiles lie inside one and the same document with no padding.
    """
    t, device = docs.shape[0], docs.device
    nq, nk = ceil(t, bm), ceil(t, bn)
    _, dense = torch.unique(docs, return_inverse=True)
    ndocs = int(dense.max()) + 1
    pos = torch.arange(t, device=device)
    # Presence of each document in each tile; products count shared documents (small integers:
    # exact in float32).
    pq = torch.zeros(nq, ndocs, device=device)
    pq[pos // bm, dense] = 1.0
    pk = torch.zeros(nk, ndocs, device=device)
    pk[pos // bn, dense] = 1.0
    share = (pq @ pk.T) > 0
    q_first = torch.arange(nq, device=device) * bm
    q_last = torch.clamp(q_first + bm, max=t) - 1
    k_first = torch.arange(nk, device=device) * bn
    k_last = k_first + bn - 1
    visited = share & (k_first[None, :] <= q_last[:, None])
    q_single = (pq.sum(1) == 1) & (q_first + bm <= t)
    k_single = (pk.sum(1) == 1) & (k_last < t)
    q_doc = torch.where(q_single, pq.argmax(1), -1)
    k_doc = torch.where(k_single, pk.argmax(1), -2)
    full = (
        (k_last[None, :] <= q_first[:, None])
        & (q_doc[:, None] == k_doc[None, :])
        & q_single[:, None]
        & k_single[None, :]
    )
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
