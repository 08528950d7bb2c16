"""Packed-row layouts: which key each query may see, and the position ids the row uses.

A packed row of ``T`` tokens is a list of segments (``seg_lens``, summing to ``T``); segment 0
starts with the anchor token at index 0. ``seg_doc`` maps each segment to a document id, so
interleaved chunks of one document share an id. Query ``q`` may attend to key ``kv`` iff
``kv <= q`` and

=================  =================================  =====================================
variant            condition                          position ids
=================  =================================  =====================================
full               always                             0..T-1
intra_doc          doc(kv) == doc(q)                  0..T-1
intra_doc_reset    doc(kv) == doc(q)                  restart at 0 at each segment start
anchor             doc(kv) == doc(q) or kv == 0       0..T-1
=================  =================================  =====================================

A :class:`Layout` is immutable; engines cache what they derive from it (dense masks, flex block
masks, varlen plans) in its private cache, so a layout built once per batch is reused by every
layer of the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from anchorctx.attention.errors import LayoutError
from anchorctx.attention.names import VARIANTS
from anchorctx.attention.pairs import row_pairs

DOCUMENT_MASKED: frozenset[str] = frozenset({"intra_doc", "intra_doc_reset", "anchor"})


@dataclass(frozen=True, eq=False)
class Layout:
    """The attention layout of one packed row (identity semantics: ``==`` is ``is``)."""

    seg_lens: tuple[int, ...]
    seg_doc: tuple[int, ...]
    variant: str
    position_ids: torch.Tensor  # LongTensor [T]
    doc_ids: torch.Tensor  # IntTensor [T]: seg_doc of each token's segment
    cu_seqlens: torch.Tensor  # IntTensor [n_segments + 1]: segment boundaries
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def seq_len(self) -> int:
        return sum(self.seg_lens)

    @property
    def num_segments(self) -> int:
        return len(self.seg_lens)

    @property
    def num_documents(self) -> int:
        return len(set(self.seg_doc))

    @property
    def device(self) -> torch.device:
        return self.position_ids.device

    @property
    def seg_starts(self) -> tuple[int, ...]:
        starts, pos = [], 0
        for n in self.seg_lens:
            starts.append(pos)
            pos += n
        return tuple(starts)

    @property
    def attended_pairs(self) -> int:
        """Number of allowed (query, key) pairs: the work a sparse kernel has to do
        (:func:`anchorctx.attention.pairs.row_pairs`, the one count)."""
        pairs = row_pairs(self.seg_lens, self.seg_doc, [self.num_segments])
        return int(pairs.of(self.variant)[0])

    def attention_flops(self, num_heads: int, head_dim: int, *, backward: bool = False) -> float:
        """Useful (masked) attention FLOPs of one layer on this row.

        Forward: two matmuls of ``2·d`` FLOPs per allowed pair and head; forward+backward is
        3.5× forward (the backward recomputes QK^T and does four matmuls).
        """
        fwd = 4.0 * head_dim * num_heads * self.attended_pairs
        return fwd * 3.5 if backward else fwd

    def to(self, device: torch.device | str) -> Layout:
        """The same layout with tensors on ``device`` (cached; ``self`` if already there)."""
        device = torch.device(device)
        if _same_device(self.device, device):
            return self
        key = ("to", str(device))
        if key not in self._cache:
            self._cache[key] = Layout(
                self.seg_lens,
                self.seg_doc,
                self.variant,
                self.position_ids.to(device),
                self.doc_ids.to(device),
                self.cu_seqlens.to(device),
            )
        return self._cache[key]

    def mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Dense boolean mask [T, T], ``True`` where query (row) may attend to key (column).

        Materialises T×T: for the reference engine and tests (fine up to a few K tokens).
        """
        layout = self.to(device) if device is not None else self
        key = ("mask",)
        if key not in layout._cache:
            layout._cache[key] = dense_mask(layout.doc_ids, layout.variant)
        return layout._cache[key]


def dense_mask(doc_ids: torch.Tensor, variant: str) -> torch.Tensor:
    """Boolean mask [T, T] of a variant from per-token document ids [T]."""
    t = doc_ids.shape[0]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril_()
    if variant == "full":
        return causal
    allowed = causal & (doc_ids[:, None] == doc_ids[None, :])
    if variant == "anchor":
        allowed[:, 0] = True
    return allowed


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    # "cuda" and "cuda:0" name the same device when the current device is 0.
    if a.type == "cuda" and (a.index is None or b.index is None):
        current = torch.cuda.current_device()
        return (a.index if a.index is not None else current) == (
            b.index if b.index is not None else current
        )
    return a.index == b.index


