"""lm-eval's long-context tasks as suites (``lm_eval:<task>``), offline, end to end.

A tiny random Llama with the demo tokenizer is evaluated on CPU through the lm-eval model
``anchorctx`` on small local files written in each dataset's published layout (file names and
the fields lm-eval's task files read): BABILong (RMT-team/babilong-1k-samples parquet),
InfiniteBench (xinrongzhang2022/InfiniteBench jsonl), LongBench v2 (THUDM/LongBench-v2
data.json) and RULER (lm-eval generates the samples; its essay haystack from RULER's
PaulGrahamEssays.json, punkt_tab from a local NLTK directory). Checked: the result files and their scores, the cache hit of a second run, the
experiment report's rows, the one-line error of a missing file (before any model loads), and
that the settings' task names and RULER loaders follow the installed lm-eval.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoints import save_checkpoint

from anchorctx.evaluation import results
from anchorctx.evaluation.averaging import summarize_run
from anchorctx.evaluation.lm_eval import suites as lm_eval_suites
from anchorctx.evaluation.report import write_experiment_report
from anchorctx.evaluation.results import EvaluationError, evaluate_checkpoint, result_path
from anchorctx.evaluation.settings import LM_EVAL_TASKS
from anchorctx.experiment import config_from_dict


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def run(demo_corpus, tmp_path_factory):
    """(run_root, checkpoint): a tiny Llama checkpoint inside a run directory."""
    root = tmp_path_factory.mktemp("lm_eval_suites")
    ckpt = root / "test" / "anchor" / "checkpoints" / "step-000002"
    save_checkpoint(ckpt, demo_corpus.tokenizer_dir, seed=0, step=2, positions=1024, pad=True)
    return root, ckpt


def _config(tiny_config, root: Path, suites: list[str], lm_eval: dict):
    raw = tiny_config.model_dump(mode="json", exclude_none=True)
    raw["run_root"] = str(root)
    raw["variant"] = "anchor"
    raw["evaluation"] = {
        "suites": suites,
        "device": "cpu",
        "dtype": "float32",
        "engine": "hf",
        "lm_eval": {"limit": 2, **lm_eval},
    }
    return config_from_dict(raw)


def _babilong(root: Path) -> Path:
    """RMT-team/babilong-1k-samples: ``<length>/qa<N>-00000-of-00001.parquet``, fields
    ``input``, ``question``, ``target`` (what lm-eval's babilong task files read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "input": f"Mary went to the {place}. John moved to the garden.",
            "question": "Where is Mary?",
            "target": place,
        }
        for place in ("kitchen", "office", "hallway")
    ]
    path = root / "4k" / "qa1-00000-of-00001.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return root


