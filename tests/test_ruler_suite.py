"""The RULER suite runner: records as produced, resume without redoing work, not-run tasks."""

from __future__ import annotations

import pytest

from anchorctx.demo.fixtures import write_ruler_fixtures
from anchorctx.evaluation.results import evaluation_fingerprint
from anchorctx.evaluation.ruler import PAPER_EXCLUDE, TASKS, RulerLengthError, run_suite, score
from anchorctx.evaluation.ruler.runner import selected_tasks
from anchorctx.experiment import config_from_dict


@pytest.fixture(scope="module")
def tokenizer(demo_corpus):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_corpus.tokenizer_dir))


@pytest.fixture(scope="module")
def model(tiny_config, tokenizer):
    from anchorctx.models.loading import load_model

    return load_model(tiny_config.model, tokenizer=tokenizer, attn_implementation="sdpa").eval()


def _cfg(tiny_config, **ruler):
    raw = tiny_config.model_dump(mode="json")
    # fit tight: at 512 tokens RULER's smallest haystacks (its incremental) overflow the demo
    # tokenizer's budget; these tests are about the runner, the fit rules have their own tests.
    base = {"tasks": ["niah_single_1", "fwe", "qa_2"], "lengths": [512], "num_samples": 2}
    # sample_store off: these tests count generations within one process; the on-disk store
    # (shared by every test of the session through tiny_config's run_root) has its own test.
    raw["evaluation"]["ruler"].update({**base, "fit": "tight", "sample_store": False, **ruler})
    raw["evaluation"]["batch_size"] = 1  # one record per batch: the crash lands mid-task
    return config_from_dict(raw)


class Interrupted(Exception):
    pass


def test_resume_after_interruption(tiny_config, model, tokenizer):
    cfg = _cfg(tiny_config)  # no hotpotqa_path: qa_2 is not run
    journal: dict[str, dict] = {}

    def crash_after_three(rec: dict) -> None:
        journal[rec["key"]] = rec
        if len(journal) == 3:
            raise Interrupted

    with pytest.raises(Interrupted):
        run_suite(model, tokenizer, cfg, done={}, on_sample=crash_after_three, progress=False)
    assert len(journal) == 3 and {k.split("/")[0] for k in journal} == {"niah_single_1", "fwe"}

    new: list[dict] = []
    result = run_suite(
        model, tokenizer, cfg, done=dict(journal), on_sample=new.append, progress=False
    )
    assert {r["key"] for r in new}.isdisjoint(journal)  # nothing done is redone
    assert len(new) == 1
    records = [*journal.values(), *new]
    for task, new_tokens in (("niah_single_1", 128), ("fwe", 50)):
        mine = sorted((r for r in records if r["task"] == task), key=lambda r: r["index"])
        assert [r["index"] for r in mine] == [0, 1]
        expect = score(task, [r["prediction"] for r in mine], [r["references"] for r in mine])
        assert result["scores"][task] == {"512": round(expect, 2)}  # RULER rounds
        assert result["counts"][task] == {"512": 2}
        assert all(r["prompt_tokens"] + new_tokens <= 512 for r in mine)
    assert set(result["not_run"]) == {"qa_2"}
    assert "evaluation.ruler.hotpotqa_path" in result["not_run"]["qa_2"]

    again: list[dict] = []
    done = {r["key"]: r for r in records}
    assert (
        run_suite(model, tokenizer, cfg, done=done, on_sample=again.append, progress=False)
        == result
    )
    assert again == []  # a finished suite does no work


def test_qa_runs_with_its_file(tiny_config, model, tokenizer, tmp_path):
    paths = write_ruler_fixtures(tmp_path)
    # RULER's smallest QA haystack is ten paragraphs (its incremental), ~0.6K demo-tokenizer
    # tokens: run it at 2K.
    cfg = _cfg(
        tiny_config,
        tasks=["qa_2"],
        hotpotqa_path=str(paths["hotpotqa_path"]),
        lengths=[2048],
        num_samples=1,
    )
    recs: list[dict] = []
    result = run_suite(model, tokenizer, cfg, done={}, on_sample=recs.append, progress=False)
    assert result["not_run"] == {} and result["counts"] == {"qa_2": {"2048": 1}}
    assert [r["references"] for r in recs] == [["river0x0"]]


def test_length_beyond_model_limit(tiny_config, model, tokenizer):
    cfg = _cfg(tiny_config, lengths=[512, 8192])
    with pytest.raises(
        RulerLengthError, match=r"\[8192\] exceed the model's max_position_embeddings=4096"
    ):
        run_suite(model, tokenizer, cfg, done={}, on_sample=lambda r: None, progress=False)


