"""LongBench prompts, generation lengths, middle truncation, first-line cut, aggregation."""

from __future__ import annotations

import pytest

from anchorctx.evaluation.longbench.runner import (
    LongBenchDataError,
    fit_prompt,
    load_rows,
    prompt_budget,
    sample_keys,
)
from anchorctx.evaluation.longbench.tasks import (
    ALL_DATASETS,
    CATEGORIES,
    DATASET2MAXLEN,
    DATASET2METRIC,
    ENGLISH_DATASETS,
    build_prompt,
    category_scores,
    check_datasets,
    dataset_score,
    postprocess,
    score_sample,
    truncate_middle,
)


def test_tables_cover_every_dataset():
    assert len(ALL_DATASETS) == 21 and len(ENGLISH_DATASETS) == 16
    assert set(DATASET2MAXLEN) == set(DATASET2METRIC) == set(ALL_DATASETS)
    assert [d for d in ENGLISH_DATASETS if DATASET2MAXLEN[d] == 512] == [
        "gov_report",
        "qmsum",
        "multi_news",
    ]
    assert {d for d in ENGLISH_DATASETS if DATASET2MAXLEN[d] == 128} == {
        "narrativeqa",
        "qasper",
        "samsum",
    }
    assert {d for d in ENGLISH_DATASETS if DATASET2MAXLEN[d] == 64} == {
        "multifieldqa_en",
        "trec",
        "lcc",
        "repobench-p",
    }
    assert list(CATEGORIES) == [
        "Single-Doc QA",
        "Multi-Doc QA",
        "Summarization",
        "Few-shot",
        "Synthetic",
        "Code",
    ]
    with pytest.raises(ValueError, match="unknown LongBench dataset"):
        check_datasets(["hotpot"])


def test_prompts_are_the_published_templates():
    row = {"context": "CTX", "input": "Q?", "answers": ["x"]}
    assert build_prompt("hotpotqa", row) == (
        "Answer the question based on the given passages. Only give me the answer and do not "
        "output any other words.\n\nThe following are given passages.\nCTX\n\nAnswer the question "
        "based on the given passages. Only give me the answer and do not output any other words."
        "\n\nQuestion: Q?\nAnswer:"
    )
    assert build_prompt("trec", row) == (
        "Please determine the type of the question below. Here are some examples of questions."
        "\n\nCTX\nQ?"
    )
    assert (
        build_prompt("lcc", row)
        == "Please complete the code given below. \nCTXNext line of code:\n"
    )
    assert build_prompt("repobench-p", row).endswith("\nCTXQ?Next line of code:\n")
    assert build_prompt("passage_count", row).endswith("The final answer is: ")
    # config/dataset2prompt.json at 2e00731: "asconcisely" (no space), twice, as published.
    assert build_prompt("narrativeqa", row) == (
        "You are given a story, which can be either a novel or a movie script, and a question. "
        "Answer the question asconcisely as you can, using a single phrase if possible. Do not "
        "provide any explanation.\n\nStory: CTX\n\nNow, answer the question based on the story "
        "asconcisely as you can, using a single phrase if possible. Do not provide any "
        "explanation.\n\nQuestion: Q?\n\nAnswer:"
    )


def test_truncate_middle_keeps_both_ends():
    ids = list(range(10))
    assert truncate_middle(ids, 4) == [0, 1, 8, 9]
    assert truncate_middle(ids, 5) == [0, 1, 8, 9]  # int(max_length / 2) from each end
    assert truncate_middle(ids, 10) == ids
    with pytest.raises(ValueError):
        truncate_middle(ids, 1)


def test_first_line_cut_only_for_few_shot_datasets():
    text = "\n\nCity\nQuestion: next one"
    for d in ("trec", "triviaqa", "samsum"):
        assert postprocess(d, text) == "City"
    assert postprocess("hotpotqa", text) == text
    # the cut happens before scoring: the second line would otherwise add a wrong class
    classes = ["City", "Country"]
    assert score_sample("trec", "City\nCountry", ["City"], classes) == 1.0


