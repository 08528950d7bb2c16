"""Data pipeline: sources, mixture sampling, length upsampling, tokenising, packing with the
anchor token, domain tags, interleaved chunks and statistics (the synthetic demo corpus is in
:mod:`anchorctx.demo`).

The packed dataset format is the contract in docs/ARCHITECTURE.md: ``datasets.save_to_disk`` rows of exactly
``seq_len`` tokens (``input_ids``, ``seg_lens``, ``seg_doc``, ``seg_domain``, ``loss_mask``) with
``manifest.json`` beside them.
"""

from anchorctx.packing.pipeline import load_packed, prepare_data
from anchorctx.packing.sources import DataError

__all__ = [
    "DataError",
    "load_packed",
    "prepare_data",
]