def test_exclude_and_unknown_tasks(tiny_config, model, tokenizer):
    assert selected_tasks(None, list(PAPER_EXCLUDE)) == [t for t in TASKS if t not in PAPER_EXCLUDE]
    assert selected_tasks(["cwe", "vt"], ["cwe"]) == ["vt"]
    with pytest.raises(ValueError, match="unknown RULER task 'niah_single_9'"):
        run_suite(
            model,
            tokenizer,
            _cfg(tiny_config, tasks=["niah_single_9"]),
            done={},
            on_sample=lambda r: None,
            progress=False,
        )


def test_engine_settings_reach_generation(tiny_config, model, tokenizer, monkeypatch):
    """evaluation.engine and evaluation.deterministic_decode are what the suite decodes with:
    the static engine with the deterministic kernel gives the records hf gives (CPU, float32)."""
    from anchorctx.evaluation import generation

    seen: list[tuple[str, bool]] = []
    real = generation.generate_greedy

    def spy(*args, engine, deterministic, **kwargs):
        seen.append((engine, deterministic))
        return real(*args, engine=engine, deterministic=deterministic, **kwargs)

    monkeypatch.setattr(generation, "generate_greedy", spy)
    predictions = {}
    for engine, deterministic in (("hf", False), ("static", True)):
        cfg = _cfg(tiny_config, tasks=["niah_single_1"], num_samples=1)
        cfg.evaluation.engine, cfg.evaluation.deterministic_decode = engine, deterministic
        recs: list[dict] = []
        run_suite(model, tokenizer, cfg, done={}, on_sample=recs.append, progress=False)
        predictions[engine] = {r["key"]: r["prediction"] for r in recs}
    assert seen == [("hf", False), ("static", True)]
    assert predictions["hf"] == predictions["static"] and len(predictions["hf"]) == 1


def test_samples_are_generated_once_per_process(tiny_config, model, tokenizer, monkeypatch):
    """A second evaluation on the same samples (another checkpoint) generates and encodes none
    of them again and records the same inputs; another seed, or a changed data file, generates
    anew."""
    from anchorctx.evaluation import generation
    from anchorctx.evaluation.ruler import runner

    runner.SAMPLES.clear()
    calls: list[tuple[str, int, tuple[int, ...]]] = []
    real = runner.generate
    encoded: list[str] = []
    real_encode = generation.encode_prompt

    def spy(task, length, *args, indices, **kwargs):
        calls.append((task, length, tuple(indices)))
        return real(task, length, *args, indices=indices, **kwargs)

    def encode_spy(tok, text):
        encoded.append(text)
        return real_encode(tok, text)

    monkeypatch.setattr(runner, "generate", spy)
    monkeypatch.setattr(generation, "encode_prompt", encode_spy)
    cfg = _cfg(tiny_config, tasks=["niah_single_1", "fwe"], num_samples=2)
    first: list[dict] = []
    run_suite(model, tokenizer, cfg, done={}, on_sample=first.append, progress=False)
    assert sorted(calls) == [("fwe", 512, (0, 1)), ("niah_single_1", 512, (0, 1))]
    assert len(encoded) == 4
    second: list[dict] = []
    run_suite(model, tokenizer, cfg, done={}, on_sample=second.append, progress=False)
    assert len(calls) == 2
    assert len(encoded) == 4  # the cached samples keep their token ids
    assert sorted((r["key"], r["prediction"]) for r in second) == sorted(
        (r["key"], r["prediction"]) for r in first
    )
    # A subset (a resumed run) comes from the cache too; a new index is generated alone.
    more = _cfg(tiny_config, tasks=["fwe"], num_samples=3)
    done = {r["key"]: r for r in first if r["task"] == "fwe" and r["index"] < 1}
    run_suite(model, tokenizer, more, done=done, on_sample=lambda r: None, progress=False)
    assert calls[2:] == [("fwe", 512, (2,))]
    # Another seed: other samples.
    run_suite(
        model,
        tokenizer,
        _cfg(tiny_config, tasks=["fwe"], num_samples=1, seed=43),
        done={},
        on_sample=lambda r: None,
        progress=False,
    )
    assert calls[3:] == [("fwe", 512, (0,))]
    runner.SAMPLES.clear()


