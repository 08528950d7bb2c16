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

The constants are fitted to one-H200 measurements (docs/PERFORMANCE.md section 1, 2026-11-23:
32 query heads, 8 KV heads, d 128, bf16) as ratios to intra_doc flex on the same row, against
``x = n_q / U``: fixed 2K documents (x = 0.118), heavy-tailed (0.066 at 32K, 0.012 at 128K) and
tiny documents (0.243). ``auto`` takes the cheapest engine that can run the call; ties keep
the order of ``CANDIDATES``. ``n_q`` counts the query tiles of anchor rows only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from anchorctx.attention.layout import Layout

TILE = 128
# Anchor flex over intra_doc flex - 1: 0.38 (x = 0.066), 0.77 (0.118), 1.32-1.45 (0.243): a
# line through the first two. Where the chain is hidden (long documents at 128K) the excess is
# still 1.3 (heavy-tailed), 1.4 (one book) and 3.6 (web + book) tiles per query tile: PHI = 2.
KAPPA = 7.6
THETA = 0.12
PHI = 2.0
# varlen (anchor) over intra_doc flex - 1: 0.26 (x = 0.012), 0.36 (0.066), 0.51-0.53 (0.118),
# 0.73 (0.243).
NU = 1.25
LAMBDA = 2.3
# flex_merge over intra_doc flex - 1: 0.13 (x = 0.118, at 32K and 128K), 0.09 (0.066),
# 0.30 (0.243): about 1.2 tiles per query tile (0 to 0.7 on the long-document rows).
MU = 1.2
# triton (anchor) over intra_doc flex - 1, in tiles per query tile: 0.45-0.54 (fixed 2K),
# 0.39 (heavy-tailed 32K), below 0 on long-document and tiny-document rows (0.98-0.99 and
# 0.95-0.97 of intra_doc's time): the upper envelope. Below flex_merge's MU on every row, as
# measured (docs/PERFORMANCE.md section 1, "triton").
PSI = 0.5

# Ties keep this order: on intra_doc rows triton and flex_merge cost what flex does (triton's
# intra_doc speed was measured only through its anchor rows, and flex_merge adds a
# log-sum-exp output), so flex stays first there.
# flex_copy (anchor copies) is left out: measured slower than flex_merge on every row
# (docs/PERFORMANCE.md section 1, "Anchor copies").
CANDIDATES = ("flex", "triton", "flex_merge", "varlen", "flash_attn")


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
        return u + max(PHI * nq, KAPPA * nq - THETA * u) if nq else u
    if engine in ("varlen", "flash_attn"):
        return NU * u + LAMBDA * nq
    if engine == "flex_merge":
        return u + MU * nq
    if engine == "triton":
        return u + PSI * nq
    raise ValueError(f"no cost model for engine {engine!r}")


def ranked(rows: Sequence[Layout]) -> list[str]:
    """CANDIDATES, cheapest first (a stable sort: equal costs keep the listed order)."""
    return sorted(CANDIDATES, key=lambda name: estimate(name, rows))
