"""The ``flex_copy`` engine (anchor copies in an augmented key sequence), on CPU and GPU.

CPU: the engine's dense path against the float64 loop reference of test_attention_core
(forward and gradients of q, k, v in float32); the block mask's tiles against the dense mask of
the same plan at two tile sizes (exact at tile level); FlexAttention's CPU forward with that
block mask. GPU (``pytest -m gpu``): bf16 against a float32 dense reference, as
test_attention_gpu does for the other engines.
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

from anchorctx.attention import VARIANTS, attend, build_layout
from anchorctx.attention.engines import copy

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# float32 against float64, as test_attention_merge: softmax over at most 300 keys of O(1)
# scores, dk/dv summed over at most 3 rows × 300 positions (and dk0/dv0 over the copies);
# observed errors are below 4e-6, and one wrongly masked key of ~100 moves outputs by ~1e-2.
TOL = {"atol": 1e-5, "rtol": 1e-5}
IDS = lambda c: f"T{c[0]}-{c[1]}-H{c[2]}kv{c[3]}-B{c[4]}"  # noqa: E731


@pytest.mark.parametrize("variant", ["anchor", "intra_doc", "full"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_and_gradients_match_reference(variant, case):
    q, k, v, masks, layouts = make_case(23, *case, variant, grad=True)
    out = attend(q, k, v, layouts, engine="flex_copy", scale=0.3)
    ref = reference(q, k, v, masks, 0.3)
    assert_matches_reference(out, ref, q, k, v, **TOL)


def test_mixed_variants_and_shared_layout():
    rng = random.Random(9)
    rows = [(*random_row(rng, 140, "chunked"), variant) for variant in VARIANTS]
    layouts = [build_layout(lens, variant, docs) for lens, docs, variant in rows]
    masks = torch.stack([reference_allowed(*row) for row in rows])
    q, k, v = (torch.randn(4, 4, 140, 8, requires_grad=True) for _ in range(3))
    out = attend(q, k, v, layouts, engine="flex_copy")
    torch.testing.assert_close(out, reference(q, k, v, masks).float(), **TOL)

    q, k, v, masks, layout = make_case(
        4, 150, "many_docs", 4, 2, 3, "anchor", grad=True, shared=True
    )
    out = attend(q, k, v, layout, engine="flex_copy")
    ref = reference(q, k, v, masks)
    assert_matches_reference(out, ref, q, k, v, **TOL)


def test_plan_places_one_copy_before_each_foreign_document():
    # Documents 0 (anchor's, two chunks), 1 and 2: copies before the first tokens of 1 and 2
    # only; the anchor document's second chunk sees key 0 already.
    layout = build_layout([3, 2, 2, 1], "anchor", seg_doc=[0, 1, 0, 2])
    plan = copy.CopyPlan((layout,), torch.device("cpu"), block=4)
    assert plan.copies == 2 and plan.kv_len == 8 + 16  # T rounded to tiles + four copy tiles
    assert plan.gather[0].tolist()[:10] == [0, 1, 2, 0, 3, 4, 5, 6, 0, 7]
    assert plan.pos_kv[0].tolist()[:10] == [0, 1, 2, 0, 3, 4, 5, 6, 0, 7]
    assert plan.token_slot[0].tolist() == [0, 1, 2, 4, 5, 6, 7, 9]
    assert plan.extra[0].tolist() == [3, 8, *range(10, 24)]  # two copies, then padding
    assert copy._bucket(0, 128) == 0 and copy._bucket(1, 128) == 512
    assert copy._bucket(512, 128) == 512 and copy._bucket(513, 128) == 1024


@pytest.mark.parametrize("block", [16, 128])
@pytest.mark.parametrize("case", FLEX_CASES, ids=IDS)
def test_tiles_are_exact_and_flex_forward_matches(case, block):
    q, k, v, masks, layouts = make_case(29, *case, "anchor")
    plan = copy.CopyPlan(tuple(layouts), q.device, block=block)
    dense = plan.dense_mask()[:, 0]
    for i in range(dense.shape[0]):
        partial, full = copy.tile_classes(plan, i)
        nq, nk = partial.shape
        padded = torch.zeros(nq * block, nk * block, dtype=torch.bool)
        padded[: plan.seq_len] = dense[i]
        tiles = padded.view(nq, block, nk, block)
        # Visited = holds an allowed pair (no tile missing, none wasted); full = all allowed.
        assert torch.equal(partial | full, tiles.any(3).any(1))
        assert torch.equal(full, tiles.all(3).all(1))
    if block != 128:
        return
    from torch.nn.attention.flex_attention import flex_attention

    k_aug, v_aug = copy.augment(k, v, plan)
    gqa = q.shape[1] != k.shape[1]
    with torch.no_grad():
        out = flex_attention(
            q, k_aug, v_aug, block_mask=plan.block_mask(), scale=0.25, enable_gqa=gqa
        )
    torch.testing.assert_close(out, reference(q, k, v, masks, 0.25).float(), **TOL)


# ------------------------------------------------------------------------------------ GPU
T_GPU = 3000  # not a multiple of 128, as test_attention_gpu


def _gpu_layout(seed: int, chunked: bool):
    rng = random.Random(seed)
    lens = []
    while sum(lens) < T_GPU:
        lens.append(min(T_GPU - sum(lens), max(1, int(rng.lognormvariate(5.5, 1.4)))))
    docs = [rng.randrange(max(1, len(lens) // 2)) for _ in lens] if chunked else None
    return build_layout(lens, "anchor", seg_doc=docs, device="cuda")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.gpu
@pytest.mark.parametrize("chunked", [False, True], ids=["docs", "chunks"])
def test_gpu_bf16_matches_fp32_reference(chunked):
    layouts = [_gpu_layout(s, chunked) for s in (1, 2)]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(2, h, T_GPU, 128, device="cuda", generator=g).bfloat16().float()
        for h in (8, 2, 2)
    )
    grad = torch.randn_like(q).bfloat16().float()
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = attend(*ref_in, layouts, engine="sdpa")
    ref_grads = torch.autograd.grad(ref, ref_in, grad)
    x = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    out = attend(*x, layouts, engine="flex_copy")
    grads = torch.autograd.grad(out, x, grad.bfloat16())
    # bf16 kernels against fp32: the other engines' bound (test_attention_gpu); a masking
    # mistake or a lost copy gradient is O(1e-1).
    assert _rel(out, ref) <= 1e-2, f"forward rel err {_rel(out, ref):.2e}"
    for name, a, b in zip("qkv", grads, ref_grads):
        assert _rel(a, b) <= 1e-2, f"d{name} rel err {_rel(a, b):.2e}"
