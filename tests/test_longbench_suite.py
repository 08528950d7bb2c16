"""LongBench suite runner on the fixture files with a tiny random model (CPU)."""

from __future__ import annotations

import shutil

import pytest

from anchorctx.demo.fixtures import write_eval_fixtures
from anchorctx.evaluation.longbench import run_suite
from anchorctx.evaluation.longbench.runner import fit_prompt, load_rows
from anchorctx.evaluation.longbench.tasks import build_prompt, score_sample

DATASETS = ["hotpotqa", "passage_retrieval_en", "trec", "musique"]


@pytest.fixture(scope="module")
def setup(tiny_config, tmp_path_factory):
    from anchorctx.models.loading import load_model, load_tokenizer

    paths = write_eval_fixtures(tmp_path_factory.mktemp("eval_fixtures"))
    (paths["longbench_dir"] / "musique.jsonl").unlink()  # a dataset the user does not have
    cfg = tiny_config.model_copy(deep=True)
    cfg.evaluation.batch_size = 2
    lb = cfg.evaluation.longbench
    lb.data_dir, lb.datasets, lb.limit, lb.max_length = paths["longbench_dir"], DATASETS, 2, 384
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tokenizer=tok, attn_implementation=None).eval()
    records: list[dict] = []
    result = run_suite(model, tok, cfg, done={}, on_sample=records.append, progress=False)
    return cfg, model, tok, result, records


def test_scores_counts_and_not_run(setup):
    _cfg, _, _, result, records = setup
    assert set(result["scores"]) == {"hotpotqa", "passage_retrieval_en", "trec"}
    assert result["counts"] == {"hotpotqa": 2, "passage_retrieval_en": 2, "trec": 2}
    assert "musique" in result["not_run"] and "no data file" in result["not_run"]["musique"]
    assert result["categories"] == {}  # no category is complete: none is reported
    assert len(records) == 6 and len({r["key"] for r in records}) == 6
    for name in result["scores"]:
        mine = [r["score"] for r in records if r["dataset"] == name]
        assert result["scores"][name]["score"] == round(100 * sum(mine) / len(mine), 2)


def test_records_are_scored_and_within_budget(setup):
    cfg, _, _, _, records = setup
    rows = {r["key"]: r for r in records}
    for name in ("hotpotqa", "passage_retrieval_en", "trec"):
        for row in load_rows(cfg.evaluation.longbench.data_dir / f"{name}.jsonl", limit=2):
            rec = rows[f"{name}/{row['_id']}"]
            assert rec["answers"] == row["answers"]
            assert rec["score"] == score_sample(
                name, rec["prediction"], row["answers"], row["all_classes"]
            )
            assert rec["prompt_tokens"] <= 384
    assert any(r["truncated"] for r in records)  # the fixtures' hotpotqa prompts exceed 384


def test_prediction_equals_plain_greedy_decoding(setup):
    """The batched, left-padded runner decodes what an unbatched HF greedy decode does."""
    import torch

    cfg, model, tok, _, records = setup
    row = load_rows(cfg.evaluation.longbench.data_dir / "trec.jsonl", limit=1)[0]
    text, n, _ = fit_prompt(tok, build_prompt("trec", row), 384)
    ids = torch.tensor([[tok.bos_token_id, *tok.encode(text, add_special_tokens=False)]])
    assert ids.shape[1] == n
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=64,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    expected = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert next(r for r in records if r["key"] == f"trec/{row['_id']}")["prediction"] == expected


def test_resume_skips_done_samples(setup):
    cfg, model, tok, result, records = setup
    done = {r["key"]: r for r in records[:-2]}
    again: list[dict] = []
    resumed = run_suite(model, tok, cfg, done=done, on_sample=again.append, progress=False)
    assert [r["key"] for r in again] == [r["key"] for r in records[-2:]]
    assert resumed["scores"] == result["scores"]


def test_missing_data_dir_and_unknown_dataset(setup, tmp_path):
    cfg, model, tok, _, _ = setup
    bad = cfg.model_copy(deep=True)
    bad.evaluation.longbench.datasets = ["not_a_dataset"]
    with pytest.raises(ValueError, match="unknown LongBench dataset"):
        run_suite(model, tok, bad, done={}, on_sample=lambda r: None, progress=False)
    empty = cfg.model_copy(deep=True)
    shutil.copytree(cfg.evaluation.longbench.data_dir, tmp_path / "lb")
    for f in (tmp_path / "lb").glob("*.jsonl"):
        f.unlink()
    empty.evaluation.longbench.data_dir = tmp_path / "lb"
    out = run_suite(model, tok, empty, done={}, on_sample=lambda r: None, progress=False)
    assert out["scores"] == {} and set(out["not_run"]) == set(DATASETS)


def test_engine_settings_reach_generation(setup, monkeypatch):
    from anchorctx.evaluation import generation

    cfg, model, tok, _, _ = setup
    seen: list[tuple[str, bool]] = []

    def fake(model, tokenizer, prompts, *, engine, deterministic, on_batch, **kwargs):
        seen.append((engine, deterministic))
        on_batch(list(range(len(prompts))), [""] * len(prompts))
        return [""] * len(prompts)

    monkeypatch.setattr(generation, "generate_greedy", fake)
    other = cfg.model_copy(deep=True)
    other.evaluation.longbench.datasets = ["trec"]
    other.evaluation.engine, other.evaluation.deterministic_decode = "static", True
    run_suite(model, tok, other, done={}, on_sample=lambda r: None, progress=False)
    assert seen == [("static", True)]
