"""Batched, parallel tokenisation into an on-disk token store.

The corpus is tokenised exactly once. Token ids of every valid document go to one flat file
(uint16 when the vocabulary fits, else uint32) that later stages memory-map, and a small
per-document index (offset, length, domain, file, line) stays in memory: memory is flat in the
number of tokens, and sampling, upsampling and packing can visit documents in any order.

Workers receive batches of texts and return flat id arrays; results are consumed in submission
order with a bounded number of batches in flight, so the output is identical for any
``num_workers`` and memory does not grow with the corpus.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from array import array
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from anchorctx.packing.sources import BadInput, Record

_WORKER_TOKENIZER: Any = None


@dataclass
class DocIndex:
    """One entry per valid input document, in corpus (file, line) order."""

    offset: np.ndarray  # int64 [N], into the token store
    length: np.ndarray  # int64 [N], tokens
    domain: np.ndarray  # int32 [N], into ``domains``
    file: np.ndarray  # int32 [N], into the resolved input files
    line: np.ndarray  # int64 [N]
    domains: list[str]

    def __len__(self) -> int:
        return int(self.length.shape[0])


class TokenStore:
    """Append-only flat token file; ``view()`` memory-maps it for random access."""

    def __init__(self, path: Path, vocab_size: int) -> None:
        self.path = path
        self.dtype = np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32)
        self.size = 0
        self._fh = path.open("wb")

    def append(self, ids: np.ndarray) -> int:
        offset = self.size
        self._fh.write(np.ascontiguousarray(ids, dtype=self.dtype).tobytes())
        self.size += int(ids.shape[0])
        return offset

    def close(self) -> None:
        self._fh.close()

    def view(self) -> np.ndarray:
        if self.size == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.size,))


# ---------------------------------------------------------------------------------- encoding
def encode_texts(tokenizer: Any, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids without special tokens: (flat int64 ids, per-text lengths)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # the Rust tokenizer directly: same ids, less Python overhead
        seqs = [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    else:
        seqs = tokenizer(texts, add_special_tokens=False)["input_ids"]
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    flat = np.fromiter((t for s in seqs for t in s), dtype=np.int64, count=int(lengths.sum()))
    return flat, lengths


def _worker_init(tokenizer_path: str) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    # Imported here: a worker process loads transformers only when it starts tokenizing.
    from transformers import AutoTokenizer

    _WORKER_TOKENIZER = AutoTokenizer.from_pretrained(tokenizer_path)


def _worker_encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return encode_texts(_WORKER_TOKENIZER, texts)


def _batches(records: Iterable[Record], size: int) -> Iterator[list[Record]]:
    batch: list[Record] = []
    for rec in records:
        batch.append(rec)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def encode_batches(
    records: Iterable[Record],
    tokenizer: Any,
    tokenizer_path: str,
    *,
    batch_size: int,
    num_workers: int,
) -> Iterator[tuple[list[Record], np.ndarray, np.ndarray]]:
    """(records, flat ids, lengths) per batch, in input order, for any number of workers."""
    batches = _batches(records, batch_size)
    if num_workers <= 1:
        for batch in batches:
            yield (batch, *encode_texts(tokenizer, [r.text for r in batch]))
        return
    ctx = mp.get_context("spawn")  # no fork of a process whose tokenizer threads already ran
    with ctx.Pool(num_workers, initializer=_worker_init, initargs=(tokenizer_path,)) as pool:
        pending: deque = deque()
        for batch in batches:
            pending.append((batch, pool.apply_async(_worker_encode, ([r.text for r in batch],))))
            if len(pending) >= 2 * num_workers:  # bounded in-flight work: flat memory
                done, res = pending.popleft()
                yield (done, *res.get())
        while pending:
            done, res = pending.popleft()
            yield (done, *res.get())


# -------------------------------------------------------------------------------------- scan
def scan(
    encoded: Iterable[tuple[list[Record], np.ndarray, np.ndarray]],
    store: TokenStore,
    bad: BadInput,
    files: list[Path],
    progress: bool,
) -> DocIndex:
    """Write every document's tokens to ``store``; return the per-document index."""
    domains: dict[str, int] = {}
    # array('q'): 8 bytes per value, not a Python int object each (millions of documents).
    cols = {k: array("q") for k in ("offset", "length", "domain", "file", "line")}
    bar = tqdm(desc="tokenize", unit="tok", unit_scale=True, disable=not progress, smoothing=0.1)
    for batch, flat, lengths in encoded:
        base = store.append(flat)  # empty documents add no tokens, so offsets stay aligned
        starts = base + np.concatenate([[0], np.cumsum(lengths)[:-1]])
        for i, rec in enumerate(batch):
            if lengths[i] == 0:
                bad.report("empty_text", f"{files[rec.file_index]}:{rec.line}", "no tokens")
                continue
            cols["offset"].append(int(starts[i]))
            cols["length"].append(int(lengths[i]))
            cols["domain"].append(domains.setdefault(rec.domain, len(domains)))
            cols["file"].append(rec.file_index)
            cols["line"].append(rec.line)
        bar.update(int(flat.shape[0]))
    bar.close()
    store.close()
    return DocIndex(
        offset=np.asarray(cols["offset"], dtype=np.int64),
        length=np.asarray(cols["length"], dtype=np.int64),
        domain=np.asarray(cols["domain"], dtype=np.int32),
        file=np.asarray(cols["file"], dtype=np.int32),
        line=np.asarray(cols["line"], dtype=np.int64),
        domains=list(domains),
    )
