"""``flex_copy``: anchor attention as an intra-document mask over keys with anchor copies.

The anchor mask is the intra-document mask plus key 0 for every query outside the anchor's
own document. In FlexAttention that extra key is one key tile visited by every query tile, and
in backward every document accumulates its dK/dV into that tile in one serial program. Here
every document other than the anchor's own (``seg_doc[0]``, which holds key 0 already) gets its
own copy of the anchor key/value, placed immediately before the document's first token, in an
augmented key/value sequence of ``N >= T + m`` slots (``m`` copies, then unused padding slots):

    k_aug = k[:, :, gather], v_aug = v[:, :, gather]      gather: [N] token index of each slot
    allowed(q, kv) = doc_kv[kv] == doc_q[q] and pos_kv[kv] <= q

where a copy has its document's id and position 0 and padding slots no document. The mask is
then purely intra-document: a document's keys (copy included) sit next to each other, so query
tiles visit about the tiles ``intra_doc`` does and no key tile is shared by all documents. RoPE
is applied before attention, so copying the rotated key is exact; with GQA the gather runs over
the KV heads' sequence dim. The gather's backward is written out (:class:`_GatherKV`): each
token's gradient is read from its own slot and the copies' gradients are summed into token 0
in float32 (deterministic: no scatter with duplicate indices, no atomics). Padding slots are
never attended, so their gradient is exactly zero and summing them with the copies is harmless.

``N`` is ``T`` rounded up to the tile size plus the copies rounded up to a power-of-two number
of tiles (at least four), so the compiled kernel (static shapes) is shared by every layout whose copy count
falls in one bucket. ``full`` rows use one document for the whole row (causal); ``intra_doc``
and ``intra_doc_reset`` rows get no copies. A batch without copies runs the ``flex`` engine.
On CPU (FlexAttention has no backward there) the same augmented keys go through a dense masked
softmax [T, N]: exact, for tests and short rows.
"""

from __future__ import annotations

import torch

from anchorctx.attention.engines.base import AttentionCall
from anchorctx.attention.engines.flex import (
    BLOCK,
    FlexAnchorEngine,
    FlexEngine,
    ceil,
    compiled_flex,
    ordered,
)
from anchorctx.attention.layout import Layout

_FAR = 2**30  # position of a padding slot: later than every query, so never attended
_CHUNK_ELEMENTS = 2**25  # bound on the [q tiles, kv tiles, documents] comparison of one step


class FlexCopyEngine(FlexAnchorEngine):
    """Runs when named only: no ``auto`` rank and no cost, as it was measured slower than
    ``flex_merge`` on every row (docs/benchmarks/2026-11-23-attention-flex-copy.md)."""

    name = "flex_copy"

    def forward(self, call: AttentionCall) -> torch.Tensor:
        plan = cached_plan(call)
        if plan.copies == 0:  # no anchor copy in the batch: exactly the flex engine's mask
            if call.q.is_cuda:
                return _FLEX.forward(call)
            return _dense(call.q, call.k, call.v, plan, call.scale)
        if call.q.is_cuda:
            k_aug, v_aug = augment(call.k, call.v, plan)
            gqa = call.q.shape[1] != call.k.shape[1]
            return compiled_flex()(
                call.q,
                k_aug,
                v_aug,
                block_mask=plan.block_mask(),
                scale=call.scale,
                enable_gqa=gqa,
            )
        return _dense(call.q, call.k, call.v, plan, call.scale)


_FLEX = FlexEngine()


