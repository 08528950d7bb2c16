"""Data pipeline: sources, mixture sampling, length upsampling, tokenising, packing with the
anchor token, domain tags, interleaved chunks and statistics (the synthetic demo corpus is in
:mod:`anchorctx.demo`).

The packed dataset format is the contract in docs/ARCHITECTURE.md: ``datasets.save_to_disk``
rows of exactly ``seq_len + 1`` tokens (``seq_len`` inputs, ``seq_len`` targets) (``input_ids``, ``seg_lens``, ``seg_doc``, ``seg_domain``,
``loss_mask``) with ``manifest.json`` beside them.

The names below load on first use (PEP 562): the config reads :mod:`anchorctx.packing.settings`,
and importing that must not import the pipeline (numpy, pyarrow, transformers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from anchorctx import lazy

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


__getattr__, __dir__ = lazy.exports(__name__, _EXPORTS)
