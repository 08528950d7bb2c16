"""A fused one-token decode step for Llama / Mistral / Qwen2 checkpoints (gpt-fast style).

Why: the decode step through the checkpoint's own modules runs ~35 small kernels per layer
(unfused RMSNorm, RoPE, separate q/k/v and gate/up GEMVs, residual adds). A CUDA graph removes
the host gaps between them but not their launch and memory round trips: on a 7B model at batch 1
that is ~3.5 ms per token on H200 on top of the ~3.1 ms it takes to stream the weights.

What this does instead, per layer, with the same weights and the same arithmetic as the modules:

- ``_pre_attention``: RMSNorm, one GEMV against q/k/v concatenated into one
  ``[(H_q + 2 H_kv) D, hidden]`` matrix (plus the qkv bias where the checkpoint has one, Qwen2),
  RoPE, and the K/V write into the static cache slot;
- attention: the model's own attention function (``config._attn_implementation``: SDPA, or the
  decode attention that :class:`~anchorctx.models.decoding.GreedyDecoder` swaps in), unchanged,
  so the kernel choices (cuDNN by default, FlexAttention when deterministic) stay the decoder's;
- ``_post_attention``: o_proj, residual, RMSNorm, one GEMV against gate/up concatenated into one
  ``[2 I, hidden]`` matrix, SiLU·mul, down_proj, residual.

The two halves are plain functions of (hidden state, layer weights, cache, slot, cos/sin) and are
compiled once with ``torch.compile``: every layer has the same shapes, so one compiled graph
serves all layers (the first changes of batch size and buffer length recompile, until
automatic dynamic shapes take over: 4 + 2 compiles, ~13 s, in bench/eval_throughput.py) and
inductor fuses the norms, RoPE, SiLU·mul and residual adds around the cuBLAS GEMVs. cos/sin come from the
checkpoint's ``rotary_emb`` module outside the compiled code, so RoPE scaling stays the model's.

Weights are not duplicated: q/k/v (and gate/up) are concatenated once and the modules' parameters
then become views into the concatenated tensor (no copy at all when they are already adjacent in
memory), so the model's own forward (prefill, the reference step) keeps working on the same
memory. Tied embeddings need nothing: the LM head is the model's own module.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

# hidden_act values the fused MLP implements (the checkpoints the project trains use SiLU).
_ACTIVATIONS = {"silu": F.silu, "swish": F.silu}


def fused_unsupported_reason(model) -> str | None:
    """Why the fused step cannot run ``model``; None when it can (the caller checked the model
    type with ``decoding.unsupported_reason`` first)."""
    cfg = model.config
    if cfg.hidden_act not in _ACTIVATIONS:
        return f"hidden_act {cfg.hidden_act!r} (fused step: {', '.join(_ACTIVATIONS)})"
    layer = model.model.layers[0]
    names = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    if not all(hasattr(layer, n) for n in names):
        return f"{type(layer).__name__} lacks {'/'.join(names)}"
    return None


def _joined(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """One tensor stacking ``params`` along dim 0. A view when they already lie back to back in
    one storage; otherwise a concatenation, which the parameters then become views of (so the
    old copies are freed and memory does not double)."""
    first = params[0]
    rows = sum(p.shape[0] for p in params)
    shape = (rows, *first.shape[1:])
    storage = first.untyped_storage().data_ptr()
    ptr = first.data_ptr()
    adjacent = True
    for p in params:
        adjacent &= (p.is_contiguous() and p.untyped_storage().data_ptr() == storage
                     and p.data_ptr() == ptr)  # fmt: skip
        ptr = p.data_ptr() + p.numel() * p.element_size()
    if adjacent:
        return first.detach().as_strided(shape, first.stride())
    with torch.no_grad():
        joined = torch.cat([p.detach() for p in params])
    start = 0
    for p in params:
        p.data = joined[start : start + p.shape[0]]
        start += p.shape[0]
    return joined


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm / Qwen2RMSNorm: float32 statistics, weight in the input dtype."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _pre_attention(h, norm_w, wqkv, bqkv, cos, sin, k_cache, v_cache, slot, eps: float,
                   heads: int, kv_heads: int):  # fmt: skip
    """h [B, 1, hidden] -> q [B, H_q, 1, D]; writes the step's rotated K and V [B, H_kv, 1, D]
    into ``k_cache``/``v_cache`` [B, H_kv, S, D] at ``slot`` [1]."""
    x = _rms_norm(h, norm_w, eps)
    qkv = F.linear(x, wqkv, bqkv)  # [B, 1, (H_q + 2 H_kv) D]
    b, t = h.shape[:2]
    d = cos.shape[-1]
    q, k, v = qkv.view(b, t, heads + 2 * kv_heads, d).transpose(1, 2).split(
        [heads, kv_heads, kv_heads], dim=1)  # fmt: skip  # each [B, H, 1, D]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, 1, D]: broadcast over heads
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    k_cache.index_copy_(2, slot, k)
    v_cache.index_copy_(2, slot, v)
    return q


def _post_attention(h, attn, wo, bo, norm_w, wgu, bgu, wdown, bdown, eps: float, act: str):
    """h [B, 1, hidden], attn [B, 1, H_q D] -> the layer's output [B, 1, hidden]."""
    h = h + F.linear(attn, wo, bo)
    x = _rms_norm(h, norm_w, eps)
    gate, up = F.linear(x, wgu, bgu).chunk(2, dim=-1)  # each [B, 1, I]
    return h + F.linear(_ACTIVATIONS[act](gate) * up, wdown, bdown)


