"""evaluate_checkpoint: result files, idempotence, resume after interruption, invalidation,
clear errors. A fake suite is registered in the suite registry; the model is a real tiny HF
checkpoint loaded with transformers (counted, to prove when no loading happens)."""

from __future__ import annotations

import json
import shutil
import typing
from pathlib import Path
from typing import Any

import pytest

from anchorctx.evaluation import results
from anchorctx.evaluation.averaging import summarize_run
from anchorctx.evaluation.records import ResultRecord, RunSummary, SamplesInfo, SuiteSummary
from anchorctx.evaluation.results import (
    EvaluationError,
    Suite,
    checkpoint_hash,
    evaluate_checkpoint,
    samples_path,
)
from anchorctx.experiment import config_from_dict
from anchorctx.io import sha256_file

NUM_SAMPLES = 10


def assert_record_keys(record_type: Any, value: dict[str, Any]) -> None:
    """``value`` (a record read from its file) holds every required key of the TypedDict
    ``record_type`` and no key it does not name: the type and the writer agree."""
    hints = typing.get_type_hints(record_type, include_extras=True)
    optional = {k for k, t in hints.items() if typing.get_origin(t) is typing.NotRequired}
    name = record_type.__name__
    assert not (missing := set(hints) - optional - set(value)), f"{name}: {missing} not written"
    assert not (unknown := set(value) - set(hints)), f"{name}: {unknown} written, not typed"


# --------------------------------------------------------------------------- fixtures
def save_tiny_checkpoint(path: Path, *, seed: int, step: int | None = None) -> Path:
    """A real HF checkpoint: tiny random Llama + a word-level tokenizer + anchorctx.json."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<s>", "</s>", "<unk>", "a", "b", "c", "d", "e"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    if step is not None:
        (path / "anchorctx.json").write_text(json.dumps({"step": step}))
    return path


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    save_tiny_checkpoint(tmp_path / "run" / "checkpoints" / "step-000010", seed=0, step=10)
    return tmp_path / "run"


@pytest.fixture
def checkpoint(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "step-000010"


@pytest.fixture
def cfg(tmp_path: Path, checkpoint: Path):
    return config_from_dict(
        {
            "name": "t",
            "run_root": str(tmp_path),  # the checkpoint's run lies inside run_root
            "model": {"path": str(checkpoint)},
            "evaluation": {"device": "cpu", "dtype": "float32"},
        }
    )


class FakeSuite:
    """A suite of NUM_SAMPLES samples over two tasks whose per-sample score depends on the
    model's weights (so a changed checkpoint changes scores). Can fail after N new samples."""

    def __init__(self) -> None:
        self.calls = 0
        self.fail_after: int | None = None
        self.seen_done: list[int] = []

    def __call__(self, model, tokenizer, cfg, *, done, on_sample, progress=True) -> dict[str, Any]:
        self.calls += 1
        self.seen_done.append(len(done))
        weight = float(next(model.parameters()).detach().flatten()[0])
        records, new = [], 0
        for i in range(NUM_SAMPLES):
            task = "alpha" if i % 2 else "beta"
            key = f"{task}/4096/{i}"
            if key in done:
                records.append(done[key])
                continue
            if self.fail_after is not None and new == self.fail_after:
                raise RuntimeError("simulated crash")
            rec = {"key": key, "task": task, "score": (i * 7 % 5) * 25.0 + weight}
            on_sample(rec)
            records.append(rec)
            new += 1
        scores: dict[str, dict[str, float]] = {}
        counts: dict[str, dict[str, int]] = {}
        for task in ("alpha", "beta"):
            vals = [r["score"] for r in records if r["task"] == task]
            scores[task] = {"4096": sum(vals) / len(vals)}
            counts[task] = {"4096": len(vals)}
        return {"scores": scores, "counts": counts, "not_run": {"gamma": "no data"}}


@pytest.fixture
def fake(monkeypatch) -> FakeSuite:
    suite = FakeSuite()
    monkeypatch.setitem(results.SUITES, "fake", Suite(suite))
    return suite


