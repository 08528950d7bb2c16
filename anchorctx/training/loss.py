"""Next-token targets of a packed row and the loss summed over them.

Targets. Position ``t`` predicts token ``t + 1`` when ``loss_mask[t + 1] == 1`` (the packed
dataset sets 0 for the anchor and for domain-tag tokens). A packed row holds ``seq_len + 1``
tokens; the model sees the first ``seq_len`` and each of them has a target (see
:func:`anchorctx.training.data.make_row`), as in AnchorContext's ``train.py``
(``input_ids[..., :-1]`` against ``input_ids[..., 1:]``).

Document boundaries (``training.boundary_targets``), for the target that crosses one (position
``t`` is the last token of one document, ``t + 1`` the first token of the next):

- ``all`` (default, the reference's): kept for every attention variant. AnchorContext trains
  every next token with no ignore index, so the ``full`` and document-masked arms train on the
  same target set and their losses compare directly.
- ``within_document`` (an option): dropped for the document-masked variants (``intra_doc``,
  ``intra_doc_reset``, ``anchor``), kept for ``full``. Under a document mask position ``t``
  cannot see any token of the next document (under ``anchor`` only the shared anchor, which
  carries no information about which document follows), so that target asks the model to guess
  a document's opening from an unrelated one. The rule is evaluated on document ids, so
  interleaved chunks of one document that happen to be adjacent keep their target, and the
  anchor's own document (segment 0) keeps all of its targets. It removes at most one target
  per document.

The loss is normalised by the number of targets actually kept over the whole global batch (see
:mod:`anchorctx.training.step`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
DOCUMENT_MASKED = frozenset({"intra_doc", "intra_doc_reset", "anchor"})
BOUNDARY_TARGETS: tuple[str, ...] = ("all", "within_document")


def segment_doc_ids(seg_lens: Sequence[int], seg_doc: Sequence[int] | None) -> torch.Tensor:
    """Document id of every token, IntTensor [T] (segment index when ``seg_doc`` is None)."""
    lens = torch.as_tensor(list(seg_lens), dtype=torch.long)
    docs = torch.arange(len(lens)) if seg_doc is None else torch.as_tensor(list(seg_doc))
    return torch.repeat_interleave(docs.to(torch.int32), lens)


def shifted_targets(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    seg_lens: Sequence[int],
    seg_doc: Sequence[int] | None,
    variant: str,
    boundary_targets: str = "all",
) -> torch.Tensor:
    """Targets of one row, LongTensor [T]: ``input_ids[t+1]`` or ``IGNORE_INDEX``.

    ``input_ids`` and ``loss_mask`` are [T]; the last position has no target.
    ``boundary_targets``: ``all`` or ``within_document`` (see the module docstring).
    """
    if boundary_targets not in BOUNDARY_TARGETS:
        raise ValueError(
            f"unknown boundary_targets {boundary_targets!r}; expected one of {BOUNDARY_TARGETS}"
        )
    t = input_ids.shape[0]
    if sum(seg_lens) != t or loss_mask.shape[0] != t:
        raise ValueError(
            f"row of {t} tokens has loss_mask of {loss_mask.shape[0]} and seg_lens summing to "
            f"{sum(seg_lens)}: the packed dataset is inconsistent"
        )
    keep = loss_mask[1:].bool()
    if boundary_targets == "within_document" and variant in DOCUMENT_MASKED:
        doc = segment_doc_ids(seg_lens, seg_doc)
        keep = keep & (doc[1:] == doc[:-1])
    targets = torch.full((t,), IGNORE_INDEX, dtype=torch.long)
    targets[:-1] = torch.where(keep, input_ids[1:].long(), IGNORE_INDEX)
    return targets


def count_targets(targets: torch.Tensor) -> int:
    return int((targets != IGNORE_INDEX).sum())


def summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies, fp32 scalar. logits [B, T, V], targets [B, T].

    A sum, not a mean: every rank holds a different share of the global batch's targets, and
    the caller divides by the global target count so the gradients add up exactly.
    """
    vocab = logits.shape[-1]
    return F.cross_entropy(
        logits.reshape(-1, vocab).float(),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def tiled_summed_cross_entropy(
    lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, tiles: int
) -> torch.Tensor:
    """``summed_cross_entropy(lm_head(hidden), targets)`` computed in ``tiles`` sequence tiles
    (``training.memory.tiled_loss``, see :mod:`anchorctx.training.tiling`).

    hidden [B, T, H], targets [B, T]; fp32 scalar. Gradients flow to ``hidden`` and the head's
    weights exactly as through the untiled expression (each tile is recomputed in backward).
    """
    # Imported here: DeepSpeed loads only through import_deepspeed() (its op cache set first).
    from deepspeed.runtime.sequence_parallel.ulysses_sp import sequence_tiled_compute

    def tile_loss(hidden, targets, head):
        return summed_cross_entropy(head(hidden), targets)

    return sequence_tiled_compute(
        tile_loss,
        seqlen=hidden.shape[1],
        shards=tiles,
        kwargs_to_shard={"hidden": hidden, "targets": targets},
        kwargs_to_pass={"head": lm_head},
        grad_requiring_tensor_key="hidden",
        compute_params=list(lm_head.parameters()),
        output_unshard_dimension=0,
        output_reduction="sum",
    )