def _infinitebench(root: Path) -> Path:
    """xinrongzhang2022/InfiniteBench: ``passkey.jsonl`` with id, context, input, answer,
    options (the fields lm-eval's features declare)."""
    root.mkdir(parents=True)
    lines = [
        {
            "id": i,
            "context": f"The grass is green. The pass key is {key}. Remember it. The sky is blue.",
            "input": "What is the pass key?",
            "answer": [str(key)],
            "options": [],
        }
        for i, key in enumerate((71432, 50316, 98765))
    ]
    (root / "passkey.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root


def _longbench2(root: Path) -> Path:
    """THUDM/LongBench-v2 ``data.json``: a JSON list with its published fields."""
    root.mkdir(parents=True)
    data = [
        {
            "_id": f"id{i}",
            "domain": "Single-Document QA",
            "sub_domain": "Academic",
            "difficulty": "easy",
            "length": "short",
            "question": f"Which number is mentioned? ({i})",
            "choice_A": "one",
            "choice_B": "two",
            "choice_C": "three",
            "choice_D": "four",
            "answer": "ABC"[i],
            "context": f"The paper mentions the number {('one', 'two', 'three')[i]}.",
        }
        for i in range(3)
    ]
    (root / "data.json").write_text(json.dumps(data))
    return root / "data.json"


def _no_model(*args, **kwargs):
    raise AssertionError("the model was loaded")


def test_babilong_end_to_end_and_cached(tiny_config, run, tmp_path, monkeypatch):
    root, ckpt = run
    data = _babilong(tmp_path / "babilong")
    cfg = _config(tiny_config, root, ["lm_eval:babilong_qa1"], {"babilong": {"data_dir": data}})
    out = evaluate_checkpoint(cfg, ckpt, "lm_eval:babilong_qa1", progress=False)
    assert out == result_path(ckpt, "lm_eval:babilong_qa1", cfg)
    assert out.name == "lm_eval-babilong_qa1.json"
    result = json.loads(out.read_text())
    assert result["suite"] == "lm_eval:babilong_qa1"
    assert set(result["scores"]) == {"babilong_qa1"}
    assert 0 <= result["scores"]["babilong_qa1"]["4k"] <= 100
    assert result["counts"] == {"babilong_qa1": {"4k": 2}}
    assert result["reference"]["pinned"] == "0.4.13"
    assert result["reference"]["anchor_token_id"] == 0
    assert "evaluation.lm_eval.babilong.data_dir/4k/qa1-00000-of-00001.parquet" in result["inputs"]
    lines = (out.parent / "lm_eval-babilong_qa1.samples.jsonl").read_text().splitlines()
    (record,) = [json.loads(line) for line in lines[1:]]
    assert record["key"] == "babilong_qa1/4k" and record["n"] == 2
    assert [s["doc_id"] for s in record["samples"]] == [0, 1]
    assert all(isinstance(s["prediction"], str) for s in record["samples"])

    # Second run: the cached result, without loading the model.
    stamp = out.stat().st_mtime_ns
    monkeypatch.setattr(results, "load_eval_model", _no_model)
    results.clear_model_cache()
    assert evaluate_checkpoint(cfg, ckpt, "lm_eval:babilong_qa1", progress=False) == out
    assert out.stat().st_mtime_ns == stamp


def test_infinitebench_and_longbench2_in_the_report(tiny_config, run, tmp_path):
    root, ckpt = run
    suites = ["lm_eval:infinitebench_passkey", "lm_eval:longbench2_academic_single"]
    lm_eval = {
        "infinitebench": {"data_dir": _infinitebench(tmp_path / "ib")},
        "longbench2": {"data_path": _longbench2(tmp_path / "lb2")},
    }
    cfg = _config(tiny_config, root, suites, lm_eval)
    for suite in suites:
        evaluate_checkpoint(cfg, ckpt, suite, progress=False)
    passkey = json.loads(result_path(ckpt, suites[0], cfg).read_text())
    assert set(passkey["scores"]) == {"infinitebench_passkey"}
    assert set(passkey["scores"]["infinitebench_passkey"]) == {"score"}
    mc = json.loads(result_path(ckpt, suites[1], cfg).read_text())
    assert mc["counts"] == {"longbench2_academic_single": {"acc": 2}}
    # Each choice scored by log-likelihood: acc is 0, 50 or 100 over two questions.
    assert mc["scores"]["longbench2_academic_single"]["acc"] in (0.0, 50.0, 100.0)

    summarize_run(ckpt.parent.parent, last_k=1)
    report = write_experiment_report(root / "test", ["anchor"])
    table = report["tables"]["lm_eval"]
    # (the module's other tests evaluate the same checkpoint on BABILong: its column may show)
    assert {"infinitebench_passkey/score", "longbench2_academic_single/acc"} <= set(
        table["columns"]
    )
    row = table["rows"]["anchor"]
    assert (
        row["longbench2_academic_single/acc"]["mean"]
        == mc["scores"]["longbench2_academic_single"]["acc"]
    )
    assert "lm-eval long-context tasks" in report["markdown"]
    header = next(x for x in report["markdown"].splitlines() if "passkey score" in x)
    assert header.startswith("| variant |") and "| longbench2_academic_single acc |" in header


def test_missing_file_is_one_error_before_the_model_loads(tiny_config, run, tmp_path, monkeypatch):
    root, ckpt = run
    data = _babilong(tmp_path / "babilong")
    cfg = _config(
        tiny_config,
        root,
        ["lm_eval:babilong"],
        {"babilong": {"data_dir": data, "lengths": ["4k"]}},
    )
    monkeypatch.setattr(results, "load_eval_model", _no_model)
    results.clear_model_cache()
    with pytest.raises(EvaluationError) as err:
        evaluate_checkpoint(cfg, ckpt, "lm_eval:babilong", progress=False)
    message = str(err.value)
    assert "\n" not in message
    assert message == (
        f"suite 'lm_eval:babilong': missing {data / '4k' / 'qa2-00000-of-00001.parquet'} "
        "(evaluation.lm_eval.babilong.data_dir): the Hugging Face dataset "
        "RMT-team/babilong-1k-samples, file 4k/qa2-00000-of-00001.parquet"
    )
    unset = _config(tiny_config, root, ["lm_eval:infinitebench"], {})
    with pytest.raises(EvaluationError, match=r"evaluation\.lm_eval\.infinitebench\.data_dir is"):
        evaluate_checkpoint(unset, ckpt, "lm_eval:infinitebench", progress=False)


def test_suite_names_are_lm_evals_and_typos_fail(tiny_config, tmp_path):
    for family, names in LM_EVAL_TASKS.items():
        assert set(names) == set(lm_eval_suites._index(family)), family
    with pytest.raises(ValueError, match="'lm_eval:babilong_qa33' is not a suite"):
        _config(tiny_config, tmp_path, ["lm_eval:babilong_qa33"], {})
    with pytest.raises(ValueError, match=r"unknown key 'evaluation\.lm_eval\.babilong\.data_dirs'"):
        _config(tiny_config, tmp_path, ["ruler"], {"babilong": {"data_dirs": "x"}})
    cfg = _config(tiny_config, tmp_path, ["lm_eval:ruler"], {"ruler": {"lengths": [4096, 8192]}})
    units = lm_eval_suites.units(cfg, "lm_eval:ruler")
    assert len(units) == 26 and units[0].key == "niah_single_1/4096"
    # RULER's lengths are the ones lm-eval's task file scores.
    metrics = [m["metric"] for m in lm_eval_suites._entry("niah_single_1")[1]["metric_list"]]
    assert metrics == ["4096", "8192", "16384", "32768", "65536", "131072"]


def test_ruler_essay_parameters_are_lm_evals():
    """The essay NIAH loader hands lm-eval's generate_samples what lm-eval's own task
    functions hand it (read from niah_utils.py's source: importing it builds RULER's word lists
    and may fetch NLTK data)."""
    import ast

    source = (lm_eval_suites.tasks_dir() / "ruler" / "niah_utils.py").read_text()
    calls = {
        fn.name: next(
            c
            for c in ast.walk(fn)
            if isinstance(c, ast.Call) and getattr(c.func, "id", "") == "generate_samples"
        )
        for fn in ast.parse(source).body
        if isinstance(fn, ast.FunctionDef) and fn.name.startswith("niah_")
    }
    fixed = {"template", "max_seq_length", "TOKENIZER"}
    for task, call in calls.items():
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg not in fixed}
        haystack = ast.literal_eval(call.args[0].keywords[0].value)
        if haystack != "essay":
            assert task not in lm_eval_suites.RULER_ESSAY_TASKS
            continue
        want = {
            "type_haystack": "essay",
            "num_samples": 500,
            **lm_eval_suites.RULER_ESSAY_TASKS[task],
        }
        assert kwargs == want, task
    assert set(lm_eval_suites.RULER_ESSAY_TASKS) <= set(calls)


