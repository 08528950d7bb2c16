"""Targets, the loss-mask and document-boundary rule, batch sharding, the save schedule."""

from __future__ import annotations

import datasets
import pytest
import torch
import torch.nn.functional as F

from anchorctx.models.checkpoints import list_checkpoints
from anchorctx.training.checkpoints import should_save, should_save_resume
from anchorctx.training.data import BatchPlan, make_row
from anchorctx.training.loss import IGNORE_INDEX, shifted_targets, summed_cross_entropy
from anchorctx.training.plan import Parallelism
from anchorctx.training.settings import SaveConfig

# Row: anchor 1, doc A = [10 11 12], doc B = [tag 90, 20 21], doc A again (chunk) = [13 14]
IDS = torch.tensor([1, 10, 11, 12, 90, 20, 21, 13, 14])
MASK = torch.tensor([0, 1, 1, 1, 0, 1, 1, 1, 1])  # anchor and the domain tag are no targets
SEG_LENS, SEG_DOC = [4, 3, 2], [0, 1, 0]


def _kept(variant: str, boundary: str = "all") -> list[int]:
    targets = shifted_targets(IDS, MASK, SEG_LENS, SEG_DOC, variant, boundary)
    return [t for t in targets.tolist() if t != IGNORE_INDEX]


def test_full_keeps_cross_document_targets():
    # Position t predicts t+1; the tag (90) is no target; 13 after doc B is kept under full.
    assert _kept("full") == [10, 11, 12, 20, 21, 13, 14]


@pytest.mark.parametrize("variant", ["intra_doc", "intra_doc_reset", "anchor"])
def test_document_masked_variants_keep_every_target_by_default(variant):
    # AnchorContext: every next token is a target for every variant (no ignore index).
    assert _kept(variant) == _kept("full") == [10, 11, 12, 20, 21, 13, 14]


@pytest.mark.parametrize("variant", ["intra_doc", "intra_doc_reset", "anchor"])
def test_within_document_option_drops_cross_document_targets(variant):
    # 90 is masked anyway; 13 follows doc B's last token (another document): masked.
    assert _kept(variant, "within_document") == [10, 11, 12, 20, 21, 14]
    assert _kept("full", "within_document") == [10, 11, 12, 20, 21, 13, 14]


def test_adjacent_chunks_of_one_document_keep_their_target():
    targets = shifted_targets(IDS, MASK, [4, 3, 2], [0, 1, 1], "anchor", "within_document")
    assert targets[6].item() == 13  # doc 1 continues into the next segment


def test_last_position_has_no_target_and_lengths_are_checked():
    assert shifted_targets(IDS, MASK, SEG_LENS, SEG_DOC, "full")[-1].item() == IGNORE_INDEX
    with pytest.raises(ValueError, match="seg_lens"):
        shifted_targets(IDS, MASK, [4, 3], SEG_DOC[:2], "full")


def test_summed_cross_entropy_matches_dense_reference():
    torch.manual_seed(0)
    logits = torch.randn(2, 9, 100)
    targets = torch.stack(
        [shifted_targets(IDS, MASK, SEG_LENS, SEG_DOC, v) for v in ("full", "anchor")]
    )
    keep = targets != IGNORE_INDEX
    ref = -F.log_softmax(logits, -1).gather(-1, targets.clamp_min(0)[..., None])[..., 0]
    assert torch.allclose(summed_cross_entropy(logits, targets), ref[keep].sum(), rtol=1e-6)


def test_row_is_truncated_and_padded_to_a_multiple_of_sp():
    record = {
        "input_ids": IDS.numpy(),
        "loss_mask": MASK.numpy(),
        "seg_lens": SEG_LENS,
        "seg_doc": SEG_DOC,
    }
    # seq_len 6 reads 7 tokens: 6 inputs, each with a target (the 7th token is a target only).
    row = make_row(record, seq_len=6, sp=4, variant="anchor", pad_id=1)
    assert row.input_ids.shape[0] == 8 and row.real_tokens == 6
    assert row.seg_lens == (4, 2, 2) and row.seg_doc == (0, 1, 2)  # padding: its own document
    assert row.targets[:6].tolist() == [10, 11, 12, IGNORE_INDEX, 20, 21]
    assert row.targets[6:].tolist() == [IGNORE_INDEX] * 2


def _fake_dataset(rows: int, t: int) -> datasets.Dataset:
    return datasets.Dataset.from_dict(
        {
            "input_ids": [[1] + [100 * i + j for j in range(1, t)] for i in range(rows)],
            "seg_lens": [[t // 2, t - t // 2]] * rows,
            "seg_doc": [[0, 1]] * rows,
            "loss_mask": [[0] + [1] * (t - 1)] * rows,
        }
    )


def test_batch_plan_shards_each_global_batch_exactly_once():
    ds = _fake_dataset(rows=5, t=8)
    par = Parallelism(
        world=4, sp=2, dp=2, micro=1, accum=2, device="cpu", zero_stage=0, engine="sdpa"
    )
    plans = [
        BatchPlan(ds, seed=3, par=par, seq_len=8, variant="anchor", pad_id=1, rank=r)
        for r in range(4)
    ]
    for step in range(3):  # crosses an epoch boundary (5 rows, 4 per step)
        rows = plans[0].row_indices(step)
        assert all(p.row_indices(step) == rows for p in plans)
        seen = []
        for dp in range(2):
            per_rank = [plans[dp * 2 + sp].step_data(step, "cpu") for sp in range(2)]
            for slot in range(2):
                full = torch.cat([d.micro_batches[slot].input_ids for d in per_rank], dim=1)
                seen.append(int(full[0, 1]) // 100)
        assert sorted(seen) == sorted(rows)
        # every rank counts the same global targets: rows of 8 tokens give 7 inputs (padded to
        # 8 for SP 2), 7 targets each, the one across the document boundary included
        assert {p.step_data(step, "cpu").global_targets for p in plans} == {4 * 7}
    assert sorted([*plans[0].row_indices(0), plans[0].row_indices(1)[0]]) == list(range(5))


def test_save_schedule_matches_the_paper():
    paper = SaveConfig(every=10, last=50)
    assert [s for s in range(1, 2001) if should_save(s, 2000, paper)] == [
        1960,
        1970,
        1980,
        1990,
        2000,
    ]
    assert [s for s in range(1, 8) if should_save(s, 7, SaveConfig(every=3, last=None))] == [
        3,
        6,
        7,
    ]


def test_resume_state_schedule_and_the_checkpoints_only_option():
    save = SaveConfig(every=10, last=None, resume_every=4)
    assert [s for s in range(1, 13) if should_save_resume(s, 12, save)] == [4, 8, 10, 12]
    off = save.model_copy(update={"resume": False})
    assert [s for s in range(1, 13) if should_save_resume(s, 12, off)] == []
    assert [s for s in range(1, 13) if should_save(s, 12, off)] == [10, 12]


def test_list_checkpoints_ignores_incomplete_directories(tmp_path):
    for name in ("step-000010", "step-000002", ".step-000020.abc.tmp", "step-000030", "other"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    for name in ("step-000010", "step-000002"):
        (tmp_path / "checkpoints" / name / "anchorctx.json").write_text("{}")
    got = [p.name for p in list_checkpoints(tmp_path)]
    assert got == ["step-000002", "step-000010"]
