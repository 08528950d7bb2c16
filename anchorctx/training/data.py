"""Deterministic global batches from the packed dataset, sharded for DP × SP ranks.

Order. Epoch ``e`` visits the rows in ``permutation(seed, e)``; the global sample stream is the
concatenation of epochs and step ``s`` takes samples ``[s·G, (s+1)·G)``. The data cursor of a
run is therefore just its step: ``--resume`` continues the identical sequence of batches, and
every rank derives its own share without communication.

Rows. A packed row holds ``seq_len + 1`` tokens (docs/ARCHITECTURE.md, packed dataset): the
model sees ``row[:-1]`` (``seq_len`` tokens, the length that must divide by the SP degree) and
every input position has a target in ``row[1:]``, as AnchorContext's ``train.py`` cuts its rows
(``seq_length + 1`` tokens, ``seq_length`` targets).

Sharding. Sample ``i`` of a step goes to accumulation slot ``i // (DP·micro)``, DP rank
``(i // micro) % DP``; within a replica the row is cut into SP contiguous shards of
``T / SP`` tokens (rows are padded to a multiple of SP first). Every rank also counts the
targets of the whole global batch, so the loss is normalised by one exact global count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from anchorctx.attention import build_layout
from anchorctx.attention.pairs import RowPairs, row_pairs
from anchorctx.training.loss import count_targets, shifted_targets
from anchorctx.training.plan import Parallelism, padded_length

COLUMNS = ("input_ids", "seg_lens", "seg_doc", "loss_mask")


@dataclass
class Row:
    """One packed row after truncation/padding: ids, targets [T]; its segments."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    seg_lens: tuple[int, ...]
    seg_doc: tuple[int, ...]
    real_tokens: int


