"""Static-cache greedy decoding for Hugging Face decoder-only RoPE models (Llama, Mistral, Qwen2).

Why not ``model.generate``: on a 7B model at 32K its host-side work per token (logits
processors, stopping criteria, cache bookkeeping, a mask rebuilt every step) costs several times
the GPU time of the step itself, and ``cache_implementation="static"`` recompiles at every step.

The forward is :class:`~anchorctx.models.decoder.StaticDecoder` (built once per model: the
checkpoint's weights, its RoPE scaling, GQA, qkv bias, tied embeddings; its own KV cache); this
module is the loop around it: batches, the decode step's attention kernel, CUDA-graph capture,
stopping.

- KV cache: one static buffer ``[B, H_kv, S, D]`` per layer, sized for the batch. Prompts are
  right-aligned to a common end slot ``W`` (the longest prompt), so at decode step ``i`` every
  row writes slot ``W + i``, while each row keeps its own RoPE positions (``len(row) + i``).
- Prefill runs one row at a time without padding, so SDPA uses its implicit-causal (flash)
  kernels and no ``[B, T, T]`` mask exists; prompts that would not fit in one pass are prefilled
  in chunks (later chunks attend the cached earlier ones through a ``[C, end]`` mask).
- Decode: one step = one token for every row, attention over the whole buffer with a boolean
  slot mask ``[B, 1, 1, S]``. On CUDA the step, including the argmax, the stop bookkeeping and
  the counters, is captured once as a CUDA graph and replayed, so a step costs one launch.
  The step's attention kernel is a choice (``DECODE_ATTENTIONS``): SDPA's pick (cuDNN on
  Hopper: fast, not run-to-run deterministic), SDPA's memory-efficient kernel, or FlexAttention
  (compiled; its decoding kernel splits the keys into a fixed number of blocks and reduces them
  in a second kernel, so it is deterministic), whose mask reads the slot mask from device memory,
  so the captured graph sees the slots each replay makes visible.
- The decode step's layers are a choice too (``DECODE_STEPS``): "hf" runs the checkpoint's
  submodules (the reference), "fused" the same weights merged (q/k/v and gate/up as one GEMV
  each) with norms, RoPE and residuals fused by ``torch.compile``, with the same attention.
- Rows stop on their stop tokens (the caller puts EOS among them); stop strings are checked on
  the host every ``sync_every`` steps; the loop exits once every row has stopped.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from anchorctx.models import decoder as static
from anchorctx.models.decoder import DECODE_STEPS, DecodeAttention, KVCache, StaticDecoder

# Buffer lengths round up to this: batches of similar length then reuse one captured graph, and
# the mask's row stride stays aligned for SDPA's memory-efficient kernel (it wants multiples of 8).
SLOT_ROUND = 128
# Decode steps between host checks ("has every row stopped?", stop strings). A check is one
# device-to-host copy; every 16 steps it costs well under 1% at 7B scale and wastes at most 15
# steps after the last row stopped.
SYNC_EVERY = 16
# Decode-step attention kernels: "sdpa" = PyTorch's pick for a masked single query (cuDNN on
# H100/H200), "efficient" = SDPA's memory-efficient kernel, "flex" = compiled FlexAttention.
DECODE_ATTENTIONS = ("sdpa", "efficient", "flex")
# The kernel ``deterministic=True`` selects: the fastest of the run-to-run deterministic ones
# (docs/benchmarks/2026-11-23-decode-attention-determinism.md).
DETERMINISTIC_ATTENTION = "flex"
# Triton options of FlexAttention's decoding kernel on CUDA (``kernel_options``). Fixed split
# count, so still deterministic; the best of bench/decode_attention_sweep.py's variants on H200
# (7B-shaped attention alone: 0.59 ms against 0.93 ms with flex's own choice at 128K, batch 1).
FLEX_KERNEL_OPTIONS: dict[str, int] = {"SPLIT_KV": 32, "num_stages": 3}
__all__ = [
    "DECODE_ATTENTIONS",
    "DECODE_STEPS",
    "GreedyDecoder",
    "StopRules",
    "UnsupportedModelError",
    "kv_bytes_per_token",
    "plan_batches",
    "unsupported_reason",
]


class UnsupportedModelError(ValueError):
    """The model cannot run through the static engine (architecture or attention variant)."""


@dataclass(frozen=True)
class StopRules:
    """Per-call stopping and first-token rules.

    ``stop_token_ids``: a row stops after producing one of these (the token is kept).
    ``stop_strings``: a row stops at the first token whose decoded continuation contains one.
    ``suppress_first``: tokens that may not be the first generated token.
    """

    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    suppress_first: tuple[int, ...] = ()


def unsupported_reason(model, total_tokens: int) -> str | None:
    """Why ``model`` cannot decode ``total_tokens`` (prompt + new) here; None when it can."""
    reason = static.unsupported_reason(model)
    if reason is not None:
        return reason
    cfg = model.config
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", True) is False:
        window = None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        window = None
    if window is not None and total_tokens > window:
        return f"sliding_window {window} < {total_tokens} tokens (the static mask is full causal)"
    return None


def kv_bytes_per_token(model) -> int:
    """Bytes of K and V cache one token occupies over all layers."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    itemsize = model.model.embed_tokens.weight.element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * itemsize


