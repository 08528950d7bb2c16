"""Packing planned documents into rows of exactly ``seq_len + 1`` tokens (docs/ARCHITECTURE.md,
packed dataset).

A row is ``[anchor] + segments``: index 0 holds the anchor token and belongs to segment 0. Its
``seq_len + 1`` tokens give the model ``seq_len`` inputs (``row[:-1]``) and ``seq_len`` targets
(``row[1:]``), as AnchorContext's ``train.py`` cuts a row of ``seq_length + 1`` tokens. Each
document is ``[tag] + tokens + [separator]``; tag tokens are masked out of the loss. A document
that does not fit continues in the next row as a new segment with the same ``seg_doc``, so no
token is lost except those of the final partial row (counted). With interleaved chunks a
document is cut at random points into 2-3 chunks; chunks of all documents are shuffled, each
document's chunks stay in order, its tag precedes the first chunk and its separator follows the
last.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from anchorctx.packing.mixture import DocumentPlan
from anchorctx.packing.tokens import DocIndex

# Token kinds, for loss masking and statistics.
ANCHOR, TAG, TEXT, SEP = 0, 1, 2, 3

SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("seg_lens", pa.list_(pa.int32())),
        ("seg_doc", pa.list_(pa.int32())),
        ("seg_domain", pa.list_(pa.string())),
        ("loss_mask", pa.list_(pa.uint8())),
    ]
)


@dataclass(frozen=True)
class Units:
    """Pieces of planned documents in packing order: document ``doc[i]``, tokens [start, end)."""

    doc: np.ndarray  # int64 [U], position in the plan (= seg_doc)
    start: np.ndarray  # int64 [U]
    end: np.ndarray  # int64 [U]
    first: np.ndarray  # bool [U], the document's first piece (gets the tag)
    last: np.ndarray  # bool [U], the document's last piece (gets the separator)


def whole_documents(plan: DocumentPlan) -> Units:
    ones = np.ones(len(plan), dtype=bool)
    return Units(np.arange(len(plan)), np.zeros(len(plan), np.int64), plan.take.copy(), ones, ones)


def interleaved_chunks(plan: DocumentPlan, chunks: tuple[int, int], seed: int) -> Units:
    """Cut each document into ``chunks[0]..chunks[1]`` pieces at random points; shuffle pieces
    across documents keeping each document's order (paper Section 5.2)."""
    rng = np.random.default_rng([seed, 3])
    lo, hi = chunks
    n = np.minimum(rng.integers(lo, hi + 1, size=len(plan)), plan.take)  # <= one token per chunk
    starts: list[np.ndarray] = []
    for i, take in enumerate(plan.take):
        cuts = _cut_points(rng, int(take), int(n[i]))
        starts.append(np.concatenate([[0], cuts]))
    # Shuffle the multiset of document ids; the k-th occurrence of a document is its k-th chunk.
    slots = rng.permutation(np.repeat(np.arange(len(plan)), n))
    by_doc = np.argsort(slots, kind="stable")
    first_pos = np.concatenate([[0], np.cumsum(n)[:-1]])
    k = np.empty_like(slots)
    k[by_doc] = np.arange(slots.size) - np.repeat(first_pos, n)
    start = np.array([starts[d][c] for d, c in zip(slots, k)], dtype=np.int64)
    end = np.array(
        [starts[d][c + 1] if c + 1 < n[d] else plan.take[d] for d, c in zip(slots, k)],
        dtype=np.int64,
    )
    return Units(slots, start, end, k == 0, k == n[slots] - 1)


def _cut_points(rng: np.random.Generator, length: int, pieces: int) -> np.ndarray:
    if pieces <= 1:
        return np.zeros(0, dtype=np.int64)
    while True:  # distinct interior points; collisions are rare for real documents
        cuts = np.sort(rng.integers(1, length, size=pieces - 1))
        if np.unique(cuts).size == cuts.size:
            return cuts


@dataclass
class PackStats:
    rows: int = 0
    text_tokens: Counter = field(default_factory=Counter)  # by domain, in emitted rows
    tag_tokens: int = 0
    separator_tokens: int = 0
    dropped_tokens: int = 0  # all tokens of the final partial row (anchor excluded)
    dropped_text_tokens: Counter = field(default_factory=Counter)


