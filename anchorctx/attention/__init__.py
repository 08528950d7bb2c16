"""AnchorAttention core: packed-row layouts, attention engines, transformers integration.

>>> from anchorctx.attention import build_layout, attend
>>> layout = build_layout([5, 3], "anchor")
>>> layout.position_ids.tolist()
[0, 1, 2, 3, 4, 5, 6, 7]

The names below load on first use (PEP 562): the config validates against
:mod:`anchorctx.attention.names`, and importing that must not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from anchorctx import lazy

if TYPE_CHECKING:
    from anchorctx.attention.api import attend
    from anchorctx.attention.engines import ENGINE_NAMES, available_engines
    from anchorctx.attention.errors import AttentionError, LayoutError
    from anchorctx.attention.layout import VARIANTS, Layout, LayoutBatch, build_layout, dense_mask

# public name -> the module that defines it
_EXPORTS = {
    "attend": "anchorctx.attention.api",
    "ENGINE_NAMES": "anchorctx.attention.engines",
    "available_engines": "anchorctx.attention.engines",
    "AttentionError": "anchorctx.attention.errors",
    "LayoutError": "anchorctx.attention.errors",
    "VARIANTS": "anchorctx.attention.layout",
    "Layout": "anchorctx.attention.layout",
    "LayoutBatch": "anchorctx.attention.layout",
    "build_layout": "anchorctx.attention.layout",
    "dense_mask": "anchorctx.attention.layout",
}

__all__ = [
    "ENGINE_NAMES",
    "VARIANTS",
    "AttentionError",
    "Layout",
    "LayoutBatch",
    "LayoutError",
    "attend",
    "available_engines",
    "build_layout",
    "dense_mask",
]


__getattr__, __dir__ = lazy.exports(__name__, _EXPORTS)