def test_score_is_max_over_answers_and_100x_mean():
    assert score_sample("triviaqa", "\nParis France\nmore", ["Paris", "paris france"], None) == 1.0
    assert score_sample("hotpotqa", "Paris France", ["Paris", "Lyon"], None) == pytest.approx(2 / 3)
    assert dataset_score([1.0, 0.0, 0.5]) == 50.0
    assert dataset_score([1 / 3]) == 33.33
    scores = {d: 10.0 * i for i, d in enumerate(ENGLISH_DATASETS)}
    cats = category_scores(scores)
    assert cats["Single-Doc QA"] == 10.0  # (0 + 10 + 20) / 3
    assert cats["Code"] == 145.0  # (140 + 150) / 2
    del scores["musique"]
    assert "Multi-Doc QA" not in category_scores(scores)  # never averaged over fewer datasets


def test_fit_prompt_truncates_in_the_middle(demo_corpus):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_corpus.tokenizer_dir))
    text = "BEGIN here. " + "filler words go on and on. " * 200 + "Question: END?"
    full = len(tok.encode(text, add_special_tokens=False)) + 1
    same, n, cut = fit_prompt(tok, text, full)
    assert (same, n, cut) == (text, full, False)
    short, n, cut = fit_prompt(tok, text, 101)
    # pred.py: the first and last int(101/2) = 50 ids of the BOS-led prompt, decoded without
    # special tokens, joined, and encoded again (with BOS).
    ids = [tok.bos_token_id, *tok.encode(text, add_special_tokens=False)]
    expected = tok.decode(ids[:50], skip_special_tokens=True) + tok.decode(
        ids[-50:], skip_special_tokens=True
    )
    assert cut and short == expected
    assert n == 1 + len(tok.encode(expected, add_special_tokens=False))
    assert short.startswith("BEGIN here.") and short.endswith("Question: END?")
    even, _, _ = fit_prompt(tok, text, 100)  # even max_length: 50 each side, not 49 + 50
    assert even == expected


def test_prompt_budget():
    # config/model2maxlen.json: 3500 for 4K models, 7500 for 8K, 15500 for 16K, 31500 for 32K.
    assert [prompt_budget(k * 1024, 512, None) for k in (4, 8, 16, 32)] == [
        3500,
        7500,
        15500,
        31500,
    ]
    assert prompt_budget(4096, 512, 3000) == 3000
    with pytest.raises(
        LongBenchDataError, match=r"below 1K\): set evaluation\.longbench\.max_length"
    ):
        prompt_budget(512, 32, None)
    with pytest.raises(LongBenchDataError, match="max_length=4000"):
        prompt_budget(4096, 512, 4000)
    with pytest.raises(LongBenchDataError, match=r"set evaluation\.longbench\.max_length"):
        prompt_budget(None, 32, None)


def test_samsum_decode_rule(demo_corpus):
    from transformers import AutoTokenizer

    from anchorctx.evaluation.longbench.runner import decode_rules
    from anchorctx.models.decoding import StopRules

    tok = AutoTokenizer.from_pretrained(str(demo_corpus.tokenizer_dir))
    nl = tok.encode("\n", add_special_tokens=False)[-1]
    assert decode_rules(tok, "samsum") == StopRules(
        stop_token_ids=(nl,), suppress_first=(tok.eos_token_id, nl)
    )
    assert all(decode_rules(tok, d) is None for d in ALL_DATASETS if d != "samsum")


def test_load_rows_checks_fields_and_ids(tmp_path):
    path = tmp_path / "trec.jsonl"
    path.write_text('{"input": "q", "context": "c", "answers": ["a"], "_id": "1"}\n\n' * 2)
    rows = load_rows(path)
    assert len(rows) == 2 and len(load_rows(path, limit=1)) == 1
    with pytest.raises(LongBenchDataError, match="duplicate sample id 'trec/1'"):
        sample_keys("trec", rows)
    path.write_text('{"input": "q", "answers": ["a"]}\n')
    with pytest.raises(LongBenchDataError, match=r"trec.jsonl:1: record lacks \['context'\]"):
        load_rows(path)