def test_stored_samples_serve_the_experiments_other_processes(
    tiny_config, model, tokenizer, monkeypatch, tmp_path
):
    """With ``sample_store`` (the default) a fresh process (an empty in-memory cache) reads the
    samples an earlier one stored instead of generating them, and records the same outputs; an
    unreadable file is generated again and replaced; another seed has a file of its own."""
    from anchorctx.evaluation.ruler import runner

    cfg = _cfg(tiny_config, tasks=["niah_single_1", "fwe"], num_samples=2, sample_store=True)
    cfg = cfg.model_copy(update={"run_root": tmp_path / "runs"})
    calls: list[tuple[str, tuple[int, ...]]] = []
    real = runner.generate

    def spy(task, length, *args, indices, **kwargs):
        calls.append((task, tuple(indices)))
        return real(task, length, *args, indices=indices, **kwargs)

    monkeypatch.setattr(runner, "generate", spy)

    def evaluate(c) -> list[tuple[str, str]]:
        runner.SAMPLES.clear()  # each evaluation as a process of its own
        recs: list[dict] = []
        run_suite(model, tokenizer, c, done={}, on_sample=recs.append, progress=False)
        return sorted((r["key"], r["prediction"]) for r in recs)

    cold = evaluate(cfg)
    assert sorted(calls) == [("fwe", (0, 1)), ("niah_single_1", (0, 1))]
    store = cfg.experiment_dir / "ruler-samples"
    files = sorted(store.iterdir())
    assert [f.name.rsplit("-", 1)[0] for f in files] == ["fwe-512", "niah_single_1-512"]
    assert evaluate(cfg) == cold and len(calls) == 2  # read, not generated
    files[0].write_text('{"identity": "')  # a torn file: generated again, then replaced
    assert evaluate(cfg) == cold and calls[2:] == [("fwe", (0, 1))]
    assert evaluate(cfg) == cold and len(calls) == 3
    seed = cfg.model_copy(deep=True)
    seed.evaluation.ruler.seed = 43
    evaluate(seed)
    assert len(calls) == 5 and len(list(store.iterdir())) == 4
    runner.SAMPLES.clear()
    # Where samples are kept does not change scores: cached results stay valid either way.
    off = cfg.model_copy(deep=True)
    off.evaluation.ruler.sample_store = False
    assert evaluation_fingerprint(off, "ruler") == evaluation_fingerprint(cfg, "ruler")


def test_sample_cache_is_bounded_by_characters():
    """Past max_chars the oldest samples go; the newest always stays."""
    from anchorctx.evaluation.ruler.runner import SampleCache

    cache = SampleCache(max_chars=10)
    for i in range(4):
        cache._put(("id", i), {"index": i, "input": "x" * 4})
    assert [k[1] for k in cache._samples] == [2, 3] and cache._chars == 8
    cache._put(("id", 9), {"index": 9, "input": "y" * 50})
    assert [k[1] for k in cache._samples] == [9]


def test_prefetched_samples_are_not_generated_again(tiny_config, model, tokenizer, monkeypatch):
    """What a flow generates while the GPU trains (longest first) is what the evaluation then
    reads: it generates and encodes nothing itself, and its records match an unfetched run's."""
    from anchorctx.evaluation import generation
    from anchorctx.evaluation.ruler import runner

    cfg = _cfg(tiny_config, tasks=["niah_single_1", "fwe"], lengths=[512, 768], num_samples=1)
    runner.SAMPLES.clear()
    cold: list[dict] = []
    run_suite(model, tokenizer, cfg, done={}, on_sample=cold.append, progress=False)
    runner.SAMPLES.clear()
    calls: list[tuple[str, int]] = []
    real = runner.generate
    encoded: list[str] = []
    real_encode = generation.encode_prompt
    monkeypatch.setattr(
        runner,
        "generate",
        lambda task, length, *a, **k: calls.append((task, length)) or real(task, length, *a, **k),
    )
    monkeypatch.setattr(
        generation,
        "encode_prompt",
        lambda tok, text: encoded.append(text) or real_encode(tok, text),
    )
    assert runner.prefetch_samples(cfg, tokenizer) == 4
    assert [length for _, length in calls] == [768, 768, 512, 512]  # longest first
    assert len(encoded) == 4
    warm: list[dict] = []
    run_suite(model, tokenizer, cfg, done={}, on_sample=warm.append, progress=False)
    assert len(calls) == 4 and len(encoded) == 4
    assert sorted((r["key"], r["prediction"]) for r in warm) == sorted(
        (r["key"], r["prediction"]) for r in cold
    )
    # Asked to stop, it ends between cells.
    runner.SAMPLES.clear()
    assert runner.prefetch_samples(cfg, tokenizer, should_stop=lambda: True) == 0
    runner.SAMPLES.clear()
