"""``training.kernels=liger``'s attention forward with the fused RoPE, on CPU.

Liger's RoPE kernel needs CUDA, so transformers' own ``apply_rotary_pos_emb`` stands in for it
here: the swapped forward must then give bit-identical logits and gradients to the model's
own forward, for each family it declares (Llama, Mistral, Qwen2), with the project's
registered attention and packed-row layouts as training runs them; with a KV cache it must
hand over to the class's own forward. tests/test_determinism_gpu.py and the GPU training tests
run the real kernel.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from anchorctx.attention import build_layout, hf
from anchorctx.training import kernels

FAMILIES = ["llama", "mistral", "qwen2"]


def _model(family: str, attn: str):
    cfg = AutoConfig.for_model(
        family,
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)


def _stand_in(monkeypatch):
    family_rope = {}

    def rope(q, k, cos, sin):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        family_rope["called"] = family_rope.get("called", 0) + 1
        return apply_rotary_pos_emb(q, k, cos, sin)

    monkeypatch.setattr(kernels, "rope_function", lambda: rope)
    return family_rope


def _logits_and_grads(model, ids, inputs):
    model.zero_grad()
    logits = model(input_ids=ids, use_cache=False, **inputs).logits
    logits.float().square().mean().backward()
    return [logits.detach(), *(p.grad.clone() for p in model.parameters())]


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_rope_forward_reproduces_the_models_forward(monkeypatch, family):
    called = _stand_in(monkeypatch)
    model = _model(family, hf.register())
    ids = torch.randint(0, 64, (2, 48))
    layouts = [build_layout([20, 28], "anchor"), build_layout([48], "intra_doc_reset")]
    inputs = hf.model_inputs(layouts, engine="sdpa")
    want = _logits_and_grads(model, ids, inputs)
    classes: dict[type, type] = {}
    fused = sum(kernels._fuse_rope(layer.self_attn, classes) for layer in model.model.layers)
    assert fused == 2 and len(classes) == 1
    got = _logits_and_grads(model, ids, inputs)
    assert called["called"] == 2  # one call per layer: the swapped forward ran
    for a, b in zip(got, want):
        assert torch.equal(a, b)  # the same operations in the same order


def test_fused_rope_hands_generation_to_the_models_forward(monkeypatch):
    called = _stand_in(monkeypatch)
    model = _model("llama", "sdpa").eval()
    ids = torch.randint(0, 64, (1, 12))
    want = model.generate(ids, max_new_tokens=4, do_sample=False)
    for layer in model.model.layers:
        kernels._fuse_rope(layer.self_attn, {})
    got = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want) and "called" not in called


def test_unknown_attention_classes_are_left_alone():
    class OtherAttention(torch.nn.Module):
        pass

    module = OtherAttention()
    assert kernels._fuse_rope(module, {}) == 0 and type(module) is OtherAttention


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_liger_kernels_agree_with_transformers_on_the_gpu(family):
    """The real kernels (RMSNorm, SwiGLU, RoPE) against transformers' modules, bf16."""
    pytest.importorskip("liger_kernel")
    model = _model(family, hf.register()).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 64, (2, 48), device="cuda")
    layouts = [
        build_layout([20, 28], "anchor", device="cuda"),
        build_layout([48], "intra_doc_reset", device="cuda"),
    ]
    inputs = hf.model_inputs(layouts, engine="sdpa")
    want = _logits_and_grads(model, ids, inputs)
    assert kernels.use_kernels(model, "liger") == 2 * 4 + 1  # 2 norms, MLP, attention; final norm
    got = _logits_and_grads(model, ids, inputs)
    for a, b in zip(got, want):
        # bf16: the fused kernels round once where transformers rounds each step; the relative
        # difference of a few bf16 ulps (2^-8 each) stays under 2e-2, a wrong rotation is O(1)
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 2e-2
