"""Greedy generation for evaluation: one anchor token per prompt, batched, left-padded.

Evaluation models run with transformers' stock SDPA attention. Every evaluation prompt is one
document, so causal attention *is* the anchor mask (the prompt's first token is the anchor);
SDPA dispatches to the flash / memory-efficient kernels on GPU, which keep 64K-128K prefill in
linear memory, and the KV cache makes decoding cheap.

Prompts get exactly one anchor (BOS, or EOS for tokenizers without BOS, as in training) at the
start: text is encoded without special tokens and the anchor is prepended, so a tokenizer that
adds BOS itself can never produce two.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from anchorctx.models.checkpoints import model_dir_problem
from anchorctx.models.decoding import (
    GreedyDecoder,
    StopRules,
    kv_bytes_per_token,
    plan_batches,
    unsupported_reason,
)
from anchorctx.models.loading import (
    anchor_token_id,
    load_model,
    read_model_config,
    resolve_device,
)
from anchorctx.models.settings import ModelConfig

# Set inside :func:`compile_only`.
_COMPILE_ONLY = contextvars.ContextVar("anchorctx_compile_only", default=False)


@contextlib.contextmanager
def compile_only() -> Iterator[None]:
    """Within it, :func:`generate_greedy` plans its batches exactly as it would and compiles
    the static engine's decode step for each (:meth:`GreedyDecoder.prepare`), but prefills and
    decodes nothing: every text is "". A process that runs an evaluation this way, with the
    model it will evaluate or one of the same architecture, holds the graphs that evaluation
    would compile (and the prefill attention's kernel plans) for its own later evaluations (an
    evaluation worker's), and leaves the graphs in torch's on-disk compile caches for other
    processes (:func:`anchorctx.evaluation.sharding.compile_shard`). The Hugging Face engine
    compiles nothing, so it is skipped."""
    token = _COMPILE_ONLY.set(True)
    try:
        yield
    finally:
        _COMPILE_ONLY.reset(token)


class CheckpointError(FileNotFoundError):
    """The checkpoint directory is missing or is not a Hugging Face model with tokenizer."""


def load_eval_model(
    checkpoint: str | Path,
    *,
    device: str | None = "auto",
    dtype: str = "bfloat16",
    model_overrides: dict[str, Any] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model (stock SDPA attention, eval mode) and tokenizer from a checkpoint directory.

    ``model_overrides`` are ``model.*`` settings applied on top of the checkpoint's own config,
    e.g. ``rope_scaling`` for a base model evaluated with a RoPE extension it was never trained
    with (Table 2's Free* rows; :func:`anchorctx.evaluation.results.eval_model_overrides`)."""
    path = Path(checkpoint)
    if problem := model_dir_problem(path, tokenizer=True):
        raise CheckpointError(f"not a Hugging Face checkpoint with tokenizer ({problem}): {path}")
    read_model_config(path)  # the tokenizer may read it first, naming no line or column
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model_cfg = ModelConfig(path=path, dtype=dtype, **(model_overrides or {}))
    model = load_model(
        model_cfg,
        dtype=dtype,
        device=resolve_device(device, "evaluation.device"),
        attn_implementation="sdpa",
        tokenizer=tokenizer,
    )
    return model.eval(), tokenizer


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of ``text`` with exactly one anchor token in front."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [anchor_token_id(tokenizer), *ids]


# A padded batch needs an explicit [B, 1, T, T] attention mask: SDPA then cannot use its
# implicit causal kernels and the mask alone is B·T² bytes (16 GiB at 128K). Rows of one length
# need no padding (the all-ones mask is dropped by transformers), so only those batch above this.
MAX_PADDED_TOKENS = 16384


def _batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped longest-first, so a batch pads to within a few tokens of its longest;
    long prompts of different lengths run one at a time (see MAX_PADDED_TOKENS)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        last = batches[-1] if batches else None
        fits = (
            last is not None
            and len(last) < batch_size
            and (lengths[last[0]] <= MAX_PADDED_TOKENS or lengths[i] == lengths[last[0]])
        )
        if fits and last is not None:  # fits implies a last batch; mypy cannot see it
            last.append(i)
        else:
            batches.append([i])
    return batches


def _left_pad(
    rows: Sequence[Sequence[int]], pad_id: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [B, T]
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # [B, T], 1 on real tokens
    for b, row in enumerate(rows):
        ids[b, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[b, width - len(row) :] = 1
    return ids.to(device), mask.to(device)


def _generation_config(
    tokenizer: PreTrainedTokenizerBase, max_new_tokens: int, stop: StopRules | None = None
):
    eos = tokenizer.eos_token_id
    stop = stop or StopRules()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    # A fresh config: the checkpoint's generation_config may ask for sampling; evaluation is
    # greedy (temperature/top-p unset so transformers does not warn about unused values).
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        temperature=None,
        top_p=None,
        top_k=None,
        eos_token_id=_stop_ids(tokenizer, stop),
        pad_token_id=pad if pad is not None else anchor_token_id(tokenizer),
        use_cache=True,
        stop_strings=list(stop.stop_strings) or None,
        begin_suppress_tokens=list(stop.suppress_first) or None,
    )


def _stop_ids(tokenizer: PreTrainedTokenizerBase, stop: StopRules) -> list[int]:
    """EOS and the call's stop tokens: generation ends a row after any of them."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return sorted(set(ids) | set(stop.stop_token_ids))


ENGINES = ("auto", "hf", "static")


def _pick_engine(
    engine: str, model: PreTrainedModel, encoded: Sequence[Sequence[int]], new: int
) -> str:
    """``auto``: the static engine where the model supports it (else Hugging Face generate)."""
    if engine not in ENGINES:
        raise ValueError(f"generation engine {engine!r}: expected one of {', '.join(ENGINES)}")
    if engine != "auto":
        return engine
    longest = max((len(e) for e in encoded), default=0)
    return "static" if unsupported_reason(model, longest + new) is None else "hf"


def _generate_static(
    model,
    tokenizer,
    encoded,
    *,
    max_new_tokens,
    batch_size,
    stop,
    bar,
    on_batch,
    deterministic=False,
) -> list[str]:
    """The static-cache engine over length-bucketed batches (``batch_size`` rows at most, and
    as many cache slots as fit in free device memory)."""
    decoder = GreedyDecoder(model, deterministic=deterministic)
    free = decoder.free_bytes()
    # 60% of free memory for the KV cache of a batch; the rest is prefill activations and
    # allocator slack (the cache of a 7B MHA model is 0.5 MiB per token).
    budget = None if free is None else int(0.6 * free) // kv_bytes_per_token(model)
    plan = plan_batches(
        [len(e) + max_new_tokens for e in encoded], max_rows=batch_size, max_tokens=budget
    )
    stop = stop or StopRules()
    rules = StopRules(
        stop_token_ids=tuple(_stop_ids(tokenizer, stop)),
        stop_strings=stop.stop_strings,
        suppress_first=stop.suppress_first,
    )
    config = _generation_config(tokenizer, max_new_tokens)
    out: list[str] = [""] * len(encoded)
    for batch in plan:
        if _COMPILE_ONLY.get():
            lengths = [len(encoded[i]) for i in batch]
            decoder.prepare(
                lengths, max_new_tokens=max_new_tokens, pad_id=config.pad_token_id, stop=rules
            )
            _deliver(batch, [""] * len(batch), out, on_batch, bar)
            continue
        new = decoder.generate(
            [encoded[i] for i in batch],
            max_new_tokens=max_new_tokens,
            pad_id=config.pad_token_id,
            stop=rules,
            decode=lambda ids: tokenizer.decode(ids),
        )
        _deliver(batch, tokenizer.batch_decode(new, skip_special_tokens=True), out, on_batch, bar)
    decoder.release()
    return out


def _deliver(batch: list[int], texts: list[str], out: list, on_batch, bar) -> None:
    """Place a batch's texts at their prompts' indices, hand them to ``on_batch``, advance."""
    for i, text in zip(batch, texts):
        out[i] = text
    if on_batch is not None:
        on_batch(batch, texts)
    bar.update(len(batch))


def generate_greedy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    batch_size: int = 1,
    progress: bool = True,
    desc: str = "generate",
    on_batch: Callable[[list[int], list[str]], None] | None = None,
    engine: str = "auto",
    stop: StopRules | None = None,
    deterministic: bool = False,
    encoded: Sequence[Sequence[int]] | None = None,
) -> list[str]:
    """Greedy continuations of ``prompts`` (decoded, special tokens dropped), in input order.

    Stops at ``max_new_tokens``, EOS or ``stop``'s rules. ``on_batch(indices, texts)`` is called
    after every batch (indices into ``prompts``), so callers can persist results as they are
    produced. ``engine``: ``hf`` (transformers ``generate``, the reference), ``static``
    (:mod:`anchorctx.models.decoding`: static KV cache, CUDA-graph decode) or ``auto`` (static
    where the model supports it). Both give the same tokens up to floating-point rounding.
    ``deterministic``: the static engine's decode uses a run-to-run deterministic attention
    kernel (slower at long lengths; see :class:`anchorctx.models.decoding.GreedyDecoder`).
    ``encoded``: the prompts' token ids as ``encode_prompt`` gives them, when the caller holds
    them already (RULER's sample cache: encoding a 16K prompt costs ~20 ms of CPU).
    """
    if encoded is None:
        encoded = [encode_prompt(tokenizer, p) for p in prompts]
    elif len(encoded) != len(prompts):
        raise ValueError(f"{len(encoded)} encoded prompts for {len(prompts)} prompts")
    bar = tqdm(total=len(prompts), desc=desc, unit="sample", disable=not progress)
    static = bool(prompts) and _pick_engine(engine, model, encoded, max_new_tokens) == "static"
    if not static and _COMPILE_ONLY.get():
        bar.close()
        return [""] * len(prompts)
    if static:
        texts = _generate_static(
            model,
            tokenizer,
            encoded,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            stop=stop,
            bar=bar,
            on_batch=on_batch,
            deterministic=deterministic,
        )
        bar.close()
        return texts
    config = _generation_config(tokenizer, max_new_tokens, stop)
    device = next(model.parameters()).device
    out: list[str | None] = [None] * len(prompts)
    for batch in _batches([len(e) for e in encoded], batch_size):
        ids, mask = _left_pad([encoded[i] for i in batch], config.pad_token_id, device)
        with torch.inference_mode():
            seqs = model.generate(  # type: ignore[operator]  # GenerationMixin's, untyped for mypy
                input_ids=ids,
                attention_mask=mask,
                generation_config=config,
                tokenizer=tokenizer if config.stop_strings else None,
            )
        new = seqs[:, ids.shape[1] :]  # [B, new tokens]: everything after the (padded) prompt
        _deliver(batch, tokenizer.batch_decode(new, skip_special_tokens=True), out, on_batch, bar)
    bar.close()
    return [t or "" for t in out]
