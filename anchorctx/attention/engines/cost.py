"""The cost rule behind ``engine="auto"`` for document-masked rows on CUDA.

Every engine's forward+backward time on a packed row is estimated from the row's document
lengths, in units of one 128×128 FlexAttention tile (forward+backward, all heads): the ratio of
two engines' times does not depend on the head count or head dimension, since the kernels'
FLOPs and the merge's memory traffic both scale with ``H·D``. With ``n_q = ceil(T/128)`` query
tiles and ``U`` = tiles a document mask visits (a document touching ``m`` tiles visits
``m(m+1)/2``), each engine's :meth:`~anchorctx.attention.engines.base.Engine.cost` (where its
formula and fitted constant live) gives:

===============  =================================================================
engine           estimated cost (tile units)
===============  =================================================================
flex, intra_doc  ``U``
flex, anchor     ``U + max(φ·n_q, κ·n_q - θ·U)``: an extra key tile per query tile, and
                 in backward the anchor's tile accumulates dK/dV of every query tile in one
                 program per KV head, a serial chain that the rest of the work hides only
                 when ``U`` is large against ``n_q`` (long documents)
varlen           ``ν·U``, anchor adds ``λ·n_q`` (the anchor K/V gathered in front of every
                 document, its gradient scattered back)
flex_merge       ``U + μ·n_q`` (intra_doc flex with its log-sum-exp, plus the memory-bound
                 merge, linear in T); intra_doc rows: ``U``
triton           ``U + ψ·n_q``: the anchor is a register-resident key in the kernel, so its
                 tiles are intra_doc's; intra_doc rows: ``U``
===============  =================================================================

The constants are fitted to one-H200 measurements
(docs/benchmarks/2026-11-23-attention-flex-merge.md: 32 query heads, 8 KV heads, d 128, bf16) as
ratios to intra_doc flex on the same row, against ``x = n_q / U``: fixed 2K documents (x = 0.118),
heavy-tailed (0.066 at 32K, 0.012 at 128K) and tiny documents (0.243). ``auto`` takes the cheapest
engine that can run the call among those with a ``masked`` rank (``Engine.auto``) and a cost; ties
keep the ``masked`` rank order. ``n_q`` counts the query tiles of anchor rows only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from anchorctx.attention.layout import Layout

TILE = 128


@dataclass(frozen=True)
class TileCounts:
    """What the cost rule reads from a batch of rows, counted once per batch."""

    u: int  # tiles the rows' document masks visit (``visited_tiles``, summed over rows)
    n_q: int  # query tiles of the anchor rows

    @classmethod
    def of(cls, rows: Sequence[Layout], tile: int = TILE) -> TileCounts:
        u = sum(visited_tiles(row, tile) for row in rows)
        n_q = sum(math.ceil(row.seq_len / tile) for row in rows if row.variant == "anchor")
        return cls(u=u, n_q=n_q)


def visited_tiles(layout: Layout, tile: int = TILE) -> int:
    """Tiles a document mask visits: per document, m(m+1)/2 over the m tiles it touches."""
    tiles: dict[int, set[int]] = {}
    for start, n, doc in zip(layout.seg_starts, layout.seg_lens, layout.seg_doc):
        tiles.setdefault(doc, set()).update(range(start // tile, (start + n - 1) // tile + 1))
    return sum(len(s) * (len(s) + 1) // 2 for s in tiles.values())
