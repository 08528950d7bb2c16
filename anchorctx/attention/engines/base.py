"""The engine interface: one ``forward`` behind declared capabilities.

An engine states which devices it runs on, where it has a backward, which dtypes and variants
it supports and whether it handles grouped-query attention natively. ``check`` turns every
unsupported combination into an :class:`AttentionError` that names an engine that can do it,
before any kernel runs. It also states where ``auto`` tries it (:class:`AutoRanks`) and, to
take part in the cost rule (:mod:`.cost`), its estimated cost (:meth:`Engine.cost`). Engines
are registered in ``anchorctx/attention/names.py`` (``ENGINE_CLASSES``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from anchorctx.attention.engines.cost import TileCounts
from anchorctx.attention.errors import AttentionError
from anchorctx.attention.layout import Layout, LayoutBatch
from anchorctx.attention.names import VARIANTS


@dataclass(frozen=True)
class Capabilities:
    devices: frozenset[str]
    backward_devices: frozenset[str]
    dtypes: frozenset[torch.dtype] | None  # None: any floating dtype
    variants: frozenset[str] = frozenset(VARIANTS)
    max_head_dim: int | None = None
    #: devices where the backward is run-to-run deterministic under torch's deterministic mode
    #: (``training.deterministic``): the same inputs give bit-identical gradients. Checked on a
    #: GPU by tests/test_determinism_gpu.py.
    deterministic_backward: frozenset[str] = frozenset()


@dataclass(frozen=True)
class AutoRanks:
    """Where ``engine="auto"`` tries an engine, lowest rank first; None: ``auto`` never takes it
    there (it still runs when named). The situations, decided per batch:

    - ``full``: on CUDA, every row ``full``;
    - ``mixed``: on CUDA, ``full`` rows beside document-masked ones;
    - ``masked``: on CUDA, document-masked rows only. Engines with a :meth:`Engine.cost` come
      first, cheapest first, equal costs in rank order; then those without one, in rank order;
    - ``other``: any device but CUDA.

    Ranks are compared across engines only within one situation; spaced values (10, 20, ...)
    leave room for a new engine between two others.
    """

    full: int | None = None
    mixed: int | None = None
    masked: int | None = None
    other: int | None = None


@dataclass
class AttentionCall:
    """One validated call: q [B, H, T, D], k/v [B, H_kv, T, D], the rows' layouts."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    batch: LayoutBatch
    cache: dict[Any, Any]  # where per-batch plans live (the batch's, or a shared layout's)
    scale: float

    @property
    def needs_grad(self) -> bool:
        return torch.is_grad_enabled() and any(t.requires_grad for t in (self.q, self.k, self.v))

    @property
    def shared(self) -> bool:
        return self.batch.shared

    @property
    def rows(self) -> tuple[Layout, ...]:
        return self.batch.rows


class Engine(ABC):
    name: str = ""
    capabilities: Capabilities
    #: engine to suggest when this one cannot run a call
    alternative: str = "sdpa"
    #: where ``auto`` tries this engine (default: never)
    auto: AutoRanks = AutoRanks()

    def cost(self, tiles: TileCounts) -> float | None:
        """Estimated forward+backward time on a batch of document-masked rows, in the cost
        rule's tile units (:mod:`.cost`); None: no cost model, not ranked by cost."""
        return None

    def available(self) -> tuple[bool, str]:
        """(usable in this process, why not)."""
        return True, ""

    def check(self, call: AttentionCall) -> None:
        """Raise :class:`AttentionError` naming an alternative if this engine cannot run."""
        ok, why = self.available()
        if not ok:
            raise AttentionError(f"engine {self.name!r} is not available: {why}")
        caps, dev = self.capabilities, call.q.device.type
        if dev not in caps.devices:
            raise AttentionError(
                f"engine {self.name!r} does not run on {dev} (runs on: "
                f"{', '.join(sorted(caps.devices))}); use engine={self.alternative!r}"
            )
        if call.needs_grad and dev not in caps.backward_devices:
            raise AttentionError(
                f"engine {self.name!r} has no backward on {dev}; use engine='sdpa' for training "
                f"on {dev} (or run under torch.no_grad())"
            )
        if (
            call.needs_grad
            and torch.are_deterministic_algorithms_enabled()
            and dev not in caps.deterministic_backward
        ):
            able = ", ".join(sorted(caps.deterministic_backward)) or "no device"
            raise AttentionError(
                f"engine {self.name!r} has no deterministic backward on {dev} (deterministic on: "
                f"{able}), and torch's deterministic mode is on (training.deterministic); use "
                "engine='sdpa' or 'auto', or set training.deterministic=false"
            )
        if caps.dtypes is not None and call.q.dtype not in caps.dtypes:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in caps.dtypes))
            raise AttentionError(
                f"engine {self.name!r} needs {names} inputs, got {call.q.dtype}; "
                "use engine='sdpa' or 'flex' for other dtypes"
            )
        for variant in call.batch.variants:
            if variant not in caps.variants:
                raise AttentionError(f"engine {self.name!r} does not support variant {variant!r}")
        d = call.q.shape[-1]
        if caps.max_head_dim is not None and d > caps.max_head_dim:
            raise AttentionError(
                f"engine {self.name!r} supports head_dim <= {caps.max_head_dim}, got {d}; "
                "use engine='flex' or 'sdpa'"
            )

    @abstractmethod
    def forward(self, call: AttentionCall) -> torch.Tensor:
        """Attention output [B, H, T, D] (may be a non-contiguous view)."""