def test_ruler_niah_end_to_end_from_local_files(tiny_config, run, tmp_path):
    """lm-eval's niah_single_2 (essay haystack) offline: the haystack from RULER's
    PaulGrahamEssays.json (what ``anchorctx demo-assets --paper`` writes), punkt_tab from a local
    NLTK directory, lm-eval's own generator, prompt and scoring, one sample at 4096 tokens."""
    from anchorctx.demo.fixtures import (
        FixtureWriter,
        dump_json,
        paul_graham_json,
        write_empty_punkt,
    )

    essays = tmp_path / "PaulGrahamEssays.json"
    dump_json(essays, paul_graham_json(FixtureWriter(0), 600))
    nltk_data = write_empty_punkt(tmp_path / "nltk_data")
    root, ckpt = run
    ruler = {"lengths": [4096], "essay_path": essays, "nltk_data": nltk_data}
    suite = "lm_eval:niah_single_2"
    cfg = _config(tiny_config, root, [suite], {"limit": 1, "ruler": ruler})
    out = evaluate_checkpoint(cfg, ckpt, suite, progress=False)
    result = json.loads(out.read_text())
    assert result["counts"] == {"niah_single_2": {"4096": 1}}
    assert 0 <= result["scores"]["niah_single_2"]["4096"] <= 100
    assert "evaluation.lm_eval.ruler.essay_path" in result["inputs"]
    lines = (out.parent / "lm_eval-niah_single_2.samples.jsonl").read_text().splitlines()
    (record,) = [json.loads(line) for line in lines[1:]]
    assert record["key"] == "niah_single_2/4096"
    assert isinstance(record["samples"][0]["prediction"], str)


