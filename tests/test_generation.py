"""Greedy evaluation generation: one anchor per prompt, batching equals one-by-one, EOS stop."""

from __future__ import annotations

import copy

import pytest
import torch

from anchorctx.evaluation.generation import (
    CheckpointError,
    encode_prompt,
    generate_greedy,
    load_eval_model,
)
from anchorctx.models.decoding import StopRules

PROMPTS = [
    "The grass is green. The sky is blue.",
    "One of the special magic numbers for wild-cat is: 1234567. What is it?",
    "Hi",
    "Below is a numbered list of words. 1. apple 2. pear 3. apple",
]


@pytest.fixture(scope="module")
def tokenizer(demo_corpus):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_corpus.tokenizer_dir))


@pytest.fixture(scope="module")
def model(tiny_config, tokenizer):
    from anchorctx.models.loading import load_model

    m = load_model(tiny_config.model, tokenizer=tokenizer, attn_implementation="sdpa")
    # float64: batched and unbatched runs differ in matmul shapes; in double precision the
    # rounding differences cannot flip a greedy argmax of a random model.
    return m.to(torch.float64).eval()


def test_exactly_one_anchor(tokenizer):
    assert tokenizer("x").input_ids[0] == tokenizer.bos_token_id  # this tokenizer adds BOS itself
    for text in PROMPTS:
        ids = encode_prompt(tokenizer, text)
        assert ids[0] == tokenizer.bos_token_id and tokenizer.bos_token_id not in ids[1:]
    no_bos = copy.deepcopy(tokenizer)
    no_bos.bos_token = None  # Qwen-style: the anchor is EOS
    ids = encode_prompt(no_bos, PROMPTS[0])
    assert ids[0] == no_bos.eos_token_id and ids.count(no_bos.eos_token_id) == 1


def test_batched_equals_unbatched_and_greedy(model, tokenizer):
    one = generate_greedy(
        model, tokenizer, PROMPTS, max_new_tokens=12, batch_size=1, progress=False
    )
    many = generate_greedy(
        model, tokenizer, PROMPTS, max_new_tokens=12, batch_size=3, progress=False
    )
    assert one == many and all(one)
    # Greedy: the first new token is the argmax of a plain forward pass over [anchor, prompt].
    ids = torch.tensor([encode_prompt(tokenizer, PROMPTS[1])])
    with torch.no_grad():
        first = int(model(input_ids=ids).logits[0, -1].argmax())
    again = generate_greedy(model, tokenizer, PROMPTS[1:2], max_new_tokens=1, progress=False)
    assert again == [tokenizer.decode([first], skip_special_tokens=True)]


def test_stops_at_eos_and_reports_batches(model, tokenizer):
    forced = copy.deepcopy(model)
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():  # logits = one-hot(EOS) at every position: generation stops at once
        head.weight.zero_()
        head.bias.zero_()
        head.bias[tokenizer.eos_token_id] = 1.0
    forced.lm_head = head.to(torch.float64)
    seen: list[int] = []
    out = generate_greedy(
        forced,
        tokenizer,
        PROMPTS,
        max_new_tokens=20,
        batch_size=2,
        progress=False,
        on_batch=lambda idx, texts: seen.extend(idx),
    )
    assert sorted(seen) == [0, 1, 2, 3]
    assert all(len(tokenizer.encode(t, add_special_tokens=False)) == 0 for t in out)


def _biased(model, bias: dict[int, float]):
    """A copy of ``model`` whose logits are the constant ``bias`` at every position."""
    forced = copy.deepcopy(model)
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        for token, value in bias.items():
            head.bias[token] = value
    forced.lm_head = head.to(torch.float64)
    return forced


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_decode_rules_samsum(model, tokenizer, engine):
    # LongBench pred.py for samsum: EOS and "\n" may not come first; "\n" ends generation.
    eos, nl = tokenizer.eos_token_id, tokenizer.encode("\n", add_special_tokens=False)[-1]
    word = tokenizer.encode(" the", add_special_tokens=False)[-1]
    rules = StopRules(stop_token_ids=(nl,), suppress_first=(eos, nl))
    newline_first = _biased(model, {nl: 3.0, word: 2.0, eos: 1.0})
    plain = generate_greedy(
        newline_first, tokenizer, PROMPTS[:2], max_new_tokens=6, progress=False, engine=engine
    )
    assert plain == [tokenizer.decode([nl] * 6)] * 2  # without the rule: newlines to the limit
    ruled = generate_greedy(
        newline_first,
        tokenizer,
        PROMPTS[:2],
        max_new_tokens=6,
        batch_size=2,
        progress=False,
        stop=rules,
        engine=engine,
    )
    assert ruled == [tokenizer.decode([word, nl])] * 2  # a word first, then stop at the newline
    eos_first = _biased(model, {eos: 3.0, word: 2.0})
    out = generate_greedy(
        eos_first,
        tokenizer,
        PROMPTS[:1],
        max_new_tokens=6,
        progress=False,
        stop=rules,
        engine=engine,
    )
    assert out == [tokenizer.decode([word])]  # EOS is forbidden only as the first token


def test_load_eval_model_roundtrip(model, tokenizer, tmp_path):
    model.to(torch.float32).save_pretrained(tmp_path / "ckpt")
    model.to(torch.float64)
    tokenizer.save_pretrained(tmp_path / "ckpt")
    loaded, tok = load_eval_model(tmp_path / "ckpt", device="cpu", dtype="float32")
    assert loaded.config._attn_implementation == "sdpa" and not loaded.training
    assert len(tok) == len(tokenizer)
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_eval_model(tmp_path / "missing", device="cpu")
