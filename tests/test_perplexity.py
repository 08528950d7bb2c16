"""Suite ``perplexity`` (paper Figure 4): exp(mean NLL over the predicted tokens) of held-out
rows packed as training packs them, read with the checkpoint's training attention. Checked
against a direct computation: transformers' own forward of a tiny Llama and F.cross_entropy."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from anchorctx.evaluation import results
from anchorctx.evaluation.results import EvaluationError, evaluate_checkpoint
from anchorctx.experiment import config_from_dict

WORDS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
LENGTHS = [32, 64]
# Float32 on a CPU: the suite's attention (the project's SDPA engine with a dense document mask)
# and transformers' stock causal SDPA sum in different orders; 1e-5 relative is far below any
# difference a wrong mask or target would make (one target more or less moves the mean by ~3%).
REL = 1e-5


def save_checkpoint(path: Path, attention: str | None, seed: int = 0) -> Path:
    """A tiny random Llama with a word-level tokenizer (BOS anchor), as a run's checkpoint."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<s>", "</s>", "<unk>", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    torch.manual_seed(seed)
    hf = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=1,
    )
    LlamaForCausalLM(hf).save_pretrained(path)
    tok.save_pretrained(path)
    meta = {"step": 10, **({"attention": attention} if attention else {})}
    (path / "anchorctx.json").write_text(json.dumps(meta))
    return path


def write_heldout(path: Path, docs: int = 12) -> Path:
    rng = random.Random(0)
    lines = [
        json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30)))})
        for _ in range(docs)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def make_cfg(tmp_path: Path, checkpoint: Path, **perplexity):
    return config_from_dict(
        {
            "name": "t",
            "run_root": str(tmp_path),
            "model": {"path": str(checkpoint)},
            "data": {"seq_len": 64},
            "evaluation": {
                "device": "cpu",
                "dtype": "float32",
                "suites": ["perplexity"],
                "perplexity": {"lengths": LENGTHS, "rows": 2, **perplexity},
            },
        }
    )


@pytest.fixture(autouse=True)
def _fresh_model_cache():
    results.clear_model_cache()
    yield
    results.clear_model_cache()


@pytest.fixture
def heldout(tmp_path: Path) -> Path:
    return write_heldout(tmp_path / "heldout.jsonl")


def _rows(tokenizer, heldout: Path, length: int, rows: int = 2) -> list[dict]:
    """The rows the suite must build: documents one after another (no separator), anchor first."""
    from anchorctx.evaluation.perplexity import packed_rows
    from anchorctx.packing.tokens import encode_texts

    texts = [json.loads(line)["text"] for line in heldout.read_text().splitlines()]
    flat, sizes = encode_texts(tokenizer, texts)
    import numpy as np

    docs = np.split(flat, np.cumsum(sizes)[:-1])
    return packed_rows(docs, np.zeros(0, dtype=np.int64), tokenizer.bos_token_id, length, rows)


def _direct_full(model, row: dict, length: int) -> tuple[float, int]:
    """Stock transformers forward on the row's first ``length`` tokens, plain causal."""
    import torch
    import torch.nn.functional as F

    ids = torch.as_tensor(row["input_ids"][: length + 1], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids[None, :-1]).logits[0]
    nll = F.cross_entropy(logits.float(), ids[1:], reduction="sum")
    return float(nll), length


def _direct_anchor(model, row: dict, length: int) -> tuple[float, int]:
    """Each document alone behind the anchor, at its positions in the row: what anchor
    attention computes (a document sees itself and the anchor at position 0)."""
    import torch
    import torch.nn.functional as F

    ids = torch.as_tensor(row["input_ids"][: length + 1], dtype=torch.long)
    total, start = 0.0, 0
    for seg in row["seg_lens"]:
        end = min(start + int(seg), length)  # the input is the first `length` tokens
        if start >= end:
            break
        idx = (
            torch.arange(start, end)
            if start == 0
            else torch.cat([torch.tensor([0]), torch.arange(start, end)])
        )
        with torch.no_grad():
            logits = model(input_ids=ids[idx][None], position_ids=idx[None]).logits[0]
        logits = (
            logits if start == 0 else logits[1:]
        )  # the anchor's own prediction is not this segment's
        total += float(F.cross_entropy(logits.float(), ids[start + 1 : end + 1], reduction="sum"))
        start = end
    return total, length


