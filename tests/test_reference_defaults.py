"""The reference's behaviour at default settings, one test (or a few) per rule of
docs/FIDELITY.md that follows AnchorContext, Fu et al., RULER or LongBench: small fixed inputs,
facts of the pinned references as expected values."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from anchorctx.evaluation.longbench import metrics as LM
from anchorctx.evaluation.longbench import runner as LR
from anchorctx.evaluation.longbench.tasks import ALL_DATASETS
from anchorctx.evaluation.ruler import constants as C
from anchorctx.evaluation.ruler import tasks as T
from anchorctx.evaluation.ruler.generate import MAX_REDRAWS, _Fitter, sample_rng
from anchorctx.evaluation.ruler.runner import _summarise, record_key
from anchorctx.evaluation.settings import LongBenchConfig
from anchorctx.packing import pack
from anchorctx.packing.mixture import buffered_stream, plan_documents
from anchorctx.packing.pipeline import SCHEMA_VERSION
from anchorctx.packing.settings import DataConfig, UpsampleConfig
from anchorctx.packing.sources import BadInput
from anchorctx.packing.tokens import DocIndex
from anchorctx.training.data import make_row
from anchorctx.training.loss import IGNORE_INDEX, shifted_targets
from anchorctx.training.settings import TrainingConfig

DOCS = Path(__file__).resolve().parents[1] / "docs"

# A row: anchor 1, document 0 = [10 11 12], document 1 = [20 21 22]; no tags.
IDS = torch.tensor([1, 10, 11, 12, 20, 21, 22])
MASK = torch.tensor([0, 1, 1, 1, 1, 1, 1])
LENS, SEGS = [4, 3], [0, 1]


# ------------------------------------------------------------- 1: targets at document boundaries
@pytest.mark.parametrize("variant", ["full", "intra_doc", "intra_doc_reset", "anchor"])
def test_every_next_token_is_a_target_for_every_variant(variant):
    # AnchorContext train.py: targets = input_ids[..., 1:], no ignore index, for every variant.
    assert TrainingConfig().boundary_targets == "all"
    targets = shifted_targets(IDS, MASK, LENS, SEGS, variant)
    assert targets.tolist() == [10, 11, 12, 20, 21, 22, IGNORE_INDEX]


def test_within_document_option_drops_only_the_crossing_target_of_masked_variants():
    masked = shifted_targets(IDS, MASK, LENS, SEGS, "anchor", "within_document")
    assert masked.tolist() == [10, 11, 12, IGNORE_INDEX, 21, 22, IGNORE_INDEX]
    full = shifted_targets(IDS, MASK, LENS, SEGS, "full", "within_document")
    assert full.tolist() == [10, 11, 12, 20, 21, 22, IGNORE_INDEX]
    with pytest.raises(ValueError, match="boundary_targets"):
        shifted_targets(IDS, MASK, LENS, SEGS, "anchor", "sometimes")


# ------------------------------------------------------------------------ 2: targets per row
def test_packed_rows_hold_seq_len_plus_one_tokens():
    packer = pack.RowPacker(seq_len=6, anchor=1, n_docs=2)
    kinds = np.full(4, pack.TEXT, dtype=np.uint8)
    rows = [
        *packer.add(np.array([10, 11, 12, 13]), kinds, 0, "d"),
        *packer.add(np.array([20, 21, 22, 23]), kinds, 1, "d"),
    ]
    assert len(rows) == 1 and rows[0]["input_ids"].tolist() == [1, 10, 11, 12, 13, 20, 21]
    assert rows[0]["seg_lens"].tolist() == [5, 2] and rows[0]["loss_mask"].tolist()[0] == 0
    assert SCHEMA_VERSION == 2  # rows of seq_len tokens (schema 1) are rebuilt


@pytest.mark.parametrize("sp", [1, 2, 3])
def test_seq_len_inputs_and_seq_len_targets_per_row(sp):
    # AnchorContext: rows of seq_length + 1 tokens; input row[:-1], targets row[1:].
    record = {
        "input_ids": IDS.numpy(),
        "loss_mask": MASK.numpy(),
        "seg_lens": LENS,
        "seg_doc": SEGS,
    }
    row = make_row(record, seq_len=6, sp=sp, variant="anchor", pad_id=1)
    assert row.real_tokens == 6 and row.input_ids.shape[0] % sp == 0
    assert row.input_ids[:6].tolist() == IDS[:-1].tolist()
    assert row.targets[:6].tolist() == IDS[1:].tolist()  # six targets, none lost
    assert row.seg_lens[:2] == (4, 2)


# ------------------------------------------------------------------ 3: Llama-2 vocabulary
def test_llama2_pad_resize_choice_is_documented():
    text = (DOCS / "FIDELITY.md").read_text()
    assert "32001" in text and "[PAD]" in text


# ------------------------------------------------------------------ 4: RULER VT one-shot
def _words(text: str) -> int:
    return len(text.split())


def test_vt_one_shot_fits_only_its_question_into_500_tokens():
    b = T.VTBuilder({"num_chains": 1, "num_hops": 4}, 4096, 42, _words)
    size = b.icl.count(C.NOISE_SENTENCE.strip())  # noise lines in the example

    def question_tokens(n: int) -> int:
        q, prefix, _ = b._question(n, random.Random(42), icl=True)
        return _words(q + prefix)

    assert question_tokens(size) <= 500 < question_tokens(size + 1)  # the largest that fits
    assert b.icl.endswith("\n") and _words(b.icl) > question_tokens(size)  # answer after


# ---------------------------------------------------------------- 5: RULER size search
class _Lines(T.Builder):
    """size lines of 10 characters plus 0-49 random characters; incremental 10."""

    min_size, probe = 1, 10

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def build(self, size: int, index: int, rng: random.Random) -> T.Sample:
        extra = rng.randrange(50)
        self.calls.append((size, extra))
        return T.Sample("x" * (10 * size + extra), "", ["x"])


def _fitter(budget: int) -> _Fitter:
    f = _Fitter.__new__(_Fitter)
    f.task, f.length, f.seed, f.fit = "niah_single_1", 4096, 42, "ruler"
    f.spec, f.count, f.budget, f.builder = C.task_spec("niah_single_1"), len, budget, _Lines()
    return f


def test_size_search_starts_at_incremental_and_falls_back_to_it():
    f = _fitter(budget=85)  # 8 lines fit, incremental (10) does not
    assert f._search(0) == 10
    assert _fitter(budget=1000)._search(0) >= 10


def test_overflowing_sample_is_redrawn_with_fresh_randomness():
    assert sample_rng(42, "vt", 4096, 3).random() != sample_rng(42, "vt", 4096, 3, 1).random()
    attempt0 = sample_rng(42, "niah_single_1", 4096, 0).randrange(50)  # 9
    f = _fitter(budget=10 * 30 + attempt0 - 1)  # the first draw at 30 lines overflows by one
    f.size = 30
    f.builder.calls.clear()
    f.sample(0)
    sizes = [s for s, _ in f.builder.calls]
    assert sizes == [30, 20]  # one whole step smaller, with the next draw's randomness
    assert f.builder.calls[1][1] == sample_rng(42, f.task, f.length, 0, 1).randrange(50)
    f = _fitter(budget=5)  # nothing fits even at incremental: RULER would retry forever
    f.size = 10
    with pytest.raises(ValueError, match=f"after {MAX_REDRAWS} draws"):
        f.sample(0)


# ------------------------------------------------------------- 6: RULER QA beyond the pool
def test_qa_repeats_the_documents_beyond_the_pool():
    b = T.QABuilder.__new__(T.QABuilder)
    b.seed = 42
    b.qa = SimpleNamespace(docs=["d0", "d1"], items=[])
    item = SimpleNamespace(context=(0,), more_context=())
    docs = b._documents(5, item, random.Random(0))
    assert sorted(docs) == ["d0", "d0", "d0", "d1", "d1"]  # (DOCS * 3)[:5], then shuffled
    assert b.max_size is None


# ---------------------------------------------------------------- 7: RULER per-task score
def test_ruler_task_score_is_rounded_to_two_decimals():
    records = {record_key("vt", 4096, i): {"score": s} for i, s in enumerate([100.0, 0.0, 0.0])}
    out = _summarise([("vt", 4096)], records, {}, 3, {})
    assert out["scores"] == {"vt": {"4096": 33.33}}


# ------------------------------------------------------------ 8: LongBench default datasets
PRED_PY_DATASETS = (
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "multifieldqa_zh",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "dureader",
    "gov_report",
    "qmsum",
    "multi_news",
    "vcsum",
    "trec",
    "triviaqa",
    "samsum",
    "lsht",
    "passage_count",
    "passage_retrieval_en",
    "passage_retrieval_zh",
    "lcc",
    "repobench-p",
)


def test_longbench_defaults_to_pred_py_datasets(tmp_path):
    assert LongBenchConfig().datasets is None and ALL_DATASETS == PRED_PY_DATASETS
    cfg = SimpleNamespace(evaluation=SimpleNamespace(longbench=LongBenchConfig(data_dir=tmp_path)))
    out = LR.run_suite(None, None, cfg, done={}, on_sample=lambda r: None, progress=False)
    assert list(out["not_run"]) == list(PRED_PY_DATASETS)  # no files: every one reported


def test_chinese_datasets_need_jieba_before_any_generation(tmp_path, monkeypatch):
    (tmp_path / "dureader.jsonl").write_text('{"input": "q", "context": "c", "answers": ["a"]}\n')
    monkeypatch.setattr(LR.importlib.util, "find_spec", lambda name: None)
    cfg = SimpleNamespace(evaluation=SimpleNamespace(longbench=LongBenchConfig(data_dir=tmp_path)))
    with pytest.raises(LR.LongBenchDataError, match="pip install jieba"):
        LR.run_suite(None, None, cfg, done={}, on_sample=lambda r: None, progress=False)


# ------------------------------------------------------------------ 9: Fu et al. stream order
def _index(domain, length, file) -> DocIndex:
    n = len(length)
    length = np.asarray(length, dtype=np.int64)
    return DocIndex(
        np.cumsum(length) - length,
        length,
        np.asarray(domain, np.int32),
        np.asarray(file, np.int32),
        np.arange(n),
        ["A", "B"],
    )


def test_stream_is_datasets_streaming_shuffle():
    # default_rng(42).shuffle([0, 1, 2]) gives the shard order [2, 1, 0]: the stream reads file 2
    # (documents 7-11), file 1 (4-6), file 0 (0-3) into the buffer.
    index = _index([0] * 12, [1] * 12, [0] * 4 + [1] * 3 + [2] * 5)
    expect = [7, 10, 9, 8, 6, 4, 11, 5, 0, 2, 1, 3]
    assert buffered_stream(index, 3, 42, buffer_size=4).tolist() == expect
    # Fewer documents than the 1000-document buffer: one shuffle of the shard-ordered stream.
    expect = [7, 8, 9, 10, 11, 4, 5, 6, 0, 1, 2, 3]
    np.random.default_rng(42).shuffle(expect)
    assert buffered_stream(index, 3, 42).tolist() == expect
    # A file with no valid document still takes part in the shard shuffle.
    shards = [0, 1, 2, 3]
    np.random.default_rng(42).shuffle(shards)
    files = {0: [0, 1, 2, 3], 1: [4, 5, 6], 2: [7, 8, 9, 10, 11], 3: []}
    expect = [d for f in shards for d in files[f]]
    np.random.default_rng(42).shuffle(expect)
    assert buffered_stream(index, 4, 42).tolist() == expect


UPSAMPLE = {"threshold": 100, "keep_short": 0.5, "shares": {"A": 0.5, "B": 0.5}}
DOMAIN = [0, 0, 1, 1, 0, 1, 0, 1]
LENGTH = [50, 200, 50, 100, 60, 40, 500, 30]


def test_coins_only_for_short_documents_of_open_sources():
    # Stream (one file, seed 42): default_rng(42).shuffle(range(8)) = [3, 4, 2, 7, 6, 1, 5, 0].
    # Budgets 200 each. Coins: np.random.RandomState(15213).random_sample() = 0.827, 0.559,
    # 0.399, 0.053, ...; a short document is kept when its coin is <= 0.5.
    #   3 B 100 long: kept (B 100) | 4 A 60 short, coin 0.827: dropped
    #   2 B 50 short, coin 0.559: dropped | 7 B 30 short, coin 0.399: kept (B 130)
    #   6 A 500 long: kept (A 500) | 1 A 200: A closed, no coin | 5 B 40 short, coin 0.053:
    #   kept (B 170) | 0 A 50: A closed, no coin.
    cfg = DataConfig(mixture="upsampled", token_budget=400, upsample=UPSAMPLE)
    assert UpsampleConfig().order == "buffered"
    plan = plan_documents(cfg, _index(DOMAIN, LENGTH, [0] * 8), 42, BadInput(skip=False))
    assert plan.doc.tolist() == [3, 7, 6, 5]
    by = plan.upsample["by_source"]
    assert by["A"]["documents_kept"] == {"short": 0, "long": 1}
    assert (by["A"]["documents_dropped_short"], by["A"]["documents_unused"]) == (1, 2)
    assert by["B"]["documents_kept"] == {"short": 2, "long": 1} and by["B"]["tokens"] == 170


def test_stream_stops_once_every_budget_is_met():
    # Budgets 130 each: 3 (B 100) kept; 4 and 2 dropped by their coins; 7 (B 30, coin 0.399)
    # kept: B has 130, its budget met but not exceeded, so still open; 6 (A 500) kept: every
    # budget met, the stream stops. Streamed on, 5 (B 40, coin 0.053) would have been kept.
    cfg = DataConfig(mixture="upsampled", token_budget=260, upsample=UPSAMPLE)
    plan = plan_documents(cfg, _index(DOMAIN, LENGTH, [0] * 8), 42, BadInput(skip=False))
    assert plan.doc.tolist() == [3, 7, 6]
    assert plan.upsample["by_source"]["B"]["documents_unused"] == 1  # 5, after the stop


def test_permutation_option_keeps_the_earlier_rule():
    up = {**UPSAMPLE, "order": "permutation"}
    cfg = DataConfig(mixture="upsampled", token_budget=400, upsample=up)
    plan = plan_documents(cfg, _index(DOMAIN, LENGTH, [0] * 8), 42, BadInput(skip=False))
    rng = np.random.default_rng([42, 3])
    order, coins = rng.permutation(8), rng.random(8)  # one coin per document, drawn up front
    kept, tokens = [], {0: 0, 1: 0}
    for i in order:
        if tokens[DOMAIN[i]] > 200 or (LENGTH[i] < 100 and coins[i] > 0.5):
            continue
        kept.append(int(i))
        tokens[DOMAIN[i]] += LENGTH[i]
    assert plan.doc.tolist() == kept and plan.upsample["order"] == "permutation"


# ------------------------------------------------- 10: LongBench classification_score
def test_classification_has_no_fallback():
    classes = ["Abbreviation", "Entity", "Human being"]
    assert LM.classification_score("Entity", "Entity", all_classes=classes) == 1.0
    # A near miss names no class: 0, as the pinned metrics.py (no similarity fallback).
    assert LM.classification_score("Abbreviatio", "Abbreviation", all_classes=classes) == 0.0
    assert "difflib" not in (LM.classification_score.__doc__ or "")