# ------------------------------------------------------------------------------------ plan
class CopyPlan:
    """Index tables of one batch (rows of equal length), built once and reused by every layer.

    Tables have batch dim ``B`` (one per row), or 1 when all rows share one layout:
    ``gather`` [., N] token of each slot, ``token_slot`` [., T] slot of each token, ``extra``
    [., N - T] the other slots (copies and padding), ``doc_q`` [., T_pad] and ``doc_kv``
    [., N] dense document ids (-2 / -1 on padding, so padding never matches), ``pos_kv``
    [., N] the position each slot stands for.
    """

    def __init__(self, rows: tuple[Layout, ...], device: torch.device, block: int = BLOCK):
        self.rows, self.device, self.block = rows, device, block
        t = rows[0].seq_len
        starts = [_copy_starts(row) for row in rows]
        self.copies = max(len(s) for s in starts)
        self.seq_len = t
        self.kv_len = ceil(t, block) * block + _bucket(self.copies, block)
        tables = [
            _row_tables(row.to(device), s, self.kv_len, block) for row, s in zip(rows, starts)
        ]
        (self.gather, self.token_slot, self.extra, self.doc_q, self.doc_kv, self.pos_kv) = (
            torch.stack(x) for x in zip(*tables)
        )
        self._block_mask = None

    def block_mask(self):
        """FlexAttention BlockMask over (T queries, N slots), built on first use."""
        if self._block_mask is None:
            self._block_mask = build_copy_block_mask(self)
        return self._block_mask

    def dense_mask(self) -> torch.Tensor:
        """Bool [., 1, T, N] (CPU path and tests)."""
        t = self.seq_len
        q_idx = torch.arange(t, device=self.device)
        same = self.doc_q[:, :t, None] == self.doc_kv[:, None, :]
        return (same & (self.pos_kv[:, None, :] <= q_idx[:, None]))[:, None]


def cached_plan(call: AttentionCall) -> CopyPlan:
    key = ("copy_plan", str(call.q.device))
    if key not in call.cache:
        rows = call.rows[:1] if call.shared else call.rows
        call.cache[key] = CopyPlan(rows, call.q.device)
    return call.cache[key]


def _copy_starts(row: Layout) -> list[int]:
    """Start of the first segment of every document that needs an anchor copy (host side)."""
    if row.variant != "anchor":
        return []
    seen, out = {row.seg_doc[0]}, []
    for start, doc in zip(row.seg_starts, row.seg_doc):
        if doc not in seen:
            seen.add(doc)
            out.append(start)
    return out


def _bucket(m: int, block: int) -> int:
    """Copy slots: ``m`` rounded up to a power-of-two number of tiles, at least four (0 for no
    copies): 128K-token rows hold up to ~500 documents, so one shape covers them all."""
    if m == 0:
        return 0
    tiles = 4
    while tiles * block < m:
        tiles *= 2
    return tiles * block


def _row_tables(row: Layout, starts: list[int], n: int, block: int):
    t, dev = row.seq_len, row.device
    if row.variant == "full":  # causal: one document
        doc = torch.zeros(t, dtype=torch.long, device=dev)
    else:
        doc = torch.unique(row.doc_ids, return_inverse=True)[1]
    is_first = torch.zeros(t, dtype=torch.bool, device=dev)
    is_first[torch.tensor(starts, dtype=torch.long, device=dev)] = True
    tokens = torch.arange(t, device=dev)
    # A token's slot moves right by the copies inserted at or before it (its own included).
    slot = tokens + torch.cumsum(is_first, 0)
    copy_slot = slot[is_first] - 1
    gather = torch.zeros(n, dtype=torch.long, device=dev)  # copies and padding read token 0
    gather[slot] = tokens
    doc_kv = torch.full((n,), -1, dtype=torch.long, device=dev)
    doc_kv[slot] = doc
    doc_kv[copy_slot] = doc[is_first]
    pos_kv = torch.full((n,), _FAR, dtype=torch.long, device=dev)
    pos_kv[slot] = tokens
    pos_kv[copy_slot] = 0
    free = torch.ones(n, dtype=torch.bool, device=dev)
    free[slot] = False
    extra = free.nonzero().squeeze(1)
    doc_q = torch.full((ceil(t, block) * block,), -2, dtype=torch.long, device=dev)
    doc_q[:t] = doc
    return gather, slot, extra, doc_q, doc_kv, pos_kv


