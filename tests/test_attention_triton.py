"""The ``triton`` engine's kernels on CPU, in Triton's interpreter (exact float32 numpy math).

Forward and gradients against the float64 loop reference of test_attention_core on every
variant and layout kind, with tiles small enough (16-32 tokens) that rows of 64-150 tokens
cross many tile and document boundaries; the tile lists against a brute-force reading of the
dense mask. Skipped where Triton is not installed (it comes with CUDA builds of PyTorch; the
CPU lock installs it for these tests).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from test_attention_core import make_case, random_row, reference_allowed
from test_attention_core import reference_attention as reference

from anchorctx.attention import VARIANTS, build_layout

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

from anchorctx.attention.engines import triton_doc
from anchorctx.attention.engines.triton_doc import Blocks, build_plan, tile_classes

# Small tiles so short rows have many of them; rectangular in both kernels' orientations.
SMALL = Blocks(m=32, n=16, dq_m=16, dq_n=32, m_kv=16, n_kv=32)
SMALL_SPLIT = Blocks(m=16, n=16, dq_m=32, dq_n=16, m_kv=32, n_kv=16, split_backward=True)
# float32 against float64: as in test_attention_merge (softmax over <= 300 keys of O(1) scores,
# gradients summed over <= 3 rows x 300 positions; observed errors below 5e-6). One wrong key
# in ~100 moves outputs by ~1e-2.
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _run(q, k, v, layouts, scale=None, shared=False, blocks=SMALL):
    rows = (layouts,) * q.shape[0] if shared else tuple(layouts)
    plan = build_plan(rows, q.device, shared=shared, blocks=blocks)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    return triton_doc.document_attention(q, k, v, plan, scale)


def _check(out, ref, q, k, v):
    torch.testing.assert_close(out, ref.float(), **TOL)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    want = torch.autograd.grad(ref, (q, k, v), grad_out.double())
    for name, g, w in zip("qkv", got, want):
        torch.testing.assert_close(g, w.float(), **TOL, msg=lambda m, n=name: f"d{n}: {m}")


# test_attention_core's layout kinds, each once, at sizes the interpreter runs quickly: several
# tiles per row (a partial last one included), GQA and batches of unlike rows.
CASES = [  # (T, kind, H, H_kv, B)
    (64, "many_docs", 2, 2, 1),
    (150, "many_docs", 2, 1, 2),
    (130, "chunked", 2, 1, 2),
    (130, "tiny_docs", 2, 1, 1),
    (100, "one_doc", 2, 1, 1),
]
# intra_doc_reset has intra_doc's mask (only position ids differ, which the kernel never sees);
# every variant runs together in the mixed-batch test below. ``full`` rows are one document:
# two cases are enough.
PAIRS = [(v, c) for v in ("anchor", "intra_doc") for c in CASES] + [
    ("full", CASES[0]),
    ("full", CASES[3]),
]


@pytest.mark.parametrize(
    ("variant", "case"),
    PAIRS,
    ids=lambda x: x if isinstance(x, str) else "T{}-{}-H{}kv{}-B{}".format(*x),
)
def test_forward_backward_match_reference(variant, case):
    q, k, v, masks, layouts = make_case(31, *case, variant, grad=True)
    out = _run(q, k, v, layouts, scale=0.3)
    _check(out, reference(q, k, v, masks, 0.3), q, k, v)


@pytest.mark.parametrize("variant", ["anchor", "intra_doc"])
def test_backward_in_two_launches_matches_reference(variant):
    """``split_backward`` (dK/dV and dQ as separate launches, other tile shapes) is the same
    computation."""
    q, k, v, masks, layouts = make_case(17, 150, "many_docs", 2, 1, 2, variant, grad=True)
    out = _run(q, k, v, layouts, blocks=SMALL_SPLIT)
    _check(out, reference(q, k, v, masks), q, k, v)


def test_tile_settings_follow_the_document_histogram():
    """Rows of tiny documents take the small tiles, rows of 2K documents and longer the large."""
    tiny = build_layout([300] * 436 + [1072], "anchor")
    fixed = build_layout([2048] * 64, "anchor")
    books = build_layout([300] * 40 + [96 * 1024] + [400] * 40, "anchor")
    assert triton_doc.blocks_for((tiny,)) == triton_doc.SHORT_BLOCKS
    assert triton_doc.blocks_for((fixed,)) == triton_doc.LONG_BLOCKS
    assert triton_doc.blocks_for((books,)) == triton_doc.LONG_BLOCKS
    # The engine decides once per batch and reuses the plan for every layer.
    from anchorctx.attention.api import _as_batch
    from anchorctx.attention.engines import AttentionCall

    batch, cache = _as_batch(tiny, 1)
    q = torch.zeros(1, 2, tiny.seq_len, 16)
    call = AttentionCall(q=q, k=q, v=q, batch=batch, cache=cache, scale=0.25)
    plan = triton_doc.TritonEngine.plan(call)
    assert plan.blocks == triton_doc.SHORT_BLOCKS
    assert triton_doc.TritonEngine.plan(call) is plan


def test_rows_with_different_variants_and_a_shared_layout():
    rng = random.Random(12)
    rows = [(*random_row(rng, 100, "chunked"), variant) for variant in VARIANTS]
    layouts = [build_layout(lens, variant, docs) for lens, docs, variant in rows]
    masks = torch.stack([reference_allowed(*row) for row in rows])
    q, k, v = (torch.randn(4, 2, 100, 16, requires_grad=True) for _ in range(3))
    _check(_run(q, k, v, layouts), reference(q, k, v, masks), q, k, v)

    q, k, v, masks, layout = make_case(8, 120, "chunked", 2, 1, 2, "anchor", grad=True, shared=True)
    _check(_run(q, k, v, layout, shared=True), reference(q, k, v, masks), q, k, v)


def test_token_major_inputs_keep_their_layout():
    """q/k/v as Hugging Face passes them ([B, T, H, D] memory, transposed views): the output has
    q's strides, so transposing it back is free, and the values are the same."""
    q, k, v, masks, layouts = make_case(5, 100, "many_docs", 4, 2, 1, "anchor")
    views = [x.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for x in (q, k, v)]
    out = _run(*views, layouts)
    assert out.stride() == views[0].stride()
    _check(out, reference(*views, masks), *views)


