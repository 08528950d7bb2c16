"""configs/paper/: one preset per experiment of the paper, each validated by `anchorctx config
--arms`, each arm carrying the paper's settings for its table (docs/PAPER_MAP.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from anchorctx.cli import main
from anchorctx.experiment import load_config

PAPER = Path(__file__).resolve().parents[1] / "configs" / "paper"
PRESETS = sorted(PAPER.glob("*.yaml"))


def _arms(stem: str):
    return {a.variant_name: a for a in load_config(PAPER / f"{stem}.yaml").arms()}


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_every_preset_passes_config_arms(path, capsys):
    assert main(["config", str(path), "--arms"]) == 0
    out = capsys.readouterr().out
    cfg = load_config(path)
    assert out.count("# run directory:") == len(cfg.arms())
    if cfg.training.steps > 1:  # a training preset: the layout plan chooses the split
        assert cfg.training.sequence_parallel == "auto"


def test_table_1_bases_follow_the_training_length():
    for stem, seq, theta in [
        ("llama2-7b-16k", 16384, 1e6),
        ("llama2-7b-64k", 65536, 5e6),
        ("llama2-7b-128k", 131072, 1e7),
    ]:
        cfg = load_config(PAPER / f"{stem}.yaml")
        assert (cfg.data.seq_len, cfg.model.rope_theta) == (seq, theta)
        assert max(cfg.evaluation.ruler.lengths) == seq
        assert cfg.evaluation.ruler.exclude == ["niah_multikey_3", "cwe"]


def test_table_2_grid_is_method_by_base_at_64k_and_table_4_needs_no_retraining():
    arms = _arms("llama2-7b-64k-rope-methods")
    grid = {
        name: (a.model.rope_scaling.type, a.model.rope_theta, a.model.rope_scaling.factor)
        for name, a in arms.items()
    }
    assert grid["rope-5m"] == ("keep", 5e6, None)  # Llama-2 has no scaling of its own
    assert grid["yarn-1m"] == ("yarn", 1e6, 16.0) and grid["ntk-10k"] == ("ntk", 1e4, 16.0)
    assert {n.split("-")[0] for n in grid} == {"rope", "yarn", "ntk"} and len(grid) == 11
    for a in arms.values():
        assert a.data.seq_len == 65536 and a.training.attention == "full"
        # Table 4: the same checkpoints at 128K; the limit is the deliberate override.
        assert a.model.max_position_embeddings == 131072
        assert 131072 in a.evaluation.ruler.lengths


def test_table_3_sweeps_the_base_at_32k():
    arms = _arms("llama2-7b-32k-base-sweep")
    assert sorted(a.model.rope_theta for a in arms.values()) == [
        500,
        1e4,
        2e5,
        6e5,
        9e5,
        5e6,
        1e9,
    ]
    assert {a.data.seq_len for a in arms.values()} == {32768}


def test_table_5_three_datasets_by_seven_arms():
    for stem, mixture in [
        ("table5-slimpajama-64k", "original"),
        ("table5-slimpajama-128k", "original"),
        ("table5-upsampledmix-128k", "upsampled"),
    ]:
        arms = _arms(stem)
        assert len(arms) == 7 and {a.data.mixture for a in arms.values()} == {mixture}
        assert arms["anchor_interleave"].data.interleave_chunks
        assert arms["intra_doc_interleave"].training.attention == "intra_doc"
        assert arms["anchor_tags"].data.domain_tags and not arms["anchor"].data.domain_tags


@pytest.mark.parametrize("stem", ["llama3-8b-128k", "mistral-7b-v0.3-128k", "qwen1.5-1.8b-128k"])
def test_table_6_families_at_128k_base_1e7_all_13_tasks(stem):
    cfg = load_config(PAPER / f"{stem}.yaml")
    assert (cfg.data.seq_len, cfg.model.rope_theta) == (131072, 1e7)
    assert cfg.model.rope_scaling.type == "none"  # plain RoPE with base 1e7, never llama3's
    assert cfg.evaluation.ruler.exclude == [] and cfg.evaluation.ruler.tasks is None
    assert cfg.evaluation.ruler.english_words_path is not None  # CWE near 128K
    assert [v.name for v in cfg.variants] == ["full", "anchor", "anchor_tags"]


def test_tables_10_11_cwe_at_4000_and_4096():
    cfg = load_config(PAPER / "llama2-7b-ruler-4000-vs-4096.yaml")
    assert cfg.evaluation.ruler.lengths == [4000, 4096] and cfg.evaluation.ruler.exclude == []
    assert cfg.model.rope_theta is None  # the base checkpoint as published