# ------------------------------------------------------------------------------ block mask
def tile_classes(plan: CopyPlan, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) tile booleans [nq, nk] of plan row ``i``.

    A tile pair is visited iff some document has a query in the q tile at or after the
    position of one of its slots in the kv tile (exact at tile level, per document: a kv tile
    holding one document's copy and another's late keys is not visited by the other's early
    query tiles). It is full iff both tiles hold one and the same document, without padding,
    and every slot's position is at or before the q tile's first query.
    """
    b, t = plan.block, plan.seq_len
    nq, nk = ceil(t, b), plan.kv_len // b
    doc_q, doc_kv, pos_kv = plan.doc_q[i, :t], plan.doc_kv[i], plan.pos_kv[i]
    n_docs = int(doc_q.max()) + 1
    dev = doc_q.device
    # Last query of each document in each q tile, first slot position in each kv tile.
    last_q = torch.full((nq * n_docs,), -1, dtype=torch.long, device=dev)
    q_tok = torch.arange(t, device=dev)
    last_q.scatter_reduce_(0, (q_tok // b) * n_docs + doc_q, q_tok, "amax")
    last_q = last_q.view(nq, n_docs)
    real = doc_kv >= 0
    first_kv = torch.full((nk * n_docs,), _FAR, dtype=torch.long, device=dev)
    kv_tile = torch.arange(plan.kv_len, device=dev) // b
    first_kv.scatter_reduce_(0, (kv_tile * n_docs + doc_kv)[real], pos_kv[real], "amin")
    first_kv = first_kv.view(nk, n_docs)
    visited = torch.zeros(nq, nk, dtype=torch.bool, device=dev)
    step = max(1, _CHUNK_ELEMENTS // (nq * nk))
    for d in range(0, n_docs, step):
        sl = slice(d, d + step)
        visited |= (last_q[:, None, sl] >= first_kv[None, :, sl]).any(-1)
    q_docs = (last_q >= 0).sum(1)
    kv_docs = (first_kv < _FAR).sum(1)
    q_doc = last_q.argmax(1)  # the one document where q_docs == 1
    kv_doc = (first_kv < _FAR).to(torch.int8).argmax(1)
    kv_last = pos_kv.view(nk, b).max(1).values  # _FAR if the tile has padding
    q_first = torch.arange(nq, device=dev) * b
    q_whole = (q_docs == 1) & (torch.arange(nq, device=dev) < t // b)
    full = (
        q_whole[:, None]
        & (kv_docs == 1)[None, :]
        & (q_doc[:, None] == kv_doc[None, :])
        & (kv_last[None, :] <= q_first[:, None])
    )
    return visited & ~full, full


def build_copy_block_mask(plan: CopyPlan):
    from torch.nn.attention.flex_attention import BlockMask

    tiles = [tile_classes(plan, i) for i in range(plan.doc_q.shape[0])]
    partial = torch.stack([p for p, _ in tiles])[:, None]  # [B or 1, 1, nq, nk]
    full = torch.stack([f for _, f in tiles])[:, None]
    doc_q, doc_kv, pos_kv = plan.doc_q, plan.doc_kv, plan.pos_kv
    # Rows sharing one plan: the tables have batch dim 1 and the kernel passes the real row
    # index, so the mask reads row 0 for every row.
    shared = doc_q.shape[0] == 1

    def mask_mod(b, h, q_idx, kv_idx):
        r = 0 if shared else b
        return (doc_q[r, q_idx] == doc_kv[r, kv_idx]) & (pos_kv[r, kv_idx] <= q_idx)

    return BlockMask.from_kv_blocks(
        *ordered(partial),
        *ordered(full),
        BLOCK_SIZE=plan.block,
        mask_mod=mask_mod,
        seq_lengths=(plan.seq_len, plan.kv_len),
    )


# ------------------------------------------------------------------------ the gather of k, v
def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, H, L, D] at sequence indices ``index`` [B or 1, S] -> [B, H, S, D]."""
    if index.shape[0] == 1:
        return x.index_select(2, index[0])
    return torch.gather(x, 2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


class _GatherKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gather, token_slot, extra):
        ctx.token_slot, ctx.extra = token_slot, extra
        return _take(x, gather)

    @staticmethod
    def backward(ctx, grad):
        dx = _take(grad, ctx.token_slot)
        if ctx.extra.shape[1]:
            copies = _take(grad, ctx.extra).sum(2, dtype=torch.float32)  # [B, H, D]
            dx[:, :, 0] = (dx[:, :, 0].float() + copies).to(dx.dtype)
        return dx, None, None, None


def augment(k: torch.Tensor, v: torch.Tensor, plan: CopyPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [B, H_kv, T, D] -> [B, H_kv, N, D] with the anchor copies in place."""
    idx = (plan.gather, plan.token_slot, plan.extra)
    return _GatherKV.apply(k, *idx), _GatherKV.apply(v, *idx)


def _dense(q, k, v, plan: CopyPlan, scale: float) -> torch.Tensor:
    from anchorctx.attention.engines.merge import dense_attention_lse

    k_aug, v_aug = augment(k, v, plan)
    return dense_attention_lse(q, k_aug, v_aug, plan.dense_mask(), scale)[0]