@functools.cache
def _compiled(fn):
    # One compiled function per process (not per decoder), so dynamo's cache entries are shared
    # by every layer and decoder; fullgraph: a graph break would silently unfuse the step.
    return torch.compile(fn, fullgraph=True)


def _bias(module) -> torch.Tensor | None:
    return None if module.bias is None else module.bias.detach()


class _LayerWeights:
    def __init__(self, layer):
        attn, mlp = layer.self_attn, layer.mlp
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        self.wqkv = _joined([m.weight for m in projs])
        self.bqkv = None if attn.q_proj.bias is None else _joined([m.bias for m in projs])
        self.wo, self.bo = attn.o_proj.weight.detach(), _bias(attn.o_proj)
        self.wgu = _joined([mlp.gate_proj.weight, mlp.up_proj.weight])
        self.bgu = (None if getattr(mlp.gate_proj, "bias", None) is None
                    else _joined([mlp.gate_proj.bias, mlp.up_proj.bias]))  # fmt: skip
        self.wdown, self.bdown = mlp.down_proj.weight.detach(), _bias(mlp.down_proj)
        self.norm1 = layer.input_layernorm.weight.detach()
        self.norm2 = layer.post_attention_layernorm.weight.detach()
        self.attn = attn


class FusedDecodeStep:
    """Hidden states of a one-token decode step through fused per-layer functions.

    ``compile``: run the two per-layer halves through ``torch.compile`` (default: on CUDA);
    uncompiled they are the same arithmetic in eager PyTorch (CPU, tests).
    """

    def __init__(self, model, *, compile: bool | None = None):
        reason = fused_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"fused decode step: {reason}")
        cfg = model.config
        self.model = model
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.act = cfg.hidden_act
        base = model.model
        layers = base.layers[: cfg.num_hidden_layers]
        self.eps = float(layers[0].input_layernorm.variance_epsilon)
        self.layers = [_LayerWeights(layer) for layer in layers]
        device = base.embed_tokens.weight.device
        if compile is None:
            compile = device.type == "cuda"
        self.pre = _compiled(_pre_attention) if compile else _pre_attention
        self.post = _compiled(_post_attention) if compile else _post_attention
        # The model's eager attention function, used when it runs with attn_implementation
        # "eager" (transformers keeps it in the model's own module).
        self._eager = sys.modules[type(layers[0].self_attn).__module__].eager_attention_forward

    def _attention_fn(self):
        # Looked up per step: GreedyDecoder swaps config._attn_implementation for FlexAttention.
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        impl = self.model.config._attn_implementation
        return self._eager if impl == "eager" else ALL_ATTENTION_FUNCTIONS[impl]

    def hidden(self, ids, pos, mask, k_caches, v_caches, slot, **attn_kwargs) -> torch.Tensor:
        """ids, pos [B, 1]; mask [B, 1, 1, S] (True = visible); caches [B, H_kv, S, D] per
        layer; slot [1] -> hidden states after the last layer [B, 1, hidden].
        ``attn_kwargs`` reach the attention function as the layers would pass them."""
        base = self.model.model
        h = base.embed_tokens(ids)  # [B, 1, hidden]
        cos, sin = base.rotary_emb(h, pos)  # each [B, 1, D], the checkpoint's RoPE scaling
        attend = self._attention_fn()
        for w, k_cache, v_cache in zip(self.layers, k_caches, v_caches):
            q = self.pre(h, w.norm1, w.wqkv, w.bqkv, cos, sin, k_cache, v_cache, slot, self.eps,
                         self.heads, self.kv_heads)  # fmt: skip
            out, _ = attend(w.attn, q, k_cache, v_cache, mask, dropout=0.0,
                            scaling=w.attn.scaling, **attn_kwargs)  # fmt: skip  # [B, 1, H_q, D]
            out = out.reshape(*h.shape[:2], -1)  # [B, 1, H_q D]
            h = self.post(h, out, w.wo, w.bo, w.norm2, w.wgu, w.bgu, w.wdown, w.bdown, self.eps,
                          self.act)  # fmt: skip
        return h
