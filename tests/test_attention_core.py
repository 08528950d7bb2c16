"""Layouts, masks and every CPU engine against an independent reference written here.

The reference decides each (query, key) pair with the docs/ARCHITECTURE.md table by plain Python loops
over segments (it never touches ``Layout``), and computes attention in float64.
"""

from __future__ import annotations

import functools
import itertools
import math
import random

import pytest
import torch

from anchorctx.attention import (
    VARIANTS,
    AttentionError,
    LayoutBatch,
    LayoutError,
    attend,
    build_layout,
)
from anchorctx.attention.engines import AttentionCall, get_engine
from anchorctx.attention.engines.flex import build_block_mask
from anchorctx.attention.engines.varlen import build_plan, flatten, gather_keys, unflatten

# The reference runs flex eagerly on CPU (no compile): torch warns once per process that the
# unfused path materialises the scores, which is what these small cases want. A mark, not a
# module-level filter: pytest resets the filters around every test.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


# ------------------------------------------------------------------------------- reference
@functools.cache
def _reference_allowed(seg_lens: tuple, seg_doc: tuple | None, variant: str) -> torch.Tensor:
    seg_doc = seg_doc if seg_doc is not None else tuple(range(len(seg_lens)))
    doc = [d for n, d in zip(seg_lens, seg_doc) for _ in range(n)]
    t = len(doc)
    rows = []
    for q in range(t):
        row = []
        for kv in range(t):
            if kv > q:
                ok = False
            elif variant == "full":
                ok = True
            elif variant in ("intra_doc", "intra_doc_reset"):
                ok = doc[kv] == doc[q]
            else:  # anchor
                ok = doc[kv] == doc[q] or kv == 0
            row.append(ok)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool)


def reference_allowed(seg_lens, seg_doc, variant) -> torch.Tensor:
    """Bool [T, T] from the docs/ARCHITECTURE.md table, by loops over (query, key) pairs."""
    docs = tuple(seg_doc) if seg_doc is not None else None
    return _reference_allowed(tuple(seg_lens), docs, variant).clone()


def reference_positions(seg_lens, variant) -> list[int]:
    if variant != "intra_doc_reset":
        return list(range(sum(seg_lens)))
    return [i for n in seg_lens for i in range(n)]


