"""Synthetic packed rows with a heavy-tailed document-length distribution (benchmarks).

Document lengths are log-normal (median ``median_doc`` tokens, sigma 1.2 — a long tail of
documents many times the median, like web/book mixtures), cut at the row end. Token ids are
uniform; segment 0 starts with the anchor. Throughput depends only on the lengths.
"""

from __future__ import annotations

import numpy as np

from anchorctx.training.data import Row, make_row

# Benchmark model shapes: Llama-2-7B width (depth chosen per run) and a CPU smoke-test width.
VOCAB = 32000
WIDTH_7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32}
SMOKE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4}


def doc_lengths(seq_len: int, rng: np.random.Generator, median_doc: int = 1024) -> list[int]:
    lens: list[int] = []
    while sum(lens) < seq_len:
        n = int(np.clip(rng.lognormal(np.log(median_doc), 1.2), 16, seq_len))
        lens.append(min(n, seq_len - sum(lens)))
    return lens


def synthetic_row(
    seq_len: int,
    variant: str,
    *,
    seed: int,
    vocab: int,
    sp: int = 1,
    anchor_id: int = 1,
    median_doc: int = 1024,
) -> Row:
    rng = np.random.default_rng(seed)
    total = seq_len + 1  # a packed row: seq_len inputs and seq_len targets (docs/ARCHITECTURE.md)
    lens = doc_lengths(total, rng, median_doc)
    ids = rng.integers(2, vocab, size=total)
    ids[0] = anchor_id
    mask = np.ones(total, dtype=np.uint8)
    mask[0] = 0
    record = {
        "input_ids": ids,
        "loss_mask": mask,
        "seg_lens": lens,
        "seg_doc": list(range(len(lens))),
    }
    return make_row(record, seq_len, sp, variant, pad_id=anchor_id)
