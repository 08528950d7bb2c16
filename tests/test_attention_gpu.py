"""GPU checks of the fused engines (run on a CUDA machine: ``pytest -m gpu``).

Every engine in bf16 against a float32 dense-mask reference, forward and backward, on
heavy-tailed, chunked and per-row layouts of a few thousand tokens; the compiled flex kernel
and varlen must run backward; flex must not recompile for a new layout of the same length.
"""

from __future__ import annotations

import random

import pytest
import torch

from anchorctx.attention import VARIANTS, attend, build_layout
from anchorctx.attention.engines import ENGINES

pytestmark = pytest.mark.gpu

T = 3000  # not a multiple of 128
FUSED = [
    name
    for name in ("flex", "varlen", "flash_attn", "flex_merge", "triton", "fa4", "flex_flash")
    if ENGINES[name].available()[0]
]


def _row(seed: int, chunked: bool):
    rng = random.Random(seed)
    lens = []
    while sum(lens) < T:
        lens.append(min(T - sum(lens), max(1, int(rng.lognormvariate(5.5, 1.4)))))
    docs = [rng.randrange(max(1, len(lens) // 2)) for _ in lens] if chunked else None
    return lens, docs


def _layout(variant: str, seed: int, chunked: bool):
    seg_lens, seg_doc = _row(seed, chunked)
    return build_layout(seg_lens, variant, seg_doc=seg_doc, device="cuda")


def _inputs(b: int, h: int, h_kv: int, d: int = 128):
    g = torch.Generator(device="cuda").manual_seed(0)
    make = lambda heads: torch.randn(b, heads, T, d, device="cuda", generator=g)  # noqa: E731
    return make(h), make(h_kv), make(h_kv)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("engine", ["sdpa", *FUSED])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("chunked", [False, True], ids=["docs", "chunks"])
def test_engine_bf16_matches_fp32_reference(engine, variant, chunked):
    layouts = [_layout(variant, s, chunked) for s in (1, 2)]
    # Round inputs to bf16 first: the fp32 reference then measures only the kernel's error.
    q, k, v = (t.bfloat16().float() for t in _inputs(2, 8, 2))
    grad = torch.randn_like(q).bfloat16().float()
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = attend(*ref_in, layouts, engine="sdpa")
    ref_grads = torch.autograd.grad(ref, ref_in, grad)
    x = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    out = attend(*x, layouts, engine=engine)
    grads = torch.autograd.grad(out, x, grad.bfloat16())
    assert out.shape == q.shape
    assert _rel(out, ref) <= 1e-2, f"forward rel err {_rel(out, ref):.2e}"
    for name, g, r in zip("qkv", grads, ref_grads):
        assert _rel(g, r) <= 1e-2, f"d{name} rel err {_rel(g, r):.2e}"


@pytest.mark.parametrize("engine", FUSED)
def test_auto_picks_a_fused_engine_and_trains(engine):
    layout = _layout("anchor", 3, False)
    q, k, v = (t.bfloat16().requires_grad_() for t in _inputs(1, 4, 4))
    attend(q, k, v, layout, engine="auto").sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_auto_takes_the_in_kernel_anchor_for_anchor_rows():
    """``auto`` takes the cheapest engine by the cost rule that this machine can run (fa4 where
    FlashAttention-4 is installed on Hopper, else triton with the anchor inside the kernel,
    else the merge)."""
    from anchorctx.attention.api import _as_batch
    from anchorctx.attention.engines import AttentionCall, ranked, select_engine

    layout = _layout("anchor", 9, False)
    q, k, v = (t.bfloat16() for t in _inputs(1, 8, 2))
    batch, cache = _as_batch(layout, 1)
    call = AttentionCall(q=q, k=k, v=v, batch=batch, cache=cache, scale=q.shape[-1] ** -0.5)
    want = next(e for e in ranked([layout]) if e in FUSED)
    assert select_engine(call, "auto").name == want


@pytest.mark.parametrize("engine", [e for e in ("flex_merge", "triton", "fa4") if e in FUSED])
def test_checkpointing_keeps_gradients(engine):
    """Under non-reentrant activation checkpointing (as training runs it) the gradients are the
    same as without: the engines save what backward needs the ordinary way."""
    from torch.utils.checkpoint import checkpoint

    layout = _layout("anchor", 9, False)
    q, k, v = (t.bfloat16() for t in _inputs(1, 8, 2))
    grads = []
    for wrap in (False, True):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        fn = lambda *a: attend(*a, layout, engine=engine)  # noqa: E731
        out = checkpoint(fn, *x, use_reentrant=False) if wrap else fn(*x)
        out.float().square().sum().backward()
        grads.append([t.grad for t in x])
    # Recomputation repeats the same kernels, so any difference is rounding (bf16 outputs);
    # a lost or doubled gradient path would be O(1). FA4 sums a KV group's dK/dV in an order
    # that varies between runs outside the deterministic mode: up to one bf16 ulp (2^-8).
    tol = 4e-3 if engine == "fa4" else 1e-3
    for name, a, b in zip("qkv", *grads):
        assert _rel(a, b) <= tol, f"d{name} differs under checkpointing: {_rel(a, b):.2e}"


def test_triton_tile_settings_agree():
    """The two tile settings (long and short documents) give the same result on one row."""
    if "triton" not in FUSED:
        pytest.skip("triton unavailable")
    from anchorctx.attention.engines import triton_doc

    layout = _layout("anchor", 11, True)
    q, k, v = (t.bfloat16() for t in _inputs(2, 8, 2))
    grad = torch.randn_like(q)
    results = []
    for blocks in (triton_doc.LONG_BLOCKS, triton_doc.SHORT_BLOCKS):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        plan = triton_doc.build_plan((layout,) * 2, q.device, shared=True, blocks=blocks)
        out = triton_doc.document_attention(*x, plan, q.shape[-1] ** -0.5)
        results.append([out, *torch.autograd.grad(out, x, grad)])
    # Different tilings sum in different orders: bf16 outputs agree to rounding.
    for name, a, b in zip(["out", "dq", "dk", "dv"], *results):
        assert _rel(a, b) <= 1e-2, f"{name}: {_rel(a, b):.2e}"


def test_flex_reuses_compiled_kernel_for_new_layouts():
    if "flex" not in FUSED:
        pytest.skip("flex unavailable")
    import torch._dynamo

    q, k, v = (t.bfloat16().requires_grad_() for t in _inputs(1, 8, 2))
    attend(q, k, v, _layout("anchor", 4, False), engine="flex").sum().backward()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in (5, 6):
            layout = _layout("anchor", seed, seed == 6)
            attend(q, k, v, layout, engine="flex").sum().backward()


def test_hf_model_engines_agree():
    """A tiny bf16 Llama with the registered attention: fused engines vs sdpa logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from anchorctx.attention import hf

    cfg = AutoConfig.for_model(
        "llama",
        vocab_size=128,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=T,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=hf.register())
    model = model.to("cuda", torch.bfloat16)
    ids = torch.randint(0, 128, (2, T), device="cuda")
    layouts = [_layout("anchor", s, s == 8) for s in (7, 8)]
    logits = {}
    for engine in ["sdpa", *FUSED]:
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=False, **hf.model_inputs(layouts, engine=engine))
        logits[engine] = out.logits.float()
    for engine in FUSED:
        assert _rel(logits[engine], logits["sdpa"]) <= 1e-2, engine
