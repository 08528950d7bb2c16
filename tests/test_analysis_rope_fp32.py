"""model.rope_fp32: RoPE evaluated in float32 inside a bf16 model (anchorctx.models.rope)."""

from __future__ import annotations

import json

import pytest
import torch

from anchorctx.analysis.probe import capture
from anchorctx.analysis.probe import register as register_probe
from anchorctx.models.rope import (
    SUFFIX,
    Fp32RotaryEmbedding,
    disable_fp32_rope,
    enable_fp32_rope,
    is_fp32_rope,
)

T = 96
SHIFT = 3000  # large positions: where bf16 cos/sin rounding matters


def tiny_llama(attn: str = "sdpa", dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn).eval()


@pytest.fixture(scope="module")
def batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (1, T), generator=gen)
    return ids, torch.arange(SHIFT, SHIFT + T)[None]


def logits(model, batch) -> torch.Tensor:
    ids, pos = batch
    with torch.no_grad():
        return model(input_ids=ids, position_ids=pos, use_cache=False).logits


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_fp32_model_is_bit_identical(attn, batch):
    model = tiny_llama(attn)
    before = logits(model, batch)
    enable_fp32_rope(model)
    assert model.config._attn_implementation == attn + SUFFIX
    assert torch.equal(logits(model, batch), before)


def _layer0_query(model, ids, pos, *, fp32_rope: bool) -> torch.Tensor:
    """Layer 0's rotated query computed by hand: [1, H, T, D] in the model dtype."""
    from transformers.models.llama.modeling_llama import rotate_half

    layer = model.model.layers[0]
    attn = layer.self_attn
    h = layer.input_layernorm(model.model.embed_tokens(ids))
    q = attn.q_proj(h).view(1, T, -1, attn.head_dim).transpose(1, 2)
    inv = 1.0 / (
        model.config.rope_parameters["rope_theta"]
        ** (torch.arange(0, attn.head_dim, 2, dtype=torch.float) / attn.head_dim)
    )
    ang = pos[0, :, None].float() * inv
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if fp32_rope:  # one rounding of the exact float32 rotation
        return (q.float() * cos + rotate_half(q.float()) * sin).to(q.dtype)
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # stock: bf16 factors and bf16 arithmetic
    return q * cos + rotate_half(q) * sin


@pytest.mark.parametrize("fp32_rope", [False, True])
def test_attention_receives_the_documented_bf16_query(fp32_rope, batch):
    """The q the kernel gets is the stock bf16 rotation, or with the option the float32 rotation
    rounded once to bf16 — checked bit-exactly against a hand computation."""
    model = tiny_llama(register_probe(), torch.bfloat16)
    if fp32_rope:
        enable_fp32_rope(model)
    seen = {}
    ids, pos = batch
    with torch.no_grad(), capture(lambda layer, q, k, s: seen.setdefault(layer, q)):
        model(input_ids=ids, position_ids=pos, use_cache=False)
        expected = _layer0_query(model, ids, pos, fp32_rope=fp32_rope)
    assert seen[0].dtype == torch.bfloat16
    assert torch.equal(seen[0], expected)
    other = _layer0_query(model, ids, pos, fp32_rope=not fp32_rope)
    assert not torch.equal(seen[0], other)  # the two paths really differ at these positions


def test_bf16_backward_and_disable_roundtrip(batch):
    model = tiny_llama("sdpa", torch.bfloat16)
    stock = logits(model, batch)
    enable_fp32_rope(model)
    enable_fp32_rope(model)  # idempotent
    assert sum(isinstance(m, Fp32RotaryEmbedding) for m in model.modules()) == 1
    assert model.config._attn_implementation == "sdpa" + SUFFIX
    ids, pos = batch
    out = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False)
    assert out.logits.dtype == torch.bfloat16
    out.loss.backward()
    grad = model.model.layers[0].self_attn.q_proj.weight.grad
    assert grad is not None and grad.dtype == torch.bfloat16 and torch.isfinite(grad.float()).all()
    disable_fp32_rope(model)
    assert not is_fp32_rope(model) and model.config._attn_implementation == "sdpa"
    assert torch.equal(logits(model, batch), stock)


def test_frequencies_stay_float32_after_whole_module_cast(batch):
    """``module.bfloat16()`` (a bf16 engine) rounds inv_freq; the wrapper restores float32."""
    model = tiny_llama("sdpa")
    exact = model.model.rotary_emb.inv_freq.clone()
    enable_fp32_rope(model)
    model.bfloat16()
    assert model.model.rotary_emb.inner.inv_freq.dtype == torch.bfloat16
    logits(model, batch)
    assert torch.equal(model.model.rotary_emb.inner.inv_freq, exact)


def test_checkpoint_is_unchanged(tmp_path, batch):
    from transformers import AutoModelForCausalLM

    model = tiny_llama("sdpa", torch.bfloat16)
    keys = set(model.state_dict())
    enable_fp32_rope(model)
    assert set(model.state_dict()) == keys
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert not any(SUFFIX in str(v) for v in saved.values())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    assert not is_fp32_rope(reloaded)
    assert torch.equal(logits(reloaded, batch), logits(disable_fp32_rope(model), batch))


def test_rejects_models_without_rope():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="RotaryEmbedding"):
        enable_fp32_rope(model)