def test_ruler_essay_sources_and_qa_sample_count(tmp_path):
    """The essay haystack reads RULER's PaulGrahamEssays.json, a list of records or a copy of
    baber/paul_graham_essays alike, split as lm-eval's get_haystack("essay"); the QA loader's
    sample count is lm-eval's get_dataset's."""
    import ast

    text = "An essay.\n\nIts  second\tparagraph. "
    (tmp_path / "one.json").write_text(json.dumps({"text": text}))
    (tmp_path / "list.json").write_text(json.dumps([{"text": text}, {"text": "More."}]))
    repo = tmp_path / "paul_graham_essays" / "data"
    repo.mkdir(parents=True)
    (repo / "train.jsonl").write_text(json.dumps({"title": "t", "text": text}) + "\n")
    assert lm_eval_suites.essay_texts(tmp_path / "one.json") == [text]
    assert lm_eval_suites.essay_texts(tmp_path / "list.json") == [text, "More."]
    cache = str(tmp_path / "cache")
    assert lm_eval_suites.essay_texts(repo.parent, cache) == [text]
    assert lm_eval_suites.essay_haystack([text, "More."]) == [
        "An",
        "essay.",
        "Its",
        "second",
        "paragraph.",
        "More.",
    ]
    with pytest.raises(lm_eval_suites.LmEvalDataError, match=r"PaulGrahamEssays\.json"):
        (tmp_path / "bad.json").write_text(json.dumps({"essays": []}))
        lm_eval_suites.essay_texts(tmp_path / "bad.json")

    source = (lm_eval_suites.tasks_dir() / "ruler" / "qa_utils.py").read_text()
    fn = next(f for f in ast.parse(source).body if getattr(f, "name", "") == "get_dataset")
    call = next(c for c in ast.walk(fn) if isinstance(c, ast.Call))
    kwargs = {k.arg: k.value for k in call.keywords}
    assert ast.literal_eval(kwargs["num_samples"]) == lm_eval_suites.QA_SAMPLES
    assert ast.literal_eval(kwargs["tokens_to_generate"]) == 32


def test_ruler_group_score_is_lm_evals_unweighted_mean():
    """lm_eval:ruler's group score: lm-eval's aggregate_subtask_metrics over its 13 tasks,
    unweighted (ruler.yaml), per length; a partial group has none."""
    leaves = lm_eval_suites.leaves("ruler")
    assert len(leaves) == 13 and leaves[0] == "niah_single_1" and leaves[-1] == "ruler_qa_hotpot"
    records = [
        {"task": t, "scores": {"4096": float(i), "8192": 50.0}, "n": 1 + i}
        for i, t in enumerate(leaves)
    ]
    out = lm_eval_suites.summarize("lm_eval:ruler", records)
    assert out["scores"]["ruler"] == {"4096": 6.0, "8192": 50.0}  # mean of 0..12, sizes ignored
    assert out["counts"]["ruler"]["4096"] == sum(range(1, 14))
    partial = lm_eval_suites.summarize("lm_eval:ruler", records[:-1])
    assert "ruler" not in partial["scores"]


def test_ruler_vt_fails_fast_where_lm_eval_would_hang(demo_corpus):
    """The demo tokenizer (3,000 pieces) puts lm-eval's smallest vt one-shot example over its
    500 tokens, where lm-eval retries forever: one clear error instead, the RNGs untouched."""
    import random

    import numpy as np
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_corpus.tokenizer_dir))
    random.seed(5)
    np.random.seed(5)
    with pytest.raises(RuntimeError, match=r"ruler_vt cannot run with this tokenizer"):
        lm_eval_suites.check_vt_tokenizer(tok)
    assert random.random() == random.Random(5).random()
    assert np.random.random() == np.random.RandomState(5).random_sample()