@dataclass
class MicroBatch:
    """This rank's share of one micro-batch. ``input_ids``/``targets`` are [B, T/SP]; the
    layouts describe the FULL rows (the attention sees the whole sequence after all-to-all)."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    layouts: list[Any]
    shard: slice

    @property
    def num_targets(self) -> int:
        return count_targets(self.targets)


@dataclass
class StepData:
    micro_batches: list[MicroBatch]
    global_targets: int  # targets in the whole global batch (all ranks, all micro-batches)
    global_tokens: int  # real (unpadded) tokens in the whole global batch
    attention_pairs: int  # allowed (query, key) pairs over the global batch (for MFU)


def truncate_segments(seg_lens: Sequence[int], seg_doc: Sequence[int], t: int):
    """Segments covering the first ``t`` tokens (the last one cut short)."""
    lens, docs, total = [], [], 0
    for n, d in zip(seg_lens, seg_doc):
        if total >= t:
            break
        take = min(int(n), t - total)
        lens.append(take)
        docs.append(int(d))
        total += take
    return lens, docs


def epoch_permutation(seed: int, epoch: int, rows: int) -> np.ndarray:
    """The order in which epoch ``epoch`` of a run seeded ``seed`` visits a dataset's ``rows``
    rows (the module docstring's ``permutation(seed, e)``)."""
    return np.random.default_rng([seed, epoch]).permutation(rows)


def packed_segments(dataset: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every row's ``seg_lens`` and ``seg_doc`` of a packed dataset, flat (int64), and the
    segments per row: read as Arrow columns (memory-mapped for a dataset on disk), the token
    ids left untouched."""
    table = dataset.select_columns(["seg_lens", "seg_doc"]).with_format("arrow")[:]
    seg_lens = table.column("seg_lens").combine_chunks()
    seg_doc = table.column("seg_doc").combine_chunks()
    return (
        seg_lens.flatten().to_numpy().astype(np.int64),
        seg_doc.flatten().to_numpy().astype(np.int64),
        seg_lens.value_lengths().to_numpy().astype(np.int64),
    )


def trained_pairs(seg_lens: Any, seg_doc: Any, counts: Any, seq_len: int, sp: int) -> RowPairs:
    """The attended pairs of the rows training builds from packed rows given by their segments
    (:func:`~anchorctx.attention.pairs.row_pairs`): as :func:`make_row` builds them, each row's
    first ``seq_len`` tokens but never its last (a target only), padded to a multiple of
    ``sp`` by one segment of its own."""
    counts = np.asarray(counts, dtype=np.int64)
    lens = np.asarray(seg_lens, dtype=np.int64)
    totals = np.zeros(len(counts), dtype=np.int64)
    np.add.at(totals, np.repeat(np.arange(len(counts)), counts), lens)
    return row_pairs(lens, seg_doc, counts, np.minimum(seq_len, totals - 1), sp)


def make_row(
    record: dict[str, Any],
    seq_len: int,
    sp: int,
    variant: str,
    pad_id: int,
    boundary_targets: str = "all",
) -> Row:
    """The model input of one packed row: its first ``seq_len`` tokens, each with the target
    that follows it (``seq_len + 1`` tokens of the row are read), padded to a multiple of ``sp``.

    Padding is one extra segment with its own document id at the end: causal masking means no
    real token ever attends to it, and its targets are ignored.
    """
    ids = torch.as_tensor(np.asarray(record["input_ids"][: seq_len + 1]), dtype=torch.long)
    mask = torch.as_tensor(np.asarray(record["loss_mask"][: seq_len + 1]), dtype=torch.long)
    lens, docs = truncate_segments(record["seg_lens"], record["seg_doc"], ids.shape[0])
    # Targets over the whole read span, then the last token leaves the input: it is a target only.
    targets = shifted_targets(ids, mask, lens, docs, variant, boundary_targets)[:-1]
    ids = ids[:-1]
    lens, docs = truncate_segments(lens, docs, ids.shape[0])
    pad = padded_length(ids.shape[0], sp) - ids.shape[0]
    if pad:
        ids = torch.cat([ids, torch.full((pad,), pad_id, dtype=torch.long)])
        targets = torch.cat([targets, torch.full((pad,), -100, dtype=torch.long)])
        lens, docs = [*lens, pad], [*docs, max(docs) + 1]
    return Row(ids, targets, tuple(lens), tuple(docs), real_tokens=len(mask) - 1)


class BatchPlan:
    """Global batches of a run for one rank (see the module docstring)."""

    def __init__(
        self,
        dataset: Any,
        *,
        seed: int,
        par: Parallelism,
        seq_len: int,
        variant: str,
        pad_id: int,
        rank: int,
        boundary_targets: str = "all",
    ) -> None:
        self.dataset = dataset.select_columns(list(COLUMNS)).with_format("numpy")
        self.num_rows = len(self.dataset)
        if self.num_rows == 0:
            raise ValueError("the packed dataset has no rows")
        self.seed, self.par, self.seq_len = seed, par, seq_len
        self.variant, self.pad_id = variant, pad_id
        self.boundary_targets = boundary_targets
        self.sp_rank, self.dp_rank = rank % par.sp, rank // par.sp
        self._perm_cache: dict[int, np.ndarray] = {}

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            self._perm_cache = {epoch: epoch_permutation(self.seed, epoch, self.num_rows)}
        return self._perm_cache[epoch]

    def row_indices(self, step: int) -> list[int]:
        """Dataset rows of the global batch of ``step`` (G of them, in sample order)."""
        g = self.par.global_batch
        out = []
        for sample in range(step * g, (step + 1) * g):
            epoch, offset = divmod(sample, self.num_rows)
            out.append(int(self._permutation(epoch)[offset]))
        return out

    def step_data(self, step: int, device: torch.device | str) -> StepData:
        rows = [self._row(i) for i in self.row_indices(step)]
        micro, dp = self.par.micro, self.par.dp
        batches = []
        for slot in range(self.par.accum):
            first = (slot * dp + self.dp_rank) * micro
            batches.append(self._micro_batch(rows[first : first + micro], device))
        return StepData(
            micro_batches=batches,
            global_targets=sum(count_targets(r.targets) for r in rows),
            global_tokens=sum(r.real_tokens for r in rows),
            attention_pairs=sum(self._pairs(r) for r in rows),
        )

    def _pairs(self, row: Row) -> int:
        return build_layout(row.seg_lens, self.variant, row.seg_doc).attended_pairs

    def _row(self, index: int) -> Row:
        record = self.dataset[index]
        return make_row(
            record, self.seq_len, self.par.sp, self.variant, self.pad_id, self.boundary_targets
        )

    def _micro_batch(self, rows: list[Row], device: torch.device | str) -> MicroBatch:
        return shard_rows(rows, self.variant, self.par.sp, self.sp_rank, device)


def shard_rows(
    rows: list[Row], variant: str, sp: int, sp_rank: int, device: torch.device | str
) -> MicroBatch:
    """This SP rank's contiguous sequence shard of a micro-batch of (padded) rows."""
    t = rows[0].input_ids.shape[0]
    local = t // sp
    shard = slice(sp_rank * local, (sp_rank + 1) * local)
    ids = torch.stack([r.input_ids for r in rows])[:, shard]  # [B, T/SP]
    targets = torch.stack([r.targets for r in rows])[:, shard]  # [B, T/SP]
    layouts = [build_layout(r.seg_lens, variant, r.seg_doc, device=device) for r in rows]
    return MicroBatch(ids.to(device), targets.to(device), layouts, shard)
