"""The BF16 RoPE precision study: metrics, probe, measurement and the command."""

from __future__ import annotations

import json

import pytest
import torch

from anchorctx.analysis import metrics
from anchorctx.analysis.rope_precision import (
    StudyInputError,
    capture_qk,
    measure,
    prepare_model,
    random_sequences,
    sequences_from_token_lists,
)
from anchorctx.analysis.settings import RopePrecisionConfig
from anchorctx.config import ConfigError
from anchorctx.experiment import config_from_dict

T = 128
SPEC = RopePrecisionConfig(
    shifts=[0, 8, 16, 500], delta2=16, seq_len=T, num_sequences=2, lengths=[32, 64, 128]
)


def tiny_llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


@pytest.fixture(scope="module")
def study():
    model = prepare_model(tiny_llama())
    return measure(model, random_sequences(2, T, 128, anchor=1, seed=0), SPEC, progress=False)


# ------------------------------------------------------------------------------------ metrics
def _dense_key_diff(q1, k1, q2, k2, scaling):
    """Reference: float64, one head at a time, explicit loops over keys."""
    h = q1.shape[1]
    k1, k2 = metrics.expand_kv(k1, h).double(), metrics.expand_kv(k2, h).double()
    t = q1.shape[2]
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    out = torch.zeros(q1.shape[0], t, dtype=torch.float64)
    for head in range(h):
        a = [
            ((q.double()[:, head] @ k[:, head].transpose(-1, -2)) * scaling)
            .masked_fill(~mask, float("-inf"))
            .softmax(-1)
            for q, k in ((q1, k1), (q2, k2))
        ]
        out += (a[0] - a[1]).abs().sum(dim=1)
    return out


def test_key_abs_diff_matches_dense_reference_with_gqa_and_chunking(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    q1, q2 = (torch.randn(2, 6, 40, 8, generator=gen) for _ in range(2))
    k1, k2 = (torch.randn(2, 3, 40, 8, generator=gen) for _ in range(2))
    monkeypatch.setattr(metrics, "_CHUNK_BYTES", 4 * 2 * 40 * 40 * 3 * 2)  # two heads per chunk
    got = metrics.key_abs_diff(q1, k1, q2, k2, 0.3)
    torch.testing.assert_close(got, _dense_key_diff(q1, k1, q2, k2, 0.3), rtol=1e-5, atol=1e-6)
    assert torch.equal(
        metrics.key_abs_diff(q1, k1, q1, k1, 0.3), torch.zeros(2, 40, dtype=torch.float64)
    )


def test_first_token_logits_and_normalizer():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 10, 8, generator=gen), torch.randn(1, 2, 10, 8, generator=gen)
    z = metrics.first_token_logits(q, k, 0.5)
    assert torch.allclose(z[0, 3], (q[0, 3] @ k[0, 1, 0]) * 0.5)  # head 3 reads kv head 1
    assert metrics.column_normalizer(4).tolist() == [0.25, 1 / 3, 0.5, 1.0]


def test_probe_captures_the_models_attention():
    """Probabilities from the captured q/k equal the stock eager attention weights."""
    model = prepare_model(tiny_llama())
    eager = tiny_llama()
    eager.load_state_dict(model.state_dict())
    eager.set_attn_implementation("eager")
    ids = random_sequences(1, 48, 128, anchor=1, seed=3)
    with torch.no_grad():
        captured = capture_qk(model, ids, shift=7)
        ref = eager(input_ids=ids, position_ids=torch.arange(7, 55)[None], output_attentions=True)
    for layer, (q, k, scaling) in captured.items():
        torch.testing.assert_close(
            metrics.causal_probs(q, metrics.expand_kv(k, 4), scaling),
            ref.attentions[layer],
            rtol=1e-5,
            atol=1e-6,
        )


# -------------------------------------------------------------------------------- measurement
def test_difference_is_exactly_zero_when_shifts_match(study):
    for mode in ("bf16", "bf16_rope_fp32", "fp32"):
        assert study["shift_curve"][mode]["16"] == 0.0


