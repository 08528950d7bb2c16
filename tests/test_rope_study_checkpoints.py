"""The Section 2 study on learned weights: base model and arms' final checkpoints, each with and
without the anchor token, gathered into one result and shown in the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from anchorctx.analysis import rope_weights as rw
from anchorctx.analysis.rope_weights_table import (
    JSON_NAME,
    MD_NAME,
    PNG_NAME,
    read_weights_study,
    study_dir,
    write_weights_study,
)
from anchorctx.experiment import config_from_dict

SEQ_LEN = 48


@pytest.fixture(scope="module")
def experiment(tiny_config, demo_corpus, tmp_path_factory):
    """Two arms of the tiny config; ``full`` has a saved final checkpoint (perturbed weights),
    ``anchor`` has none yet. The study reads a text file (no packing)."""
    from anchorctx.models.loading import load_model, load_tokenizer

    root = tmp_path_factory.mktemp("rope_weights")
    text = root / "text.txt"
    files = sorted(p for p in demo_corpus.data_dir.rglob("*") if p.is_file())
    text.write_text("\n".join(p.read_text(errors="replace") for p in files)[:40_000])
    raw = tiny_config.model_dump(mode="json")
    raw.update(run_root=str(root / "runs"), name="rw")
    raw["variants"] = [
        {"name": "full", "attention": "full"},
        {"name": "anchor", "attention": "anchor"},
    ]
    raw["analysis"] = {
        "rope_precision": {
            "seq_len": SEQ_LEN,
            "num_sequences": 2,
            "lengths": [SEQ_LEN],
            "shifts": [0, 16],
            "device": "cpu",
            "in_report": True,
            "text_files": [str(text)],
        }
    }
    cfg = config_from_dict(raw)
    arm = cfg.arms()[0]
    tokenizer = load_tokenizer(arm.model)
    model = load_model(arm.model, attn_implementation=None, tokenizer=tokenizer)
    with torch.no_grad():  # a "trained" checkpoint: weights that differ from the init
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ckpt = arm.run_dir / "checkpoints" / "step-000004"
    model.save_pretrained(ckpt)
    tokenizer.save_pretrained(ckpt)
    (ckpt / "anchorctx.json").write_text(json.dumps({"step": 4}))
    return cfg, ckpt


def test_weights_are_base_and_arms_with_checkpoints(experiment):
    cfg, ckpt = experiment
    weights = rw.weights_list(cfg)
    # No pretrain stage and no model.path: the base model is model.tiny's init, measured once.
    assert [(w.key, w.kind) for w in weights] == [("base", "base"), ("arm-full", "arm")]
    assert weights[0].path is None and weights[1].path == ckpt
    assert weights[1].info()["step"] == 4


def test_with_and_without_anchor_inputs_differ_by_the_anchor_token(experiment):
    cfg, _ = experiment
    data = json.loads(rw.write_inputs(cfg).read_text())
    with_anchor = torch.tensor(data["with_anchor"])
    without = torch.tensor(data["without_anchor"])
    assert with_anchor.shape == without.shape == (2, SEQ_LEN)
    assert (with_anchor[:, 0] == data["anchor"]).all()
    assert torch.equal(with_anchor[:, 1:], without[:, :-1])  # the same text, shifted by one
    assert not (without[:, 0] == data["anchor"]).any()
    # Cut from one stream: the second pair continues the first one's text.
    assert data["source"] == "text files (1)"


def test_anchor_pairs_cut_consecutive_windows():
    with_anchor, without = rw.anchor_pairs([[5, 6, 7, 8, 9, 10, 11]], 1, 2, 3, source="x")
    assert with_anchor.tolist() == [[1, 5, 6], [1, 8, 9]]
    assert without.tolist() == [[5, 6, 7], [8, 9, 10]]


def test_study_runs_on_a_checkpoint_and_is_reused(experiment):
    cfg, ckpt = experiment
    inputs = rw.write_inputs(cfg)
    path = rw.run_weights(cfg, "arm-full", inputs)
    result = json.loads(path.read_text())
    assert result["weights"]["checkpoint"] == str(ckpt) and result["weights"]["name"] == "full"
    assert result["settings"]["seq_len"] == SEQ_LEN and result["settings"]["num_sequences"] == 2
    for inp in ("with_anchor", "without_anchor"):
        by_mode = result["results"][inp]
        assert list(by_mode) == ["bf16", "bf16_rope_fp32", "fp32"]
        for m in by_mode.values():
            assert len(m["per_token"]) == SEQ_LEN
            assert m["D"] == pytest.approx(sum(m["per_token"]), rel=1e-9)  # float64 sums
            assert 0 < m["first_token_share"] < 1
        # fp32 differs by float32 rounding only: measured ≈ 1e-6 here, bf16 ≈ 1e-3. Margins
        # are wide because only the order of magnitude is a property of the model.
        assert by_mode["fp32"]["D"] < 1e-4
        assert by_mode["bf16"]["D"] > 100 * by_mode["fp32"]["D"]
        assert by_mode["bf16"]["D_logit"] > 100 * by_mode["fp32"]["D_logit"]
    mtime = path.stat().st_mtime_ns
    assert rw.run_weights(cfg, "arm-full", inputs) == path and path.stat().st_mtime_ns == mtime


def test_zero_shift_difference_is_exactly_zero(experiment):
    """Δ1 = Δ2: the two passes are the same computation, so D and D_logit are exactly 0."""
    from anchorctx.analysis.rope_precision import load_study_model
    from anchorctx.models.loading import load_tokenizer

    cfg, _ = experiment
    weights = rw.find_weights(cfg, "arm-full")
    model, _ = load_study_model(rw._study_cfg(cfg, weights), load_tokenizer(weights.model), "cpu")
    data = json.loads(rw.write_inputs(cfg).read_text())
    seqs = {k: torch.tensor(data[k]) for k in ("with_anchor", "without_anchor")}
    spec = cfg.analysis.rope_precision.model_copy(update={"compare_shift": 16, "delta2": 16})
    out = rw.measure_weights(model, seqs, spec)
    for by_mode in out.values():
        for m in by_mode.values():
            assert m["D"] == 0.0 and m["D_logit"] == 0.0
            assert m["per_token"] == [0.0] * SEQ_LEN


def test_combined_result_and_report_rows(experiment, tmp_path):
    from anchorctx.evaluation.report import comparison_markdown

    cfg, _ = experiment
    inputs = rw.write_inputs(cfg)
    paths = [rw.run_weights(cfg, w.key, inputs) for w in rw.weights_list(cfg)]
    out = study_dir(cfg.experiment_dir)
    path = write_weights_study(paths, out)
    assert path == out / JSON_NAME
    assert (out / PNG_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = read_weights_study(path)
    assert [w["name"] for w in result["weights"]] == ["base (random init)", "full"]
    # A single per-weights file reads as a one-entry result.
    single = read_weights_study(paths[1])
    assert [w["name"] for w in single["weights"]] == ["full"]
    assert read_weights_study(tmp_path / "missing.json") is None

    md = comparison_markdown(
        {"rope_weights": result}, ["full", "anchor"], {"rope_weights_plot": str(out / PNG_NAME)}
    )
    assert "on learned weights" in md
    assert f"![BF16 vs FP32 RoPE on learned weights](rope_precision/{PNG_NAME})" in md
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    labels = [tuple(c.strip() for c in r.strip("|").split("|")[:2]) for r in rows[1:]]
    assert labels == [
        ("base (random init)", "anchor (BOS) at 0"),
        ("base (random init)", "no anchor"),
        ("full", "anchor (BOS) at 0"),
        ("full", "no anchor"),
    ]
    d = result["weights"][1]["results"]["with_anchor"]["bf16"]
    assert f"{d['D']:.3e}" in rows[3] and f"{100 * d['first_token_share']:.1f}%" in rows[3]
    assert (out / MD_NAME).read_text().count("| full |") == 2


def test_report_reads_the_study(experiment):
    """write_experiment_report picks the gathered result up beside the arm comparison."""
    from anchorctx.evaluation.arm_comparison import write_arm_comparison
    from anchorctx.evaluation.report import write_experiment_report

    cfg, _ = experiment
    inputs = rw.write_inputs(cfg)
    paths = [rw.run_weights(cfg, w.key, inputs) for w in rw.weights_list(cfg)]
    write_weights_study(paths, study_dir(cfg.experiment_dir))
    write_arm_comparison(cfg, {}, rope_study=False)
    report = write_experiment_report(cfg.experiment_dir, ["full", "anchor"])
    assert "rope_weights_plot" in report["paths"]
    assert "| full | no anchor |" in report["markdown"]
    saved = json.loads((Path(cfg.experiment_dir) / "report.json").read_text())
    weights = saved["comparison"]["rope_weights"]["weights"]
    assert [w["key"] for w in weights] == ["base", "arm-full"]
    # report.json keeps the table's numbers; the curves stay in rope_weights.json.
    assert "per_token" not in weights[1]["results"]["without_anchor"]["bf16"]
    assert "D" in weights[1]["results"]["without_anchor"]["bf16"]
