"""MMLU and HellaSwag through lm-eval on the fixture files with a tiny random model (CPU).

The suites score with the project's one lm-eval model (``anchorctx``), as lm-eval's ``hf``
model scores: the parity tests below run both on the same documents, in float32 and bfloat16."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest

from anchorctx.demo.fixtures import MMLU_FIXTURE_SUBJECTS, write_eval_fixtures
from anchorctx.evaluation.lm_eval import harness
from anchorctx.evaluation.lm_eval.call import task_manager
from anchorctx.evaluation.lm_eval.model import make_lm


@pytest.fixture(scope="module")
def setup(tiny_config, tmp_path_factory):
    from anchorctx.models.loading import load_model, load_tokenizer

    paths = write_eval_fixtures(tmp_path_factory.mktemp("eval_fixtures"))
    # 2 subjects x 3 questions: drop the third subject (reported as not run).
    for split in ("dev", "test"):
        (paths["mmlu_dir"] / split / f"{MMLU_FIXTURE_SUBJECTS[2]}.jsonl").unlink()
    cfg = tiny_config.model_copy(deep=True)
    h = cfg.evaluation.harness
    h.mmlu_dir, h.hellaswag_dir, h.limit, h.batch_size = (
        paths["mmlu_dir"],
        paths["hellaswag_dir"],
        3,
        4,
    )
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tokenizer=tok, attn_implementation=None).eval()
    return cfg, model, tok, paths


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _loglik(model, tok, context: str, continuation: str) -> float:
    """Sum of log p(continuation | context), encoded the way lm-eval pairs them."""
    import torch

    whole = tok(context + continuation).input_ids
    ctx = tok(context).input_ids
    ids = torch.tensor([whole])
    with torch.inference_mode():
        logp = model(ids).logits[0].float().log_softmax(-1)  # [T, V]
    return float(sum(logp[t - 1, whole[t]] for t in range(len(ctx), len(whole))))


def test_mmlu_docs_match_an_independent_loglikelihood(setup):
    """lm-eval reads our local files and its choice equals our own argmax of log-likelihoods."""
    _cfg, model, tok, paths = setup
    subject = MMLU_FIXTURE_SUBJECTS[0]
    found, _ = harness.mmlu_layout(paths["mmlu_dir"])
    tests = _rows(paths["mmlu_dir"] / "test" / f"{subject}.jsonl")
    with tempfile.TemporaryDirectory() as tmp:
        name = harness.write_mmlu_yaml(Path(tmp), subject, found[subject])
        lm = make_lm(model, tok, batch_size=4, **harness.HF_SCORING)
        docs = harness.evaluate_docs(lm, task_manager(Path(tmp)), name, [0, 1, 2], 5)
    assert [d["doc_id"] for d in docs] == [0, 1, 2]
    dev = _rows(paths["mmlu_dir"] / "dev" / f"{subject}.jsonl")
    for doc, row in zip(docs, tests):
        context = doc["arguments"][0][0]
        assert context.startswith(
            "The following are multiple choice questions (with answers) "
            "about abstract algebra.\n\n" + dev[0]["question"]
        )
        assert all(d["question"] in context for d in dev)  # 5-shot from dev
        assert context.endswith(
            f"{row['question']}\nA. {row['choices'][0]}\nB. {row['choices'][1]}"
            f"\nC. {row['choices'][2]}\nD. {row['choices'][3]}\nAnswer:"
        )
        assert int(doc["target"]) == row["answer"]
        mine = [_loglik(model, tok, context, f" {c}") for c in "ABCD"]
        theirs = [r[0] for r in doc["filtered_resps"]]
        assert mine == pytest.approx(theirs, abs=1e-3)
        assert doc["acc"] == float(max(range(4), key=mine.__getitem__) == row["answer"])


# float32 log-likelihoods: the same arithmetic in another order (batch composition and padding
# width change the GEMM blocking; the adapter runs the output embedding on the scored positions
# only), so they agree to float32 rounding (~1e-7 relative, tests/test_lm_eval_model.py); a real
# difference (a wrong position, token or anchor) moves a value by O(1) on a random model.
F32_REL = 1e-5
# bfloat16 ones are bfloat16 values (8-bit significand): within one step of that grid (2^-7
# relative) of lm-eval's, where reduction order moves a rounding; equal on this machine.
BF16_REL = 2**-7


def _bf16_value(x: float) -> bool:
    import torch

    return float(torch.tensor(x).to(torch.bfloat16)) == x


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_scores_equal_lm_evals_hf_model(setup, dtype):
    """The suites' model scores every MMLU and HellaSwag document as lm-eval's ``hf`` model
    (what they ran on before the lm-eval adapter was shared): the same choices (acc, acc_norm)
    from the same log-likelihoods. In bfloat16 lm-eval's log-probabilities are bfloat16: choices
    A and B of every fixture question tie (the tie goes to A); float32 log-probabilities (the
    adapter's default) break the ties and change the MMLU score."""
    import copy

    import torch
    from lm_eval.models.huggingface import HFLM

    _cfg, model, tok, paths = setup
    model = copy.deepcopy(model).to(getattr(torch, dtype))
    stock = HFLM(pretrained=model, tokenizer=tok, batch_size=4, add_bos_token=True)
    ours = make_lm(model, tok, batch_size=4, **harness.HF_SCORING)
    found, _ = harness.mmlu_layout(paths["mmlu_dir"])
    with tempfile.TemporaryDirectory() as tmp:
        tasks = {harness.write_mmlu_yaml(Path(tmp), s, f, fewshot=5): 5 for s, f in found.items()}
        tasks[
            harness.write_hellaswag_yaml(Path(tmp), harness.hellaswag_file(paths["hellaswag_dir"]))
        ] = 0
        manager = task_manager(Path(tmp))
        pairs = [
            (name, g, w)
            for name, shots in tasks.items()
            for g, w in zip(
                harness.evaluate_docs(ours, manager, name, [0, 1, 2], shots),
                harness.evaluate_docs(stock, manager, name, [0, 1, 2], shots),
            )
        ]
    assert len(pairs) == 3 * len(tasks)
    rel = F32_REL if dtype == "float32" else BF16_REL
    for _, got, want in pairs:
        metrics = [m for m in ("acc", "acc_norm") if m in want]
        assert [got[m] for m in metrics] == [want[m] for m in metrics]
        assert [g[1] for g in got["filtered_resps"]] == [w[1] for w in want["filtered_resps"]]
        values = [(g[0], w[0]) for g, w in zip(got["filtered_resps"], want["filtered_resps"])]
        assert all(math.isclose(g, w, rel_tol=rel) for g, w in values), values
        if dtype == "bfloat16":
            assert all(_bf16_value(g) for g, _ in values), values
    if dtype == "bfloat16":  # the ties that make the log-probabilities' dtype matter
        mmlu = [got["filtered_resps"] for name, got, _ in pairs if "mmlu" in name]
        assert all(resps[0][0] == resps[1][0] for resps in mmlu)


def test_mmlu_suite_micro_average_and_resume(setup):
    cfg, model, tok, _ = setup
    records: list[dict] = []
    out = harness.run_suite_mmlu(model, tok, cfg, done={}, on_sample=records.append, progress=False)
    assert [r["key"] for r in records] == [f"mmlu/{s}" for s in MMLU_FIXTURE_SUBJECTS[:2]]
    assert all(r["n"] == 3 and len(r["correct"]) == 3 for r in records)
    correct = [c for r in records for c in r["correct"]]
    assert out["scores"]["mmlu"]["acc"] == pytest.approx(100 * sum(correct) / 6, abs=1e-4)
    assert out["counts"]["mmlu"] == 6 and not out["complete"]
    assert len(out["not_run"]) == 57 - 2 and f"mmlu_{MMLU_FIXTURE_SUBJECTS[2]}" in out["not_run"]
    again: list[dict] = []
    resumed = harness.run_suite_mmlu(
        model,
        tok,
        cfg,
        done={records[0]["key"]: records[0]},
        on_sample=again.append,
        progress=False,
    )
    assert [r["key"] for r in again] == [records[1]["key"]]
    assert resumed["scores"] == out["scores"]


def test_hellaswag_acc_norm(setup):
    cfg, model, tok, _paths = setup
    records: list[dict] = []
    out = harness.run_suite_hellaswag(
        model, tok, cfg, done={}, on_sample=records.append, progress=False
    )
    assert [r["key"] for r in records] == ["hellaswag/000000-000002"]
    assert out["counts"] == {"hellaswag": 3}
    assert out["scores"]["hellaswag"]["acc_norm"] == pytest.approx(
        100 * sum(records[0]["acc_norm"]) / 3, abs=1e-4
    )
    assert set(out["scores"]["hellaswag"]) == {"acc", "acc_norm"}


def test_original_mmlu_csv_layout_and_missing_files(tmp_path, setup):
    _, _, _, paths = setup
    subject = MMLU_FIXTURE_SUBJECTS[0]
    for split in ("dev", "test"):
        (tmp_path / "data" / split).mkdir(parents=True)
        rows = _rows(paths["mmlu_dir"] / split / f"{subject}.jsonl")
        lines = [",".join([r["question"], *r["choices"], "ABCD"[r["answer"]]]) for r in rows]
        (tmp_path / "data" / split / f"{subject}_{split}.csv").write_text("\n".join(lines) + "\n")
    found, missing = harness.mmlu_layout(tmp_path)
    assert list(found) == [subject] and len(missing) == 56
    out = Path(tempfile.mkdtemp())
    try:
        harness.write_mmlu_yaml(out, subject, found[subject])
        converted = _rows(out / "data" / "mmlu" / "test" / f"{subject}.jsonl")
    finally:
        shutil.rmtree(out)
    original = _rows(paths["mmlu_dir"] / "test" / f"{subject}.jsonl")
    assert [(r["question"], r["choices"], r["answer"]) for r in converted] == [
        (r["question"], r["choices"], r["answer"]) for r in original
    ]
    with pytest.raises(harness.HarnessDataError, match="hellaswag_dir"):
        harness.hellaswag_file(tmp_path)
    with pytest.raises(harness.HarnessDataError, match="not a directory"):
        harness.mmlu_layout(tmp_path / "nope")


def test_contexts_start_with_one_anchor(setup):
    """Every context gets the training anchor exactly once: BOS (identical to stock HFLM with
    add_bos_token=True) or EOS for a tokenizer without BOS."""
    import copy

    from lm_eval.models.huggingface import HFLM

    _cfg, model, tok, _ = setup
    text = "The following are multiple choice questions.\nAnswer:"
    ours = make_lm(model, tok, batch_size=1, **harness.HF_SCORING)
    stock = HFLM(pretrained=model, tokenizer=tok, batch_size=1, add_bos_token=True)
    assert ours.prefix_token_id == tok.bos_token_id
    assert ours.tok_encode(text) == stock.tok_encode(text)
    assert ours.tok_encode(text)[0] == tok.bos_token_id
    assert ours.tok_encode(" A", add_special_tokens=False) == tok.encode(
        " A", add_special_tokens=False
    )
    no_bos = copy.deepcopy(tok)
    no_bos.bos_token = None  # Qwen-style: the anchor is EOS
    qwen_like = make_lm(model, no_bos, batch_size=1, **harness.HF_SCORING)
    ids = qwen_like.tok_encode(text)
    assert ids[0] == no_bos.eos_token_id and ids.count(no_bos.eos_token_id) == 1
    assert qwen_like.prefix_token_id == no_bos.eos_token_id
    import importlib.metadata

    ref = harness.run_suite_hellaswag(
        model, tok, _cfg, done={}, on_sample=lambda r: None, progress=False
    )["reference"]
    assert ref["lm_eval"] == importlib.metadata.version("lm-eval") and ref["model"] == "anchorctx"
    assert ref["anchor_token_id"] == tok.bos_token_id
    assert (ref["keep_anchor"], ref["softmax_dtype"]) == (False, None)  # as lm-eval's hf scores


def test_uninformative_lm_eval_warnings_are_filtered(setup, caplog):
    import logging

    cfg, model, tok, _paths = setup
    with caplog.at_level(logging.WARNING):
        harness.run_suite_hellaswag(
            model, tok, cfg, done={}, on_sample=lambda r: None, progress=False
        )
        logging.getLogger("lm_eval.evaluator").warning("a real problem")
    lm_eval_messages = [r.getMessage() for r in caplog.records if r.name.startswith("lm_eval")]
    assert lm_eval_messages == ["a real problem"]  # other lm-eval warnings still reach the log


def test_environment_report_is_made_once_per_process(setup, monkeypatch):
    """lm-eval adds torch's environment report (`pip list`, compiler and driver versions: ~1.8 s)
    to every simple_evaluate result; MMLU calls it once per subject. Every result still holds
    what the report function returns, and the function runs on the first call only."""
    import torch.utils.collect_env as collect_env

    from anchorctx.evaluation.lm_eval import call as lm_eval_call

    calls: list[int] = []

    def report() -> str:
        calls.append(1)
        return "the environment report"

    monkeypatch.setattr(collect_env, "get_pretty_env_info", report)
    _cfg, model, tok, paths = setup
    subject = MMLU_FIXTURE_SUBJECTS[0]
    found, _ = harness.mmlu_layout(paths["mmlu_dir"])
    with tempfile.TemporaryDirectory() as tmp:
        name = harness.write_mmlu_yaml(Path(tmp), subject, found[subject])
        lm = make_lm(model, tok, batch_size=4, **harness.HF_SCORING)
        manager = task_manager(Path(tmp))
        outs = [
            lm_eval_call.simple_evaluate(
                model=lm, tasks=[name], task_manager=manager, limit=1, bootstrap_iters=0
            )
            for _ in range(2)
        ]
    assert [out["pretty_env_info"] for out in outs] == ["the environment report"] * 2
    assert calls == [1]
