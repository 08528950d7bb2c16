"""``triton``: document-masked attention in Triton, with the anchor key inside the kernel.

FlexAttention pays for the anchor variant in its tile structure: the anchor's key tile is one
more (partial) tile for every query tile in the forward, and in the backward the program that
owns key tile 0 accumulates dK/dV over every query tile of the row, a serial chain as long as
the sequence (docs/benchmarks/2026-11-22-attention-engines.md). Merging the anchor afterwards
(``flex_merge``) removes both but adds about a dozen memory passes over [T, H, D] tensors (0.5-1 ms
at 32K, 3-4 ms at 128K: 12-28% of the intra-document kernel's time on short documents).

Here the anchor is one register-resident key, not a tile:

- **forward** (one program per query tile and head): queries outside the anchor's document
  start their online softmax from the anchor key, ``m = s0 = scale·q·k0``, ``l = 1``,
  ``acc = v0``; then the tiles the *intra-document* mask visits follow. The anchor costs one
  [BM, D] dot product per tile, nothing per key tile.
- **backward**: dK/dV programs (one per key tile and KV head, looping over the query heads of
  the group, so no atomics) see only intra-document tiles, so key tile 0 is as cheap as any
  other; the dQ programs add the anchor's term ``dq += ds0·k0`` with
  ``ds0 = p0·(dO·v0 - Δ)`` and write their tile's share of ``dk0 = Σ ds0·q`` and
  ``dv0 = Σ p0·dO``, summed afterwards over [B, H, n_tiles, D] (small, deterministic).

The tiles come from per-batch lists like FlexAttention's BlockMask: for every query tile, the
key tiles it shares a document with (causally), split into *full* tiles (one document, below
the diagonal: no mask evaluated) and *partial* tiles (``kv <= q`` and equal document ids,
evaluated per element). The lists are built once per batch on the GPU from document ids; the
backward's dK/dV kernel uses the transposed lists. Interleaved chunks of one document share an
id, so they are handled like any other layout. ``full`` rows are one document. Element
offsets are 32-bit: a q or k spanning 2**31 elements (512K tokens × 32 heads × 128 on one GPU)
is refused by ``check``, and ``auto`` takes the next engine.

Softmax in base 2 (``exp2``, scores scaled by ``scale·log2(e)``); the saved
log-sum-exp is in that unit. Partial tiles mask with ``-inf`` while running maxima start at a
large finite negative number, so a row whose keys in one tile are all masked keeps ``l = 0``
and a rescale factor of 1 rather than ``exp2(-inf + inf) = NaN``.

The kernels need Triton (shipped with CUDA builds of PyTorch). On a machine without a GPU they
run in Triton's interpreter when ``TRITON_INTERPRET=1`` is set before Triton is first
imported (tests/conftest.py does this), exact in float32.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from anchorctx.attention.engines.base import AttentionCall, AutoRanks, Capabilities, Engine
from anchorctx.attention.engines.cost import TILE, TileCounts, visited_tiles
from anchorctx.attention.engines.flex import ceil, ordered, row_docs, tile_classes
from anchorctx.attention.errors import AttentionError
from anchorctx.attention.layout import Layout


@dataclass(frozen=True)
class Blocks:
    """Tile shapes (query tokens × key tokens) of the kernels and their launch settings (warps,
    software-pipeline stages). The defaults are :data:`LONG_BLOCKS`."""

    m: int = 128  # forward
    n: int = 128
    fwd_warps: int = 8
    fwd_stages: int = 2
    dq_m: int = 128  # backward, dQ programs
    dq_n: int = 64
    m_kv: int = 64  # backward, dK/dV programs: one per n_kv keys, m_kv queries per step
    n_kv: int = 128
    bwd_warps: int = 8  # one launch runs both kinds of programs...
    bwd_stages: int = 3
    split_backward: bool = False  # ...or two launches, each with its own settings:
    dq_warps: int = 8
    dq_stages: int = 3
    dkdv_warps: int = 8
    dkdv_stages: int = 3


# Measured on one H200 (docs/benchmarks/2026-11-24-attention-triton.md; 32 query heads, 8 KV
# heads, d 128, bf16). Documents of 2K tokens and longer: large forward tiles and the backward in
# one launch. Tiny documents (a few hundred tokens) waste most of a large tile on masked pairs:
# 64×64 forward tiles, and dK/dV over 64-key tiles with four warps in a launch of its own (11%
# faster than LONG_BLOCKS on 433 documents in 128K, 3-9% slower on 2K documents and longer).
LONG_BLOCKS = Blocks()
SHORT_BLOCKS = Blocks(
    m=64,
    n=64,
    fwd_warps=4,
    fwd_stages=3,
    split_backward=True,
    m_kv=32,
    n_kv=64,
    dkdv_warps=4,
    dkdv_stages=3,
)
# Rows whose query tiles per visited 128×128 tile (the cost rule's x = n_q / U) reach this
# take SHORT_BLOCKS: 0.24 for the tiny-document rows, 0.12 for 2K documents, below 0.07 for
# log-normal ones.
SHORT_ROWS_X = 0.18
HEAD_DIMS = (16, 32, 64, 128)
# Cost rule (engines/cost.py). triton (anchor) over intra_doc flex - 1, in tiles per query tile:
# 0.45-0.54 (fixed 2K), 0.39 (heavy-tailed 32K), below 0 on long-document and tiny-document rows
# (0.98-0.99 and 0.95-0.97 of intra_doc's time): the upper envelope. Below flex_merge's MU on
# every row, as measured (docs/benchmarks/2026-11-24-attention-triton.md).
PSI = 0.5


@functools.cache
def triton_available() -> tuple[bool, str]:
    # Cached: ``check`` asks on every attention call, and Triton reads TRITON_INTERPRET once.
    try:
        import triton  # noqa: F401
    except ImportError as err:
        return False, f"triton is not installed ({err})"
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return False, "no CUDA device (set TRITON_INTERPRET=1 to run Triton's interpreter)"
    return True, ""


# ----------------------------------------------------------------------------- tile lists
@dataclass(frozen=True)
class TileLists:
    """Per query (or key) tile: counts [B', n] and ascending tile indices [B', n, w] of the full
    and the partial tiles it visits (``w``: the largest count, the index arrays' row stride).
    ``B' = 1`` when every row shares a layout."""

    full_count: torch.Tensor
    full_index: torch.Tensor
    part_count: torch.Tensor
    part_index: torch.Tensor

    @property
    def batch_stride(self) -> int:
        return 0 if self.full_count.shape[0] == 1 else 1


@dataclass(frozen=True)
class TritonPlan:
    """Everything the kernels need about one batch of rows (built once, reused by all layers)."""

    docs: torch.Tensor  # int32 [B, T]; 0 everywhere on ``full`` rows
    anchor: torch.Tensor  # int32 [B]: 1 on anchor rows
    forward: TileLists  # (m, n) tiles, per query tile
    dq: TileLists  # (dq_m, dq_n) tiles, per query tile
    dkdv: TileLists  # (m_kv, n_kv) tiles, per key tile (transposed)
    blocks: Blocks
    has_anchor: bool


def _lists(partial: torch.Tensor, full: torch.Tensor) -> TileLists:
    """Dense tile booleans [B', n, n_other] -> counts and indices (visited tiles first, in order)."""

    full_count, full_index = ordered(full)
    part_count, part_index = ordered(partial)
    # Only the first max-count columns are ever read: a row of 2K documents at 512K keeps
    # 16 indices per 128-token tile (256 KB per array) instead of 4096 (64 MB).
    width = max(1, int(max(full_count.max(), part_count.max())))
    return TileLists(
        full_count.contiguous(),
        full_index[..., :width].contiguous(),
        part_count.contiguous(),
        part_index[..., :width].contiguous(),
    )


def build_plan(
    rows: tuple[Layout, ...], device: torch.device, *, shared: bool, blocks: Blocks
) -> TritonPlan:
    docs = torch.stack([row_docs(row, device) for row in rows])
    tile_rows = docs[:1] if shared else docs

    def lists(bm: int, bn: int, transposed: bool = False) -> TileLists:
        classes = [tile_classes(d, bm, bn) for d in tile_rows]
        if transposed:  # for every key tile, the query tiles that visit it
            classes = [(p.T, f.T) for p, f in classes]
        return _lists(torch.stack([p for p, _ in classes]), torch.stack([f for _, f in classes]))

    forward = lists(blocks.m, blocks.n)
    same = (blocks.dq_m, blocks.dq_n) == (blocks.m, blocks.n)
    anchor = torch.tensor([row.variant == "anchor" for row in rows], dtype=torch.int32)
    return TritonPlan(
        docs=docs.contiguous(),
        anchor=anchor.to(device),
        forward=forward,
        dq=forward if same else lists(blocks.dq_m, blocks.dq_n),
        dkdv=lists(blocks.m_kv, blocks.n_kv, transposed=True),
        blocks=blocks,
        has_anchor=bool(anchor.any()),
    )


# ---------------------------------------------------------------------------------- kernels
@functools.cache
def _kernels():
    """(forward, Δ, backward in one launch, dQ alone, dK/dV alone), imported on first use."""
    from anchorctx.attention.engines import triton_kernels as k

    return k.fwd_kernel, k.delta_kernel, k.bwd_kernel, k.dq_kernel, k.dkdv_kernel


# ------------------------------------------------------------------------------ launching
LOG2E = 1.4426950408889634


def _strides(x: torch.Tensor, name: str) -> dict[str, int]:
    """The (batch, head, token) strides of a [B, H, T, D] tensor whose last dim is contiguous,
    as the kernels' parameters ``{name}b``, ``{name}h``, ``{name}t``."""
    return {f"{name}b": x.stride(0), f"{name}h": x.stride(1), f"{name}t": x.stride(2)}


def _list_args(lists: TileLists, name: str) -> dict[str, torch.Tensor]:
    """Tile lists as the kernels' parameters ``{name}FC``, ``{name}FI``, ``{name}PC``,
    ``{name}PI`` (full tiles' counts and indices, partial tiles' counts and indices)."""
    return {
        f"{name}FC": lists.full_count,
        f"{name}FI": lists.full_index,
        f"{name}PC": lists.part_count,
        f"{name}PI": lists.part_index,
    }


def _dense_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# Every launch below passes its arguments by the kernel's parameter names (Triton binds them
# as Python does): a stride given to the wrong parameter would otherwise compute wrong
# gradients without an error.
def attention_forward(q, k, v, plan: TritonPlan, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, T, D] like q, lse float32 [B, H, T] in log2 units)."""
    fwd_kernel = _kernels()[0]
    bsz, h, t, d = q.shape
    bl = plan.blocks
    out = torch.empty_like(q)  # same strides as q: a [B, T, H, D] caller gets its layout back
    lse = torch.empty(bsz, h, t, device=q.device, dtype=torch.float32)
    lists = plan.forward
    nq, width = lists.full_index.shape[1], lists.full_index.shape[2]  # width: index row stride
    fwd_kernel[(nq, bsz * h)](
        Q=q,
        K=k,
        V=v,
        OUT=out,
        LSE=lse,
        DOCS=plan.docs,
        ANCHOR=plan.anchor,
        **_list_args(lists, ""),
        **_strides(q, "sq"),
        **_strides(k, "sk"),
        **_strides(v, "sv"),
        **_strides(out, "so"),
        list_b=lists.batch_stride,
        T=t,
        NQ=nq,
        W=width,
        qk_scale=scale * LOG2E,
        H=h,
        G=h // k.shape[1],
        D=d,
        BM=bl.m,
        BN=bl.n,
        HAS_ANCHOR=plan.has_anchor,
        num_warps=bl.fwd_warps,
        num_stages=bl.fwd_stages,
    )
    return out, lse


def attention_backward(q, k, v, out, lse, dout, plan: TritonPlan, scale: float):
    """(dq, dk, dv) of :func:`attention_forward`: Δ, then dK/dV and dQ in one launch."""
    _, delta_kernel, bwd_kernel, dq_kernel, dkdv_kernel = _kernels()
    bsz, h, t, d = q.shape
    hk = k.shape[1]
    bl = plan.blocks
    dout = _dense_last(dout)
    delta = torch.empty(bsz, h, t, device=q.device, dtype=torch.float32)
    delta_kernel[(ceil(t, 128), bsz * h)](
        OUT=out,
        DO=dout,
        DELTA=delta,
        **_strides(out, "so"),
        **_strides(dout, "sd"),
        T=t,
        H=h,
        D=d,
        BM=128,
    )
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ql, kl = plan.dq, plan.dkdv
    # (tiles, index row stride) of the dQ lists and of the transposed dK/dV lists
    nq, nkq = ql.full_index.shape[1], ql.full_index.shape[2]
    nk1, nq1 = kl.full_index.shape[1], kl.full_index.shape[2]
    n_dkdv = nk1 * bsz * hk
    # [2, B, H, NQ, D] float32 shares of the anchor key's gradients, one per dQ program, summed
    # below (deterministic); without an anchor the kernels never touch them.
    shape = (2, bsz, h, nq, d) if plan.has_anchor else (2, 1)
    shares = torch.empty(shape, device=q.device, dtype=torch.float32)
    inputs = {"Q": q, "K": k, "V": v, "DO": dout, "LSE": lse, "DELTA": delta, "DOCS": plan.docs}
    strides = {
        **_strides(q, "sq"),
        **_strides(k, "sk"),
        **_strides(v, "sv"),
        **_strides(dout, "sd"),
        "T": t,
        "qk_scale": scale * LOG2E,
        "sm_scale": scale,
        "H": h,
        "G": h // hk,
        "D": d,
    }
    dq_part = {  # what the dQ programs read and write
        "DQ": dq,
        "ANCHOR": plan.anchor,
        "DK0": shares[0],
        "DV0": shares[1],
        **_list_args(ql, "Q"),
        **_strides(dq, "sdq"),
        "qlist_b": ql.batch_stride,
        "NQ": nq,
        "W_DQ": nkq,
        "BM_DQ": bl.dq_m,
        "BN_DQ": bl.dq_n,
    }
    dkdv_part = {  # what the dK/dV programs read and write
        "DK": dk,
        "DV": dv,
        **_list_args(kl, "K"),
        **_strides(dk, "sdk"),
        **_strides(dv, "sdv"),
        "klist_b": kl.batch_stride,
        "NK1": nk1,
        "W_KV": nq1,
        "BM_KV": bl.m_kv,
        "BN_KV": bl.n_kv,
    }
    if bl.split_backward:
        dkdv_kernel[(nk1, bsz * hk)](
            **inputs,
            **strides,
            **dkdv_part,
            num_warps=bl.dkdv_warps,
            num_stages=bl.dkdv_stages,
        )
        dq_kernel[(nq, bsz * h)](
            **inputs,
            **strides,
            **dq_part,
            HAS_ANCHOR=plan.has_anchor,
            num_warps=bl.dq_warps,
            num_stages=bl.dq_stages,
        )
    else:
        bwd_kernel[(n_dkdv + nq * bsz * h,)](
            **inputs,
            **strides,
            **dq_part,
            **dkdv_part,
            N_DKDV=n_dkdv,
            HAS_ANCHOR=plan.has_anchor,
            num_warps=bl.bwd_warps,
            num_stages=bl.bwd_stages,
        )
    if plan.has_anchor:
        # [2, B, H, NQ, D] -> [2, B, H_kv, D]: the query heads of each KV group and all tiles.
        dk0, dv0 = shares.unflatten(2, (hk, h // hk)).sum((3, 4))
        dk[:, :, 0] += (dk0 * scale).to(dk.dtype)
        dv[:, :, 0] += dv0.to(dv.dtype)
    return dq, dk, dv


class _DocumentAttention(torch.autograd.Function):
    # Saved through ctx.save_for_backward, so non-reentrant activation checkpointing drops and
    # recomputes them like any other activation.
    @staticmethod
    def forward(ctx, q, k, v, plan: TritonPlan, scale: float):
        q, k, v = (_dense_last(x) for x in (q, k, v))
        out, lse = attention_forward(q, k, v, plan, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(q, k, v, out, lse, dout, ctx.plan, ctx.scale)
        return dq, dk, dv, None, None


def document_attention(q, k, v, plan: TritonPlan, scale: float) -> torch.Tensor:
    """Differentiable document-masked attention (with the anchor on anchor rows)."""
    return _DocumentAttention.apply(q, k, v, plan, scale)


INDEX_LIMIT = 2**31


def index_limit_error(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why the kernels cannot address these tensors, or None. Their element offsets are 32-bit
    integers, so no tensor may span 2**31 elements (from 512K tokens × 32 heads × 128 on one GPU;
    Ulysses splits the heads, so 512K on two GPUs fits)."""
    for name, x in (("q", q), ("k", k)):
        span = 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride()))
        if span >= INDEX_LIMIT:
            return (
                f"engine 'triton' addresses at most 2**31 elements per tensor; {name} "
                f"{tuple(x.shape)} spans {span:,}: use engine='flex_merge' (auto does)"
            )
    return None


