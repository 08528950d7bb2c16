"""AnchorAttention core: packed-row layouts, attention engines, transformers integration.

>>> from anchorctx.attention import build_layout, attend
>>> layout = build_layout([5, 3], "anchor")
>>> layout.position_ids.tolist()
[0, 1, 2, 3, 4, 5, 6, 7]
"""

from anchorctx.attention.api import attend
from anchorctx.attention.engines import ENGINE_NAMES, available_engines
from anchorctx.attention.errors import AttentionError, LayoutError
from anchorctx.attention.layout import VARIANTS, Layout, LayoutBatch, build_layout, dense_mask

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
