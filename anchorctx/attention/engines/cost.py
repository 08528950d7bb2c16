"""The cost rule behind ``engine="auto"`` for document-masked rows on CUDA.

Every engine's forward+backward time on a packed row is estimated from the row's document
lengths, in units of one 128×128 FlexAttention tile (forward+backward, all heads): the ratio of
two engines' times does not depend on the head count or head dimension, since the kernels'
FLOPs and the merge's memory traffic both scale with ``H·D``. With ``n_q = ceil(T/128)`` query
tiles and ``U`` = tiles a document mask visits (a document touching ``m`` tiles visits
``m(m+1)/2``):

===============  =================================================================
engine           estimated cost (tile units)
===============  =================================================================
flex, intra_doc  ``U``
flex, anchor     ``max(U + n_q, κ·n_q)``: one extra key tile per query tile; in backward
                 the anchor's tile accumulates dK/dV of every query tile in one program
                 per KV head, a serial chain of ``κ·n_q`` that the rest of the work hides
                 only while ``U`` is large (long documents)
varlen           ``ν·U``, anchor adds ``λ·n_q`` (the anchor K/V gathered in front of every
                 document, its gradient scattered back)
flex_merge       ``U + μ·n_q`` (intra_doc flex, plus three memory-bound passes of reading /
                 writing [T, H, D] per direction); intra_doc rows: ``U``
===============  =================================================================

The constants are fitted to the one-H200 measurements in docs/PERFORMANCE.md section 1 (fixed
2K and heavy-tailed documents at 32K and 128K; see there). ``auto`` takes the cheapest engine
that can run the call; ties keep the order of ``CANDIDATES``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from anchorctx.attention.layout import Layout

TILE = 128
# Anchor flex backward: the serial chain through the anchor's key tile, per query tile
# (fixed 2K documents: anchor/intra_doc = 1.72 at 128K and 1.74 at 32K give 14.6 and 14.8).
KAPPA = 14.7
# varlen against flex on the intra_doc mask (304/237 = 1.28 fixed 2K, 385/312 = 1.23 heavy-tailed).
NU = 1.28
# varlen's anchor gather/scatter per query tile (fixed 2K: 1.88 at 128K, 1.97 at 32K).
LAMBDA = 1.9
# flex_merge's merge per query tile: ~9 passes of 128·H·D bf16 at ~4 TB/s against a 128×128 tile
# at ~330 TFLOP/s forward+backward, 18·330 / (1792·4) = 0.83.
MU = 0.83

# Ties keep this order: on intra_doc rows flex_merge costs what flex does, and flex skips the
# log-sum-exp output.
CANDIDATES = ("flex", "flex_merge", "varlen", "flash_attn")


def visited_tiles(layout: Layout, tile: int = TILE) -> int:
    """Tiles a document mask visits: per document, m(m+1)/2 over the m tiles it touches."""
    tiles: dict[int, set[int]] = {}
    for start, n, doc in zip(layout.seg_starts, layout.seg_lens, layout.seg_doc):
        tiles.setdefault(doc, set()).update(range(start // tile, (start + n - 1) // tile + 1))
    return sum(len(s) * (len(s) + 1) // 2 for s in tiles.values())


def estimate(engine: str, rows: Sequence[Layout], tile: int = TILE) -> float:
    """Estimated forward+backward cost of ``engine`` on document-masked ``rows`` (tile units)."""
    u = sum(visited_tiles(row, tile) for row in rows)
    anchor_nq = [math.ceil(row.seq_len / tile) for row in rows if row.variant == "anchor"]
    nq = sum(anchor_nq)
    if engine == "flex":
        return max(u + nq, KAPPA * max(anchor_nq, default=0))
    if engine in ("varlen", "flash_attn"):
        return NU * u + LAMBDA * nq
    if engine == "flex_merge":
        return u + MU * nq
    raise ValueError(f"no cost model for engine {engine!r}")


def ranked(rows: Sequence[Layout]) -> list[str]:
    """CANDIDATES, cheapest first (a stable sort: equal costs keep the listed order)."""
    return sorted(CANDIDATES, key=lambda name: estimate(name, rows))