def test_fp32_at_rounding_level_and_bf16_far_larger(study):
    # Measured on this model: fp32 D ≈ 4e-7..2e-6, bf16 D ≈ 1.5e-3; D_logit fp32 ≈ 1e-7,
    # bf16 ≈ 7e-4. Asserted with ample margins.
    fp32 = [v for d, v in study["shift_curve"]["fp32"].items() if d != "16"]
    bf16 = [v for d, v in study["shift_curve"]["bf16"].items() if d != "16"]
    assert max(fp32) < 1e-4
    assert min(bf16) > 100 * max(fp32)
    for n in ("32", "64", "128"):
        assert (
            study["logit_diff_by_length"]["bf16"][n]
            > 100 * study["logit_diff_by_length"]["fp32"][n]
        )


def test_fp32_rope_reduces_the_bf16_difference(study):
    # Measured ratio ≈ 0.7 (the rotation's own rounding removed; the rest of bf16 remains).
    for d in ("0", "8", "500"):
        assert study["shift_curve"]["bf16_rope_fp32"][d] < 0.9 * study["shift_curve"]["bf16"][d]
        assert study["shift_curve"]["bf16_rope_fp32"][d] > 10 * study["shift_curve"]["fp32"][d]


def test_per_token_contributions_add_up(study):
    for mode in study["settings"]["modes"]:
        per_token = study["per_token"][mode]
        assert len(per_token) == T
        assert sum(per_token) == pytest.approx(study["shift_curve"][mode]["0"], rel=1e-9)
        assert 0 < study["first_token_share"][mode] < 1
        assert study["first_token_share"][mode] == pytest.approx(per_token[0] / sum(per_token))
    assert study["rope_fp32"] == {"bf16": False, "bf16_rope_fp32": True, "fp32": False}


def test_per_sample_curves_average_to_the_shift_curve_exactly(study):
    """Figure 7's per-sequence curves: one per input sequence, mean equal to the mean curve."""
    for mode in study["settings"]["modes"]:
        curves = study["per_sample_shift_curve"][mode]
        assert len(curves) == SPEC.num_sequences
        assert curves[0] != curves[1]  # two different sequences, not one curve repeated
        for d, mean in study["shift_curve"][mode].items():
            values = [c[d] for c in curves]
            assert sum(values) / len(values) == mean  # exact: the same floats, the same sum


def test_measure_rejects_short_sequences():
    with pytest.raises(StudyInputError, match="max of seq_len and lengths"):
        measure(prepare_model(tiny_llama()), torch.zeros(1, T - 1, dtype=torch.long), SPEC)


def test_sequences_start_with_the_anchor_and_report_shortage():
    seqs = sequences_from_token_lists([[5] * 7, [6] * 10], anchor=1, n=3, length=6, source="x")
    assert seqs.tolist() == [[1, 5, 5, 5, 5, 5], [1, 5, 5, 6, 6, 6], [1, 6, 6, 6, 6, 6]]
    with pytest.raises(StudyInputError, match="holds 1 sequence"):
        sequences_from_token_lists([[5] * 7], anchor=1, n=2, length=6, source="x")


def test_config_rejects_negative_shift():
    raw = {"name": "x", "model": {"path": "m"}}
    with pytest.raises(ConfigError, match="shifts"):
        config_from_dict(raw, ["analysis.rope_precision.shifts=[0, -1]"])