def _expected(checkpoint: Path, heldout: Path, direct) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(checkpoint)
    out = {}
    for length in LENGTHS:
        pairs = [direct(model, row, length) for row in _rows(tok, heldout, length)]
        out[str(length)] = math.exp(sum(n for n, _ in pairs) / sum(t for _, t in pairs))
    return out


@pytest.mark.parametrize(
    ("attention", "direct"), [("full", _direct_full), ("anchor", _direct_anchor)]
)
def test_perplexity_equals_transformers_forward_and_cross_entropy(
    tmp_path, heldout, attention, direct
):
    ckpt = save_checkpoint(tmp_path / "arm" / "checkpoints" / "step-000010", attention)
    cfg = make_cfg(tmp_path, ckpt, data_path=str(heldout))
    out = evaluate_checkpoint(cfg, ckpt, "perplexity", progress=False)
    result = json.loads(out.read_text())
    assert result["attention"] == attention
    assert result["counts"]["perplexity"] == {"32": 2, "64": 2}
    assert result["tokens"]["perplexity"] == {"32": 64, "64": 128}
    expected = _expected(ckpt, heldout, direct)
    assert result["scores"]["perplexity"] == pytest.approx(expected, rel=REL)
    # The evaluation model is shared with the decoding suites: its SDPA attention is back.
    model, _ = results.cached_model(ckpt, cfg, result["checkpoint_hash"])
    from anchorctx.attention.hf import attention_name

    assert attention_name(model) == "sdpa"


def test_anchor_and_full_differ_on_multi_document_rows(tmp_path, heldout):
    """The checkpoint's attention matters: the same weights read as anchor rows score otherwise."""
    ckpt = save_checkpoint(tmp_path / "arm" / "checkpoints" / "step-000010", "anchor")
    anchor = make_cfg(tmp_path, ckpt, data_path=str(heldout))
    full = make_cfg(tmp_path, ckpt, data_path=str(heldout), attention="full")
    a = json.loads(evaluate_checkpoint(anchor, ckpt, "perplexity", progress=False).read_text())
    f = json.loads(evaluate_checkpoint(full, ckpt, "perplexity", progress=False).read_text())
    assert a["attention"] == "anchor" and f["attention"] == "full"
    assert a["scores"]["perplexity"]["64"] != pytest.approx(f["scores"]["perplexity"]["64"])


def test_a_base_model_without_anchorctx_json_reads_full_rows(tmp_path):
    from anchorctx.evaluation.perplexity import checkpoint_attention

    assert checkpoint_attention(tmp_path, "checkpoint") == "full"
    (tmp_path / "anchorctx.json").write_text(json.dumps({"attention": "intra_doc"}))
    assert checkpoint_attention(tmp_path, "checkpoint") == "intra_doc"
    assert checkpoint_attention(tmp_path, "anchor") == "anchor"


def test_resumes_from_its_row_records(tmp_path, heldout):
    ckpt = save_checkpoint(tmp_path / "arm" / "checkpoints" / "step-000010", "anchor")
    cfg = make_cfg(tmp_path, ckpt, data_path=str(heldout))
    first = json.loads(evaluate_checkpoint(cfg, ckpt, "perplexity", progress=False).read_text())
    samples = results.samples_path(ckpt, "perplexity", cfg)
    lines = samples.read_text().splitlines()
    assert len(lines) == 1 + 4  # header + 2 rows x 2 lengths
    samples.write_text("\n".join(lines[:3]) + "\n")  # two rows lost
    results.result_path(ckpt, "perplexity", cfg).unlink()
    again = json.loads(evaluate_checkpoint(cfg, ckpt, "perplexity", progress=False).read_text())
    assert again["samples"] == {**again["samples"], "resumed": 2, "new": 2}
    assert again["scores"] == first["scores"]