def reference_attention(q, k, v, masks, scale=None) -> torch.Tensor:
    """float64 softmax attention; masks [B, T, T]; k/v heads repeated for GQA."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scale = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~masks[:, None], float("-inf"))
    return scores.softmax(-1) @ v


# -------------------------------------------------------------------------- random layouts
def random_row(rng: random.Random, t: int, kind: str) -> tuple[list[int], list[int] | None]:
    """(seg_lens, seg_doc) of one packed row of ``t`` tokens."""
    if kind == "one_doc":
        return [t], None
    if kind == "tiny_docs":  # many length-1 and length-2 documents
        lens = []
        while sum(lens) < t:
            lens.append(min(rng.choice([1, 1, 2, 3]), t - sum(lens)))
        return lens, None
    cuts = sorted(rng.sample(range(1, t), rng.randint(1, min(12, t - 1))))
    lens = [b - a for a, b in zip([0, *cuts], [*cuts, t])]
    if kind == "chunked":  # interleaved chunks: a few documents, chunks in random order
        docs = [rng.randrange(max(2, len(lens) // 2)) for _ in lens]
        return lens, docs
    return lens, None


KINDS = ("many_docs", "one_doc", "tiny_docs", "chunked")
CASES = [  # (T, kind, H, H_kv, B)
    (64, "many_docs", 4, 4, 1),
    (300, "many_docs", 4, 2, 2),
    (257, "chunked", 4, 1, 2),
    (130, "tiny_docs", 2, 1, 1),
    (200, "one_doc", 4, 2, 1),
    (129, "chunked", 4, 4, 3),
]
# The CPU flex kernel is slow (unfused, vmapped mask_mod); its tiles are tested separately.
FLEX_CASES = [CASES[0], CASES[2], CASES[3]]


def make_case(seed, t, kind, h, h_kv, b, variant, *, grad=False, shared=False):
    rng = random.Random(seed)
    rows = (
        [random_row(rng, t, kind)] * b if shared else [random_row(rng, t, kind) for _ in range(b)]
    )
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, 16, generator=g, requires_grad=grad)
    k = torch.randn(b, h_kv, t, 16, generator=g, requires_grad=grad)
    v = torch.randn(b, h_kv, t, 16, generator=g, requires_grad=grad)
    masks = torch.stack([reference_allowed(lens, docs, variant) for lens, docs in rows])
    layouts = [build_layout(lens, variant, docs) for lens, docs in rows]
    return q, k, v, masks, (layouts[0] if shared else layouts)


# --------------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", KINDS)
def test_layout_matches_table(variant, kind):
    rng = random.Random(hash((variant, kind)) % 1000)
    for t in (1, 2, 37, 150):
        if t < 3 and kind != "one_doc":
            continue
        lens, docs = random_row(rng, t, kind)
        layout = build_layout(lens, variant, docs)
        assert layout.seq_len == t and layout.seg_lens == tuple(lens)
        assert layout.position_ids.dtype == torch.long and layout.doc_ids.dtype == torch.int32
        assert layout.position_ids.tolist() == reference_positions(lens, variant)
        allowed = reference_allowed(lens, docs, variant)
        assert torch.equal(layout.mask(), allowed)
        assert layout.attended_pairs == int(allowed.sum())
        assert layout.cu_seqlens.tolist() == [0, *torch.tensor(lens).cumsum(0).tolist()]


@pytest.mark.parametrize("variant", VARIANTS)
def test_row_pairs_count_many_rows_at_once_as_the_reference_mask(variant):
    """Rows given flat, each cut to its first tokens mid-segment and padded to a multiple by a
    segment of its own: every row's pairs and documents equal its reference mask's."""
    from anchorctx.attention.pairs import row_pairs

    rng = random.Random(hash(variant) % 1000)
    for multiple in (1, 3):
        rows, cuts = [], []
        for _ in range(25):
            n = rng.randint(1, 6)
            lens = [rng.randint(1, 40) for _ in range(n)]
            # Interleaved chunks of one document share an id (ids repeat).
            rows.append((lens, [rng.randint(0, max(0, n - 2)) for _ in range(n)]))
            cuts.append(rng.randint(1, sum(lens)))
        flat = [[x for row in rows for x in row[i]] for i in (0, 1)]
        got = row_pairs(*flat, [len(lens) for lens, _ in rows], cuts, multiple)
        for i, ((lens, docs), cut) in enumerate(zip(rows, cuts)):
            t = -(-cut // multiple) * multiple
            doc_ids = [d for n, d in zip(lens, docs) for _ in range(n)][:cut] + [99] * (t - cut)
            seg_lens = [sum(1 for _ in group) for _, group in itertools.groupby(doc_ids)]
            seg_doc = [d for d, _ in itertools.groupby(doc_ids)]
            allowed = reference_allowed(seg_lens, seg_doc, variant)
            assert got.of(variant)[i] == int(allowed.sum()), (multiple, i)
            assert got.tokens[i] == t and got.documents[i] == len(set(doc_ids))
    with pytest.raises(LayoutError, match="do not describe rows"):
        row_pairs([3, 2], [0, 1], [1])


def test_layout_examples():
    layout = build_layout([3, 2, 2], "intra_doc_reset", seg_doc=[0, 1, 0])
    assert layout.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 1]
    assert layout.doc_ids.tolist() == [0, 0, 0, 1, 1, 0, 0]
    anchor = build_layout([3, 2], "anchor")
    assert anchor.mask()[3:, 0].all() and not anchor.mask()[3:, 1:3].any()
    assert anchor.attention_flops(2, 8) == 4 * 8 * 2 * (6 + 3 + 2)
    assert anchor.attention_flops(2, 8, backward=True) == 3.5 * anchor.attention_flops(2, 8)
    assert build_layout(torch.tensor([4, 4]), "full").position_ids.tolist() == list(range(8))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([], "anchor"), "empty"),
        (([3, 0, 2], "anchor"), r"seg_lens\[1\] = 0"),
        (([3, -1], "anchor"), r"seg_lens\[1\] = -1"),
        (([3, 2], "anchr"), "valid: full, intra_doc, intra_doc_reset, anchor"),
        (([3, 2], "anchor", [0]), "seg_doc has 1 entries but seg_lens has 2"),
        (([3, 2.5], "anchor"), "not an integer"),
        ((5, "anchor"), "sequence of integers"),
    ],
)
def test_bad_layouts(args, match):
    with pytest.raises(LayoutError, match=match):
        build_layout(*args)


def test_layout_batch_validation():
    with pytest.raises(LayoutError, match="differ in length"):
        LayoutBatch([build_layout([4], "anchor"), build_layout([5], "anchor")])
    with pytest.raises(LayoutError, match="expected an anchorctx Layout"):
        LayoutBatch([[4]])


# ---------------------------------------------------------------------------------- engines


def assert_matches_reference(out, ref, q, k, v, **tol) -> None:
    """``out`` equals the float64 reference ``ref`` within ``tol``, and so do the gradients of
    q, k and v for one random output gradient."""
    torch.testing.assert_close(out, ref.float(), **tol)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    want = torch.autograd.grad(ref, (q, k, v), grad_out.double())
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b.float(), **tol, msg=f"d{name}")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-{c[1]}-H{c[2]}kv{c[3]}-B{c[4]}")
def test_sdpa_forward_backward_matches_reference(variant, case):
    q, k, v, masks, layouts = make_case(7, *case, variant, grad=True)
    out = attend(q, k, v, layouts, engine="sdpa")
    ref = reference_attention(q, k, v, masks)
    assert_matches_reference(out, ref, q, k, v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "case", FLEX_CASES, ids=lambda c: f"T{c[0]}-{c[1]}-H{c[2]}kv{c[3]}-B{c[4]}"
)
def test_flex_forward_matches_reference(variant, case):
    q, k, v, masks, layouts = make_case(11, *case, variant)
    with torch.no_grad():
        out = attend(q, k, v, layouts, engine="flex", scale=0.2)
    torch.testing.assert_close(
        out, reference_attention(q, k, v, masks, 0.2).float(), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("engine", ["sdpa", "flex", "auto"])
def test_shared_layout_broadcasts_over_rows(engine):
    q, k, v, masks, layout = make_case(3, 150, "chunked", 4, 2, 3, "anchor", shared=True)
    with torch.no_grad():
        out = attend(q, k, v, layout, engine=engine)
        again = attend(q, k, v, layout, engine=engine)  # cached masks give the same result
    torch.testing.assert_close(
        out, reference_attention(q, k, v, masks).float(), atol=1e-5, rtol=1e-5
    )
    assert torch.equal(out, again)


@pytest.mark.parametrize("engine", ["sdpa", "flex"])
def test_rows_with_different_variants(engine):
    rng = random.Random(5)
    rows = [(*random_row(rng, 140, "chunked"), variant) for variant in VARIANTS]
    layouts = [build_layout(lens, variant, docs) for lens, docs, variant in rows]
    masks = torch.stack([reference_allowed(*row) for row in rows])
    q, k, v = (torch.randn(4, 2, 140, 8) for _ in range(3))
    with torch.no_grad():
        out = attend(q, k, v, layouts, engine=engine)
    torch.testing.assert_close(
        out, reference_attention(q, k, v, masks).float(), atol=1e-5, rtol=1e-5
    )


# ------------------------------------------------------- GPU kernels' plans, checked on CPU
def _tiles_to_tokens(tiles: torch.Tensor, block: int, t: int) -> torch.Tensor:
    return tiles.repeat_interleave(block, 0).repeat_interleave(block, 1)[:t, :t]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", KINDS)
def test_flex_block_mask_structure(variant, kind):
    """What the fused GPU kernel computes: visited tiles (mask_mod inside partial tiles, every
    pair inside full tiles, nothing elsewhere) must reproduce the dense mask exactly, and no
    tile without an allowed pair may be visited. (The CPU kernel ignores tiles, so this is
    the test of the tile construction.)"""
    rng = random.Random(hash((variant, kind)) % 997)
    for t, block in ((200, 16), (97, 8), (64, 16), (300, 128)):
        lens, docs = random_row(rng, t, kind)
        layout = build_layout(lens, variant, docs)
        bm = build_block_mask((layout,) * 2, torch.device("cpu"), block=block, shared=True)
        assert bm.kv_num_blocks.shape[0] == 1  # tiles broadcast over the batch
        n = -(-t // block)
        partial = torch.zeros(n, n, dtype=torch.bool)
        full = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            partial[i, bm.kv_indices[0, 0, i, : bm.kv_num_blocks[0, 0, i]].long()] = True
            full[i, bm.full_kv_indices[0, 0, i, : bm.full_kv_num_blocks[0, 0, i]].long()] = True
        assert not (partial & full).any()
        qi, ki = torch.meshgrid(torch.arange(t), torch.arange(t), indexing="ij")
        by_mod = bm.mask_mod(torch.tensor(0), torch.tensor(0), qi, ki)
        computed = (_tiles_to_tokens(partial, block, t) & by_mod) | _tiles_to_tokens(full, block, t)
        allowed = reference_allowed(lens, docs, variant)
        assert torch.equal(computed, allowed)
        any_allowed = torch.nn.functional.max_pool2d(
            torch.nn.functional.pad(allowed.float(), (0, n * block - t, 0, n * block - t))[None],
            block,
        )[0].bool()
        assert torch.equal(partial | full, any_allowed)  # no wasted tiles


def _emulate_varlen(q, k, v, cu_q, cu_k, scale):
    """Causal varlen attention, bottom-right aligned (FlashAttention's convention)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    groups = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qs = q[cu_q[i] : cu_q[i + 1]].double().transpose(0, 1)  # [H, Lq, D]
        ks = k[cu_k[i] : cu_k[i + 1]].double().transpose(0, 1).repeat_interleave(groups, 0)
        vs = v[cu_k[i] : cu_k[i + 1]].double().transpose(0, 1).repeat_interleave(groups, 0)
        lq, lk = qs.shape[1], ks.shape[1]
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        s = (qs @ ks.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))
        out[cu_q[i] : cu_q[i + 1]] = (s.softmax(-1) @ vs).transpose(0, 1)
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-{c[1]}-H{c[2]}kv{c[3]}-B{c[4]}")
def test_varlen_plan_reproduces_mask(variant, case):
    """The varlen/flash_attn construction (anchor K/V prepended per document, earlier chunks
    gathered) run through an emulated bottom-right causal varlen kernel equals the reference."""
    q, k, v, masks, layouts = make_case(13, *case, variant)
    batch = LayoutBatch(layouts)
    call = AttentionCall(q=q, k=k, v=v, batch=batch, cache=batch.cache, scale=0.25)
    plan = build_plan(batch.rows, q.device)
    fq, fk, fv = flatten(call, plan)
    cu_q, cu_k = plan.cu_seq_q.tolist(), plan.cu_seq_k.tolist()
    assert plan.max_q == max(b - a for a, b in itertools.pairwise(cu_q))
    assert plan.max_k == max(b - a for a, b in itertools.pairwise(cu_k))
    out = unflatten(_emulate_varlen(fq, fk, fv, cu_q, cu_k, 0.25), call)
    torch.testing.assert_close(
        out, reference_attention(q, k, v, masks, 0.25), atol=1e-10, rtol=1e-10
    )
    if variant != "anchor" and case[1] != "chunked":
        assert plan.kv_index is None  # plain per-document varlen: no gather


