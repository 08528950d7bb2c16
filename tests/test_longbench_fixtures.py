"""The evaluation fixtures: deterministic, in the real formats, answers present in the text."""

from __future__ import annotations

import json

import pytest

from anchorctx.demo.fixtures import (
    KEYS,
    ensure_eval_fixtures,
    write_eval_fixtures,
    write_ruler_fixtures,
)
from anchorctx.evaluation.longbench.runner import load_rows, sample_keys
from anchorctx.evaluation.longbench.tasks import ENGLISH_DATASETS
from anchorctx.io import hash_tree


def test_deterministic_and_complete(tmp_path):
    a = write_eval_fixtures(tmp_path / "a", seed=3)
    write_eval_fixtures(tmp_path / "b", seed=3)
    write_eval_fixtures(tmp_path / "c", seed=4)
    assert set(a) == set(KEYS) and all(p.exists() for p in a.values())
    assert hash_tree(tmp_path / "a") == hash_tree(tmp_path / "b") != hash_tree(tmp_path / "c")


def test_ruler_set_is_a_subset_of_the_full_set(tmp_path):
    """One generator: the RULER-only set holds the same bytes as the full set's RULER files."""
    full = write_eval_fixtures(tmp_path / "full", seed=5)
    ruler = write_ruler_fixtures(tmp_path / "ruler", seed=5)
    assert set(ruler) == {"essay_path", "squad_path", "hotpotqa_path", "nltk_data"}
    for key in ("essay", "squad", "hotpotqa"):
        assert ruler[f"{key}_path"].read_bytes() == full[key].read_bytes()
    assert hash_tree(ruler["nltk_data"]) == hash_tree(full["nltk_data"])
    assert not (tmp_path / "ruler" / "longbench").exists()
    with pytest.raises(ValueError, match=r"unknown keys \['essays'\]"):
        write_eval_fixtures(tmp_path / "bad", keys=("essays",))


def test_real_formats(tmp_path):
    p = write_eval_fixtures(tmp_path)
    essay = json.loads(p["essay"].read_text())["text"]  # RULER: json.load(f)["text"]
    assert len(essay.split()) >= 12_000
    squad = json.loads(p["squad"].read_text())
    answerable = 0
    for article in squad["data"]:
        for par in article["paragraphs"]:
            for qa in par["qas"]:
                assert qa["is_impossible"] == (not qa["answers"])
                for ans in qa["answers"]:
                    start = ans["answer_start"]
                    assert par["context"][start : start + len(ans["text"])] == ans["text"]
                    answerable += 1
    assert answerable == 80
    hotpot = json.loads(p["hotpotqa"].read_text())
    for q in hotpot:
        assert len(q["context"]) == 10
        text = {title: "".join(sents) for title, sents in q["context"]}
        assert all(title in text for title, _ in q["supporting_facts"])
        assert any(q["answer"] in t for t in text.values())
    for name in ENGLISH_DATASETS:
        rows = load_rows(p["longbench_dir"] / f"{name}.jsonl")
        assert len(rows) == 3 and len(set(sample_keys(name, rows))) == 3
        assert all(r["dataset"] == name and r["answers"] for r in rows)
    trec = load_rows(p["longbench_dir"] / "trec.jsonl")
    assert all(r["answers"][0] in r["all_classes"] for r in trec)
    mmlu = [
        json.loads(x) for x in (p["mmlu_dir"] / "test" / "astronomy.jsonl").read_text().splitlines()
    ]
    assert all(len(r["choices"]) == 4 and r["answer"] in range(4) for r in mmlu)
    hs = [json.loads(x) for x in (p["hellaswag_dir"] / "validation.jsonl").read_text().splitlines()]
    assert all(len(r["endings"]) == 4 and r["label"] in "0123" for r in hs)


def test_ensure_writes_once(tiny_config, tmp_path):
    cfg = tiny_config.model_copy(deep=True)
    assert ensure_eval_fixtures(cfg) is None  # real data configured: nothing written
    cfg.evaluation.demo_fixtures = tmp_path / "eval"
    paths = ensure_eval_fixtures(cfg)
    stamp = (tmp_path / "eval" / "manifest.json").stat().st_mtime_ns
    assert ensure_eval_fixtures(cfg) == paths
    assert (tmp_path / "eval" / "manifest.json").stat().st_mtime_ns == stamp
    paths["squad"].unlink()  # an incomplete copy is rewritten
    assert ensure_eval_fixtures(cfg)["squad"].is_file()
