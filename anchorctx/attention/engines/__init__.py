"""Attention engines behind one interface (see :mod:`.base`), and the ``auto`` choice."""

from __future__ import annotations

from anchorctx.attention.engines import cost
from anchorctx.attention.engines.base import AttentionCall, Capabilities, Engine
from anchorctx.attention.engines.copy import FlexCopyEngine
from anchorctx.attention.engines.flex import FlexEngine
from anchorctx.attention.engines.merge import FlexMergeEngine
from anchorctx.attention.engines.sdpa import SdpaEngine
from anchorctx.attention.engines.triton_doc import TritonEngine
from anchorctx.attention.engines.varlen import FlashAttnEngine, VarlenEngine
from anchorctx.attention.errors import AttentionError

ENGINES: dict[str, Engine] = {
    e.name: e
    for e in (
        SdpaEngine(),
        FlexEngine(),
        VarlenEngine(),
        FlashAttnEngine(),
        FlexMergeEngine(),
        FlexCopyEngine(),
        TritonEngine(),
    )
}
ENGINE_NAMES: tuple[str, ...] = ("auto", *ENGINES)

# ``full`` is plain causal attention: dense cuDNN/FlashAttention through SDPA beats every
# sparse kernel there. Document-masked rows are ranked per layout by the cost rule in
# ``cost.py``; a batch mixing ``full`` with masked rows keeps the fixed order below.
_CUDA_ORDER_MIXED = ("varlen", "flash_attn", "flex", "flex_merge", "sdpa")
_CUDA_ORDER_FULL = ("sdpa", "varlen", "flash_attn", "flex")


def _ranked(call: AttentionCall) -> tuple[str, ...]:
    """Cost-rule order of the fused engines for this batch (computed once per batch)."""
    key = ("auto_ranked",)
    if key not in call.cache:
        call.cache[key] = tuple(cost.ranked(call.rows))
    return call.cache[key]


def available_engines() -> list[str]:
    """Engines usable in this process (whatever the device)."""
    return [name for name, e in ENGINES.items() if e.available()[0]]


def get_engine(name: str) -> Engine:
    if name not in ENGINES:
        raise AttentionError(f"unknown attention engine {name!r}; valid: {', '.join(ENGINE_NAMES)}")
    return ENGINES[name]


def select_engine(call: AttentionCall, name: str = "auto") -> Engine:
    """The named engine after checking it can run ``call``, or the fastest one that can."""
    if name != "auto":
        engine = get_engine(name)
        engine.check(call)
        return engine
    if call.q.device.type != "cuda":
        order: tuple[str, ...] = ("sdpa",)  # exact, with backward; flex on CPU is unfused
    elif all(v == "full" for v in call.batch.variants):
        order = _CUDA_ORDER_FULL
    elif "full" in call.batch.variants:
        order = _CUDA_ORDER_MIXED
    else:
        order = (*_ranked(call), "sdpa")
    reasons = []
    for candidate in order:
        try:
            ENGINES[candidate].check(call)
        except AttentionError as err:
            reasons.append(str(err))
            continue
        return ENGINES[candidate]
    raise AttentionError("no attention engine can run this call:\n  " + "\n  ".join(reasons))


__all__ = [
    "ENGINES",
    "ENGINE_NAMES",
    "AttentionCall",
    "Capabilities",
    "Engine",
    "available_engines",
    "get_engine",
    "select_engine",
]
