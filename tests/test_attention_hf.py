"""Model-level invariants of the registered ``anchorctx`` attention, against the stock model.

Tiny random Llama, Mistral and Qwen2 (Qwen2 has no BOS: the anchor is EOS), fp32 on CPU.
"""

from __future__ import annotations

import copy

import pytest
import torch

from anchorctx.attention import AttentionError, LayoutBatch, build_layout, hf

ARCHS = ("llama", "mistral", "qwen2")
VOCAB = 64
TOL = {"atol": 2e-5, "rtol": 1e-5}


@pytest.fixture(scope="module", params=ARCHS)
def models(request):
    """(stock sdpa model, anchorctx model with the same weights, anchor token id)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = request.param
    specials = {"bos_token_id": None, "eos_token_id": 2} if arch == "qwen2" else {}
    cfg = AutoConfig.for_model(
        arch,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        **specials,
    )
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa")
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=hf.register())
    ours.load_state_dict(stock.state_dict())
    anchor = cfg.bos_token_id if cfg.bos_token_id is not None else cfg.eos_token_id
    assert anchor is not None
    return stock.eval(), ours.eval(), anchor


def _ids(anchor: int, t: int, seed: int) -> torch.Tensor:
    ids = torch.randint(3, VOCAB, (t,), generator=torch.Generator().manual_seed(seed))
    ids[0] = anchor
    return ids


def _logits(model, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    if "position_ids" in kwargs and "anchorctx_layout" not in kwargs:
        # An explicit all-ones mask stops transformers from reading jumps in position_ids as
        # packed-sequence boundaries: the reference must be one plain causal sequence.
        kwargs["attention_mask"] = torch.ones_like(ids)
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False, **kwargs).logits


def _segment_index(seg_lens, seg_doc, doc) -> torch.Tensor:
    starts = torch.tensor([0, *seg_lens]).cumsum(0).tolist()
    parts = [torch.arange(starts[i], starts[i + 1]) for i, d in enumerate(seg_doc) if d == doc]
    return torch.cat(parts)


@pytest.mark.parametrize("variant", ["anchor", "intra_doc", "intra_doc_reset", "full"])
def test_single_document_row_equals_stock(models, variant):
    """(a) anchor/intra_doc on one document, and (d) full on any row, equal stock attention."""
    stock, ours, anchor = models
    ids = _ids(anchor, 70, seed=1)[None]
    got = _logits(ours, ids, **hf.model_inputs(build_layout([70], variant)))
    torch.testing.assert_close(got, _logits(stock, ids), **TOL)


def test_full_on_packed_row_equals_stock(models):
    """(d) full attention ignores document boundaries: the stock causal model."""
    stock, ours, anchor = models
    ids = _ids(anchor, 90, seed=2)[None]
    layout = build_layout([30, 1, 40, 19], "full")
    torch.testing.assert_close(
        _logits(ours, ids, **hf.model_inputs(layout)), _logits(stock, ids), **TOL
    )


SEG_LENS = [20, 15, 1, 24, 12]
SEG_DOC = [0, 1, 2, 1, 3]  # document 1 is two interleaved chunks


def test_intra_doc_reset_documents_equal_running_alone(models):
    """(b) each segment's logits equal running that segment alone (positions from 0)."""
    stock, ours, anchor = models
    ids = torch.stack([_ids(anchor, 72, seed=3), _ids(anchor, 72, seed=4)])
    layouts = [build_layout(SEG_LENS, "intra_doc_reset"), build_layout([72], "anchor")]
    got = _logits(ours, ids, **hf.model_inputs(layouts))
    start = 0
    for n in SEG_LENS:
        alone = _logits(stock, ids[:1, start : start + n])
        torch.testing.assert_close(got[:1, start : start + n], alone, **TOL)
        start += n
    torch.testing.assert_close(got[1:], _logits(stock, ids[1:]), **TOL)  # row 2: one document