def blocks_for(rows: tuple[Layout, ...]) -> Blocks:
    """Tile settings for a batch of rows, from their document histogram (``x = n_q / U``)."""
    u = sum(visited_tiles(row) for row in rows)
    n_q = sum(ceil(row.seq_len, TILE) for row in rows)
    return SHORT_BLOCKS if n_q >= SHORT_ROWS_X * u else LONG_BLOCKS


# --------------------------------------------------------------------------------- engine
class TritonEngine(Engine):
    name = "triton"
    alternative = "flex"
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        backward_devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.bfloat16, torch.float16}),
        max_head_dim=128,
        # dK/dV accumulate in registers over the group's query heads, dQ in its own kernel,
        # the anchor column's partial sums are added afterwards: no atomics anywhere.
        deterministic_backward=frozenset({"cuda"}),
    )
    auto = AutoRanks(masked=20)

    def available(self) -> tuple[bool, str]:
        return triton_available()

    def cost(self, tiles: TileCounts) -> float:
        """``U + ψ·n_q``: the anchor is a register-resident key in the kernel, so its tiles are
        intra_doc's (intra_doc rows: ``U``)."""
        return tiles.u + PSI * tiles.n_q

    def check(self, call: AttentionCall) -> None:
        super().check(call)
        d = call.q.shape[-1]
        if d not in HEAD_DIMS:
            raise AttentionError(
                f"engine 'triton' supports head_dim in {HEAD_DIMS}, got {d}; use engine='flex'"
            )
        if (err := index_limit_error(call.q, call.k)) is not None:
            raise AttentionError(err)

    def forward(self, call: AttentionCall) -> torch.Tensor:
        return document_attention(call.q, call.k, call.v, self.plan(call), call.scale)

    @staticmethod
    def plan(call: AttentionCall, blocks: Blocks | None = None) -> TritonPlan:
        if blocks is None:  # chosen once per batch, like the plan: every layer asks
            if "triton_blocks" not in call.cache:
                call.cache["triton_blocks"] = blocks_for(call.rows)
            blocks = call.cache["triton_blocks"]
        key = ("triton_plan", str(call.q.device), blocks)
        if key not in call.cache:
            call.cache[key] = build_plan(
                call.rows, call.q.device, shared=call.shared, blocks=blocks
            )
        return call.cache[key]