@pytest.mark.parametrize("blocks", [(32, 16), (16, 32), (16, 16)])
@pytest.mark.parametrize("variant", ["intra_doc", "full"])
def test_tile_lists_match_the_dense_mask(blocks, variant):
    """Visited = some allowed pair in the tile; full = every pair allowed and no padding."""
    bm, bn = blocks
    rng = random.Random(3)
    for kind in ("many_docs", "chunked", "tiny_docs", "one_doc"):
        lens, docs = random_row(rng, 150, kind)
        layout = build_layout(lens, variant, docs)
        allowed = reference_allowed(lens, docs, variant)
        t = allowed.shape[0]
        partial, full = tile_classes(triton_doc.row_docs(layout, torch.device("cpu")), bm, bn)
        for i in range(partial.shape[0]):
            for j in range(partial.shape[1]):
                tile = allowed[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
                padded = (i + 1) * bm > t or (j + 1) * bn > t
                assert bool(full[i, j]) == bool(tile.all() and not padded), (kind, i, j)
                assert bool(partial[i, j] | full[i, j]) == bool(tile.any()), (kind, i, j)


def test_anchor_rows_visit_intra_document_tiles_only():
    """The anchor costs no tile: an anchor row's lists are its intra_doc row's lists."""
    lens, docs = random_row(random.Random(1), 300, "many_docs")
    plans = [
        build_plan((build_layout(lens, v, docs),), torch.device("cpu"), shared=False, blocks=SMALL)
        for v in ("anchor", "intra_doc")
    ]
    for name in ("forward", "dkdv"):
        a, b = getattr(plans[0], name), getattr(plans[1], name)
        for field in ("full_count", "full_index", "part_count", "part_index"):
            assert torch.equal(getattr(a, field), getattr(b, field)), (name, field)
    assert plans[0].has_anchor and not plans[1].has_anchor


def test_tensors_beyond_32_bit_offsets_are_refused():
    """The kernels' offsets are int32: a tensor spanning 2**31 elements is an error naming the
    fix (meta tensors: nothing is allocated); a token-major view counts its whole span."""
    fits = torch.empty(1, 32, 2**19 - 1, 128, device="meta")
    assert triton_doc.index_limit_error(fits, fits[:, :8]) is None
    big = torch.empty(1, 32, 2**19, 128, device="meta")
    assert "q (1, 32, 524288, 128)" in triton_doc.index_limit_error(big, big[:, :8])
    t = 2**19 + 1
    small = torch.empty(1, 8, t, 128, device="meta")
    # 8 of 32 heads of a token-major [B, T, H, D] buffer: the view spans (almost) all of it.
    view = torch.empty(1, t, 32, 128, device="meta").transpose(1, 2)[:, :8]
    assert triton_doc.index_limit_error(small, small) is None
    assert f"k (1, 8, {t}, 128)" in triton_doc.index_limit_error(small, view)


@pytest.mark.parametrize("blocks", [SMALL, SMALL_SPLIT], ids=["one-launch", "split"])
def test_every_launch_names_every_kernel_parameter(monkeypatch, blocks):
    """The launch sites pass each argument by the kernel's parameter name, none by position:
    a stride given to the wrong parameter would compute wrong gradients without an error."""
    kernels = triton_doc._kernels()
    calls = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append(self.kernel.arg_names)
                assert not args, f"{len(args)} positional arguments"
                assert set(self.kernel.arg_names) <= set(kwargs), "parameters not named"
                return self.kernel[grid](**kwargs)

            return launch

    monkeypatch.setattr(triton_doc, "_kernels", lambda: tuple(Recorder(k) for k in kernels))
    q, k, v, masks, layouts = make_case(31, *CASES[1], "anchor", grad=True)
    out = _run(q, k, v, layouts, scale=0.3, blocks=blocks)
    _check(out, reference(q, k, v, masks, 0.3), q, k, v)
    assert len(calls) == (4 if blocks.split_backward else 3)
