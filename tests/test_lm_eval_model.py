"""The lm-eval model ``anchorctx`` gives what lm-eval's own ``hf`` model gives.

Tiny random Llama (GQA 4:2) and Qwen2 (GQA 4:2, qkv bias) checkpoints with the demo corpus'
byte-level BPE tokenizer (BOS ``<s>`` prepended by its post-processor, as Llama's) are evaluated
on CPU in float32 by both models on the same hand-built ``Instance`` requests: generated strings
identical (the project's static decoder against transformers ``generate``), log-likelihoods
equal within float32 rounding with identical ``is_greedy``, rolling log-likelihoods equal.
The deliberate differences (anchor kept when truncating, one anchor in rolling windows, an EOS
anchor for tokenizers without BOS) are checked against lm-eval's machinery on the explicitly
anchored tokens. Everything is offline.
"""

from __future__ import annotations

import math

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import postprocess_generated_text

from anchorctx.evaluation.lm_eval.model import AnchorctxLM

CONTEXTS = [
    "The grass is green. The sky",
    "Question: what is two plus two?\nAnswer:",
    "Hi",
    "A list of fruit: apple, pear, plum, apple, pear, ",  # trailing space moves to the answer
]
CONTINUATIONS = [" is blue.", " four", " there friend", " plum"]
TEXTS = [
    "The grass is green. The sky is blue. The sea is deep and the hills are far away.",
    "x",
    "def count(items):\n    return len(items)\n",
]
ARCHS = ("llama", "qwen2")
# float32 tolerance for a log-likelihood (a sum of token log-probabilities, |value| < 500 here).
# Both models compute the same float32 arithmetic from the same weights; only the order of the
# reductions differs (batch composition and padding width change the GEMM blocking; the adapter
# runs the output embedding on the scored positions only, in chunks). float32 rounds at 6e-8
# relative, and a logit sums 64-128 products per layer, so differences stay near 1e-7 relative
# (observed: < 1e-6 absolute on values up to ~400). A real error (a wrong position, token or
# anchor) moves a value by a token's log-probability, O(1) on a random model: 1e-5 relative
# (with a 1e-5 floor near zero) separates the two by orders of magnitude.
REL_TOL = ABS_TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: these models are tiny, and on a shared CPU several threads per op
    spend most of their time waiting for each other (10x slower here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _instances(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def _close(ours: list[float], ref: list[float]) -> bool:
    return all(math.isclose(a, b, rel_tol=REL_TOL, abs_tol=ABS_TOL) for a, b in zip(ours, ref))


def _save(arch: str, tokenizer, out, *, seed: int = 0, **extra) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        arch,
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,  # transformers generate stops there too
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def checkpoints(demo_corpus, tmp_path_factory) -> dict[str, str]:
    """Checkpoint directories: ``llama`` and ``qwen2`` with the demo tokenizer, and
    ``qwen2-no-bos``: the Qwen2 weights with a Qwen-style tokenizer (no BOS at all)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("lm_eval_model")
    tok = AutoTokenizer.from_pretrained(str(demo_corpus.tokenizer_dir))
    out = {arch: _save(arch, tok, root / arch, seed=i) for i, arch in enumerate(ARCHS)}
    no_bos = AutoTokenizer.from_pretrained(str(demo_corpus.tokenizer_dir))
    no_bos.backend_tokenizer.post_processor = None  # prepends no BOS
    no_bos.bos_token = None
    out["qwen2-no-bos"] = _save("qwen2", no_bos, root / "qwen2-no-bos", seed=1)
    return out


@pytest.fixture(scope="module", params=ARCHS)
def models(request, checkpoints):
    """(adapter, lm-eval's hf model, hf with ``add_bos_token=False``) on one checkpoint."""
    path = checkpoints[request.param]
    # batch_size 3 over 4+ requests: length buckets, padding and the order restored all count.
    ours = AnchorctxLM(path, dtype="float32", device="cpu", batch_size=3, engine="static")
    ref = HFLM(pretrained=path, dtype="float32", device="cpu")
    ref_one_anchor = HFLM(pretrained=path, dtype="float32", device="cpu", add_bos_token=False)
    return ours, ref, ref_one_anchor


def test_registered_with_lm_eval(checkpoints):
    cls = get_model("anchorctx")
    assert cls is AnchorctxLM
    assert get_model("hf") is HFLM  # lm-eval's own models stay registered beside it
    lm = cls.create_from_arg_string(
        f"pretrained={checkpoints['llama']},dtype=float32,max_length=64",
        {"batch_size": "4", "device": "cuda:0", "max_batch_size": None},  # lm-eval CLI's
    )
    # lm-eval's CLI passes --device cuda:0 unless told otherwise: the CPU where there is no GPU.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert (lm.batch_size, lm.max_length, lm.device.type) == (4, 64, device)
    assert lm.tok_encode("hi") == [0, *lm.tokenizer.encode("hi", add_special_tokens=False)]
    assert lm.tok_encode("<s>hi") == lm.tok_encode("hi")  # exactly one anchor


def test_softmax_dtype_from_the_command_line(checkpoints):
    """``softmax_dtype=None`` in ``--model_args`` keeps the logits' dtype (as ``hf``); a dtype
    it cannot be is one error naming it."""
    cls = get_model("anchorctx")
    path = checkpoints["llama"]
    lm = cls.create_from_arg_string(f"pretrained={path},dtype=float32,softmax_dtype=None", {})
    assert lm.softmax_dtype is None and lm.get_model_info()["anchorctx"]["softmax_dtype"] is None
    with pytest.raises(ValueError, match=r"^softmax_dtype='fp8': expected None or one of"):
        cls.create_from_arg_string(f"pretrained={path},softmax_dtype=fp8", {})


def test_generate_until_matches_hf(models):
    ours, ref, _ = models
    free = _instances("generate_until", [(c, {"until": [], "max_gen_toks": 20}) for c in CONTEXTS])
    texts = ref.generate_until(free, disable_tqdm=True)
    assert ours.generate_until(free, disable_tqdm=True) == texts
    assert all(len(t) > 8 for t in texts)
    # Stop strings the model really produces: two characters from the middle of each text.
    stops = [t[len(t) // 2 : len(t) // 2 + 2] for t in texts]
    assert all(s.isprintable() and "\ufffd" not in s for s in stops)
    args = [(c, {"until": [stops[0], stops[1]], "max_gen_toks": 20}) for c in CONTEXTS]
    args += [(c, {"until": stops[2], "max_gen_toks": 20, "do_sample": False}) for c in CONTEXTS]
    args += [(c, {"until": ["\n\n"], "max_gen_toks": 5}) for c in CONTEXTS]
    requests = _instances("generate_until", args)
    got = ours.generate_until(requests, disable_tqdm=True)
    assert got == ref.generate_until(requests, disable_tqdm=True)
    assert got[0] == texts[0].split(stops[0])[0] and len(got[0]) < len(texts[0])
    assert got[1] == texts[1].split(stops[0])[0].split(stops[1])[0] and len(got[1]) < len(texts[1])
    assert got[6] == texts[2].split(stops[2])[0] and len(got[6]) < len(texts[2])
    # max_gen_toks=5: a prefix of the 20-token text (greedy), at most 5 tokens long.
    for out, text in zip(got[8:], texts):
        assert text.startswith(out.rstrip("\ufffd")) and len(out) < len(text)


def test_loglikelihood_matches_hf(models):
    ours, ref, _ = models
    args = [(c, x) for c in CONTEXTS for x in CONTINUATIONS]
    args += [("", "Hello world"), ("Answer:", " A"), ("Answer:", " B"), ("Answer:", " C")]
    # The models' own greedy continuations, so that is_greedy is True for some requests.
    greedy = ours.generate_until(
        _instances("generate_until", [(c, {"until": [], "max_gen_toks": 3}) for c in CONTEXTS]),
        disable_tqdm=True,
    )
    args += [(c, g) for c, g in zip(CONTEXTS, greedy) if g]
    requests = _instances("loglikelihood", args)
    got = ours.loglikelihood(requests, disable_tqdm=True)
    want = ref.loglikelihood(requests, disable_tqdm=True)
    assert _close([g[0] for g in got], [w[0] for w in want]), (got, want)
    assert [g[1] for g in got] == [w[1] for w in want]
    assert any(g[1] for g in got) and not all(g[1] for g in got)


def test_loglikelihood_rolling_matches_hf(models):
    """lm-eval's ``hf`` model with ``add_bos_token=False`` scores a text after its one prefix
    token; by default it encodes the text with the tokenizer's BOS as well, so that BOS is fed
    twice and scored once. The adapter scores the text after exactly one anchor."""
    ours, _, ref_one_anchor = models
    requests = _instances("loglikelihood_rolling", [(t,) for t in TEXTS])
    got = ours.loglikelihood_rolling(requests, disable_tqdm=True)
    assert _close(got, ref_one_anchor.loglikelihood_rolling(requests, disable_tqdm=True))


LONG = " ".join(f"item {i} is a {('red', 'green', 'blue')[i % 3]} ball;" for i in range(40))
SHORT_LIMIT = 48  # max_length for the truncation tests: LONG is several times longer


def test_truncation_without_anchor_matches_hf(checkpoints):
    """``keep_anchor=False`` cuts and windows exactly as lm-eval's ``hf`` model does."""
    path = checkpoints["llama"]
    ours = AnchorctxLM(
        path, dtype="float32", device="cpu", max_length=SHORT_LIMIT, keep_anchor=False
    )
    ref = HFLM(pretrained=path, dtype="float32", device="cpu", max_length=SHORT_LIMIT)
    gen = _instances("generate_until", [(LONG, {"until": ["\n"], "max_gen_toks": 8})])
    assert ours.generate_until(gen, disable_tqdm=True) == ref.generate_until(gen, disable_tqdm=True)
    ll = _instances("loglikelihood", [(LONG, " ball"), (LONG[:60], " item")])
    got, want = ours.loglikelihood(ll, disable_tqdm=True), ref.loglikelihood(ll, disable_tqdm=True)
    assert _close([g[0] for g in got], [w[0] for w in want])
    assert [g[1] for g in got] == [w[1] for w in want]
    ref.add_bos_token = False  # the one-anchor rolling reference (see the test above)
    roll = _instances("loglikelihood_rolling", [(LONG,)])
    got_roll = ours.loglikelihood_rolling(roll, disable_tqdm=True)
    assert _close(got_roll, ref.loglikelihood_rolling(roll, disable_tqdm=True))


def test_truncation_keeps_the_anchor(checkpoints):
    """``keep_anchor=True`` (default): the anchor stays at position 0 of every truncated
    context and rolling window; the values equal lm-eval's scoring and generation run on those
    anchored tokens."""
    path = checkpoints["llama"]
    ours = AnchorctxLM(path, dtype="float32", device="cpu", max_length=SHORT_LIMIT)
    ref = HFLM(pretrained=path, dtype="float32", device="cpu")  # its max_length: 512
    anchor, limit = ours.anchor_id, SHORT_LIMIT
    tokens = ours.tok_encode(LONG, add_special_tokens=False)
    assert len(tokens) > 3 * limit

    windows = ours.rolling_windows(tokens)
    assert len(windows) > 3
    assert [t for _, cont in windows for t in cont] == tokens  # each token scored once, in order
    for context, cont in windows:
        assert context[0] == anchor and anchor not in context[1:]
        assert len(context) + len(cont) - 1 <= limit
    roll = ours.loglikelihood_rolling(_instances("loglikelihood_rolling", [(LONG,)]), True)
    ref_windows = ref._loglikelihood_tokens([(None, c, p) for c, p in windows], disable_tqdm=True)
    assert _close(roll, [sum(lp for lp, _ in ref_windows)])

    cont = ours.tok_encode(" ball", add_special_tokens=False)
    whole = ours.tok_encode(LONG) + cont
    (got,) = ours.loglikelihood(_instances("loglikelihood", [(LONG, " ball")]), True)
    kept = [anchor, *whole[-limit : -len(cont)]]  # the anchor, then the last tokens that fit
    (want,) = ref._loglikelihood_tokens([(None, kept, cont)], disable_tqdm=True)
    assert _close([got[0]], [want[0]]) and got[1] == want[1]

    new = 8
    (text,) = ours.generate_until(
        _instances("generate_until", [(LONG, {"until": ["\n"], "max_gen_toks": new})]), True
    )
    prompt = [anchor, *tokens[-(limit - new - 1) :]]
    out = ref._model_generate(
        torch.tensor([prompt]), max_length=len(prompt) + new, stop=["\n", "</s>"], do_sample=False
    )
    ref_text = ref.tok_decode(out[0, len(prompt) :].tolist())
    assert text == postprocess_generated_text(ref_text, ["\n", "</s>"], None)


def test_tokenizer_without_bos_gets_the_eos_anchor(checkpoints):
    """A Qwen-style tokenizer (no BOS): the anchor is EOS, put in front of every context.
    lm-eval's ``hf`` model adds no token there, so its requests carry the EOS text in front (it
    encodes to the EOS token); rolling needs nothing: its prefix token is EOS already."""
    path = checkpoints["qwen2-no-bos"]
    ours = AnchorctxLM(path, dtype="float32", device="cpu", batch_size=2)
    ref = HFLM(pretrained=path, dtype="float32", device="cpu", add_bos_token=False)
    eos = ref.tokenizer.eos_token
    assert ours.tokenizer.bos_token_id is None and ours.anchor_id == ours.tokenizer.eos_token_id
    assert ours.tok_encode("hi")[0] == ours.anchor_id

    kw = {"until": ["\n\n"], "max_gen_toks": 12}
    gen = ours.generate_until(_instances("generate_until", [(c, kw) for c in CONTEXTS]), True)
    anchored = _instances("generate_until", [(eos + c, kw) for c in CONTEXTS])
    assert gen == ref.generate_until(anchored, disable_tqdm=True)

    pairs = [(c, x) for c in CONTEXTS for x in CONTINUATIONS[:2]]
    got = ours.loglikelihood(_instances("loglikelihood", [*pairs, ("", " plum")]), True)
    want = ref.loglikelihood(
        _instances("loglikelihood", [*((eos + c, x) for c, x in pairs), ("", " plum")]), True
    )
    assert _close([g[0] for g in got], [w[0] for w in want])
    assert [g[1] for g in got] == [w[1] for w in want]

    roll = _instances("loglikelihood_rolling", [(t,) for t in TEXTS])
    assert _close(ours.loglikelihood_rolling(roll, True), ref.loglikelihood_rolling(roll, True))


def test_other_model_types_are_scored_on_their_logits(demo_corpus, tmp_path):
    """A model type outside the static decoder's is scored on the model's own logits, as lm-eval's
    ``hf`` model scores it (MMLU and HellaSwag ran on any causal LM through it). Gemma2 caps its
    logits after the output embedding (``final_logit_softcapping``; 2.0 here, so the cap moves
    every value): the output embedding of the hidden states alone would score other numbers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_corpus.tokenizer_dir))
    path = _save("gemma2", tok, tmp_path / "gemma2", head_dim=16, final_logit_softcapping=2.0)
    # Loaded by the caller, as the suites pass theirs (Gemma2 runs eager attention only).
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    ours = AnchorctxLM(model, tokenizer=tok, batch_size=3)
    ref = HFLM(pretrained=model, tokenizer=tok, batch_size=3)
    requests = _instances("loglikelihood", [(c, x) for c in CONTEXTS for x in CONTINUATIONS[:2]])
    got = ours.loglikelihood(requests, disable_tqdm=True)
    want = ref.loglikelihood(requests, disable_tqdm=True)
    assert _close([g[0] for g in got], [w[0] for w in want]), (got, want)
    assert [g[1] for g in got] == [w[1] for w in want]