class RowPacker:
    """Accumulates segments into one row and emits it when it holds ``seq_len + 1`` tokens
    (``row_len``): the anchor, then ``seq_len`` tokens of documents."""

    def __init__(self, seq_len: int, anchor: int, n_docs: int) -> None:
        self.seq_len, self.anchor = seq_len, anchor
        self.row_len = seq_len + 1
        self.stats = PackStats()
        self.emitted = np.zeros(n_docs, dtype=bool)  # documents with a token in an emitted row
        self._reset()

    def _reset(self) -> None:
        self.ids: list[np.ndarray] = [np.array([self.anchor], dtype=np.int64)]
        self.kinds: list[np.ndarray] = [np.array([ANCHOR], dtype=np.uint8)]
        self.segs: list[tuple[int, int, str]] = []  # (len, doc, domain)
        self.fill = 1

    def add(self, ids: np.ndarray, kinds: np.ndarray, doc: int, domain: str) -> Iterator[dict]:
        """Append one document piece; yield every row it completes."""
        pos = 0
        while pos < ids.size:
            n = min(self.row_len - self.fill, ids.size - pos)
            self.ids.append(ids[pos : pos + n])
            self.kinds.append(kinds[pos : pos + n])
            # The anchor at index 0 belongs to the row's first segment.
            self.segs.append((n + (1 if not self.segs else 0), doc, domain))
            self.fill += n
            pos += n
            if self.fill == self.row_len:
                yield self._emit()

    def _emit(self) -> dict:
        ids, kinds = np.concatenate(self.ids), np.concatenate(self.kinds)
        self._count(kinds, self.stats.text_tokens)
        self.stats.rows += 1
        self.stats.tag_tokens += int((kinds == TAG).sum())
        self.stats.separator_tokens += int((kinds == SEP).sum())
        self.emitted[[d for _, d, _ in self.segs]] = True
        row = {
            "input_ids": ids.astype(np.int32),
            "seg_lens": np.array([s[0] for s in self.segs], dtype=np.int32),
            "seg_doc": np.array([s[1] for s in self.segs], dtype=np.int32),
            "seg_domain": [s[2] for s in self.segs],
            # 1 where token t is a target predicted from t-1: never the anchor or a tag.
            "loss_mask": ((kinds == TEXT) | (kinds == SEP)).astype(np.uint8),
        }
        self._reset()
        return row

    def _count(self, kinds: np.ndarray, into: Counter) -> None:
        start = 0
        for n, _, domain in self.segs:
            into[domain] += int((kinds[start : start + n] == TEXT).sum())
            start += n

    def finish(self) -> None:
        """Drop (and count) the final partial row."""
        if self.segs:
            kinds = np.concatenate(self.kinds)
            self.stats.dropped_tokens += self.fill - 1
            self._count(kinds, self.stats.dropped_text_tokens)
        self._reset()


def pack_rows(
    units: Units,
    plan: DocumentPlan,
    index: DocIndex,
    tokens: np.ndarray,
    packer: RowPacker,
    tags: dict[str, np.ndarray],
    separator: np.ndarray,
) -> Iterator[dict]:
    """Rows of the packed dataset, in order (a pure function of its inputs)."""
    sep_kinds = np.full(separator.size, SEP, dtype=np.uint8)
    for u in range(units.doc.size):
        d = int(units.doc[u])
        src = int(plan.doc[d])
        domain = index.domains[int(index.domain[src])]
        off = int(index.offset[src])
        body = np.asarray(tokens[off + units.start[u] : off + units.end[u]], dtype=np.int64)
        pieces, kinds = [body], [np.full(body.size, TEXT, dtype=np.uint8)]
        if units.first[u] and domain in tags:
            pieces.insert(0, tags[domain])
            kinds.insert(0, np.full(tags[domain].size, TAG, dtype=np.uint8))
        if units.last[u] and separator.size:
            pieces.append(separator)
            kinds.append(sep_kinds)
        yield from packer.add(np.concatenate(pieces), np.concatenate(kinds), d, domain)
    packer.finish()


def write_arrow(rows: Iterator[dict], path: Path, batch_rows: int = 64) -> int:
    """Stream rows into an Arrow IPC stream file (the format ``datasets`` memory-maps)."""
    n = 0
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, SCHEMA) as writer:
        batch: list[dict] = []
        for row in rows:
            batch.append(row)
            n += 1
            if len(batch) == batch_rows:
                writer.write_batch(_record_batch(batch))
                batch = []
        if batch:
            writer.write_batch(_record_batch(batch))
    return n


def _list_array(values: list, typ: pa.DataType) -> pa.ListArray:
    lengths = np.array([len(v) for v in values], dtype=np.int32)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    if typ == pa.string():
        flat = pa.array([x for v in values for x in v], type=typ)
    else:
        flat = pa.array(np.concatenate(values), type=typ)
    return pa.ListArray.from_arrays(offsets, flat)


def _record_batch(rows: list[dict]) -> pa.RecordBatch:
    cols = [_list_array([r[f.name] for r in rows], f.type.value_type) for f in SCHEMA]
    return pa.RecordBatch.from_arrays(cols, schema=SCHEMA)
