"""``flex_merge``: anchor attention at intra-document cost, by merging the anchor key afterwards.

The anchor mask is the intra-document mask plus one key (token 0) for every query outside the
anchor's own document. Softmax over a union of disjoint key sets is a log-sum-exp merge, so

    o, lse = intra_doc attention of q (with its natural-log log-sum-exp)
    s0     = scale · q·k0                      (the anchor key's score)
    w      = sigmoid(lse - s0)                 (mass of the document keys; 1 in the anchor's doc)
    out    = w·o + (1 - w)·v0

is exact (queries of the anchor's own document already see key 0 inside ``o``; their ``s0`` is
-inf, so ``w = 1``). The kernel never visits the anchor's key tile, so neither the forward's
extra tile per query tile nor the backward's serialised accumulation of every document's dK/dV
into tile 0 (what makes ``flex`` on the anchor mask up to 2.3× slower than on ``intra_doc``)
exists here. What is added is memory-bound: forward reads q and o and writes out; backward
needs ``w·dout`` for the kernel's output gradient and ``g = w(1-w)·(dout·(o - v0))`` for its
log-sum-exp gradient (FlexAttention folds an LSE gradient into its row-sum term), then
``dq += -g·scale·k0``, ``dk0 += Σ -g·scale·q``, ``dv0 += Σ (1-w)·dout`` (sums over the query
heads of a KV group and all positions).

On CUDA the FlexAttention call (intra-document block mask, ``lse`` returned) and the merge are
one ``torch.compile`` graph: Inductor fuses the merge and its backward into a few memory-bound
kernels, and AOTAutograd saves tensors the ordinary way, so non-reentrant activation
checkpointing still drops and recomputes them (a hand-written autograd.Function that keeps the
inner graph alive would pin q, k, v and o of every layer). FlexAttention has no CPU backward,
so on CPU the inner attention is a dense masked softmax with its log-sum-exp (exact, T×T: for
tests and short rows) and the merge is the same function, run eagerly.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch.nn.attention import flex_attention as fa

from anchorctx.attention.engines.base import AttentionCall, AutoRanks
from anchorctx.attention.engines.cost import TileCounts
from anchorctx.attention.engines.flex import FlexAnchorEngine, build_block_mask, compiled_flex
from anchorctx.attention.layout import Layout

# Cost rule (engines/cost.py). flex_merge over intra_doc flex - 1: 0.13 (x = 0.118, at 32K and
# 128K), 0.09 (0.066), 0.30 (0.243): about 1.2 tiles per query tile (0 to 0.7 on the
# long-document rows).
MU = 1.2


class FlexMergeEngine(FlexAnchorEngine):
    name = "flex_merge"
    auto = AutoRanks(mixed=40, masked=30)

    def cost(self, tiles: TileCounts) -> float:
        """``U + μ·n_q``: intra_doc flex with its log-sum-exp, plus the memory-bound merge,
        linear in T (intra_doc rows: ``U``)."""
        return tiles.u + MU * tiles.n_q

    def forward(self, call: AttentionCall) -> torch.Tensor:
        q, k, v, scale = call.q, call.k, call.v, call.scale
        foreign, any_foreign = _foreign(call)
        if q.is_cuda:
            block_mask = _intra_block_mask(call)
            gqa = q.shape[1] != k.shape[1]
            if not any_foreign:  # no anchor row, or only the anchor's document: plain flex
                return compiled_flex()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
            return _compiled_anchor_flex()(q, k, v, block_mask, foreign, scale, gqa)
        o, lse = dense_attention_lse(q, k, v, _intra_dense_mask(call), scale)
        return merge_anchor(q, k, v, o, lse, foreign, scale) if any_foreign else o


# --------------------------------------------------------------------------- per-batch plans
def intra_rows(rows: tuple[Layout, ...]) -> tuple[Layout, ...]:
    """The rows with ``anchor`` replaced by ``intra_doc`` (the mask the inner kernel uses)."""
    swapped: dict[int, Layout] = {}
    out = []
    for row in rows:
        if row.variant != "anchor":
            out.append(row)
            continue
        if id(row) not in swapped:  # a shared layout stays one object (one broadcast mask)
            # A fresh cache: the anchor row's cached masks must not be reused for intra_doc.
            swapped[id(row)] = dataclasses.replace(row, variant="intra_doc", _cache={})
        out.append(swapped[id(row)])
    return tuple(out)


def _foreign(call: AttentionCall) -> tuple[torch.Tensor, bool]:
    """(bool [B, T]: the query needs the anchor key merged, i.e. an anchor row outside the
    anchor's document; whether any does). Decided on the host, once per batch."""
    key = ("merge_foreign", str(call.q.device))
    if key not in call.cache:
        rows = [
            row.doc_ids != row.seg_doc[0]
            if row.variant == "anchor"
            else torch.zeros(row.seq_len, dtype=torch.bool)
            for row in call.rows
        ]
        foreign = torch.stack([r.cpu() for r in rows])
        call.cache[key] = (foreign.to(call.q.device), bool(foreign.any()))
    return call.cache[key]


def _intra_block_mask(call: AttentionCall):
    key = ("merge_block_mask", str(call.q.device))
    if key not in call.cache:
        call.cache[key] = build_block_mask(intra_rows(call.rows), call.q.device, shared=call.shared)
    return call.cache[key]


def _intra_dense_mask(call: AttentionCall) -> torch.Tensor:
    """Bool [B or 1, 1, T, T] of the intra-document mask (CPU path)."""
    key = ("merge_dense_mask", str(call.q.device))
    if key not in call.cache:
        rows = intra_rows(call.rows[:1] if call.shared else call.rows)
        call.cache[key] = torch.stack([row.mask(call.q.device) for row in rows])[:, None]
    return call.cache[key]


def _flex_lse(q, k, v, block_mask, scale: float, gqa: bool):
    if hasattr(fa, "AuxRequest"):  # torch >= 2.9; return_lse is deprecated there
        out, aux = fa.flex_attention(
            q,
            k,
            v,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=gqa,
            return_aux=fa.AuxRequest(lse=True),
        )
        return out, aux.lse
    return fa.flex_attention(
        q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_lse=True
    )


def dense_attention_lse(q, k, v, mask: torch.Tensor, scale: float):
    """Masked softmax attention and its natural-log log-sum-exp; mask [B or 1, 1, T, T]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = scores.logsumexp(-1)  # every query sees itself: finite
    probs = torch.exp(scores - lse[..., None])
    return (probs.to(v.dtype) @ v), lse


# ------------------------------------------------------------------------ the merge operation
def _group(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, ...] -> [B, H_kv, G, ...]: query heads of one KV head together (GQA order)."""
    return x.unflatten(1, (kv_heads, x.shape[1] // kv_heads))


def merge_anchor(q, k, v, o, lse, foreign: torch.Tensor, scale: float) -> torch.Tensor:
    """The anchor key (k/v row 0) merged into intra-document attention ``o`` / ``lse``.

    q, o [B, H, T, D]; k, v [B, H_kv, T, D]; lse [B, H, T]; foreign bool [B, T]. Float32 math,
    differentiable (autograd derives the backward of the module docstring).
    """
    hk = k.shape[1]
    q5, o5 = _group(q, hk).float(), _group(o, hk).float()  # [B, Hk, G, T, D]
    k0 = k[:, :, 0, None, None].float()  # [B, Hk, 1, 1, D]: shared by the group's query heads
    v0 = v[:, :, 0, None, None].float()
    s0 = (q5 * k0).sum(-1) * scale  # [B, Hk, G, T]
    # Queries of the anchor's own document already see key 0 in ``o``: s0 = -inf gives w = 1
    # (and a zero gradient through the sigmoid).
    s0 = s0.masked_fill(~foreign[:, None, None], float("-inf"))
    w = torch.sigmoid(_group(lse, hk).float() - s0)[..., None]
    return (w * o5 + (1 - w) * v0).flatten(1, 2).to(q.dtype)


def _anchor_flex(q, k, v, block_mask, foreign, scale: float, gqa: bool):
    o, lse = _flex_lse(q, k, v, block_mask, scale, gqa)
    return merge_anchor(q, k, v, o, lse, foreign, scale)


@functools.cache
def _compiled_anchor_flex():
    # One graph: Inductor fuses the merge (and its backward) around the FlexAttention kernel,
    # and AOTAutograd saves tensors the ordinary way, so activation checkpointing still drops
    # and recomputes them.
    return torch.compile(_anchor_flex, dynamic=False)
