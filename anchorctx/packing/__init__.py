"""Data pipeline: sources, mixture sampling, length upsampling, tokenising, packing with the
anchor token, domain tags, interleaved chunks, statistics, and the synthetic demo corpus.

The packed dataset format is the contract in docs/ARCHITECTURE.md: ``datasets.save_to_disk`` rows of exactly
``seq_len`` tokens (``input_ids``, ``seg_lens``, ``seg_doc``, ``seg_domain``, ``loss_mask``) with
``manifest.json`` beside them.
"""

from anchorctx.packing.demo import DemoCorpus, ensure_demo_corpus, write_demo_corpus
from anchorctx.packing.pipeline import load_packed, prepare_data
from anchorctx.packing.sources import DataError

__all__ = [
    "DataError",
    "DemoCorpus",
    "ensure_demo_corpus",
    "load_packed",
    "prepare_data",
    "write_demo_corpus",
]
