"""The report's arm comparison: attention work, chance labels, provenance, loss plot."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_eval_core_results import assert_record_keys

from anchorctx.attention import VARIANTS
from anchorctx.attention.layout import dense_mask
from anchorctx.evaluation.arm_comparison import (
    COMPARISON_JSON,
    LOSS_PNG,
    at_chance,
    attention_work,
    chance_interval,
    trained_row_indices,
    write_arm_comparison,
)
from anchorctx.evaluation.averaging import summarize_run
from anchorctx.evaluation.records import (
    ArmComparison,
    ArmProvenance,
    AttentionWork,
    ChanceFlag,
    LossSummary,
    Provenance,
    ReportRecord,
    RopeStudy,
    RunInfo,
)
from anchorctx.evaluation.report import write_experiment_report
from anchorctx.experiment import load_config

REPO = Path(__file__).resolve().parents[1]


def brute_pairs(seg_lens: list[int], seg_doc: list[int], t: int, variant: str) -> int:
    """Allowed pairs of the first ``t`` tokens, counted on the materialised T×T mask."""
    doc_ids = np.repeat(np.asarray(seg_doc), np.asarray(seg_lens))[:t]
    import torch

    return int(dense_mask(torch.as_tensor(doc_ids), variant).sum())


# ---------------------------------------------------------------------- attention work
def _dataset(rows: list[tuple[list[int], list[int]]]):
    import datasets

    return datasets.Dataset.from_dict(
        {
            "input_ids": [[1] * sum(lens) for lens, _ in rows],
            "loss_mask": [[1] * sum(lens) for lens, _ in rows],
            "seg_lens": [lens for lens, _ in rows],
            "seg_doc": [docs for _, docs in rows],
        }
    )


def test_attention_work_counts_the_trained_rows_with_repeats():
    rows = [([10, 6], [0, 1]), ([4, 4, 8], [0, 1, 2]), ([16], [0])]
    ds = _dataset(rows)
    # 2 steps × 2 rows over 3 rows: the second epoch repeats a row; the training loop's order.
    indices = trained_row_indices(ds, seed=7, global_batch=2, steps=2)
    epoch0 = np.random.default_rng([7, 0]).permutation(3)
    epoch1 = np.random.default_rng([7, 1]).permutation(3)
    assert indices == [*(int(i) for i in epoch0), int(epoch1[0])]
    for variant in VARIANTS:
        work = attention_work(ds, variant=variant, seed=7, global_batch=2, steps=2, seq_len=12)
        want = sum(brute_pairs(*rows[i], 12, variant) for i in indices)
        assert work["pairs"] == want
        assert_record_keys(AttentionWork, work)
        assert work["full_pairs"] == 4 * 12 * 13 // 2
        assert work["fraction"] == pytest.approx(want / work["full_pairs"], rel=1e-12)
    # Anchor sees exactly one more key than intra_doc per token outside the first document.
    anchor = attention_work(ds, variant="anchor", seed=7, global_batch=2, steps=2, seq_len=12)
    intra = attention_work(ds, variant="intra_doc", seed=7, global_batch=2, steps=2, seq_len=12)
    assert anchor["pairs"] - intra["pairs"] == sum(12 - min(12, rows[i][0][0]) for i in indices)


# ------------------------------------------------------------------------------ chance
def test_chance_interval_and_rule():
    # Exact binomial regions, equal tails ≤ 2.5% (checked against scipy.stats.binom: n=8 →
    # counts 0..5, n=12 → 0..6, n=100 → 17..34, n=10000 → 2415..2585).
    assert chance_interval(25.0, 8) == (0.0, 62.5)
    assert chance_interval(25.0, 12) == (0.0, 50.0)
    assert chance_interval(25.0, 100) == (17.0, 34.0)
    assert chance_interval(25.0, 10_000) == pytest.approx((24.15, 25.85), abs=1e-9)
    # A 1-in-4 guesser gets 0 of 12 with probability 0.75**12 = 3.2% > 2.5%: 0 is at chance.
    assert at_chance(0.0, 25.0, 12) and not at_chance(0.0, 25.0, 100)
    assert at_chance(29.17, 25.0, 8)  # the 20-step demo model's MMLU
    assert not at_chance(75.0, 25.0, 8) and not at_chance(27.0, 25.0, 10_000)
    # Chance 0 (RULER): only an exact 0 is at chance.
    assert chance_interval(0.0, 12) == (0.0, 0.0)
    assert at_chance(0.0, 0.0, 12) and not at_chance(0.5, 0.0, 12)
    with pytest.raises(ValueError):
        chance_interval(25.0, 0)


# ------------------------------------------------------------------------ full report
def _write_result(run_dir: Path, step: int, suite: str, scores, counts) -> None:
    path = run_dir / "eval" / f"step-{step}" / f"{suite}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"suite": suite, "step": step, "scores": scores, "counts": counts}))


def _fake_arm(run_dir: Path, mmlu: float, ruler: float, losses: list[float]) -> None:
    for step in (15, 20):
        _write_result(run_dir, step, "mmlu", {"mmlu": {"acc": mmlu}}, {"mmlu": 8})
        _write_result(
            run_dir,
            step,
            "hellaswag",
            {"hellaswag": {"acc": 25.0, "acc_norm": 25.0}},
            {"hellaswag": 8},
        )
        _write_result(
            run_dir,
            step,
            "ruler",
            {"niah_single_1": {"1024": ruler}, "vt": {"1024": 0.0}},
            {"niah_single_1": {"1024": 2}, "vt": {"1024": 2}},
        )
    summarize_run(run_dir, 2)
    lines = [json.dumps({"step": i + 1, "loss": v}) for i, v in enumerate(losses)]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_report_names_every_arm_labels_chance_and_plots_loss(tmp_path):
    cfg = load_config(REPO / "configs" / "demo.yaml").model_copy(update={"run_root": tmp_path})
    assert cfg.analysis.rope_precision.in_report  # the demo report shows the study
    arms = {a.variant_name: a for a in cfg.arms()}
    _fake_arm(arms["full"].run_dir, mmlu=29.17, ruler=0.0, losses=[8.0, 7.5, 7.0])
    _fake_arm(arms["anchor"].run_dir, mmlu=90.0, ruler=50.0, losses=[8.0, 7.2, 6.1])
    cfg.analysis.rope_precision.in_report = False  # the study has its own test below
    comparison = write_arm_comparison(cfg, {})
    assert "rope_precision" not in comparison and "rope_plot" not in comparison["paths"]
    png = cfg.experiment_dir / LOSS_PNG
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert comparison["loss"]["anchor"] == {"steps": 3, "first": 8.0, "last": 6.1}
    assert comparison["loss"]["intra_doc"] is None  # never trained: no curve, nothing invented
    assert (cfg.experiment_dir / COMPARISON_JSON).is_file()
    # records.py types what arm_comparison.json holds.
    written = json.loads((cfg.experiment_dir / COMPARISON_JSON).read_text())
    assert_record_keys(ArmComparison, written)
    assert_record_keys(Provenance, written["provenance"])
    for arm in written["provenance"]["arms"]:
        assert_record_keys(ArmProvenance, arm)
    assert_record_keys(LossSummary, written["loss"]["anchor"])

    out = write_experiment_report(cfg.experiment_dir, list(arms))
    md = out["markdown"]
    # Provenance: the experiment and every arm, with its attention and run dir.
    assert "Experiment `demo` (5 arms" in md
    for name, arm in arms.items():
        assert f"| `{name}` | {arm.training.attention} |" in md
        assert str(arm.run_dir) in md
    assert "data.domain_tags=True" in md  # the anchor_tags arm's override
    assert f"![Training loss by arm]({LOSS_PNG})" in md
    # Chance labels: MMLU 29.17 with n=8 is at chance (region 0–62.5%); 90 is not; RULER 0 is.
    general = out["tables"]["general"]["chance"]
    assert general["full"]["MMLU"]["at_chance"] and not general["anchor"]["MMLU"]["at_chance"]
    assert general["full"]["MMLU"]["n"] == 8
    ruler = out["tables"]["ruler"]["chance"]
    assert ruler["full"]["1024"] == {
        "chance": 0.0,
        "n": 4,
        "interval": [0.0, 0.0],
        "at_chance": True,
    }
    assert not ruler["anchor"]["1024"]["at_chance"]  # mean over tasks 25.0
    assert "| full | 29.17 ± 0.00 (at chance) | 25.00 ± 0.00 (at chance) |" in md
    assert "| anchor | 90.00 ± 0.00 | 25.00 ± 0.00 (at chance) |" in md
    assert "| full | 0.00 ± 0.00 (at chance) |" in md and "| anchor | 25.00 ± 0.00 |" in md
    assert "MMLU: n=8, [0.00, 62.50]" in md
    report = json.loads((cfg.experiment_dir / "report.json").read_text())
    assert_record_keys(ReportRecord, report)
    assert_record_keys(RunInfo, report["runs"]["full"])
    assert_record_keys(ChanceFlag, report["tables"]["ruler"]["chance"]["full"]["1024"])
    # A plot that is gone is not linked (nor published).
    png.unlink()
    again = write_experiment_report(cfg.experiment_dir, list(arms))
    assert "loss_plot" not in again["paths"] and LOSS_PNG not in again["markdown"]
    assert "### Training loss" in again["markdown"]  # the table of first/last loss remains
    # The Prefect table artifacts carry the same labels.
    from anchorctx.tasks.reporting import report_tables

    rows = {r["variant"]: r for r in report_tables(out)["mmlu-hellaswag"][0]}
    assert rows["full"]["MMLU"] == "29.17 ± 0.00 (at chance)"
    assert rows["anchor"]["MMLU"] == "90.00 ± 0.00"


def test_experiment_provenance_lists_every_arm():
    from anchorctx.tasks.artifacts import run_summary_markdown

    cfg = load_config(REPO / "configs" / "demo.yaml")
    md = run_summary_markdown("full-experiment demo", cfg, arms=cfg.arms())
    line = next(x for x in md.splitlines() if x.startswith("- experiment:"))
    assert line.startswith("- experiment: `demo`, 5 arms: ")
    for arm in cfg.arms():
        assert f"`{arm.variant_name}` ({arm.training.attention}, run dir `{arm.run_dir}`)" in line
    assert "variant: `anchor`" not in line


def test_rope_study_runs_once_per_inputs(tmp_path, monkeypatch):
    """The study is rerun only when the model, study settings, data or seed change."""
    import anchorctx.analysis.rope_precision as rp
    from anchorctx.evaluation.arm_comparison import ensure_rope_study

    calls = []

    def fake_run_study(cfg, out_dir, progress):
        calls.append(cfg.analysis.rope_precision.seq_len)
        spec = cfg.analysis.rope_precision
        modes = list(spec.precisions)
        result = {
            "settings": {
                "lengths": spec.lengths,
                "compare_shift": 0,
                "delta2": 16,
                "modes": modes,
                "num_sequences": spec.num_sequences,
                "seq_len": spec.seq_len,
                "weights": "random init (model.tiny)",
            },
            "shift_curve": {m: {"0": 1.0} for m in modes},
            "first_token_share": {m: 0.5 for m in modes},
            "logit_diff_by_length": {m: {str(n): 2.0 for n in spec.lengths} for m in modes},
        }
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / rp.PNG_NAME).write_bytes(b"png")
        (out_dir / rp.JSON_NAME).write_text(json.dumps(result))
        return out_dir / rp.JSON_NAME

    monkeypatch.setattr(rp, "run_study", fake_run_study)
    cfg = load_config(REPO / "configs" / "demo.yaml").model_copy(update={"run_root": tmp_path})
    first = ensure_rope_study(cfg, tmp_path / "rope")
    assert first["seconds"] is not None and first["modes"]["bf16"]["D_logit_512"] == 2.0
    assert first["modes"]["fp32"]["D"] == 1.0 and first["delta2"] == 16
    assert_record_keys(RopeStudy, first)
    from anchorctx.evaluation.report import comparison_markdown

    md = comparison_markdown({"rope_precision": first}, ["full"], {"rope_plot": first["png"]})
    assert (
        "Δ1 = 0, Δ2 = 16" in md
        and "![BF16 vs FP32 RoPE discrepancy](rope/rope_precision.png)" in md
    )
    assert "| bf16 | 1.000e+00 | 50.0% | 2.000e+00 |" in md
    again = ensure_rope_study(cfg, tmp_path / "rope")
    assert again["seconds"] is None and calls == [512]  # reused
    changed = cfg.model_copy(deep=True)
    changed.analysis.rope_precision.seq_len = 256
    ensure_rope_study(changed, tmp_path / "rope")
    assert calls == [512, 256]