def test_settings_outside_the_section_change_the_identity(tmp_path, heldout):
    ckpt = save_checkpoint(tmp_path / "arm" / "checkpoints" / "step-000010", "anchor")
    cfg = make_cfg(tmp_path, ckpt, data_path=str(heldout))
    base = results.evaluation_fingerprint(cfg, "perplexity")
    raw = cfg.model_dump(mode="json")
    raw["data"]["separator"] = "eos"
    assert results.evaluation_fingerprint(config_from_dict(raw), "perplexity") != base
    raw = cfg.model_dump(mode="json")
    raw["training"]["boundary_targets"] = "within_document"
    assert results.evaluation_fingerprint(config_from_dict(raw), "perplexity") != base


def test_bad_inputs_are_one_line_errors_naming_the_file_or_key(tmp_path, heldout):
    ckpt = save_checkpoint(tmp_path / "arm" / "checkpoints" / "step-000010", "anchor")
    with pytest.raises(EvaluationError, match=r"evaluation\.perplexity\.data_path"):
        evaluate_checkpoint(make_cfg(tmp_path, ckpt), ckpt, "perplexity")
    missing = tmp_path / "nowhere.jsonl"
    with pytest.raises(EvaluationError, match=r"nowhere\.jsonl does not exist"):
        evaluate_checkpoint(make_cfg(tmp_path, ckpt, data_path=str(missing)), ckpt, "perplexity")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a b c"}\n{"body": "d e"}\n')
    with pytest.raises(EvaluationError, match=r"bad\.jsonl:2: record has no 'text' field"):
        evaluate_checkpoint(make_cfg(tmp_path, ckpt, data_path=str(bad)), ckpt, "perplexity")
    short = write_heldout(tmp_path / "short.jsonl", docs=2)
    with pytest.raises(EvaluationError, match=r"short\.jsonl: \d+ tokens fill 1 row\(s\) of 32"):
        evaluate_checkpoint(make_cfg(tmp_path, ckpt, data_path=str(short)), ckpt, "perplexity")
    long = make_cfg(tmp_path, ckpt, data_path=str(heldout), lengths=[256])
    with pytest.raises(EvaluationError, match=r"lengths \[256\] exceed .*=128") as err:
        evaluate_checkpoint(long, ckpt, "perplexity")
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------ Figure 4: over training
def _fake_ruler(model, tokenizer, cfg, *, done, on_sample, progress=True):
    """A RULER stand-in whose score follows the weights (so it differs by checkpoint)."""
    score = abs(float(next(model.parameters()).detach().flatten()[0])) * 100
    on_sample({"key": "niah_single_1/64/0", "task": "niah_single_1", "length": 64, "score": score})
    return {"scores": {"niah_single_1": {"64": score}}, "counts": {"niah_single_1": {"64": 1}}}


def _experiment(tmp_path: Path, heldout: Path) -> Path:
    """A config file of two arms (full, anchor), three saved checkpoints each."""
    for arm in ("full", "anchor"):
        for i, step in enumerate((10, 20, 30)):
            path = tmp_path / "exp" / arm / "checkpoints" / f"step-{step:06d}"
            save_checkpoint(path, arm, seed=i)
            meta = json.loads((path / "anchorctx.json").read_text())
            (path / "anchorctx.json").write_text(json.dumps({**meta, "step": step}))
    config = tmp_path / "exp.yaml"
    config.write_text(
        json.dumps(
            {
                "name": "exp",
                "run_root": str(tmp_path),
                "model": {"path": str(tmp_path / "exp" / "full" / "checkpoints" / "step-000010")},
                "data": {"seq_len": 64},
                "variants": [
                    {"name": "full", "attention": "full"},
                    {"name": "anchor", "attention": "anchor"},
                ],
                "evaluation": {
                    "device": "cpu",
                    "dtype": "float32",
                    "suites": ["ruler", "perplexity"],
                    "last_k": 2,
                    "perplexity": {"data_path": str(heldout), "lengths": LENGTHS, "rows": 1},
                },
            }
        )
    )
    return config


