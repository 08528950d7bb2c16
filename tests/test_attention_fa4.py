"""The FlashAttention engines' logic on CPU: ``fa4`` (FlashAttention-4) and ``flash_attn`` (FA2).

Their kernels run on Hopper (FA4) or any CUDA GPU (FA2) only, so here a reference kernel with
the packages' contract stands in for them: bottom-right-aligned causal attention of each query
sequence over its key sequence (``cu_seqlens``), the natural-log log-sum-exp as [H, N_q],
grouped-query heads. What is tested is everything the engines add around the kernel: the
plans (gathered keys of interleaved chunks, the anchor's K/V before each document), the
flattening and the gradients' way back through the gathers, against the dense-mask ``sdpa``
engine, forward and backward. tests/test_attention_gpu.py runs the real kernels.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from anchorctx.attention import VARIANTS, attend, build_layout
from anchorctx.attention.api import _as_batch
from anchorctx.attention.engines import ENGINES, AttentionCall, flash4
from anchorctx.attention.engines.merge import dense_attention_lse


def reference_varlen(q, k, v, cu_q, cu_k, scale: float):
    """(out [N_q, H, D], lse [H, N_q]) of each sequence's bottom-right causal attention."""
    outs, lses = [], []
    for i in range(len(cu_q) - 1):
        qs = q[cu_q[i] : cu_q[i + 1]].transpose(0, 1)[None]  # [1, H, L_q, D]
        ks = k[cu_k[i] : cu_k[i + 1]].transpose(0, 1)[None]  # [1, H_kv, L_k, D]
        vs = v[cu_k[i] : cu_k[i + 1]].transpose(0, 1)[None]
        lq, lk = qs.shape[2], ks.shape[2]
        # query j sees the first L_k - L_q + j + 1 keys (bottom-right alignment)
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)[None, None]
        o, lse = dense_attention_lse(qs, ks, vs, mask, scale)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def fake_fa4(q, k, v, **kw):
    cu_seqlens_q, cu_seqlens_k = kw["cu_seqlens_q"], kw["cu_seqlens_k"]
    max_seqlen_q, max_seqlen_k, causal = kw["max_seqlen_q"], kw["max_seqlen_k"], kw["causal"]
    assert causal and max_seqlen_q == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    assert max_seqlen_k == int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max())
    out, lse = reference_varlen(
        q, k, v, cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), kw["softmax_scale"]
    )
    return out, lse


def _chunked(variant: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in torch.randint(1, 60, (14,), generator=g)]
    docs = [int(x) for x in torch.randint(0, 5, (14,), generator=g)]
    return build_layout(lens, variant, seg_doc=docs)


def _grads(engine: str, layouts, qkv):
    x = [t.clone().requires_grad_() for t in qkv]
    out = attend(*x, layouts, engine="sdpa") if engine == "sdpa" else _forward(engine, layouts, x)
    return [out, *torch.autograd.grad(out, x, torch.ones_like(out) + out.detach())]


def _forward(engine: str, layouts, x):
    # The engines' check() wants a Hopper GPU: call forward() directly, as attend() would.
    batch, cache = _as_batch(layouts, x[0].shape[0])
    call = AttentionCall(*x, batch=batch, cache=cache, scale=x[0].shape[-1] ** -0.5)
    return ENGINES[engine].forward(call)


@pytest.mark.parametrize("variant", VARIANTS)
def test_fa4_matches_the_dense_reference(monkeypatch, variant):
    monkeypatch.setattr(flash4, "_kernel", lambda: fake_fa4)
    rows = _two_rows(variant, 1)
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(2, h, rows[0].seq_len, 16, generator=g) for h in (4, 2, 2)]
    _assert_same(_grads("fa4", rows, qkv), _grads("sdpa", rows, qkv))


