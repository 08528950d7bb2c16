"""Variable-length FlashAttention engines: torch's ``varlen_attn`` and ``flash_attn``.

Each query sequence is a run of consecutive segments of one document. Its key/value sequence
is gathered so that a plain bottom-right-aligned causal kernel computes exactly the layout's
mask:

- ``full``: one sequence per row.
- ``intra_doc`` / ``intra_doc_reset``: K/V = [earlier chunks of the same document; the run].
  Without interleaved chunks this is the run itself and no gather happens.
- ``anchor``: as intra_doc, with the anchor's K/V (token 0) prepended for every document other
  than the anchor's own. The data holds one anchor; only its K/V rows are re-read.

Bottom-right alignment (query i of a run of length L sees the first K - L + i + 1 keys) makes
every query see all prepended keys plus the causal prefix of its own run.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from anchorctx.attention.engines.base import AttentionCall, AutoRanks, Capabilities, Engine
from anchorctx.attention.engines.cost import TileCounts
from anchorctx.attention.errors import AttentionError
from anchorctx.attention.layout import Layout

HALF = frozenset({torch.bfloat16, torch.float16})

# Cost rule (engines/cost.py). varlen (anchor) over intra_doc flex - 1: 0.26 (x = 0.012), 0.36
# (0.066), 0.51-0.53 (0.118), 0.73 (0.243).
NU = 1.25
LAMBDA = 2.3


def varlen_cost(tiles: TileCounts) -> float:
    """``ν·U``, anchor rows add ``λ·n_q`` (the anchor K/V gathered in front of every document,
    its gradient scattered back); both varlen kernels."""
    return NU * tiles.u + LAMBDA * tiles.n_q


@dataclass(frozen=True)
class KeyGather:
    """The keys' gather from the tokens and its gradient's way back without atomics.

    ``index`` [T_k] picks each key's token. Every token appears once as a key of its own run
    (``first`` [B*T]: the position of its first appearance); the anchor before every other
    document and earlier chunks of a document appear again (``extra_src`` [E] positions, their
    tokens ``extra_dst``). The gradient of the tokens is then a gather of the first appearances
    plus a scatter-add of the few repeats: autograd's own backward of ``index_select`` is a
    scatter-add of all T_k rows, atomics in bf16 on CUDA (0.045 s of a 16K-token 7B step on an
    H200, docs/benchmarks/2026-11-28-attention-fa4.md)."""

    index: torch.Tensor  # int64 [T_k]
    first: torch.Tensor  # int64 [B*T]
    extra_src: torch.Tensor  # int64 [E]
    extra_dst: torch.Tensor  # int64 [E]

    @classmethod
    def of(cls, index: torch.Tensor, tokens: int, device: torch.device) -> KeyGather:
        """From ``index`` (CPU, int64) over ``tokens`` tokens, each present at least once."""
        positions = torch.arange(len(index))
        # each token's smallest position: a scatter taking the minimum over its appearances
        first = torch.full((tokens,), len(index), dtype=torch.long)
        first.scatter_reduce_(0, index, positions, reduce="amin")
        if bool((first == len(index)).any()):  # the plan's runs cover every token
            raise AttentionError("varlen plan: a token is missing from the keys' gather")
        extra = torch.ones(len(index), dtype=torch.bool)
        extra[first] = False
        src = positions[extra]
        return cls(
            index=index.to(device),
            first=first.to(device),
            extra_src=src.to(device),
            extra_dst=index[src].to(device),
        )


class _GatherKeys(torch.autograd.Function):
    """``x.index_select(0, gather.index)`` with :class:`KeyGather`'s backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gather: KeyGather) -> torch.Tensor:
        ctx.gather = gather  # index tensors only, cached with the plan: nothing saved per call
        return x.index_select(0, gather.index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gather: KeyGather = ctx.gather
        dx = grad.index_select(0, gather.first)
        if gather.extra_src.numel():
            dx.index_add_(0, gather.extra_dst, grad.index_select(0, gather.extra_src))
        return dx, None


def gather_keys(x: torch.Tensor, gather: KeyGather) -> torch.Tensor:
    """[B*T, H_kv, D] -> [T_k, H_kv, D]: the keys (or values) of every query run."""
    return _GatherKeys.apply(x, gather)


@dataclass(frozen=True)
class VarlenPlan:
    """Flattened batch: queries are [B*T] tokens; keys are ``kv_index`` into [B*T] tokens."""

    cu_seq_q: torch.Tensor  # int32 [S + 1]
    cu_seq_k: torch.Tensor  # int32 [S + 1]
    max_q: int
    max_k: int
    kv_gather: KeyGather | None  # None: keys are the queries' tokens

    @property
    def kv_index(self) -> torch.Tensor | None:
        """int64 [T_k]: each key's token."""
        return None if self.kv_gather is None else self.kv_gather.index


def _row_sequences(layout: Layout, offset: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """(q_start, q_end, kv ranges) per query run of one row, token offsets + ``offset``."""
    t = layout.seq_len
    if layout.variant == "full":
        return [(offset, offset + t, [(offset, offset + t)])]
    runs: list[tuple[int, int, int]] = []  # (start, end, doc), consecutive same-doc segments merged
    for start, n, doc in zip(layout.seg_starts, layout.seg_lens, layout.seg_doc):
        if runs and runs[-1][2] == doc:
            runs[-1] = (runs[-1][0], start + n, doc)
        else:
            runs.append((start, start + n, doc))
    anchor_doc = layout.seg_doc[0]
    seen: dict[int, list[tuple[int, int]]] = {}
    out = []
    for start, end, doc in runs:
        earlier = seen.setdefault(doc, [])
        prefix = [(0, 1)] if layout.variant == "anchor" and doc != anchor_doc else []
        ranges = [*prefix, *earlier, (start, end)]
        out.append((offset + start, offset + end, [(offset + a, offset + b) for a, b in ranges]))
        earlier.append((start, end))
    return out


def build_plan(rows: tuple[Layout, ...], device: torch.device) -> VarlenPlan:
    t = rows[0].seq_len
    seqs = [s for b, row in enumerate(rows) for s in _row_sequences(row, b * t)]
    q_lens = [end - start for start, end, _ in seqs]
    k_lens = [sum(b - a for a, b in ranges) for _, _, ranges in seqs]
    identity = all(len(r) == 1 and r[0] == (s, e) for s, e, r in seqs)
    gather = None
    if not identity:
        index = torch.cat(
            [torch.arange(a, b, dtype=torch.long) for _, _, rs in seqs for a, b in rs]
        )
        gather = KeyGather.of(index, len(rows) * t, device)
    return VarlenPlan(
        cu_seq_q=_cumsum(q_lens, device),
        cu_seq_k=_cumsum(k_lens, device),
        max_q=max(q_lens),
        max_k=max(k_lens),
        kv_gather=gather,
    )


def _cumsum(lengths: list[int], device: torch.device) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    return cu.to(device)


def cached_plan(call: AttentionCall) -> VarlenPlan:
    b = call.q.shape[0]
    key = ("varlen_plan", str(call.q.device), b)
    if key not in call.cache:
        call.cache[key] = build_plan(call.rows, call.q.device)
    return call.cache[key]


def flatten(call: AttentionCall, plan: VarlenPlan):
    """q [B, H, T, D] -> [B*T, H, D]; k/v -> [T_k, H_kv, D] (gathered when the plan says so)."""

    def tokens_first(x: torch.Tensor) -> torch.Tensor:
        # HF hands q/k/v as a transposed view of [B, T, H, D]: this is usually free.
        b, h, t, d = x.shape
        return x.transpose(1, 2).reshape(b * t, h, d)

    q, k, v = (tokens_first(x) for x in (call.q, call.k, call.v))
    if plan.kv_gather is not None:
        k, v = gather_keys(k, plan.kv_gather), gather_keys(v, plan.kv_gather)
    return q, k, v


def unflatten(out: torch.Tensor, call: AttentionCall) -> torch.Tensor:
    """[B*T, H, D] -> [B, H, T, D] (a view; transposing back to [B, T, H, D] is free)."""
    b, h, t, d = call.q.shape
    return out.view(b, t, h, d).transpose(1, 2)


# ----------------------------------------------------------------------- torch varlen_attn
@functools.cache
def _varlen_params() -> frozenset[str]:
    # Imported here: torch.nn.attention.varlen is missing from older torch (see available()), and it
    # takes a second to import.
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


class VarlenEngine(Engine):
    name = "varlen"
    alternative = "flex"
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        backward_devices=frozenset({"cuda"}),
        dtypes=HALF,
        max_head_dim=256,
        # torch's FlashAttention backward reads torch's deterministic mode itself.
        deterministic_backward=frozenset({"cuda"}),
    )
    auto = AutoRanks(full=20, mixed=10, masked=40)

    def cost(self, tiles: TileCounts) -> float:
        return varlen_cost(tiles)

    def available(self) -> tuple[bool, str]:
        try:
            from torch.nn.attention.varlen import varlen_attn  # noqa: F401
        except ImportError as err:
            return False, f"torch {torch.__version__} has no torch.nn.attention.varlen ({err})"
        return True, ""

    def forward(self, call: AttentionCall) -> torch.Tensor:
        # Imported here: torch.nn.attention.varlen is missing from older torch (see available()).
        from torch.nn.attention.varlen import varlen_attn

        plan = cached_plan(call)
        q, k, v = flatten(call, plan)
        params = _varlen_params()
        kwargs: dict[str, Any] = {}
        # The keyword set moved between torch releases (2.10: is_causal; 2.11: window_size,
        # GQA implicit; 2.12+: enable_gqa, scale).
        if "window_size" in params:
            kwargs["window_size"] = (-1, 0)
        else:
            kwargs["is_causal"] = True
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
        if "scale" in params:
            kwargs["scale"] = call.scale
        else:
            q = q * (call.scale * q.shape[-1] ** 0.5)  # the kernel applies 1/sqrt(D)
        out = varlen_attn(q, k, v, plan.cu_seq_q, plan.cu_seq_k, plan.max_q, plan.max_k, **kwargs)
        return unflatten(out, call)  # type: ignore[arg-type]  # a tuple only with return_aux


# ------------------------------------------------------------------------------- flash_attn
class FlashAttnEngine(Engine):
    name = "flash_attn"
    alternative = "varlen"
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        backward_devices=frozenset({"cuda"}),
        dtypes=HALF,
        max_head_dim=256,
        # flash-attn's own deterministic backward, asked for in forward() under torch's
        # deterministic mode.
        deterministic_backward=frozenset({"cuda"}),
    )
    auto = AutoRanks(full=30, mixed=20, masked=50)

    def cost(self, tiles: TileCounts) -> float:
        return varlen_cost(tiles)

    def available(self) -> tuple[bool, str]:
        try:
            # The function, not the package: flash-attn-4 installs ``flash_attn`` as a
            # namespace holding only ``flash_attn.cute`` (the fa4 engines), without FA2.
            from flash_attn import flash_attn_varlen_func  # noqa: F401
        except ImportError as err:
            return False, (
                f"FlashAttention-2 does not import ({err}); pip install flash-attn (a wheel "
                "matching your torch and CUDA, or a source build: docs/ARCHITECTURE.md)"
            )
        return True, ""

    def forward(self, call: AttentionCall) -> torch.Tensor:
        # Imported here: flash_attn is an optional package (see available()).
        from flash_attn import flash_attn_varlen_func

        plan = cached_plan(call)
        q, k, v = flatten(call, plan)
        # flash-attn >= 2.1 aligns the causal mask bottom-right, as the plan needs; GQA native.
        out = flash_attn_varlen_func(
            q,
            k,
            v,
            plan.cu_seq_q,
            plan.cu_seq_k,
            plan.max_q,
            plan.max_k,
            dropout_p=0.0,
            softmax_scale=call.scale,
            causal=True,
            deterministic=torch.are_deterministic_algorithms_enabled(),
        )
        return unflatten(out, call)
