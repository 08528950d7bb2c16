"""transformers integration: one attention implementation named ``"anchorctx"``.

Registered through ``transformers.AttentionInterface`` (no library file is patched, no module
is monkey-patched). The layouts travel as a forward kwarg, which transformers hands unchanged
to every attention call::

    from anchorctx.attention import build_layout, hf
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=hf.register())
    layouts = [build_layout(seg_lens, "anchor", seg_doc) for seg_lens, seg_doc in rows]
    out = model(input_ids=ids, use_cache=False, **hf.model_inputs(layouts, device=ids.device))

A custom implementation name gets ``attention_mask=None`` from transformers, so the mask is
built here from the layouts alone. The function infers head grouping from tensor shapes, so it
also runs when DeepSpeed's Ulysses wrapper calls it with the full sequence and a subset of heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import AttentionInterface, PretrainedConfig

from anchorctx.attention.api import attend
from anchorctx.attention.errors import AttentionError
from anchorctx.attention.layout import Layout, LayoutBatch

NAME = "anchorctx"
LAYOUT_KWARG = "anchorctx_layout"
ENGINE_KWARG = "anchorctx_engine"


def anchorctx_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query [B, H, T, D], key/value [B, H_kv, T, D] -> ([B, T, H, D], None)."""
    layout = kwargs.get(LAYOUT_KWARG)
    if layout is None:
        raise AttentionError(
            f"the {NAME!r} attention needs the packed-row layouts: call the model with "
            f"**anchorctx.attention.hf.model_inputs(layouts); for generation or plain causal "
            f"inputs load the model with attn_implementation='sdpa'"
        )
    if query.shape[2] != key.shape[2]:
        raise AttentionError(
            f"q_len={query.shape[2]} != kv_len={key.shape[2]}: a KV cache is in use; the "
            f"{NAME!r} attention is for training and full-row scoring (use_cache=False). "
            "For generation load the model with attn_implementation='sdpa'"
        )
    _reject_unsupported(module, query.shape[2], dropout, kwargs)
    out = attend(
        query, key, value, layout, engine=kwargs.get(ENGINE_KWARG) or "auto", scale=scaling
    )
    return out.transpose(1, 2), None  # [B, T, H, D]


def _reject_unsupported(module: torch.nn.Module, t: int, dropout: float, kwargs: dict) -> None:
    if dropout and module.training:
        raise AttentionError(
            f"attention dropout={dropout} is not supported by {NAME!r}; set the model config's "
            "attention_dropout to 0"
        )
    window = kwargs.get("sliding_window")
    if window is not None and t > window:
        raise AttentionError(
            f"sliding_window={window} < sequence length {t}: {NAME!r} implements full-causal "
            "document masks only; set the model config's sliding_window to None"
        )
    if kwargs.get("softcap") is not None:
        raise AttentionError(f"attention logit softcapping is not supported by {NAME!r}")


def register() -> str:
    """Register ``"anchorctx"`` with transformers' ``AttentionInterface`` (idempotent).

    Wrappers of this function (Ulysses sequence parallelism, float32 RoPE) are registered under
    names of their own and selected per model, so registering the plain name again (every
    ``load_model`` does) never undoes a wrapper, in whatever order models are loaded.
    """
    AttentionInterface.register(NAME, anchorctx_attention)
    return NAME


def attention_name(model: torch.nn.Module) -> str:
    """The attention implementation ``model`` dispatches to. transformers (5.17-5.23) has a
    public setter (``set_attn_implementation``) but no public getter: the config's
    ``_attn_implementation`` is read here and nowhere else in the library."""
    # torch's Module.__getattr__ types model.config as Tensor | Module: narrowed here.
    config = getattr(model, "config", None)
    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"{type(model).__name__} has no transformers config (model.config)")
    return config._attn_implementation


def select_attention(model: torch.nn.Module, name: str) -> None:
    """Make ``model`` dispatch to the registered implementation ``name`` (public API), or raise
    if the model does not dispatch through ``AttentionInterface``."""
    setter = getattr(model, "set_attn_implementation", None)  # transformers models have it
    if setter is not None:
        setter(name)
    if attention_name(model) != name:
        raise RuntimeError(
            f"{type(model).__name__} did not accept attn_implementation={name!r}: it must "
            "dispatch attention through transformers' AttentionInterface"
        )


def model_inputs(
    layouts: Layout | Sequence[Layout],
    engine: str = "auto",
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """Forward kwargs for a batch of packed rows: ``position_ids`` [B, T] and the layouts.

    Position ids come from the layouts (restarting per segment for ``intra_doc_reset``,
    continuing otherwise). The layouts stay a non-tensor kwarg describing the full rows, so
    sequence-parallel data adapters never shard them.
    """
    rows = [layouts] if isinstance(layouts, Layout) else list(layouts)
    if device is not None:
        rows = [row.to(device) for row in rows]
    batch = LayoutBatch(rows)
    return {"position_ids": batch.position_ids, LAYOUT_KWARG: batch, ENGINE_KWARG: engine}
