"""The whole evaluation workflow through the command line, with the real RULER and LongBench
runners on the project's fixture data and tiny real checkpoints: evaluate every checkpoint of a
run, re-run (no work), report, average weights and evaluate the averaged checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checkpoints import save_checkpoint

from anchorctx.cli import main
from anchorctx.demo import ensure_eval_fixtures
from anchorctx.evaluation import results
from anchorctx.experiment import config_from_dict


@pytest.fixture
def workflow(tmp_path: Path, demo_corpus):
    raw = {
        "name": "wf",
        "run_root": str(tmp_path / "runs"),
        "model": {"tiny": {}, "tokenizer": str(demo_corpus.tokenizer_dir), "dtype": "float32"},
        "evaluation": {
            "suites": ["ruler", "longbench"],
            "demo_fixtures": str(tmp_path / "eval_data"),
            "last_k": 2,
            "device": "cpu",
            "dtype": "float32",
            "batch_size": 2,
            # fit: tight: the fixtures' ~340-token SQuAD paragraphs leave RULER's smallest qa_1
            # haystack (10 documents) no room at 1K under its whole-step rule.
            "ruler": {
                "tasks": ["niah_single_1", "qa_1"],
                "lengths": [1024],
                "num_samples": 2,
                "fit": "tight",
                "squad_path": str(tmp_path / "eval_data" / "squad.json"),
            },
            "longbench": {
                "data_dir": str(tmp_path / "eval_data" / "longbench"),
                "limit": 1,
                "datasets": ["passage_count", "passage_retrieval_en"],
            },
        },
    }
    cfg = config_from_dict(raw)
    ensure_eval_fixtures(cfg)  # as `anchorctx evaluate` does before evaluating
    for step, seed in ((5, 0), (10, 1), (15, 2)):
        ckpt = cfg.run_dir / "checkpoints" / f"step-{step:06d}"
        save_checkpoint(ckpt, demo_corpus.tokenizer_dir, seed=seed, step=step)
    config = tmp_path / "wf.yaml"
    config.write_text(cfg.to_yaml())
    return cfg, config


def test_evaluate_report_average(workflow, monkeypatch, capsys):
    cfg, config = workflow
    real_load = results.load_eval_model
    loads: list[Path] = []

    def counting_load(checkpoint, **kwargs):
        loads.append(Path(checkpoint))
        return real_load(checkpoint, **kwargs)

    monkeypatch.setattr(results, "load_eval_model", counting_load)
    results.clear_model_cache()

    assert main(["evaluate", str(config), "--last-k", "2"]) == 0
    assert [p.name for p in loads] == ["step-000010", "step-000015"]  # once per checkpoint
    out = capsys.readouterr().out
    assert "step-000015 · ruler" in out and "| niah_single_1 | " in out
    assert "not run: essay" not in out  # niah_single_1 uses the noise haystack
    ruler = json.loads((cfg.run_dir / "eval" / "step-000015" / "ruler.json").read_text())
    assert ruler["counts"] == {"niah_single_1": {"1024": 2}, "qa_1": {"1024": 2}}
    assert set(ruler["inputs"]) == {"evaluation.ruler.squad_path"}
    lb = json.loads((cfg.run_dir / "eval" / "step-000015" / "longbench.json").read_text())
    assert set(lb["categories"]) == {"Synthetic"}

    results.clear_model_cache()
    before = (cfg.run_dir / "eval" / "step-000015" / "ruler.json").read_text()
    assert main(["evaluate", str(config), "--last-k", "2"]) == 0
    assert len(loads) == 2  # unchanged checkpoints: no model load, no runner
    assert (cfg.run_dir / "eval" / "step-000015" / "ruler.json").read_text() == before

    assert main(["report", str(config)]) == 0
    report = (cfg.experiment_dir / "report.md").read_text()
    assert "| variant | 1K |" in report and "| variant | Synthetic |" in report
    # Checkpoints made by hand: no training metrics, no dataset; the arm is still named.
    assert "Nothing measured yet" in report and "| `anchor` | anchor |" in report
    assert (cfg.experiment_dir / "ruler_by_length.png").is_file()
    summary = json.loads((cfg.run_dir / "eval" / "summary.json").read_text())
    assert summary["suites"]["ruler"]["steps"] == [10, 15]

    assert main(["average-weights", str(config)]) == 0
    averaged = cfg.run_dir / "averaged" / "averaged-last-2"
    assert main(["evaluate", str(config), "--checkpoint", str(averaged), "--suite", "ruler"]) == 0
    assert main(["report", str(config)]) == 0
    summary = json.loads((cfg.run_dir / "eval" / "summary.json").read_text())
    assert list(summary["other_checkpoints"]) == ["averaged-last-2"]
    assert summary["suites"]["ruler"]["steps"] == [10, 15]  # the average is not a step
