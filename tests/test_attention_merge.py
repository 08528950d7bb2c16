"""The ``flex_merge`` anchor engine and the ``auto`` cost rule, on CPU.

The engine is checked against the float64 loop reference of test_attention_core (forward and
gradients in float32); the composition the CUDA path compiles (FlexAttention with its
log-sum-exp, then the merge) is run eagerly on CPU, forward only (FlexAttention has no CPU
backward).
"""

from __future__ import annotations

import random

import pytest
import torch
from test_attention_core import (
    CASES,
    FLEX_CASES,
    assert_matches_reference,
    make_case,
    random_row,
    reference_allowed,
)
from test_attention_core import reference_attention as reference

from anchorctx.attention import VARIANTS, attend, build_layout, engines
from anchorctx.attention.engines import cost, merge
from anchorctx.attention.engines.flex import build_block_mask

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# float32 against float64: softmax over at most 300 keys of O(1) scores, then sums over at most
# 3 rows × 300 positions for dk/dv; observed errors are below 5e-6, 1e-5 leaves 2× headroom and
# is still far below the size of any masking mistake (one key of ~100 changes outputs by ~1e-2).
TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.mark.parametrize("variant", ["anchor", "intra_doc"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-{c[1]}-H{c[2]}kv{c[3]}-B{c[4]}")
def test_flex_merge_forward_backward_matches_reference(variant, case):
    q, k, v, masks, layouts = make_case(23, *case, variant, grad=True)
    out = attend(q, k, v, layouts, engine="flex_merge", scale=0.3)
    ref = reference(q, k, v, masks, 0.3)
    assert_matches_reference(out, ref, q, k, v, **TOL)


def test_flex_merge_rows_with_different_variants_and_a_shared_layout():
    rng = random.Random(9)
    rows = [(*random_row(rng, 140, "chunked"), variant) for variant in VARIANTS]
    layouts = [build_layout(lens, variant, docs) for lens, docs, variant in rows]
    masks = torch.stack([reference_allowed(*row) for row in rows])
    q, k, v = (torch.randn(4, 4, 140, 8, requires_grad=True) for _ in range(3))
    out = attend(q, k, v, layouts, engine="flex_merge")
    torch.testing.assert_close(out, reference(q, k, v, masks).float(), **TOL)
    out.sum().backward()  # the whole batch trains through one merge
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))

    q, k, v, masks, layout = make_case(4, 150, "chunked", 4, 2, 3, "anchor", shared=True)
    out = attend(q, k, v, layout, engine="flex_merge")
    torch.testing.assert_close(out, reference(q, k, v, masks).float(), **TOL)


@pytest.mark.parametrize(
    "case", FLEX_CASES, ids=lambda c: f"T{c[0]}-{c[1]}-H{c[2]}kv{c[3]}-B{c[4]}"
)
def test_compiled_composition_forward_on_cpu(case):
    """FlexAttention's returned log-sum-exp (natural log) merged with the anchor: the function
    the CUDA path compiles, run eagerly."""
    q, k, v, masks, layouts = make_case(29, *case, "anchor")
    rows = merge.intra_rows(tuple(layouts))
    block_mask = build_block_mask(rows, q.device)
    foreign = torch.stack([row.doc_ids != row.seg_doc[0] for row in layouts])
    with torch.no_grad():
        out = merge._anchor_flex(q, k, v, block_mask, foreign, 0.25, q.shape[1] != k.shape[1])
    torch.testing.assert_close(out, reference(q, k, v, masks, 0.25).float(), **TOL)


def test_intra_rows_swap_only_anchor_rows_with_their_own_cache():
    anchor = build_layout([5, 3], "anchor")
    anchor.mask()  # cached on the anchor row: must not leak into the intra_doc copy
    full = build_layout([8], "full")
    swapped = merge.intra_rows((anchor, anchor, full))
    assert swapped[0] is swapped[1]  # a shared layout stays one object (one broadcast mask)
    assert swapped[0].variant == "intra_doc" and swapped[2] is full
    assert not swapped[0].mask()[7, 0] and anchor.mask()[7, 0]


# ------------------------------------------------------------------------------ cost rule
def test_visited_tiles_counts_document_tiles():
    assert cost.visited_tiles(build_layout([256], "anchor")) == 3  # 2 tiles: 2·3/2
    # 100 + 200 tokens: doc 0 in tile 0, doc 1 in tiles 0..2 (3·4/2); tile 0 counted per doc
    assert cost.visited_tiles(build_layout([100, 200], "intra_doc")) == 1 + 6
    # interleaved chunks of one document count once, over the tiles they touch
    assert cost.visited_tiles(build_layout([128, 128, 128], "anchor", seg_doc=[0, 1, 0])) == 3 + 1


def _rows(lens: list[int], variant: str = "anchor"):
    return [build_layout(lens, variant)]


def test_cost_rule_ranks_engines_per_document_histogram():
    fixed = _rows([2048] * 64)  # 128K of 2K documents
    books = _rows([300] * 40 + [96 * 1024] + [400] * 40)
    # FlashAttention-4 first, then the in-kernel anchor, then the merge. Behind them the
    # histogram decides: on short documents varlen beats the anchor-mask flex kernel (its
    # serial backward chain), on long ones the chain is hidden and flex beats varlen.
    assert engines.ranked(fixed) == ["fa4", "triton", "flex_merge", "varlen", "flash_attn", "flex"]
    assert engines.ranked(books) == ["fa4", "triton", "flex_merge", "flex", "varlen", "flash_attn"]
    # On intra_doc rows triton and flex_merge cost what flex does: the tie keeps flex first
    # among them (fa4 costs less).
    assert engines.ranked(_rows([2048] * 64, "intra_doc"))[:2] == ["fa4", "flex"]
    # The serial chain: anchor flex on short documents costs a multiple of intra_doc flex.
    ratio = engines.estimate("flex", fixed) / engines.estimate(
        "flex", _rows([2048] * 64, "intra_doc")
    )
    assert 1.6 < ratio < 1.9
    with pytest.raises(ValueError, match="no cost model for engine 'sdpa'"):
        engines.estimate("sdpa", fixed)
