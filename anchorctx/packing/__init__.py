"""Data pipeline: sources, mixture sampling, length upsampling, tokenising, packing with the
anchor token, domain tags, interleaved chunks and statistics (the synthetic demo corpus is in
:mod:`anchorctx.demo`).

The packed dataset format is the contract in docs/ARCHITECTURE.md: ``datasets.save_to_disk``
rows of exactly ``seq_len`` tokens (``input_ids``, ``seg_lens``, ``seg_doc``, ``seg_domain``,
``loss_mask``) with ``manifest.json`` beside them.

The names below load on first use (PEP 562): the config reads :mod:`anchorctx.packing.settings`,
and importing that must not import the pipeline (numpy, pyarrow, transformers).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from anchorctx.packing.pipeline import load_packed, prepare_data
    from anchorctx.packing.sources import DataError

# public name -> the module that defines it
_EXPORTS = {
    "DataError": "anchorctx.packing.sources",
    "load_packed": "anchorctx.packing.pipeline",
    "prepare_data": "anchorctx.packing.pipeline",
}

__all__ = [
    "DataError",
    "load_packed",
    "prepare_data",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