def test_every_checkpoint_of_every_arm_gives_the_curves_in_the_report(
    tmp_path, heldout, monkeypatch, capsys
):
    from anchorctx.cli import main
    from anchorctx.evaluation.results import Suite

    monkeypatch.setitem(results.SUITES, "ruler", Suite(_fake_ruler, "ruler"))
    config = _experiment(tmp_path, heldout)
    assert main(["evaluate", str(config), "--all-arms"]) == 0
    for arm in ("full", "anchor"):
        evaluated = sorted(p.name for p in (tmp_path / "exp" / arm / "eval").iterdir())
        assert evaluated[:3] == ["step-000010", "step-000020", "step-000030"]
    assert main(["report", str(config)]) == 0
    report = json.loads((tmp_path / "exp" / "report.json").read_text())
    curves = report["curves"]
    assert set(curves) == {"full", "anchor"}
    for arm in ("full", "anchor"):
        assert list(curves[arm]["ruler"]) == ["10", "20", "30"]
        assert list(curves[arm]["perplexity"]) == ["32", "64"]
        for step in (10, 20, 30):
            result = json.loads(
                (
                    tmp_path / "exp" / arm / "eval" / f"step-{step:06d}" / "perplexity.json"
                ).read_text()
            )
            assert result["attention"] == arm
            got = {n: curves[arm]["perplexity"][n][str(step)] for n in ("32", "64")}
            assert got == result["scores"]["perplexity"]
    assert (tmp_path / "exp" / "training_curves.png").stat().st_size > 0
    markdown = (tmp_path / "exp" / "report.md").read_text()
    assert "Figure 4 — RULER and perplexity over training" in markdown
    assert "![RULER and perplexity over training](training_curves.png)" in markdown
    # the arms side by side: a RULER table and a perplexity table per length, rows by step
    figure4 = markdown.split("Figure 4")[1]
    assert figure4.count("| step | full | anchor |") == 3
    assert "**RULER mean** by step" in figure4 and "**perplexity at 64** by step" in figure4
    assert "### Perplexity by length" in markdown
    # The last-k table averages the newest two checkpoints, the curves show all three.
    assert report["tables"]["perplexity"]["rows"]["anchor"]["64"]["n"] == 2


def test_all_arms_refuses_a_named_checkpoint(tmp_path, heldout, capsys):
    from anchorctx.cli import main

    config = _experiment(tmp_path, heldout)
    ckpt = tmp_path / "exp" / "full" / "checkpoints" / "step-000010"
    assert main(["evaluate", str(config), "--all-arms", "--checkpoint", str(ckpt)]) == 2
    assert "--all-arms evaluates the arms' own runs" in capsys.readouterr().err


def test_an_arm_whose_result_fails_its_check_is_named_not_drawn(tmp_path):
    from anchorctx.evaluation import curves

    step = tmp_path / "exp" / "anchor" / "eval" / "step-000010"
    step.mkdir(parents=True)
    (step / "ruler.json").write_text(json.dumps({"suite": "ruler", "step": 10, "scores": {}}))
    drawn, problems = curves.experiment_curves(tmp_path / "exp", ["anchor", "full"])
    assert drawn == {} and len(problems) == 1
    assert problems[0].startswith("anchor: not drawn: ") and "ruler.json" in problems[0]
    markdown = curves.curves_markdown(drawn, None, problems)
    assert "- anchor: not drawn: " in markdown and "![" not in markdown