def test_varlen_anchor_adds_one_key_per_foreign_document():
    layout = build_layout([4, 3, 2, 5], "anchor", seg_doc=[0, 1, 0, 2])
    plan = build_plan((layout,), torch.device("cpu"))
    assert plan.cu_seq_q.tolist() == [0, 4, 7, 9, 14]
    assert plan.cu_seq_k.tolist() == [0, 4, 8, 14, 20]
    assert plan.kv_index.tolist() == [
        0,
        1,
        2,
        3,
        0,
        4,
        5,
        6,
        0,
        1,
        2,
        3,
        7,
        8,
        0,
        9,
        10,
        11,
        12,
        13,
    ]
    gather = plan.kv_gather
    # first appearances are the tokens' own runs here; the repeats: the anchor before docs 1, 0
    # (second chunk) and 2, and doc 0's first chunk (tokens 1-3) before its second chunk
    assert gather.first.tolist() == [0, 1, 2, 3, 5, 6, 7, 12, 13, 15, 16, 17, 18, 19]
    assert gather.extra_src.tolist() == [4, 8, 9, 10, 11, 14]
    assert gather.extra_dst.tolist() == [0, 0, 1, 2, 3, 0]


def test_key_gather_backward_equals_index_selects():
    """The gather's hand-written backward (first appearances gathered, repeats added) gives
    autograd's own gradient of ``index_select`` exactly, on chunked anchor rows."""
    layouts = [
        build_layout([4, 3, 2, 5], "anchor", seg_doc=[0, 1, 0, 2]),
        build_layout([6, 8], "anchor"),
    ]
    plan = build_plan(tuple(layouts), torch.device("cpu"))
    x = torch.randn(28, 2, 4, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(len(plan.kv_index), 2, 4, dtype=torch.float64)
    (want,) = torch.autograd.grad(x.index_select(0, plan.kv_index), x, grad)
    (got,) = torch.autograd.grad(gather_keys(x, plan.kv_gather), x, grad)
    assert torch.equal(gather_keys(x, plan.kv_gather), x.index_select(0, plan.kv_index))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)  # sums of <= 4 terms, reordered


