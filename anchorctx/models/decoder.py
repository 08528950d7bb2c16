"""The static decoder: a Llama / Mistral / Qwen2 forward that owns its KV cache (gpt-fast style).

Built once from a loaded Hugging Face model, it runs the model's weights through code of its
own: embeddings, RoPE, GQA attention over a static KV cache, SwiGLU, final norm and LM head. It
never calls a decoder layer's ``forward``, so transformers' cache protocol (the ``cache`` /
``past_key_values`` keyword and its ``update`` call) and its attention dispatch
(``config._attn_implementation``, read by the layers) play no part: the attention kernel is a
function handed to each call.

What stays the checkpoint's: its modules' weights, its RMSNorm / projection / MLP modules on the
"hf" path, and its ``rotary_emb`` module, which computes cos/sin with the checkpoint's RoPE
scaling (default, linear, llama3, yarn: everything but the types that depend on the sequence
length, which ``unsupported_reason`` rejects). Tied embeddings need nothing: the LM head is the
model's own output-embedding module.

Two layer implementations of the same arithmetic (``DECODE_STEPS``):

- "hf": the checkpoint's submodules called per layer (``input_layernorm``, ``q/k/v_proj``,
  ``o_proj``, ``post_attention_layernorm``, ``mlp``), so any activation the model has works.
  Prefill always runs this way (compute-bound matmuls, nothing to fuse).
- "fused": a one-token decode step with q/k/v and gate/up merged into one GEMV each
  (``[(H_q + 2 H_kv) D, hidden]`` and ``[2 I, hidden]``) and the norms, RoPE, the K/V write,
  SiLU·mul and residual adds fused around them by ``torch.compile`` (on CUDA): on a 7B model the
  unfused step runs ~35 small kernels per layer, ~2.2 ms per token more on an H200
  (docs/benchmarks/2026-11-23-fused-decode-step.md).

Merged weights cost no memory: q/k/v (and gate/up) that already lie back to back in one storage
are viewed as one matrix; otherwise they are concatenated once and the projection modules get
new parameters viewing the concatenation (``_merged``), so the old copies are freed and the
model's own forward keeps working on the same memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# RoPE variants that recompute their frequencies from the sequence length inside the forward
# (a host-side decision per call): not capturable and not position-independent.
DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")
# Decode-step layer implementations: "hf" = the checkpoint's submodules, "fused" = merged weights.
DECODE_STEPS = ("hf", "fused")
# hidden_act values the fused MLP implements (the checkpoints the project trains use SiLU).
_ACTIVATIONS = {"silu": F.silu, "swish": F.silu}
_LAYER_MODULES = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
_ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")

# A decode step's attention: q [B, H_q, 1, D] over the whole cache k/v [B, H_kv, S, D]
# -> [B, H_q, 1, D]; the slot mask and the kernel choice live in the function.
DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# torch.compile's ``options``, as its signature types them.
InductorOptions = dict[str, str | int | bool | Callable[..., Any]]


def unsupported_reason(model) -> str | None:
    """Why the static decoder cannot run ``model`` at all; None when it can."""
    cfg = model.config
    base = getattr(model, "model", None)
    if cfg.model_type not in SUPPORTED_MODEL_TYPES or base is None:
        return f"model_type {cfg.model_type!r} (static engine: {', '.join(SUPPORTED_MODEL_TYPES)})"
    if not all(hasattr(base, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{type(base).__name__} lacks embed_tokens/layers/norm/rotary_emb"
    layer = base.layers[0]
    if not all(hasattr(layer, n) for n in _LAYER_MODULES):
        return f"{type(layer).__name__} lacks {'/'.join(_LAYER_MODULES)}"
    if not all(hasattr(layer.self_attn, n) for n in _ATTN_MODULES):
        return f"{type(layer.self_attn).__name__} lacks {'/'.join(_ATTN_MODULES)}"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in DYNAMIC_ROPE_TYPES:
        return f"rope_type {rope_type!r} depends on the sequence length"
    return None


def fused_unsupported_reason(model) -> str | None:
    """Why the fused step cannot run ``model`` (which ``unsupported_reason`` accepts)."""
    act = model.config.hidden_act
    if act not in _ACTIVATIONS:
        return f"hidden_act {act!r} (fused step: {', '.join(_ACTIVATIONS)})"
    return None


@dataclass(frozen=True)
class Shape:
    """The attention and MLP shape every layer shares."""

    layers: int
    heads: int  # H_q
    kv_heads: int  # H_kv
    head_dim: int  # D
    scaling: float  # softmax scale, the attention modules' own (D ** -0.5)
    eps: float  # RMSNorm epsilon
    act: str  # hidden_act

    @classmethod
    def of(cls, model) -> Shape:
        cfg = model.config
        layer = model.model.layers[0]
        return cls(
            layers=cfg.num_hidden_layers,
            heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            scaling=float(layer.self_attn.scaling),
            eps=float(layer.input_layernorm.variance_epsilon),
            act=cfg.hidden_act,
        )


@dataclass
class KVCache:
    """One static K and one V buffer ``[B, H_kv, S, D]`` per layer."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    def row_slots(
        self, layer: int, row: int, start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s keys and values of one row at slots [start, end), as views
        [1, H_kv, end - start, D] of the buffers (what the prefill's attention reads)."""
        return self.k[layer][row][None, :, start:end], self.v[layer][row][None, :, start:end]

    @classmethod
    def allocate(cls, shape: Shape, batch: int, slots: int, dtype, device) -> KVCache:
        size = (batch, shape.kv_heads, slots, shape.head_dim)  # [B, H_kv, S, D]
        # Zeros, not empty: masked slots get softmax weight 0, and 0 * NaN garbage would be NaN.
        k = [torch.zeros(size, dtype=dtype, device=device) for _ in range(shape.layers)]
        return cls(k=k, v=[torch.zeros_like(t) for t in k])


@dataclass(frozen=True)
class FusedLayer:
    """One layer's weights for the fused step (``w`` [out, in] as ``F.linear`` takes them)."""

    norm1: torch.Tensor  # [hidden]
    wqkv: torch.Tensor  # [(H_q + 2 H_kv) D, hidden]
    bqkv: torch.Tensor | None  # [(H_q + 2 H_kv) D], Qwen2's qkv bias
    wo: torch.Tensor  # [hidden, H_q D]
    bo: torch.Tensor | None
    norm2: torch.Tensor  # [hidden]
    wgu: torch.Tensor  # [2 I, hidden]
    bgu: torch.Tensor | None
    wdown: torch.Tensor  # [hidden, I]
    bdown: torch.Tensor | None

    @classmethod
    def of(cls, layer) -> FusedLayer:
        attn, mlp = layer.self_attn, layer.mlp
        return cls(
            norm1=layer.input_layernorm.weight.detach(),
            wqkv=_merged_weight([attn.q_proj, attn.k_proj, attn.v_proj]),
            bqkv=_merged([attn.q_proj, attn.k_proj, attn.v_proj], "bias"),
            wo=attn.o_proj.weight.detach(),
            bo=_detached(attn.o_proj.bias),
            norm2=layer.post_attention_layernorm.weight.detach(),
            wgu=_merged_weight([mlp.gate_proj, mlp.up_proj]),
            bgu=_merged([mlp.gate_proj, mlp.up_proj], "bias"),
            wdown=mlp.down_proj.weight.detach(),
            bdown=_detached(mlp.down_proj.bias),
        )


def _detached(p: torch.Tensor | None) -> torch.Tensor | None:
    return None if p is None else p.detach()


def _merged_weight(modules: list[nn.Module]) -> torch.Tensor:
    """:func:`_merged` of the projections' weights, which every projection has."""
    merged = _merged(modules, "weight")
    if merged is None:
        raise ValueError(f"{type(modules[0]).__name__} has no weight: not a linear projection")
    return merged


def _merged(modules: list[nn.Module], name: str) -> torch.Tensor | None:
    """The parameters ``name`` of ``modules`` stacked along dim 0 as one tensor, or None when
    any has none (no bias).

    A view when they already lie back to back in one storage. Otherwise they are concatenated
    once and each module gets a new parameter viewing its rows of the concatenation: the old
    tensors are freed, so memory does not double (q/k/v and gate/up are two thirds of a 7B
    model's weights), and the module computes on the very memory the fused step reads.
    """
    params: list[torch.Tensor] = [p for m in modules if (p := getattr(m, name, None)) is not None]
    if len(params) < len(modules):
        return None
    first = params[0]
    shape = (sum(p.shape[0] for p in params), *first.shape[1:])  # [rows of all, *in]
    storage = first.untyped_storage().data_ptr()
    ptr = first.data_ptr()
    adjacent = True
    for p in params:
        adjacent &= (
            p.is_contiguous() and p.untyped_storage().data_ptr() == storage and p.data_ptr() == ptr
        )
        ptr = p.data_ptr() + p.numel() * p.element_size()
    if adjacent:
        return first.detach().as_strided(shape, first.stride())
    with torch.no_grad():
        joined = torch.cat([p.detach() for p in params])  # [rows of all, *in]
    start = 0
    for module, p in zip(modules, params):
        rows = joined[start : start + p.shape[0]]
        setattr(module, name, nn.Parameter(rows, requires_grad=p.requires_grad))
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


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] rotated by cos/sin [B, T, D] (transformers' ``apply_rotary_pos_emb``)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, D]: broadcast over heads
    return x * cos + _rotate_half(x) * sin


def _fused_pre_attention(
    h: torch.Tensor,
    w: FusedLayer,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: torch.Tensor,
    shape: Shape,
) -> torch.Tensor:
    """h [B, 1, hidden] -> q [B, H_q, 1, D]; writes the step's rotated K and V [B, H_kv, 1, D]
    into ``k_cache``/``v_cache`` [B, H_kv, S, D] at ``slot`` [1]."""
    x = _rms_norm(h, w.norm1, shape.eps)
    qkv = F.linear(x, w.wqkv, w.bqkv)  # [B, 1, (H_q + 2 H_kv) D]
    b, t = h.shape[:2]
    heads = shape.heads + 2 * shape.kv_heads
    qkv = qkv.view(b, t, heads, shape.head_dim).transpose(1, 2)  # [B, H_q + 2 H_kv, 1, D]
    q, k, v = qkv.split([shape.heads, shape.kv_heads, shape.kv_heads], dim=1)
    k_cache.index_copy_(2, slot, _rope(k, cos, sin))
    v_cache.index_copy_(2, slot, v)
    return _rope(q, cos, sin)


def _fused_post_attention(
    h: torch.Tensor, attn: torch.Tensor, w: FusedLayer, shape: Shape
) -> torch.Tensor:
    """h [B, 1, hidden], attn [B, 1, H_q D] -> the layer's output [B, 1, hidden]."""
    h = h + F.linear(attn, w.wo, w.bo)
    x = _rms_norm(h, w.norm2, shape.eps)
    gate, up = F.linear(x, w.wgu, w.bgu).chunk(2, dim=-1)  # each [B, 1, I]
    return h + F.linear(_ACTIVATIONS[shape.act](gate) * up, w.wdown, w.bdown)


# Compiled graphs a decode-step function may keep in one process: one per batch shape
# (dynamic=False below). torch's default (8) would fall back to eager after 8 shapes; a RULER
# run over 13 tasks x 6 lengths decodes ~150 shapes in one process.
RECOMPILE_LIMIT = 1024


def static_shapes(fn):
    """Decorator for callers of the decode step's compiled functions: room for one static
    graph per batch shape (:data:`RECOMPILE_LIMIT`). The patch is made per call, so importing
    this module does not import torch's compiler."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with torch._dynamo.config.patch(
            recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=4 * RECOMPILE_LIMIT
        ):
            return fn(*args, **kwargs)

    return call


@functools.cache
def _compiled(fn, deterministic: bool = False):
    # One compiled function per process (not per decoder): dynamo guards on the weights'
    # metadata, not on which layer's container holds them, so every layer and decoder shares
    # one cache entry; fullgraph: a graph break would silently unfuse the step.
    # dynamic=False: one static graph per batch shape. With torch's automatic dynamic shapes a
    # process compiles its second shape as dynamic, so which kernel decodes a batch would
    # depend on the batches the process decoded before: two shardings of one evaluation then
    # gave different greedy tokens on 11-28 of 232 records with deterministic decoding, and
    # the dynamic graphs decoded 2.8x slower
    # (docs/benchmarks/2026-11-27-static-decode-graphs.md).
    return torch.compile(fn, fullgraph=True, dynamic=False, options=inductor_options(deterministic))


def inductor_options(deterministic: bool) -> InductorOptions | None:
    """Inductor's options for a decode graph: ``deterministic`` turns off the kernel choices
    Inductor makes by timing candidates on the device (reduction configs, matmul padding). Two
    processes compiling one graph could otherwise pick different kernels, so the same batch
    decoded in two evaluation workers (each compiles the shapes it meets first) gave different
    greedy tokens on 4 of 232 records (docs/benchmarks/2026-11-27-evaluation-workers.md)."""
    if not deterministic:
        return None
    import torch._inductor.config as inductor

    return {"deterministic": True} if hasattr(inductor, "deterministic") else None


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """One row's prompt chunk: q [1, H_q, C, D] over its cached prefix and itself k/v
    [1, H_kv, L, D] -> [1, H_q, C, D]; ``mask`` [1, 1, C, L] for a later chunk, else None
    (L = C, plain causal).

    The same SDPA calls as transformers' SDPA attention: without a mask, implicit causal with
    SDPA's own GQA (its flash kernel, linear memory at 128K); with a mask, K/V repeated to H_q
    heads first, as SDPA's GQA with a mask falls back to its math kernel ([H, C, L] scores).
    """
    groups = q.shape[1] // k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=groups > 1
        )
    if groups > 1:  # transformers' repeat_kv: query head h reads KV head h // groups
        b, kv_heads, length, d = k.shape
        k, v = (
            t[:, :, None]
            .expand(b, kv_heads, groups, length, d)  # [1, H_kv, g, L, D]
            .reshape(b, kv_heads * groups, length, d)
            for t in (k, v)
        )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class StaticDecoder:
    """The model's forward over a static ``KVCache``: ``prefill`` one row, ``step`` every row.

    ``step``: the decode step's layers, one of ``DECODE_STEPS``. ``compile``: run the fused
    step's two per-layer halves through ``torch.compile`` (default: on CUDA); uncompiled they
    are the same arithmetic in eager PyTorch (CPU, tests). ``deterministic``: compiled with
    Inductor's kernel choices made without timing (:func:`inductor_options`).
    """

    def __init__(
        self,
        model,
        *,
        step: str = "hf",
        compile: bool | None = None,
        deterministic: bool = False,
    ):
        if step not in DECODE_STEPS:
            raise ValueError(f"decode step {step!r}: expected one of {', '.join(DECODE_STEPS)}")
        reason = unsupported_reason(model)
        if reason is None and step == "fused":
            reason = fused_unsupported_reason(model)
        if reason is not None:
            raise ValueError(
                f"{'fused decode step' if step == 'fused' else 'static decoder'}: {reason}"
            )
        base = model.model
        self.step_kind = step
        self.shape = Shape.of(model)
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.norm = base.norm
        self.head = model.get_output_embeddings()
        self.modules = list(base.layers[: self.shape.layers])
        self.weight = self.embed.weight  # dtype and device of the cache
        self.layers: list[FusedLayer] = []
        if step == "fused":
            self.layers = [FusedLayer.of(layer) for layer in self.modules]
            if compile is None:
                compile = self.weight.device.type == "cuda"
            pre, post = _fused_pre_attention, _fused_post_attention
            self._pre = _compiled(pre, deterministic) if compile else pre
            self._post = _compiled(post, deterministic) if compile else post

    def allocate(self, batch: int, slots: int) -> KVCache:
        return KVCache.allocate(self.shape, batch, slots, self.weight.dtype, self.weight.device)

    def logits(self, h_last: torch.Tensor) -> torch.Tensor:
        """[B, hidden] -> [B, vocab]: the final norm is per position, so the last one suffices."""
        return self.head(self.norm(h_last))

    def prefill(
        self, cache: KVCache, row: int, first_slot: int, ids: torch.Tensor, chunk: int
    ) -> torch.Tensor:
        """Cache one row's prompt ``ids`` [1, n] at slots [first_slot, first_slot + n), ``chunk``
        tokens per pass; the last token's hidden state [1, hidden]."""
        n = ids.shape[1]
        for s in range(0, n, chunk):
            h = self._prefill_chunk(cache, row, first_slot, ids, s, min(n, s + chunk))
        return h[:, -1]

    def warm_prefill(self, cache: KVCache, row: int, first_slot: int, n: int, chunk: int) -> None:
        """Run the attention call of an ``n``-token prompt's first prefill chunk once, on
        tensors laid out as :meth:`prefill` passes them (q in the projection's heads-transposed
        layout, k/v viewing ``cache``'s row), and nothing else of the forward.

        Why: on an H100, torch 2.11 runs the prefill's SDPA call on cuDNN's kernel, which builds
        a graph per input shape (and strides) on its first call, ~68 ms, then reuses it. RULER's
        prompts have nearly all distinct lengths, so a process's first evaluation pays that per
        prompt (docs/benchmarks/2026-11-27-evaluation-workers.md). A compile-only pass calls this
        per prompt length. PyTorch keeps cuDNN's attention graphs per thread, so what it builds
        serves the evaluations of the same thread: an evaluation worker's, which serves its requests
        in its main thread."""
        c = min(n, chunk)
        s = self.shape
        weight = self.weight
        # q [1, H_q, C, D] as prefill has it: the projection's [1, C, H_q, D] view, transposed.
        q = torch.zeros(1, c, s.heads, s.head_dim, dtype=weight.dtype, device=weight.device)
        k, v = cache.row_slots(0, row, first_slot, first_slot + c)  # each [1, H_kv, C, D]
        _prefill_attention(q.transpose(1, 2), k, v, None, s.scaling)

    def _prefill_chunk(
        self, cache: KVCache, row: int, first_slot: int, ids: torch.Tensor, s: int, e: int
    ) -> torch.Tensor:
        """Tokens s..e-1 of the row's prompt -> their hidden states [1, C, hidden], C = e - s."""
        pos = torch.arange(s, e, device=ids.device)[None]  # [1, C]
        # The first chunk is plain causal (no mask: SDPA's flash path). A later one attends the
        # cached prefix too: query i (position s + i) sees keys 0..s + i.
        mask = None
        if s > 0:
            mask = torch.ones(e - s, e, dtype=torch.bool, device=ids.device).tril(s)
            mask = mask[None, None]  # [1, 1, C, e]
        lo, hi = first_slot + s, first_slot + e

        def write(i: int, k: torch.Tensor, v: torch.Tensor):
            """k/v [1, H_kv, C, D] into the row's slots; the row's keys so far [1, H_kv, e, D]."""
            cache.k[i][row][:, lo:hi] = k[0]  # the row's [H_kv, S, D] buffer
            cache.v[i][row][:, lo:hi] = v[0]
            return cache.row_slots(i, row, first_slot, hi)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return _prefill_attention(q, k, v, mask, self.shape.scaling)

        return self._modules_forward(ids[:, s:e], pos, write, attend)

    def step(
        self,
        cache: KVCache,
        tok: torch.Tensor,
        pos: torch.Tensor,
        slot: torch.Tensor,
        attend: DecodeAttention,
    ) -> torch.Tensor:
        """One token for every row: ``tok``, ``pos`` [B, 1] (each row's own RoPE position), its
        K/V written at ``slot`` [1] (a device tensor, so a captured graph reads it at replay);
        ``attend`` sees the whole buffer. -> the last layer's hidden state [B, hidden]. Only
        in-place device work, so it can be graph-captured."""
        if self.step_kind == "fused":
            return self._fused_forward(cache, tok, pos, slot, attend)[:, -1]

        def write(i: int, k: torch.Tensor, v: torch.Tensor):
            cache.k[i].index_copy_(2, slot, k)  # k: [B, H_kv, 1, D]
            cache.v[i].index_copy_(2, slot, v)
            return cache.k[i], cache.v[i]

        return self._modules_forward(tok, pos, write, attend)[:, -1]

    def _modules_forward(self, ids: torch.Tensor, pos: torch.Tensor, write, attend) -> torch.Tensor:
        """ids, pos [B, T] -> hidden states after the last layer [B, T, hidden], through the
        checkpoint's submodules; ``write(i, k, v)`` caches layer i's K/V and returns the keys
        and values to attend, ``attend(q, k, v)`` is the attention."""
        h = self.embed(ids)  # [B, T, hidden]
        cos, sin = self.rotary(h, pos)  # each [B, T, D], the checkpoint's RoPE scaling
        b, t = ids.shape
        d = self.shape.head_dim
        for i, layer in enumerate(self.modules):
            proj = layer.self_attn
            x = layer.input_layernorm(h)
            q = proj.q_proj(x).view(b, t, -1, d).transpose(1, 2)  # [B, H_q, T, D]
            k = proj.k_proj(x).view(b, t, -1, d).transpose(1, 2)  # [B, H_kv, T, D]
            v = proj.v_proj(x).view(b, t, -1, d).transpose(1, 2)  # [B, H_kv, T, D]
            keys, values = write(i, _rope(k, cos, sin), v)
            out = attend(_rope(q, cos, sin), keys, values)  # [B, H_q, T, D]
            h = h + proj.o_proj(out.transpose(1, 2).reshape(b, t, -1))  # o_proj of [B, T, H_q D]
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h

    @static_shapes
    def _fused_forward(
        self,
        cache: KVCache,
        tok: torch.Tensor,
        pos: torch.Tensor,
        slot: torch.Tensor,
        attend: DecodeAttention,
    ) -> torch.Tensor:
        """tok, pos [B, 1] -> hidden states after the last layer [B, 1, hidden]."""
        h = self.embed(tok)  # [B, 1, hidden]
        cos, sin = self.rotary(h, pos)  # each [B, 1, D], outside the compiled code
        b = tok.shape[0]
        for w, k_cache, v_cache in zip(self.layers, cache.k, cache.v):
            q = self._pre(h, w, cos, sin, k_cache, v_cache, slot, self.shape)  # [B, H_q, 1, D]
            out = attend(q, k_cache, v_cache).transpose(1, 2).reshape(b, 1, -1)  # [B, 1, H_q D]
            h = self._post(h, out, w, self.shape)
        return h
