"""Attended (query, key) pairs of packed rows, counted in closed form from their segments.

The one definition of the work a masked kernel does on a row: :attr:`Layout.attended_pairs`
(one row), the training plan's attention time and the report's attention work (every row of a
packed dataset at once) all count through :func:`row_pairs`. All tokens of one document see
each other causally wherever its chunks sit, so a document of ``N`` tokens contributes
``N(N+1)/2`` pairs; the anchor adds one key for every token outside the anchor's own document
(the first segment's); ``full`` is ``T(T+1)/2``. Counted per document, never over T×T.

numpy only: the training plan counts a dataset's rows without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from anchorctx.attention.errors import LayoutError
from anchorctx.attention.names import VARIANTS


@dataclass(frozen=True)
class RowPairs:
    """Per row (int64 arrays of one entry a row): what each variant's pairs are made of."""

    tokens: np.ndarray  # T: the row's tokens after the cut and the padding
    documents: np.ndarray  # distinct documents among them (the padding segment is one)
    document_masked: np.ndarray  # Σ N(N+1)/2 over the documents: intra_doc, intra_doc_reset
    anchor_keys: np.ndarray  # what the anchor adds: the tokens outside its own document

    def of(self, variant: str) -> np.ndarray:
        """Attended pairs of each row under ``variant``."""
        if variant not in VARIANTS:
            raise LayoutError(
                f"unknown attention variant {variant!r}; valid: {', '.join(VARIANTS)}"
            )
        if variant == "full":
            return self.tokens * (self.tokens + 1) // 2
        if variant == "anchor":
            return self.document_masked + self.anchor_keys
        return self.document_masked


def row_pairs(
    seg_lens: Any, seg_doc: Any, counts: Any, tokens: Any = None, multiple: int = 1
) -> RowPairs:
    """The pairs of packed rows given by their segments.

    ``seg_lens`` and ``seg_doc``: every row's segments one after another (flat; chunks of one
    document share an id within a row); ``counts``: segments per row (each at least 1).
    ``tokens``: keep each row's first ``tokens`` tokens (an int, or one per row; default all of
    them), the last kept segment cut short; ``multiple``: then pad each row to a multiple of it
    with one segment of a document of its own, as training pads a row for sequence parallelism.
    """
    lens = np.asarray(seg_lens, dtype=np.int64)
    docs = np.asarray(seg_doc, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    if len(lens) != len(docs) or int(counts.sum()) != len(lens) or (counts < 1).any():
        raise LayoutError(
            f"row_pairs: {len(lens)} segment lengths, {len(docs)} document ids and segment "
            f"counts summing to {int(counts.sum())} (each at least 1) do not describe rows"
        )
    rows = len(counts)
    row = np.repeat(np.arange(rows), counts)
    first = np.cumsum(counts) - counts  # index of each row's first segment
    ends = np.cumsum(lens)
    start = ends - lens - (ends - lens)[first][row]  # a segment's first token within its row
    totals = np.zeros(rows, dtype=np.int64)
    np.add.at(totals, row, lens)
    real = totals if tokens is None else np.minimum(np.asarray(tokens, dtype=np.int64), totals)
    taken = np.clip(real[row] - start, 0, lens)
    # One group per (row, document); document ids renumbered 0.. so that any ints will do.
    doc_index = np.unique(docs, return_inverse=True)[1].reshape(-1)
    width = int(doc_index.max()) + 1 if len(doc_index) else 1
    keys, group = np.unique(row * width + doc_index, return_inverse=True)
    group = group.reshape(-1)
    n = np.zeros(len(keys), dtype=np.int64)
    np.add.at(n, group, taken)
    owner = keys // width
    masked = np.zeros(rows, dtype=np.int64)
    np.add.at(masked, owner, n * (n + 1) // 2)
    documents = np.bincount(owner[n > 0], minlength=rows).astype(np.int64)
    pad = -(-real // multiple) * multiple - real
    masked += pad * (pad + 1) // 2
    documents += pad > 0
    t = real + pad
    return RowPairs(t, documents, masked, t - n[group[first]])