def plan_batches(
    lengths: Sequence[int], *, max_rows: int, max_tokens: int | None = None, min_fill: float = 0.75
) -> list[list[int]]:
    """Indices grouped longest first into batches for one static cache each.

    A batch holds at most ``max_rows`` rows and ``max_tokens`` cache slots (rows × its longest
    length), and only rows at least ``min_fill`` of its longest (padding costs decode reads).
    With a memory-derived ``max_tokens``, 64K-128K prompts end up alone and short ones batch.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        last = batches[-1] if batches else None
        if last is not None:
            longest = lengths[last[0]]
            fits = (
                len(last) < max_rows
                and (max_tokens is None or (len(last) + 1) * longest <= max_tokens)
                and lengths[i] >= min_fill * longest
            )
            if fits:
                last.append(i)
                continue
        batches.append([i])
    return batches


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _flex_decode(q, k, v, visible, kv_blocks, kv_index, scale):
    """FlexAttention of ``q`` [B, H, 1, D] over ``k``/``v`` [B, H_kv, S, D] where ``visible``
    [B, S] is True. Every key block is listed as partial (none full, none skipped), so the mask
    is evaluated per slot at run time from ``visible``'s memory: the block structure stays fixed
    while decoding makes slots visible, which a captured graph needs."""

    def mask_mod(b, h, q_idx, kv_idx):
        return visible[b, kv_idx]

    block_mask = BlockMask.from_kv_blocks(
        kv_blocks,
        kv_index,
        BLOCK_SIZE=SLOT_ROUND,
        mask_mod=mask_mod,
        seq_lengths=(q.shape[2], k.shape[2]),
        compute_q_blocks=False,
    )
    return flex_attention(
        q,
        k,
        v,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
        kernel_options=(dict(FLEX_KERNEL_OPTIONS) or None) if q.is_cuda else None,
    )


@functools.cache
def _compiled_flex_decode():
    # Compiled once per process; a new batch shape compiles a static graph of its own (as the
    # fused step, anchorctx.models.decoder._compiled, says why). Uncompiled, flex_attention
    # materializes the scores (fine on CPU, in tests).
    # Only the deterministic modes decode with flex: Inductor's choices made without timing.
    options = static.inductor_options(deterministic=True)
    return torch.compile(_flex_decode, fullgraph=True, dynamic=False, options=options)


def _eager_flex_decode(*args):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return _flex_decode(*args)


def _grouped_sdpa_decode(q, k, v, mask, scale):
    """SDPA of one decode step for a GQA model without copying K/V: ``q`` [B, H_q, 1, D] over
    ``k``/``v`` [B, H_kv, S, D] where ``mask`` [B, 1, 1, S] is True -> [B, H_q, 1, D].

    Why: given a mask, transformers' SDPA call expands K and V to H_q heads first
    (``repeat_kv``: SDPA's own GQA falls back to its math kernel with a mask), so every step
    reads the cache, writes H_q / H_kv copies of it and reads those again, ~5x the cache bytes
    at H_q / H_kv = 2 (measured on an H200: 58 ms per step at 56 x 16K, against a 10.5 ms HBM
    floor). Query head h uses KV head h // g (g = H_q / H_kv, repeat_kv's order), so the g
    query heads of KV head j are rows j*g .. j*g+g-1: viewed as g queries of one head they
    attend the cache once, each row with exactly its own softmax (rows are independent)."""
    b, heads, t, d = q.shape  # t = 1: the [B, 1, 1, S] mask broadcasts over the g rows
    kv_heads = k.shape[1]
    grouped = q.reshape(b, kv_heads, heads // kv_heads * t, d)  # [B, H_kv, g, D]
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, heads, t, d)  # [B, H_q, 1, D] (CUDA kernels may return it strided)


@dataclass(eq=False)
class _Batch:
    """Device buffers of one batch shape; a captured graph reads and writes exactly these."""

    key: tuple  # (batch, slots, new tokens, stop ids, pad id): when the buffers can be reused
    cache: KVCache
    mask: torch.Tensor  # [B, 1, 1, S] bool: slots each row's attention sees
    tok: torch.Tensor  # [B, 1] the token fed to the step
    pos: torch.Tensor  # [B, 1] its RoPE position
    slot: torch.Tensor  # [1] the cache slot the step writes
    step: torch.Tensor  # [1] the output column being written
    done: torch.Tensor  # [B] bool
    out: torch.Tensor  # [B, new tokens]
    stop_ids: torch.Tensor  # [stop tokens + 1]
    pad: torch.Tensor  # [] the token stopped rows produce
    kv_blocks: torch.Tensor  # [1, 1, 1] FlexAttention: key blocks per row and head
    kv_index: torch.Tensor  # [1, 1, 1, S / SLOT_ROUND] FlexAttention: their indices
    graph: torch.cuda.CUDAGraph | None = field(default=None)

    @classmethod
    def allocate(
        cls, decoder: StaticDecoder, batch: int, slots: int, new_tokens: int, stop_ids, pad_id: int
    ) -> _Batch:
        device = decoder.weight.device

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=device)

        # FlexAttention's block list: all S / SLOT_ROUND key blocks for every row and head
        # (broadcast over rows and heads).
        blocks = slots // SLOT_ROUND
        return cls(
            key=(batch, slots, new_tokens, tuple(stop_ids), pad_id),
            cache=decoder.allocate(batch, slots),
            mask=zeros(batch, 1, 1, slots, dtype=torch.bool),
            tok=zeros(batch, 1),
            pos=zeros(batch, 1),
            slot=zeros(1),
            step=torch.ones(1, dtype=torch.long, device=device),
            done=zeros(batch, dtype=torch.bool),
            out=torch.full((batch, new_tokens), pad_id, dtype=torch.long, device=device),
            # -1 never matches a token: keeps the comparison shape fixed without stop tokens.
            stop_ids=torch.tensor([*stop_ids, -1], dtype=torch.long, device=device),
            pad=torch.tensor(pad_id, dtype=torch.long, device=device),
            kv_blocks=torch.full((1, 1, 1), blocks, dtype=torch.int32, device=device),
            kv_index=torch.arange(blocks, dtype=torch.int32, device=device).view(1, 1, 1, -1),
        )

    def mutable(self) -> list[torch.Tensor]:
        return [self.mask, self.tok, self.pos, self.step, self.done, self.out, self.slot]


class GreedyDecoder:
    """Greedy continuations of token-id prompts with a static KV cache (see the module doc).

    ``use_graph``: capture the decode step as a CUDA graph (default: on CUDA). ``prefill_chunk``:
    prefill at most this many tokens per pass (default: one pass when the activations fit in
    free memory, else the largest chunk that does; always one pass on CPU).

    ``attention``: the decode step's attention kernel, one of ``DECODE_ATTENTIONS`` (default
    "sdpa", or ``DETERMINISTIC_ATTENTION`` when ``deterministic``). SDPA's pick on CUDA is cuDNN's
    kernel, fast but not run-to-run deterministic (measured on H200, torch 2.11: two runs of the
    same batch gave different greedy tokens after a few dozen steps on a random 7B-shaped model);
    "efficient" and "flex" give the same tokens on every run
    (docs/benchmarks/2026-11-23-decode-attention-determinism.md has speeds). On CPU "sdpa" and
    "efficient" are the same kernel and "flex" runs uncompiled.

    ``step``: the decode step's layers, one of ``DECODE_STEPS`` (default: "fused" on CUDA where
    the model allows it, else "hf"; docs/benchmarks/2026-11-23-fused-decode-step.md has the speeds).
    "fused" merges the model's q/k/v and gate/up parameters into one tensor each (no extra memory,
    see :func:`anchorctx.models.decoder._merged`). The built forward is ``self.decoder``.
    """

    def __init__(
        self,
        model,
        *,
        use_graph: bool | None = None,
        prefill_chunk: int | None = None,
        sync_every: int = SYNC_EVERY,
        deterministic: bool = False,
        attention: str | None = None,
        step: str | None = None,
    ):
        if attention is None:
            attention = DETERMINISTIC_ATTENTION if deterministic else "sdpa"
        if attention not in DECODE_ATTENTIONS:
            raise ValueError(
                f"decode attention {attention!r}: expected one of {', '.join(DECODE_ATTENTIONS)}"
            )
        if deterministic and attention == "sdpa":
            raise ValueError("deterministic decoding needs attention 'efficient' or 'flex'")
        if step is not None and step not in DECODE_STEPS:
            raise ValueError(f"decode step {step!r}: expected one of {', '.join(DECODE_STEPS)}")
        self.model = model
        self.attention = attention
        self.deterministic = attention != "sdpa"
        self.device = model.model.embed_tokens.weight.device
        self.use_graph = (self.device.type == "cuda") if use_graph is None else use_graph
        self.prefill_chunk = prefill_chunk
        self.sync_every = sync_every
        self._batch: _Batch | None = None
        self.step = step or self._default_step()
        # The fused step merges the weights now (and names an unsupported model here); the hf
        # step's forward is built at first use, after ``generate`` has checked the model.
        self._decoder: StaticDecoder | None = self._build() if self.step == "fused" else None

    def _default_step(self) -> str:
        fusable = (
            static.unsupported_reason(self.model) is None
            and static.fused_unsupported_reason(self.model) is None
        )
        return "fused" if self.device.type == "cuda" and fusable else "hf"

    def _build(self) -> StaticDecoder:
        try:
            return StaticDecoder(self.model, step=self.step, deterministic=self.deterministic)
        except ValueError as e:
            raise UnsupportedModelError(str(e)) from None

    @property
    def decoder(self) -> StaticDecoder:
        """The model's static forward (:class:`~anchorctx.models.decoder.StaticDecoder`)."""
        if self._decoder is None:
            self._decoder = self._build()
        return self._decoder

    @decoder.setter
    def decoder(self, built: StaticDecoder) -> None:
        self.release()
        self._decoder = built

    def release(self) -> None:
        """Free the cached batch buffers and graph."""
        self._batch = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def free_bytes(self) -> int | None:
        """Device memory free for caches (counting the buffers held now as free); None on CPU."""
        if self.device.type != "cuda":
            return None
        self.release()
        return torch.cuda.mem_get_info(self.device)[0]

    def _chunk(self, n: int) -> int:
        if self.prefill_chunk:
            return self.prefill_chunk
        if self.device.type != "cuda":
            return n
        cfg = self.model.config
        itemsize = self.model.model.embed_tokens.weight.element_size()
        # Live activations of one layer per token: residual, norm, q/k/v, attention and o_proj
        # outputs (≈ 6 hidden) and the MLP's gate, up, activation and product (4 intermediate).
        per_token = itemsize * (6 * cfg.hidden_size + 4 * cfg.intermediate_size)
        free = torch.cuda.mem_get_info(self.device)[0] * 0.8  # allocator slack, SDPA workspace
        if n * per_token <= free:
            return n
        # A later chunk also holds its [chunk, end] boolean mask: n bytes per query.
        return max(1024, int(free // (per_token + n)) // 1024 * 1024)

    # -- prefill -------------------------------------------------------------------------------
    def _prefill(
        self, cache: KVCache, row: int, first_slot: int, ids: Sequence[int], suppress: Sequence[int]
    ) -> torch.Tensor:
        """Cache one row's prompt at slots [first_slot, first_slot + len); its first new token."""
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)  # [1, n]
        h = self.decoder.prefill(cache, row, first_slot, x, self._chunk(len(ids)))  # [1, hidden]
        logits = self.decoder.logits(h)[0].float()  # [vocab]
        if suppress:
            logits[list(suppress)] = float("-inf")
        return logits.argmax()

    # -- decode --------------------------------------------------------------------------------
    def _decode_attention(self, b: _Batch) -> DecodeAttention:
        """The step's attention over ``b``'s buffers with the chosen kernel."""
        scale = self.decoder.shape.scaling
        if self.attention in ("sdpa", "efficient"):
            mask = b.mask  # [B, 1, 1, S]
            return lambda q, k, v: _grouped_sdpa_decode(q, k, v, mask, scale)
        flex = _compiled_flex_decode() if self.device.type == "cuda" else _eager_flex_decode
        visible = b.mask[:, 0, 0]  # [B, S]
        return lambda q, k, v: flex(q, k, v, visible, b.kv_blocks, b.kv_index, scale)

    @static.static_shapes
    def _step(self, b: _Batch) -> None:
        """One token for every row; only in-place device work, so it can be graph-captured."""
        b.mask.index_fill_(3, b.slot, True)  # the slot written now becomes visible
        # SDPA's kernel choice is a context; it only narrows the choice on CUDA (on CPU the
        # memory-efficient kernel is SDPA's pick anyway).
        kernel = (
            sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION])
            if self.attention == "efficient" and self.device.type == "cuda"
            else contextlib.nullcontext()
        )
        with kernel:
            h = self.decoder.step(b.cache, b.tok, b.pos, b.slot, self._decode_attention(b))
        nxt = self.decoder.logits(h).argmax(-1)  # [B]
        nxt = torch.where(b.done, b.pad, nxt)
        b.out.index_copy_(1, b.step, nxt[:, None])
        b.done |= (nxt[:, None] == b.stop_ids[None]).any(-1)
        b.tok.copy_(nxt[:, None])
        b.pos.add_(1)
        b.slot.add_(1)
        b.step.add_(1)

    def _capture(self, b: _Batch) -> None:
        # One eager warm-up on a side stream (cuBLAS handles, kernel selection), its effects on
        # the counters and mask undone; its K/V write is the same one the first replay makes.
        saved = [t.clone() for t in b.mutable()]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        for t, s in zip(b.mutable(), saved):
            t.copy_(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step(b)
        b.graph = graph

    def _buffers(self, batch: int, slots: int, new_tokens: int, stop_ids, pad_id: int) -> _Batch:
        key = (batch, slots, new_tokens, tuple(stop_ids), pad_id)
        if self._batch is None or self._batch.key != key:
            self.release()
            self._batch = _Batch.allocate(self.decoder, batch, slots, new_tokens, stop_ids, pad_id)
        return self._batch

    def _batch_for(
        self, lengths: Sequence[int], max_new_tokens: int, pad_id: int, stop: StopRules
    ) -> tuple[_Batch, int]:
        """The buffers for prompts of ``lengths`` (reused when the last batch had the same
        shape) and W, the prompts' common end slot."""
        if min(lengths) < 1 or max_new_tokens < 1:
            raise ValueError("every prompt needs a token and max_new_tokens must be >= 1")
        width = max(lengths)  # W: the common end slot of the prompts
        reason = unsupported_reason(self.model, width + max_new_tokens)
        if reason is not None:
            raise UnsupportedModelError(f"static decoding: {reason}")
        # The last new token is never fed back, so it needs no slot.
        slots = _round_up(width + max_new_tokens - 1, SLOT_ROUND)
        stop_ids = sorted(set(stop.stop_token_ids))
        return self._buffers(len(lengths), slots, max_new_tokens, stop_ids, pad_id), width

    def prepare(
        self,
        lengths: Sequence[int],
        *,
        max_new_tokens: int,
        pad_id: int,
        stop: StopRules = StopRules(),
    ) -> None:
        """Compile (and capture) the decode step ``generate`` would run for prompts of these
        token ``lengths``, without prefilling or decoding them.

        Why: the fused step and FlexAttention compile one static graph per batch shape (a few
        seconds each), and torch keeps what it compiled in its on-disk caches (Inductor's FX
        graph cache, Triton's kernels). A process that calls ``prepare`` for the batch shapes a
        later evaluation will decode leaves that evaluation's graphs in the cache, and the
        evaluation then loads instead of compiling them. The step runs once on the zeroed
        buffers; ``generate`` overwrites everything it wrote. Each prompt length's prefill
        attention runs once too (:meth:`StaticDecoder.warm_prefill`): a kernel that builds a
        plan per shape (cuDNN's, on Hopper) builds it now, in this process, for an evaluation
        that runs in it next (an evaluation worker's).
        """
        b, width = self._batch_for(lengths, max_new_tokens, pad_id, stop)
        with torch.inference_mode():
            warmed = set()
            for r, n in enumerate(lengths):  # each prompt length's prefill attention, once
                if n not in warmed:
                    self.decoder.warm_prefill(b.cache, r, width - n, n, self._chunk(n))
                    warmed.add(n)
            if max_new_tokens < 2:  # generate's first token comes from the prefill: no step
                return
            if b.graph is None and self.use_graph:
                self._capture(b)
            elif not self.use_graph:
                self._step(b)

    def generate(
        self,
        rows: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        pad_id: int,
        stop: StopRules = StopRules(),
        decode: Callable[[list[int]], str] | None = None,
    ) -> list[list[int]]:
        """New tokens per row, up to and including the token that stopped it.

        ``decode`` (token ids -> text) is needed only for ``stop.stop_strings``.
        """
        if stop.stop_strings and decode is None:
            raise ValueError("StopRules.stop_strings needs a decode function")
        lengths = [len(r) for r in rows]
        b, width = self._batch_for(lengths, max_new_tokens, pad_id, stop)
        with torch.inference_mode():
            b.mask.zero_()
            for r, n in enumerate(lengths):
                b.mask[r, 0, 0, width - n : width] = True
            firsts = [
                self._prefill(b.cache, r, width - n, rows[r], stop.suppress_first)
                for r, n in enumerate(lengths)
            ]
            first = torch.stack(firsts)  # [B]
            b.out.fill_(pad_id)
            b.out[:, 0] = first
            b.done.copy_((first[:, None] == b.stop_ids[None]).any(-1))
            b.tok.copy_(first[:, None])
            b.pos.copy_(torch.tensor(lengths, device=self.device)[:, None])
            b.slot.fill_(width)
            b.step.fill_(1)
            string_stop: dict[int, int] = {}
            produced = 1
            while produced < max_new_tokens:
                if b.graph is None and self.use_graph:
                    self._capture(b)
                if b.graph is not None:
                    b.graph.replay()
                else:
                    self._step(b)
                produced += 1
                if produced % self.sync_every == 0 or produced == max_new_tokens:
                    if stop.stop_strings:
                        self._check_strings(b, produced, stop.stop_strings, decode, string_stop)
                    if bool(b.done.all()):
                        break
            out = b.out[:, :produced].tolist()
        ends = set(stop.stop_token_ids)
        return [self._truncate(row, ends, string_stop.get(r)) for r, row in enumerate(out)]

    @staticmethod
    def _check_strings(b: _Batch, produced: int, strings, decode, found: dict[int, int]) -> None:
        """Mark rows whose text contains a stop string; remember where (tokens kept)."""
        done = b.done.tolist()
        tokens = b.out[:, :produced].tolist()
        for r, row in enumerate(tokens):
            if done[r] or r in found:
                continue
            if any(s in decode(row) for s in strings):
                # the shortest prefix that already contains a stop string
                k = next(
                    k for k in range(1, len(row) + 1) if any(s in decode(row[:k]) for s in strings)
                )
                found[r] = k
                b.done[r] = True

    @staticmethod
    def _truncate(row: list[int], stop_ids: set[int], string_end: int | None) -> list[int]:
        end = len(row) if string_end is None else string_end
        for i, t in enumerate(row[:end]):
            if t in stop_ids:
                return row[: i + 1]
        return row[:end]