# ---------------------------------------------------------------------------------- end to end
def test_command_writes_json_figure_and_table(tiny_config, demo_corpus, tmp_path):
    from anchorctx.cli import main

    text = tmp_path / "text.txt"
    text.write_text(
        "\n".join(
            p.read_text()
            for p in sorted(demo_corpus.data_dir.rglob("*"))
            if p.is_file() and p.suffix in {".jsonl", ".txt"}
        )[:200_000]
    )
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(tiny_config.to_yaml())
    out = tmp_path / "out"
    sets = [
        "analysis.rope_precision.seq_len=96",
        "analysis.rope_precision.num_sequences=2",
        "analysis.rope_precision.lengths=[32,96]",
        "analysis.rope_precision.shifts=[0,16,200]",
        "analysis.rope_precision.device=cpu",
        f"analysis.rope_precision.text_files=['{text}']",
    ]
    argv = ["rope-precision", str(cfg_path), "--out", str(out), "--no-progress"]
    assert main(argv + [a for s in sets for a in ("--set", s)]) == 0
    result = json.loads((out / "rope_precision.json").read_text())
    for key in (
        "shift_curve",
        "first_token_share",
        "logit_diff_by_length",
        "per_token",
        "config",
        "manifest",
        "settings",
        "rope_fp32",
    ):
        assert key in result
    assert set(result["shift_curve"]) == {"bf16", "bf16_rope_fp32", "fp32"}
    assert set(result["shift_curve"]["bf16"]) == {"0", "16", "200"}
    assert set(result["logit_diff_by_length"]["fp32"]) == {"32", "96"}
    assert result["config"]["analysis"]["rope_precision"]["seq_len"] == 96
    assert (out / "rope_precision.png").read_bytes()[:4] == b"\x89PNG"
    assert "| D(Δ1=0, Δ2=16) |" in (out / "rope_precision.md").read_text()
    # Figure 7: the curve of every sequence in its own file, their mean the file's mean exactly.
    assert "per_sample_shift_curve" not in result
    samples = json.loads((out / "rope_precision_per_sample.json").read_text())
    assert samples["settings"]["num_sequences"] == 2
    for mode in result["settings"]["modes"]:
        curves = samples["per_sample_shift_curve"][mode]
        assert len(curves) == 2 and all(set(c) == {"0", "16", "200"} for c in curves)
        for d in ("0", "16", "200"):
            assert sum(c[d] for c in curves) / 2 == result["shift_curve"][mode][d]
    assert (out / "rope_precision_per_sample.png").read_bytes()[:4] == b"\x89PNG"


def test_help_names_the_per_sample_outputs(capsys):
    from anchorctx.cli import main

    with pytest.raises(SystemExit):
        main(["rope-precision", "--help"])
    assert "rope_precision_per_sample.json" in " ".join(capsys.readouterr().out.split())


def test_packed_dataset_sequences(tiny_config, packed_demo):
    from anchorctx.analysis.rope_precision import load_sequences
    from anchorctx.models.loading import anchor_token_id, load_tokenizer

    cfg = config_from_dict(
        tiny_config.model_dump(mode="json"),
        [
            "analysis.rope_precision.seq_len=700",
            "analysis.rope_precision.num_sequences=2",
            "analysis.rope_precision.lengths=[64]",
        ],
    )
    tok = load_tokenizer(cfg.model)
    seqs, source = load_sequences(cfg, tok, progress=False)
    assert source == "packed dataset" and seqs.shape == (2, 700)  # longer than one packed row
    assert (seqs[:, 0] == anchor_token_id(tok)).all()
    assert (seqs[:, 1:] != anchor_token_id(tok)).float().mean() > 0.9


@pytest.mark.gpu
def test_gpu_study_matches_cpu_properties():
    """On CUDA (cuBLAS/SDPA kernels): exact zero at Δ1 = Δ2, fp32 ≪ bf16, fp32 RoPE helps."""
    model = prepare_model(tiny_llama()).cuda()
    spec = RopePrecisionConfig(
        shifts=[0, 16, 1000], seq_len=512, num_sequences=2, lengths=[64, 512]
    )
    result = measure(model, random_sequences(2, 512, 128, anchor=1, seed=0), spec, progress=False)
    curve = result["shift_curve"]
    assert all(curve[m]["16"] == 0.0 for m in curve)
    assert curve["bf16"]["0"] > 100 * curve["fp32"]["0"]
    assert curve["bf16_rope_fp32"]["0"] < curve["bf16"]["0"]


def test_checkpoint_weights_or_random_init(demo_corpus, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from anchorctx.analysis.rope_precision import load_study_model

    tok = AutoTokenizer.from_pretrained(str(demo_corpus.tokenizer_dir))
    hf = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(hf).save_pretrained(tmp_path / "ckpt")
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").model.embed_tokens.weight
    raw = {
        "name": "x",
        "run_root": str(tmp_path),
        "model": {"path": str(tmp_path / "ckpt"), "tokenizer": str(demo_corpus.tokenizer_dir)},
    }
    for random_init in (False, True):
        cfg = config_from_dict(
            raw, [f"analysis.rope_precision.random_init={str(random_init).lower()}"]
        )
        model, weights = load_study_model(cfg, tok, torch.device("cpu"))
        emb = model.model.embed_tokens.weight
        assert emb.dtype == torch.float32 and torch.equal(emb, emb.bfloat16().float())  # bf16 grid
        assert torch.equal(emb, saved.bfloat16().float()) != random_init
        assert ("random init" in weights) == random_init
