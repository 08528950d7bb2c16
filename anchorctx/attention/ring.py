"""Zigzag ring attention: the sequence-parallel baseline of the paper's Table 8.

Ring attention (as ring-flash-attn's zigzag variant runs it) splits a row over the ranks of a
group and passes each rank's keys and values around the ring; every rank attends its queries to
each block in turn and merges the partial results by their log-sum-exps. The paper compares the
logits this gives with one device's (0.75 max abs difference) against Ulysses' (0): Ulysses
moves whole heads and runs the same kernel on the whole row, ring attention rounds each
block's partial output to the compute dtype before the merge.

Here for that comparison only (``bench/sp_equivalence.py --ring``; causal full attention, one
row): not a training engine, and no kernel: each block is computed as a flash kernel computes
it — scores and softmax in float32, the probabilities rounded to the inputs' dtype for the
``P·V`` product, the block's output rounded to it — and merged into a float32 running output in
ring order (the rank's own block first, then the previous rank's, and so on), as
ring-flash-attn merges. The blocks travel by one all-gather: the order of the merges, not the
transport, decides the numbers; the time is not what this measures.

Zigzag sharding: the row is cut into ``2·N`` equal chunks and rank ``r`` holds chunks ``r`` and
``2N − 1 − r``, so every rank holds as many causal (query, key) pairs as any other.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface

from anchorctx.attention.errors import AttentionError

NAME = "anchorctx_ring"
POSITIONS_KWARG = "anchorctx_ring_positions"


def zigzag_positions(seq_len: int, world: int, rank: int) -> torch.Tensor:
    """int64 [seq_len / world]: the row positions ``rank`` holds (chunks ``rank`` and
    ``2·world − 1 − rank`` of ``2·world``)."""
    if seq_len % (2 * world):
        raise AttentionError(
            f"zigzag ring attention: the row length {seq_len} must divide into 2 × {world} "
            "equal chunks"
        )
    c = seq_len // (2 * world)
    late = 2 * world - 1 - rank
    return torch.cat(
        [torch.arange(rank * c, (rank + 1) * c), torch.arange(late * c, (late + 1) * c)]
    )


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos_q: torch.Tensor,
    pos_k: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: q [H, Tq, D], k/v [H, Tk, D] (heads already matched), causal by the row
    positions -> (output [H, Tq, D] in q's dtype, log-sum-exp [H, Tq] float32; −inf where a
    query sees no key of the block)."""
    s = torch.einsum("hqd,hkd->hqk", q.float(), k.float()) * scale  # [H, Tq, Tk]
    s.masked_fill_(pos_k[None, None, :] > pos_q[None, :, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [H, Tq]
    seen = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # rows with no key: p = 0
    p = torch.exp(s - seen[..., None]).to(q.dtype)  # rounded as a flash kernel's P·V input
    out = torch.einsum("hqk,hkd->hqd", p.float(), v.float()).to(q.dtype)
    return out, lse


def merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The running float32 output [H, Tq, D] and log-sum-exp [H, Tq] after one more block
    (the stable sigmoid form: a block a row cannot see, lse −inf, leaves the row as it is)."""
    w = torch.sigmoid(block_lse - lse)[..., None]  # the block's share of the new normaliser
    out = out - w * (out - block_out.float())
    lse = lse - F.logsigmoid(lse - block_lse)
    return out, lse


def attend_blocks(
    q: torch.Tensor,
    positions: torch.Tensor,
    blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    scale: float,
) -> torch.Tensor:
    """q [H, Tq, D] at row ``positions`` [Tq] against ``blocks`` of (k, v [H, Tk, D], their
    positions [Tk]) in the order they are merged, the query's own block first (every query sees
    at least itself there) -> [H, Tq, D] in q's dtype."""
    out = lse = None
    for k, v, pos_k in blocks:
        b_out, b_lse = block_attention(q, k, v, positions, pos_k, scale)
        if out is None or lse is None:
            out, lse = b_out.float(), b_lse
        else:
            out, lse = merge(out, lse, b_out, b_lse)
    if out is None:
        raise AttentionError("ring attention: no key block to attend to")
    return out.to(q.dtype)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """This rank's queries q [H, T/N, D] against the whole row's keys and values, whose shards
    k/v [H, T/N, D] (heads matched to q's) and ``positions`` [T/N] every rank of ``group``
    holds -> [H, T/N, D] in q's dtype."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    # [N, H, T/N, D] each: every rank's block, then taken in ring order
    ks = [torch.empty_like(k) for _ in range(world)]
    vs = [torch.empty_like(v) for _ in range(world)]
    ps = [torch.empty_like(positions) for _ in range(world)]
    dist.all_gather(ks, k.contiguous(), group=group)
    dist.all_gather(vs, v.contiguous(), group=group)
    dist.all_gather(ps, positions.contiguous(), group=group)
    # step s brings rank (rank - s)'s block: the own block first, then round the ring
    order = [(rank - step) % world for step in range(world)]
    return attend_blocks(q, positions, [(ks[i], vs[i], ps[i]) for i in order], scale)


def ring_attention_hf(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [1, H, T/N, D], key/value [1, H_kv, T/N, D]
    (this rank's zigzag shard; the model's own mask is ignored: causal by ``POSITIONS_KWARG``,
    the shard's row positions) -> ([1, T/N, H, D], None)."""
    positions = kwargs.get(POSITIONS_KWARG)
    if positions is None:
        raise AttentionError(
            f"the {NAME!r} attention needs the shard's row positions: call the model with "
            f"{POSITIONS_KWARG}=zigzag_positions(...)"
        )
    if query.shape[0] != 1:
        raise AttentionError(f"{NAME!r}: one row at a time (batch {query.shape[0]})")
    groups = query.shape[1] // key.shape[1]  # grouped-query attention: repeat the KV heads
    k = key[0].repeat_interleave(groups, dim=0)  # [H, T/N, D]
    v = value[0].repeat_interleave(groups, dim=0)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = ring_attention(query[0], k, v, positions.to(query.device), scale)  # [H, T/N, D]
    return out.transpose(0, 1)[None].contiguous(), None  # [1, T/N, H, D]


def register() -> str:
    """Register :func:`ring_attention_hf` as ``"anchorctx_ring"`` (idempotent)."""
    AttentionInterface.register(NAME, ring_attention_hf)
    return NAME