@pytest.fixture
def loads(monkeypatch) -> list[Path]:
    """Count model loads; load with plain transformers (the stock attention)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    calls: list[Path] = []

    def load(checkpoint: Path, *, device: str, dtype: str):
        calls.append(checkpoint)
        return AutoModelForCausalLM.from_pretrained(checkpoint), AutoTokenizer.from_pretrained(
            checkpoint
        )

    monkeypatch.setattr(results, "load_eval_model", load)
    results.clear_model_cache()
    yield calls
    results.clear_model_cache()


# ------------------------------------------------------------------------------ tests
def test_result_file_contents(cfg, checkpoint, run_dir, fake, loads):
    path = evaluate_checkpoint(cfg, checkpoint, "fake", progress=False)
    assert path == (run_dir / "eval" / "step-000010" / "fake.json").resolve()
    out = json.loads(path.read_text())
    assert out["suite"] == "fake" and out["step"] == 10
    assert out["checkpoint"] == str(checkpoint.resolve())
    assert out["checkpoint_hash"] == checkpoint_hash(checkpoint)
    assert out["evaluation"] == {
        "dtype": "float32",
        "batch_size": 1,
        "engine": "auto",
        "deterministic_decode": False,
    }
    assert out["counts"] == {"alpha": {"4096": 5}, "beta": {"4096": 5}}
    assert out["not_run"] == {"gamma": "no data"}
    assert out["samples"] == {
        "resumed": 0,
        "new": NUM_SAMPLES,
        "file": "fake.samples.jsonl",
        "sha256": sha256_file(samples_path(checkpoint, "fake")),
    }
    assert out["versions"]["torch"] and out["duration_s"] >= 0
    lines = samples_path(checkpoint, "fake").read_text().splitlines()
    assert json.loads(lines[0])["__header__"]["checkpoint_hash"] == out["checkpoint_hash"]
    assert len(lines) == 1 + NUM_SAMPLES


def test_result_and_summary_files_hold_their_record_types_keys(
    cfg, checkpoint, run_dir, fake, loads
):
    """records.py types what the files hold: a key the writer adds without typing it, or a
    typed key it stops writing, fails here."""
    out = json.loads(evaluate_checkpoint(cfg, checkpoint, "fake", progress=False).read_text())
    assert_record_keys(ResultRecord, out)
    assert_record_keys(SamplesInfo, out["samples"])
    summarize_run(run_dir, 1)
    summary = json.loads((run_dir / "eval" / "summary.json").read_text())
    assert_record_keys(RunSummary, summary)
    assert_record_keys(SuiteSummary, summary["suites"]["fake"])
    unknown = out | {"ruler_total": 1}
    with pytest.raises(AssertionError, match="ruler_total"):
        assert_record_keys(ResultRecord, unknown)


def test_second_call_does_no_work(cfg, checkpoint, fake, loads):
    first = evaluate_checkpoint(cfg, checkpoint, "fake", progress=False)
    before = first.read_text()
    results.clear_model_cache()  # a fresh process: nothing cached in memory
    second = evaluate_checkpoint(cfg, checkpoint, "fake", progress=False)
    assert second == first and second.read_text() == before
    assert fake.calls == 1 and len(loads) == 1  # neither the runner nor the loader ran again
    # A setting that cannot change this suite's scores keeps the result.
    evaluate_checkpoint(cfg.model_copy(update={"seed": 7}), checkpoint, "fake", progress=False)
    assert fake.calls == 1


def test_model_loaded_once_per_checkpoint(cfg, checkpoint, fake, loads, monkeypatch):
    monkeypatch.setitem(results.SUITES, "fake2", Suite(FakeSuite()))
    evaluate_checkpoint(cfg, checkpoint, "fake", progress=False)
    evaluate_checkpoint(cfg, checkpoint, "fake2", progress=False)
    assert len(loads) == 1


def test_resume_after_interruption_equals_uninterrupted(cfg, checkpoint, tmp_path, fake, loads):
    fake.fail_after = 4
    with pytest.raises(RuntimeError, match="simulated crash"):
        evaluate_checkpoint(cfg, checkpoint, "fake", progress=False)
    assert not (checkpoint.parent.parent / "eval" / "step-000010" / "fake.json").exists()
    assert len(samples_path(checkpoint, "fake").read_text().splitlines()) == 1 + 4

    fake.fail_after = None
    resumed = json.loads(evaluate_checkpoint(cfg, checkpoint, "fake", progress=False).read_text())
    assert fake.seen_done == [0, 4]
    assert resumed["samples"]["resumed"] == 4 and resumed["samples"]["new"] == NUM_SAMPLES - 4
    lines = samples_path(checkpoint, "fake").read_text().splitlines()
    assert len(lines) == 1 + NUM_SAMPLES  # nothing recomputed, nothing duplicated

    other = tmp_path / "other" / "checkpoints" / "step-000010"
    shutil.copytree(checkpoint, other)
    clean = json.loads(evaluate_checkpoint(cfg, other, "fake", progress=False).read_text())
    assert clean["samples"]["resumed"] == 0
    assert resumed["scores"] == clean["scores"]


def test_changed_checkpoint_is_reevaluated(cfg, checkpoint, fake, loads):
    first = json.loads(evaluate_checkpoint(cfg, checkpoint, "fake", progress=False).read_text())
    save_tiny_checkpoint(checkpoint, seed=1, step=10)  # retrained in place: new weights
    second = json.loads(evaluate_checkpoint(cfg, checkpoint, "fake", progress=False).read_text())
    assert fake.calls == 2 and len(loads) == 2
    assert second["checkpoint_hash"] != first["checkpoint_hash"]
    assert second["samples"]["resumed"] == 0  # old per-sample records were not reused
    assert second["scores"] != first["scores"]


def test_interrupted_samples_of_other_config_are_discarded(cfg, checkpoint, fake, loads):
    fake.fail_after = 3
    with pytest.raises(RuntimeError):
        evaluate_checkpoint(cfg, checkpoint, "fake", progress=False)
    fake.fail_after = None
    changed = cfg.model_copy(deep=True)
    changed.evaluation.batch_size = 4
    out = json.loads(evaluate_checkpoint(changed, checkpoint, "fake", progress=False).read_text())
    assert out["samples"]["resumed"] == 0 and out["evaluation"]["batch_size"] == 4


def test_force_reruns(cfg, checkpoint, fake, loads):
    evaluate_checkpoint(cfg, checkpoint, "fake", progress=False)
    out = json.loads(
        evaluate_checkpoint(cfg, checkpoint, "fake", force=True, progress=False).read_text()
    )
    assert fake.calls == 2 and out["samples"]["resumed"] == 0


def test_missing_or_incomplete_checkpoint(cfg, tmp_path, fake, loads):
    with pytest.raises(EvaluationError, match=r"checkpoint not found: .*nope"):
        evaluate_checkpoint(cfg, tmp_path / "nope", "fake", progress=False)
    partial = tmp_path / "run2" / "checkpoints" / "step-000001"
    partial.mkdir(parents=True)
    with pytest.raises(EvaluationError, match=r"no config\.json"):
        evaluate_checkpoint(cfg, partial, "fake", progress=False)
    (partial / "config.json").write_text("{}")
    with pytest.raises(EvaluationError, match="no weights"):
        evaluate_checkpoint(cfg, partial, "fake", progress=False)
    assert fake.calls == 0 and not loads


def test_a_required_data_path_left_unset_is_one_error_naming_its_key(cfg, fake):
    assert cfg.evaluation.harness.mmlu_dir is None
    with pytest.raises(EvaluationError, match=r"'mmlu' needs evaluation\.harness\.mmlu_dir"):
        results.check_inputs(cfg, "mmlu")
    results.check_inputs(cfg, "fake")  # a suite without a section requires nothing


def test_unknown_suite(cfg, checkpoint):
    with pytest.raises(EvaluationError, match=r"unknown evaluation suite 'rulr'.*ruler"):
        evaluate_checkpoint(cfg, checkpoint, "rulr", progress=False)


def test_missing_data_paths_are_named(cfg, checkpoint, tmp_path, loads):
    with pytest.raises(EvaluationError, match=r"evaluation\.longbench\.data_dir"):
        evaluate_checkpoint(cfg, checkpoint, "longbench", progress=False)
    bad = cfg.model_copy(deep=True)
    bad.evaluation.ruler.essay_path = tmp_path / "missing_essays.json"
    with pytest.raises(EvaluationError, match=r"evaluation\.ruler\.essay_path .*does not exist"):
        evaluate_checkpoint(bad, checkpoint, "ruler", progress=False)
    assert not loads


def test_input_data_change_changes_fingerprint(cfg, tmp_path):
    essays = tmp_path / "essays.json"
    essays.write_text('{"text": "one"}')
    with_file = cfg.model_copy(deep=True)
    with_file.evaluation.ruler.essay_path = essays
    before = results.evaluation_fingerprint(with_file, "ruler")
    assert before != results.evaluation_fingerprint(cfg, "ruler")
    essays.write_text('{"text": "two"}')
    assert results.evaluation_fingerprint(with_file, "ruler") != before
    # Settings of other suites do not touch this suite's fingerprint.
    other = with_file.model_copy(deep=True)
    other.evaluation.harness.batch_size = 99
    assert results.evaluation_fingerprint(other, "ruler") == results.evaluation_fingerprint(
        with_file, "ruler"
    )
    # Generation batching affects generated suites, not log-likelihood ones.
    batched = cfg.model_copy(deep=True)
    batched.evaluation.batch_size = 8
    fp = results.evaluation_fingerprint
    assert fp(batched, "ruler") != fp(cfg, "ruler") and fp(batched, "mmlu") == fp(cfg, "mmlu")
    # The generation engine and the decode kernel change rounding, hence possibly tokens.
    for field, value in (("engine", "hf"), ("deterministic_decode", True)):
        other = cfg.model_copy(deep=True)
        setattr(other.evaluation, field, value)
        for suite in ("ruler", "longbench"):
            assert fp(other, suite) != fp(cfg, suite)
            assert results.suite_config(other, suite)[field] == value  # recorded in results
        assert fp(other, "mmlu") == fp(cfg, "mmlu")


def test_evaluate_command_prints_table(cfg, checkpoint, fake, loads, capsys):
    import argparse

    from anchorctx.evaluation.commands import evaluate

    args = argparse.Namespace(
        cfg=cfg,
        checkpoint=[str(checkpoint)],
        run_dir=None,
        last_k=None,
        suite=["fake"],
        force=False,
    )
    assert evaluate(args) == 0
    out = capsys.readouterr().out
    assert "| task | 4K |" in out and "| alpha |" in out and "not run: gamma: no data" in out
    args.checkpoint = [str(checkpoint.parent / "missing")]
    assert evaluate(args) == 2