def _two_rows(variant: str, seed: int):
    """A row of interleaved chunks and a row of two documents, of one length."""
    first = _chunked(variant, seed)
    return [first, build_layout([5, first.seq_len - 5], variant)]


def _assert_same(got, want):
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, want):
        # float32 math on both sides (the merge runs in float32 too), sums over < 400 keys:
        # rounding stays near 1e-6; a wrong mask, plan or merge is O(1).
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5, msg=name)


def test_fa4_is_unavailable_without_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # import fails
    flash4.import_problem.cache_clear()  # asked once per process otherwise
    try:
        ok, why = ENGINES["fa4"].available()
    finally:
        flash4.import_problem.cache_clear()
    assert not ok and "pip install 'anchorctx[flash4]'" in why


def fake_fa2(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, deterministic):
    assert causal and dropout_p == 0.0
    return reference_varlen(q, k, v, cu_q.tolist(), cu_k.tolist(), softmax_scale)[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_flash_attn_fa2_engine_matches_the_dense_reference(monkeypatch, variant):
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = fake_fa2
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    assert ENGINES["flash_attn"].available() == (True, "")
    rows = _two_rows(variant, 3)
    qkv = [torch.randn(2, h, rows[0].seq_len, 16) for h in (6, 3, 3)]
    _assert_same(_grads("flash_attn", rows, qkv), _grads("sdpa", rows, qkv))


def test_flash_attn_needs_fa2_not_fa4s_namespace(monkeypatch):
    """flash-attn-4 installs ``flash_attn`` holding only ``cute``: that is not FA2."""
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    ok, why = ENGINES["flash_attn"].available()
    assert not ok and "FlashAttention-2 does not import" in why


@pytest.mark.parametrize("variant", VARIANTS)
def test_flex_flash_sends_flex_its_block_mask_with_the_flash_backend(monkeypatch, variant):
    """flex_flash is the flex engine's mask run on FA4's kernels: the same block mask and
    arguments reach FlexAttention, with ``kernel_options={"BACKEND": "FLASH"}`` (on CPU the
    engine calls the eager FlexAttention, which records them here; torch chooses the FLASH
    kernels in the compiled call on a GPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    from anchorctx.attention.engines import flex

    sent = []

    def recording(q, k, v, **kw):
        sent.append(kw.pop("kernel_options"))
        return flex_attention(q, k, v, **kw)

    monkeypatch.setattr(flex, "flex_attention", recording)
    rows = _two_rows(variant, 2)
    g = torch.Generator().manual_seed(1)
    qkv = [torch.randn(2, h, rows[0].seq_len, 16, generator=g) for h in (4, 2, 2)]
    with torch.no_grad():
        got = _forward("flex_flash", rows, qkv)
        want = attend(*qkv, rows, engine="sdpa")
    assert sent and all(o == {"BACKEND": "FLASH"} for o in sent)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)  # float32, as above


def test_flex_flash_names_what_is_missing(monkeypatch):
    from anchorctx.attention.engines import flex

    flex_flash = ENGINES["flex_flash"]
    assert flex_flash.auto == flex.AutoRanks()  # runs when named, until measured
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    flash4.import_problem.cache_clear()
    try:
        ok, why = flex_flash.available()
    finally:
        flash4.import_problem.cache_clear()
    assert not ok and ("[flash4]" in why or "BACKEND" in why)
    monkeypatch.setattr(
        "torch.nn.attention.flex_attention.FlexKernelOptions", types.SimpleNamespace()
    )
    assert "no FlexAttention BACKEND option" in flex.flash_backend_problem()


def test_fa4_engines_refuse_a_gpu_without_its_kernels(monkeypatch):
    from anchorctx.attention.errors import AttentionError

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(AttentionError, match=r"sm80: use engine='flex'"):
        flash4.require_arch("flex_flash", torch.device("cpu"), "use engine='flex'")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    flash4.require_arch("fa4", torch.device("cpu"), "")  # Hopper: nothing to refuse