# ----------------------------------------------------------------------------------- errors
def test_engine_errors_name_the_alternative():
    layout = build_layout([10, 6], "anchor")
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    k, v = torch.randn(1, 1, 16, 8), torch.randn(1, 1, 16, 8)
    with pytest.raises(AttentionError, match="no backward on cpu; use engine='sdpa'"):
        attend(q, k, v, layout, engine="flex")
    with pytest.raises(AttentionError, match=r"'varlen' does not run on cpu.*engine='flex'"):
        attend(q, k, v, layout, engine="varlen")
    with pytest.raises(AttentionError, match="valid: auto, sdpa, flex, varlen, flash_attn"):
        attend(q, k, v, layout, engine="flash")
    with pytest.raises(AttentionError, match="layout describes 16 tokens but q has T=8"):
        attend(q[:, :, :8], k[:, :, :8], v[:, :, :8], layout)
    with pytest.raises(AttentionError, match="multiple of key/value heads"):
        attend(q, torch.randn(1, 3, 16, 8), torch.randn(1, 3, 16, 8), layout)
    with pytest.raises(AttentionError, match="KV cache"):
        attend(q, k[:, :, :4], v[:, :, :4], layout)
    with pytest.raises(AttentionError, match="got 2 row layouts for a batch of B=1"):
        attend(q, k, v, [layout, layout])
    assert get_engine("sdpa").name == "sdpa"


def test_auto_on_cpu_is_the_exact_engine():
    q, k, v, masks, layouts = make_case(17, 100, "chunked", 4, 2, 2, "anchor", grad=True)
    out = attend(q, k, v, layouts)  # auto: sdpa on CPU, trains
    out.sum().backward()
    torch.testing.assert_close(
        out, reference_attention(q, k, v, masks).float(), atol=1e-5, rtol=1e-5
    )


def test_masks_are_built_once_per_batch():
    """Every layer of a forward reuses one mask: through a LayoutBatch, a shared Layout, or the
    same list of row layouts."""
    from anchorctx.attention import api

    rows = [build_layout([6, 4], "anchor"), build_layout([10], "intra_doc")]
    assert api._as_batch(rows, 2)[0] is api._as_batch(list(rows), 2)[0]
    batch = LayoutBatch(rows)
    q, k, v = (torch.randn(2, 2, 10, 4) for _ in range(3))
    attend(q, k, v, batch, engine="sdpa")
    mask = batch.cache[("sdpa_mask", "cpu")]
    attend(q, k, v, batch, engine="sdpa")
    assert batch.cache[("sdpa_mask", "cpu")] is mask
    assert rows[0].num_documents == 2 and batch.seq_len == 10