def test_anchor_documents_equal_anchor_plus_document(models):
    """(c) each document's logits equal running [anchor + document] alone with its original,
    continuing position ids (chunks of one document together, in order)."""
    stock, ours, anchor = models
    ids = torch.stack([_ids(anchor, 72, seed=5), _ids(anchor, 72, seed=6)])
    layouts = [build_layout(SEG_LENS, "anchor", SEG_DOC), build_layout([50, 22], "intra_doc")]
    inputs = hf.model_inputs(layouts)
    assert inputs["position_ids"].tolist() == [list(range(72))] * 2
    got = _logits(ours, ids, **inputs)
    for doc in sorted(set(SEG_DOC)):
        idx = _segment_index(SEG_LENS, SEG_DOC, doc)
        if doc != 0:  # document 0 already starts with the anchor
            idx = torch.cat([torch.tensor([0]), idx])
        alone = _logits(stock, ids[:1, idx], position_ids=idx[None])
        keep = slice(0, None) if doc == 0 else slice(1, None)
        torch.testing.assert_close(got[0, idx[keep]], alone[0, keep], **TOL)
    # Row 2 (intra_doc, continuing positions): the second document sees only itself.
    second = torch.arange(50, 72)
    alone = _logits(stock, ids[1:, second], position_ids=second[None])
    torch.testing.assert_close(got[1:, 50:], alone, **TOL)


def test_training_gradients_equal_stock_for_full(models):
    stock, ours, anchor = models
    ids = _ids(anchor, 40, seed=7)[None]
    grads = []
    for model, extra in ((stock, {}), (ours, hf.model_inputs(build_layout([40], "full")))):
        model.zero_grad()
        model(input_ids=ids, labels=ids, use_cache=False, **extra).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, **TOL)


def test_model_inputs_contract():
    layouts = [build_layout([3, 2], "intra_doc_reset"), build_layout([5], "anchor")]
    out = hf.model_inputs(layouts, engine="sdpa")
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]
    assert isinstance(out["anchorctx_layout"], LayoutBatch) and len(out["anchorctx_layout"]) == 2
    assert out["anchorctx_engine"] == "sdpa"
    assert hf.model_inputs(layouts[1])["position_ids"].shape == (1, 5)
    assert hf.register() == hf.register() == "anchorctx"


def test_missing_layout_and_kv_cache_are_clear_errors(models):
    _, ours, anchor = models
    ids = _ids(anchor, 10, seed=8)[None]
    with pytest.raises(AttentionError, match="model_inputs"):
        _logits(ours, ids)
    q, kv = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 10, 8)
    layout = build_layout([10], "anchor")
    with pytest.raises(AttentionError, match="attn_implementation='sdpa'"):
        hf.anchorctx_attention(
            ours.model.layers[0].self_attn, q, kv, kv, None, anchorctx_layout=layout
        )


def test_subset_of_heads_full_sequence():
    """Ulysses hands each rank all T tokens and H/sp heads: grouping comes from the shapes."""
    layout = build_layout([9, 7], "anchor")
    q, k, v = torch.randn(1, 8, 16, 4), torch.randn(1, 2, 16, 4), torch.randn(1, 2, 16, 4)
    module = torch.nn.Module()
    full, _ = hf.anchorctx_attention(module, q, k, v, None, anchorctx_layout=layout)
    part, _ = hf.anchorctx_attention(
        module, q[:, 4:], k[:, 1:], v[:, 1:], None, anchorctx_layout=layout
    )
    assert full.shape == (1, 16, 8, 4)
    torch.testing.assert_close(part, full[:, :, 4:], atol=1e-6, rtol=1e-6)


def test_attention_name_of_a_module_without_a_transformers_config_is_a_type_error():
    """Only a transformers model has an attention implementation to read: any other module is a
    one-line error naming its class, not an AttributeError from inside the getter."""
    with pytest.raises(TypeError, match=r"^Linear has no transformers config"):
        hf.attention_name(torch.nn.Linear(2, 2))
