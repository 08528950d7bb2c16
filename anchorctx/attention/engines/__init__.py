"""Attention engines behind one interface (see :mod:`.base`), and the ``auto`` choice.

The engines are the classes ``anchorctx/attention/names.py`` registers (``ENGINE_CLASSES``;
how to add one is described there), one instance each, in that order. ``auto`` derives its
orders from what each engine declares: its ranks (``Engine.auto``, :class:`.base.AutoRanks`)
and, for document-masked rows on CUDA, its cost (:mod:`.cost`).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from anchorctx.attention.engines import cost
from anchorctx.attention.engines.base import AttentionCall, AutoRanks, Capabilities, Engine
from anchorctx.attention.errors import AttentionError
from anchorctx.attention.layout import Layout
from anchorctx.attention.names import ENGINE_CLASSES, ENGINE_NAMES


def _instance(name: str, target: str) -> Engine:
    module, _, attr = target.partition(":")
    engine = getattr(importlib.import_module(module), attr)()
    if engine.name != name:
        raise ImportError(f"{target} is registered as {name!r} but is named {engine.name!r}")
    return engine


ENGINES: dict[str, Engine] = {name: _instance(name, t) for name, t in ENGINE_CLASSES.items()}


def preference(situation: str) -> tuple[str, ...]:
    """Engines ``auto`` tries in ``situation`` (a field of :class:`AutoRanks`), lowest rank
    first; equal ranks keep the registry order."""
    ranked = [
        (rank, i, name)
        for i, (name, engine) in enumerate(ENGINES.items())
        if (rank := getattr(engine.auto, situation)) is not None
    ]
    return tuple(name for _, _, name in sorted(ranked))


def estimate(engine: str, rows: Sequence[Layout], tile: int = cost.TILE) -> float:
    """Estimated forward+backward cost of ``engine`` on document-masked ``rows`` (tile units)."""
    found = ENGINES[engine].cost(cost.TileCounts.of(rows, tile)) if engine in ENGINES else None
    if found is None:
        raise ValueError(f"no cost model for engine {engine!r}")
    return found


def ranked(rows: Sequence[Layout]) -> list[str]:
    """The engines ``auto`` ranks on document-masked rows (a ``masked`` rank and a cost),
    cheapest first; equal costs keep the ``masked`` rank order (a stable sort)."""
    counts = cost.TileCounts.of(rows)
    costs = {
        name: c for name in preference("masked") if (c := ENGINES[name].cost(counts)) is not None
    }
    return sorted(costs, key=costs.__getitem__)


def auto_order(device_type: str, rows: Sequence[Layout]) -> tuple[str, ...]:
    """The engines ``auto`` tries, in order, for a batch of ``rows`` on ``device_type``."""
    variants = {row.variant for row in rows}
    if device_type != "cuda":
        return preference("other")
    if variants == {"full"}:
        return preference("full")
    if "full" in variants:
        return preference("mixed")
    order = ranked(rows)
    return (*order, *(name for name in preference("masked") if name not in order))


def _auto_order(call: AttentionCall) -> tuple[str, ...]:
    """:func:`auto_order` of this batch (computed once per batch: it ranks by cost)."""
    key = ("auto_order", call.q.device.type)
    if key not in call.cache:
        call.cache[key] = auto_order(call.q.device.type, call.rows)
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
    reasons = []
    for candidate in _auto_order(call):
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
    "AutoRanks",
    "Capabilities",
    "Engine",
    "auto_order",
    "available_engines",
    "get_engine",
    "preference",
    "select_engine",
]