def _as_int_tuple(values: Any, name: str) -> tuple[int, ...]:
    if isinstance(values, torch.Tensor) or hasattr(values, "tolist"):
        values = values.tolist()
    try:
        out = tuple(values)
    except TypeError:
        raise LayoutError(
            f"{name} must be a sequence of integers, got {type(values).__name__}"
        ) from None
    for i, v in enumerate(out):
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer():
                continue
            raise LayoutError(f"{name}[{i}] = {v!r} is not an integer")
    return tuple(int(v) for v in out)


def _validate(seg_lens: tuple[int, ...], seg_doc: tuple[int, ...], variant: str) -> None:
    if variant not in VARIANTS:
        raise LayoutError(f"unknown attention variant {variant!r}; valid: {', '.join(VARIANTS)}")
    if not seg_lens:
        raise LayoutError("seg_lens is empty: a packed row needs at least one segment")
    for i, n in enumerate(seg_lens):
        if n <= 0:
            raise LayoutError(f"seg_lens[{i}] = {n}: segment lengths must be positive")
    if len(seg_doc) != len(seg_lens):
        raise LayoutError(
            f"seg_doc has {len(seg_doc)} entries but seg_lens has {len(seg_lens)}: "
            "give one document id per segment (or seg_doc=None: one document per segment)"
        )


def build_layout(
    seg_lens: Sequence[int] | torch.Tensor,
    variant: str,
    seg_doc: Sequence[int] | torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> Layout:
    """The layout of one packed row.

    Args:
        seg_lens: segment lengths (sum = T); segment 0 starts with the anchor token.
        variant: one of ``full``, ``intra_doc``, ``intra_doc_reset``, ``anchor``.
        seg_doc: document id of each segment (chunks of one document share an id);
            default: every segment is its own document.
        device: where the layout's tensors live (default CPU).
    """
    lens = _as_int_tuple(seg_lens, "seg_lens")
    docs = tuple(range(len(lens))) if seg_doc is None else _as_int_tuple(seg_doc, "seg_doc")
    _validate(lens, docs, variant)
    device = torch.device(device) if device is not None else torch.device("cpu")
    lens_t = torch.tensor(lens, dtype=torch.long)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens_t, 0)
    t = int(cu[-1])
    doc_ids = torch.repeat_interleave(torch.tensor(docs, dtype=torch.int32), lens_t)
    positions = torch.arange(t, dtype=torch.long)
    if variant == "intra_doc_reset":
        # Position of a token = its offset from its segment's start.
        positions = positions - torch.repeat_interleave(cu[:-1].long(), lens_t)
    return Layout(lens, docs, variant, positions.to(device), doc_ids.to(device), cu.to(device))


class LayoutBatch(Sequence[Layout]):
    """Per-row layouts of one micro-batch, with the engines' per-batch plans cached on it.

    ``anchorctx.attention.hf.model_inputs`` returns one of these so that every layer of a
    forward (and its backward) reuses one block mask / varlen plan.
    """

    def __init__(self, layouts: Sequence[Layout]):
        rows = tuple(layouts)
        if not rows:
            raise LayoutError("a layout batch needs at least one row layout")
        for i, row in enumerate(rows):
            if not isinstance(row, Layout):
                raise LayoutError(
                    f"layouts[{i}] is a {type(row).__name__}, expected an anchorctx Layout "
                    "(build one with anchorctx.attention.build_layout)"
                )
        lengths = {row.seq_len for row in rows}
        if len(lengths) > 1:
            raise LayoutError(f"row layouts of one batch differ in length: {sorted(lengths)}")
        self.rows: tuple[Layout, ...] = rows
        self.cache: dict[Any, Any] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def __iter__(self) -> Iterator[Layout]:
        return iter(self.rows)

    def __repr__(self) -> str:
        return f"LayoutBatch({len(self.rows)} rows, T={self.seq_len}, variant={self.variants})"

    @property
    def seq_len(self) -> int:
        return self.rows[0].seq_len

    @property
    def variants(self) -> tuple[str, ...]:
        return tuple(sorted({row.variant for row in self.rows}))

    @property
    def shared(self) -> bool:
        """Every row has the same layout object (engines may broadcast one mask)."""
        return all(row is self.rows[0] for row in self.rows)

    @property
    def position_ids(self) -> torch.Tensor:
        """LongTensor [B, T]."""
        return torch.stack([row.position_ids for row in self.rows])

    def attention_flops(self, num_heads: int, head_dim: int, *, backward: bool = False) -> float:
        return sum(r.attention_flops(num_heads, head_dim, backward=backward) for r in self.rows)
