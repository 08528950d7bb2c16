"""Static-cache greedy engine: token-for-token equal to Hugging Face ``generate`` (CPU, float32)."""

from __future__ import annotations

import pytest
import torch

from anchorctx.models.decoding import (
    GreedyDecoder,
    StopRules,
    UnsupportedModelError,
    plan_batches,
    unsupported_reason,
)

VOCAB = 96
PAD = 0
LENGTHS = [7, 23, 2, 40, 13, 31]
NEW = 12


def _tiny(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    # Large init: random logits spread far apart, so float32 rounding differences between the
    # engines' matmul shapes (batched, padded, chunked) cannot flip a greedy argmax.
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.3,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    if kind == "llama":  # GQA, Llama-3 RoPE scaling from the config
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        cfg = LlamaConfig(**common, rope_parameters=rope)
        model = LlamaForCausalLM(cfg)
    else:  # GQA, qkv bias, tied embeddings
        cfg = Qwen2Config(
            **common,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )
        model = Qwen2ForCausalLM(cfg)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    return model.to(torch.float32).eval()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return _tiny(request.param)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [[1, *torch.randint(3, VOCAB, (n - 1,), generator=g).tolist()] for n in LENGTHS]


def _hf(model, rows, batch_size, stop_ids=(2,), suppress=()) -> list[list[int]]:
    """Reference: transformers generate, left-padded batches, cut after the first stop token."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=NEW,
        do_sample=False,
        num_beams=1,
        temperature=None,
        top_p=None,
        top_k=None,
        eos_token_id=list(stop_ids),
        pad_token_id=PAD,
        begin_suppress_tokens=list(suppress) or None,
    )
    out = []
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        width = max(len(r) for r in chunk)
        ids = torch.tensor([[PAD] * (width - len(r)) + r for r in chunk])  # [B, width]
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in chunk])
        with torch.no_grad():
            seqs = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        out += [GreedyDecoder._truncate(s, set(stop_ids), None) for s in seqs[:, width:].tolist()]
    return out


def _static(model, rows, batch_size, stop_ids=(2,), suppress=(), **kw) -> list[list[int]]:
    decoder = GreedyDecoder(model, **kw)
    rules = StopRules(stop_token_ids=tuple(stop_ids), suppress_first=tuple(suppress))
    out = []
    for i in range(0, len(rows), batch_size):
        out += decoder.generate(
            rows[i : i + batch_size], max_new_tokens=NEW, pad_id=PAD, stop=rules
        )
    return out


# The decode step's layers: the checkpoint's submodules (the reference) and the fused step.
STEPS = pytest.mark.parametrize("step", ["hf", "fused"])


@STEPS
def test_static_equals_hf_without_stops(model, step):
    rows = _prompts()
    ref = _hf(model, rows, batch_size=1, stop_ids=(VOCAB + 5,))  # a token that never occurs
    assert all(len(r) == NEW for r in ref)
    assert len({tuple(r) for r in ref}) > 1  # the prompts lead to different continuations
    for batch in (1, 3, len(rows)):
        assert _static(model, rows, batch, stop_ids=(VOCAB + 5,), step=step) == ref
    assert _hf(model, rows, batch_size=3, stop_ids=(VOCAB + 5,)) == ref  # the reference batched


@STEPS
def test_static_equals_hf_with_early_stops(model, step):
    rows = _prompts()
    free = _hf(model, rows, batch_size=1, stop_ids=(VOCAB + 5,))
    # Stop on tokens the rows produce at different steps: some rows stop early, some never.
    stops = (free[0][3], free[3][7])
    ref = _hf(model, rows, batch_size=1, stop_ids=stops)
    lengths = sorted({len(r) for r in ref})
    assert len(lengths) > 1 and lengths[0] < NEW
    for batch in (1, 4, len(rows)):
        assert _static(model, rows, batch, stop_ids=stops, step=step) == ref
    # Every row stopping at its first token ends the loop at once (and keeps that token).
    firsts = tuple({r[0] for r in free})
    assert _static(model, rows, len(rows), stop_ids=firsts, step=step) == [[r[0]] for r in free]


@STEPS
@pytest.mark.parametrize("attention", ["efficient", "flex"])
def test_deterministic_decode_attentions_equal_hf(model, attention, step):
    """The deterministic decode kernels (flex uncompiled on CPU: the same mask, evaluated per
    slot) give hf's tokens, batched rows of mixed lengths and early stops included."""
    rows = _prompts()
    free = _hf(model, rows, batch_size=1, stop_ids=(VOCAB + 5,))
    stops = (free[0][3], free[3][7])
    ref = _hf(model, rows, batch_size=1, stop_ids=stops)
    for batch in (1, len(rows)):
        assert _static(model, rows, batch, stop_ids=stops, attention=attention, step=step) == ref
    decoder = GreedyDecoder(model, deterministic=True)
    assert decoder.attention == "flex" and decoder.deterministic
    assert model.config._attn_implementation == "sdpa"  # never written: the kernel is ours
    with pytest.raises(ValueError, match="decode attention 'cudnn'"):
        GreedyDecoder(model, attention="cudnn")


def test_fused_step_shares_weights_and_compiles(model):
    """The fused step's concatenated q/k/v and gate/up matrices are the modules' own memory (a
    second decoder reuses them without a copy), and its compiled per-layer functions (inductor on
    CPU) give hf's tokens too, batched rows of mixed lengths included."""
    from anchorctx.models.decoder import StaticDecoder

    rows = _prompts()
    ref = _hf(model, rows, batch_size=1)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    first = GreedyDecoder(model, step="fused")
    w = first.decoder.layers[1]
    q_rows = attn.q_proj.weight.shape[0]
    assert attn.q_proj.weight.data_ptr() == w.wqkv.data_ptr()
    assert attn.k_proj.weight.data_ptr() == w.wqkv[q_rows:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == w.wgu[mlp.gate_proj.weight.shape[0] :].data_ptr()
    assert (w.bqkv is None) == (attn.q_proj.bias is None)
    again = StaticDecoder(model, step="fused", compile=True)
    assert again.layers[1].wqkv.data_ptr() == w.wqkv.data_ptr()  # already adjacent: a view
    assert again.layers[1].wgu.data_ptr() == w.wgu.data_ptr()
    first.decoder = again
    assert (
        first.generate(rows, max_new_tokens=NEW, pad_id=PAD, stop=StopRules(stop_token_ids=(2,)))
        == ref
    )
    assert _hf(model, rows, batch_size=3) == ref  # the model's own forward on the shared memory
    with pytest.raises(ValueError, match="decode step 'gpt-fast'"):
        GreedyDecoder(model, step="gpt-fast")


def test_deterministic_decoding_compiles_without_timed_kernel_choices(model, monkeypatch):
    """Deterministic decoding compiles its step with Inductor's ``deterministic`` option (no
    kernel picked by timing it on the device, so two processes compiling one graph get the
    same kernels); the default decoding keeps Inductor's tuned choices."""
    from anchorctx.models import decoder, decoding

    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append((fn, kw)) or fn)
    decoder._compiled.cache_clear()
    decoding._compiled_flex_decode.cache_clear()
    try:
        decoder.StaticDecoder(model, step="fused", compile=True, deterministic=True)
        decoder.StaticDecoder(model, step="fused", compile=True)
        decoding._compiled_flex_decode()
    finally:
        decoder._compiled.cache_clear()
        decoding._compiled_flex_decode.cache_clear()
    options = [(fn.__name__, kw["options"]) for fn, kw in calls]
    assert options == [
        ("_fused_pre_attention", {"deterministic": True}),
        ("_fused_post_attention", {"deterministic": True}),
        ("_fused_pre_attention", None),
        ("_fused_post_attention", None),
        ("_flex_decode", {"deterministic": True}),
    ]
    assert all(kw["dynamic"] is False and kw["fullgraph"] for _, kw in calls)


def test_first_token_suppression_matches_hf(model):
    rows = _prompts()
    free = _hf(model, rows, batch_size=1, stop_ids=(VOCAB + 5,))
    suppress = tuple({r[0] for r in free})
    ref = _hf(model, rows, batch_size=1, suppress=suppress)
    assert all(r[0] not in suppress for r in ref)
    assert _static(model, rows, len(rows), suppress=suppress) == ref


def test_chunked_prefill_and_buffer_reuse(model):
    rows = _prompts()
    ref = _static(model, rows, len(rows))
    assert _static(model, rows, len(rows), prefill_chunk=8) == ref
    # One decoder reused over batches of one shape and of another gives the same tokens.
    decoder = GreedyDecoder(model)
    for batch in ([0, 1], [4, 5], [2, 3, 4]):
        got = decoder.generate(
            [rows[i] for i in batch],
            max_new_tokens=NEW,
            pad_id=PAD,
            stop=StopRules(stop_token_ids=(2,)),
        )
        assert got == [ref[i] for i in batch]


@STEPS
def test_prepare_then_generate_equals_generate(model, step):
    """``prepare`` (the compile-ahead pass) allocates the batch's buffers and runs one step on
    them; the ``generate`` that reuses them gives the tokens of a decoder that never prepared."""
    rows = _prompts()
    ref = _static(model, rows, len(rows), step=step)
    decoder = GreedyDecoder(model, step=step)
    rules = StopRules(stop_token_ids=(2,))
    decoder.prepare([len(r) for r in rows], max_new_tokens=NEW, pad_id=PAD, stop=rules)
    prepared = decoder._batch
    assert prepared is not None and prepared.key == (len(rows), 128, NEW, (2,), PAD)
    assert prepared.slot.item() == 1  # the step ran (eager on CPU): it moved the slot
    got = decoder.generate(rows, max_new_tokens=NEW, pad_id=PAD, stop=rules)
    assert decoder._batch is prepared and got == ref


def test_prepare_runs_each_lengths_prefill_attention_as_generate_passes_it(model, monkeypatch):
    """``prepare`` runs the prefill's attention once per prompt length, with the shapes and
    strides ``generate``'s prefill passes it (a kernel that plans per input layout, cuDNN's,
    then finds its plan built), and only that call: one per length, not per layer."""
    from anchorctx.models import decoder as static

    calls: list[tuple] = []
    real = static._prefill_attention

    def spy(q, k, v, mask, scale):
        calls.append((q.shape, q.stride(), k.shape, k.stride(), v.stride(), mask is None, scale))
        return real(q, k, v, mask, scale)

    monkeypatch.setattr(static, "_prefill_attention", spy)
    rows = [*_prompts(), _prompts()[0]]  # one length twice
    lengths = [len(r) for r in rows]
    rules = StopRules(stop_token_ids=(2,))
    GreedyDecoder(model).generate(rows, max_new_tokens=NEW, pad_id=PAD, stop=rules)
    passed = set(calls)
    calls.clear()
    GreedyDecoder(model).prepare(lengths, max_new_tokens=NEW, pad_id=PAD, stop=rules)
    assert len(calls) == len(set(lengths)) and set(calls) == passed


def test_stop_strings_cut_at_the_completing_token(model):
    rows = _prompts()[:3]
    free = _static(model, rows, 3, stop_ids=())
    letters = lambda ids: "".join(chr(65 + t % 26) for t in ids)  # noqa: E731
    target = letters(free[1][4:6])  # completed by row 1's sixth token
    got = GreedyDecoder(model, sync_every=4).generate(
        rows, max_new_tokens=NEW, pad_id=PAD, stop=StopRules(stop_strings=(target,)), decode=letters
    )
    for mine, full in zip(got, free):
        text = letters(full)
        end = next((k for k in range(1, NEW + 1) if target in text[:k]), NEW)
        assert mine == full[:end]
    assert len(got[1]) <= 6


def test_unsupported_models_are_named():
    from transformers import LlamaConfig

    model = _tiny("llama")
    assert unsupported_reason(model, 100) is None
    model.config.hidden_act = "gelu"  # the fused step implements SiLU only; hf runs any
    with pytest.raises(UnsupportedModelError, match="fused decode step: hidden_act 'gelu'"):
        GreedyDecoder(model, step="fused")
    model.config.hidden_act = "silu"
    model.config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        GreedyDecoder(model).generate([[1, 5]], max_new_tokens=2, pad_id=PAD)
    gpt2_like = type("M", (), {"config": LlamaConfig(), "model": None})()
    gpt2_like.config.model_type = "gpt2"
    assert "gpt2" in unsupported_reason(gpt2_like, 10)


def test_plan_batches_buckets_by_length():
    lengths = [131072, 4000, 4096, 65536, 3900, 1000, 65000]
    plan = plan_batches(lengths, max_rows=8, max_tokens=140_000)
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
    assert plan[0] == [0]  # 128K alone
    assert plan[1] == [3, 6]  # two 64K rows fit 140K slots
    assert plan[2] == [2, 1, 4] and plan[3] == [5]  # 1000 is under 75% of 4096
    assert plan_batches(lengths, max_rows=1) == [[i] for i in (0, 3, 6, 2, 1, 4, 5)]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_cuda_graph_decode_equals_eager_and_hf(kind):
    """On CUDA (float32): the captured decode step gives the eager step's tokens and hf's, with
    early stops, first-token suppression, stop strings, and one graph replayed over batches."""
    model = _tiny(kind).cuda()
    rows = _prompts()
    free = _hf(model, rows, batch_size=1, stop_ids=(VOCAB + 5,))
    stops, suppress = (free[0][3], free[3][7]), (free[1][0],)
    ref = _hf(model, rows, batch_size=1, stop_ids=stops, suppress=suppress)
    graph = GreedyDecoder(model)
    assert graph.use_graph and graph.step == "fused"  # the default on CUDA
    rules = StopRules(stop_token_ids=stops, suppress_first=suppress)
    for batch in ([0, 1, 2], [3, 4, 5], [5, 0, 3]):  # one shape: the graph is captured once
        got = graph.generate([rows[i] for i in batch], max_new_tokens=NEW, pad_id=PAD, stop=rules)
        assert got == [ref[i] for i in batch]
    captured = graph._batch.graph
    assert captured is not None
    eager = _static(model, rows, len(rows), stop_ids=stops, suppress=suppress, use_graph=False)
    assert eager == ref == _static(model, rows, len(rows), stop_ids=stops, suppress=suppress)
    for step in ("hf", "fused"):  # the reference step and the fused one (compiled)
        for attention in ("sdpa", "efficient", "flex"):  # flex compiled, captured in the graph
            assert ref == _static(
                model,
                rows,
                len(rows),
                stop_ids=stops,
                suppress=suppress,
                attention=attention,
                step=step,
            )
    letters = lambda ids: "".join(chr(65 + t % 26) for t in ids)  # noqa: E731
    target = letters(free[2][2:5])
    got = graph.generate(
        rows, max_new_tokens=NEW, pad_id=PAD, stop=StopRules(stop_strings=(target,)), decode=letters
    )
    for mine, full in zip(got, free):
        end = next((k for k in range(1, NEW + 1) if target in letters(full[:k])), NEW)
        assert mine == full[:end]
    assert len(got[2]) <= 5


@pytest.mark.gpu
def test_prepare_captures_the_graph_generate_replays():
    """On CUDA ``prepare`` compiles and captures the batch's step (what ``generate`` would do
    at its first step) without decoding; ``generate`` then replays that graph, same tokens."""
    model = _tiny("llama").cuda()
    rows = _prompts()
    ref = _static(model, rows, len(rows))
    decoder = GreedyDecoder(model)
    rules = StopRules(stop_token_ids=(2,))
    decoder.prepare([len(r) for r in rows], max_new_tokens=NEW, pad_id=PAD, stop=rules)
    captured = decoder._batch.graph
    assert captured is not None
    assert decoder.generate(rows, max_new_tokens=NEW, pad_id=PAD, stop=rules) == ref
    assert decoder._batch.graph is captured


@pytest.mark.gpu
def test_a_batch_decodes_alike_whatever_the_process_decoded_before():
    """On CUDA in bf16 (deterministic decoding: fused step, FlexAttention) every batch shape
    gets a static graph of its own, also past torch's default limit of 8 recompilations, so a
    batch's tokens do not depend on which batches the process decoded before (two shardings
    of one evaluation give the same records)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = _tiny("llama").cuda().to(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    # (rows, longest prompt): ten distinct (rows, slots) shapes, slots 128 or 256
    shapes = [(b, n) for b, n in zip([1, 2, 3, 4, 5, 6, 7, 2, 3, 1], range(40, 240, 20))]
    batches = [
        [[1, *torch.randint(3, VOCAB, (n - 1 - r,), generator=g).tolist()] for r in range(b)]
        for b, n in shapes
    ]
    rules = StopRules(stop_token_ids=(VOCAB + 5,))

    def run(order):
        torch._dynamo.reset()  # a new process' compile history
        counters.clear()
        decoder = GreedyDecoder(model, deterministic=True)
        out = {
            i: decoder.generate(batches[i], max_new_tokens=NEW, pad_id=PAD, stop=rules)
            for i in order
        }
        return out, counters["stats"]["unique_graphs"]

    forward, graphs = run(range(len(batches)))
    backward, _ = run(reversed(range(len(batches))))
    assert forward == backward
    # The step's pre-attention half and FlexAttention compile once per (rows, slots) shape.
    assert graphs >= 2 * len(shapes), graphs


def test_auto_engine_falls_back_where_static_cannot_run():
    from transformers import MistralConfig, MistralForCausalLM

    from anchorctx.evaluation.generation import _pick_engine

    cfg = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=16,
    )
    mistral = MistralForCausalLM(cfg).eval()
    short, long = [[1, 5, 6]], [[1] * 20]
    assert _pick_engine("auto", mistral, short, 4) == "static"  # within the window: exact
    assert _pick_engine("auto", mistral, long, 4) == "hf"
    assert _pick_engine("static", mistral, long, 4) == "static"  # asked for: it raises later
    with pytest.raises(UnsupportedModelError, match="sliding_window 16"):
        GreedyDecoder(mistral).generate(long, max_new_tokens=4, pad_id=PAD)
    with pytest.raises(ValueError, match="generation engine 'vllm'"):
        _pick_engine("vllm", mistral, short, 4)
    assert GreedyDecoder(mistral).generate(short, max_new_tokens=3, pad_id=PAD) == _hf_rows(
        mistral, short, 3
    )


def _hf_rows(model, rows, new):
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=PAD
    )
    with torch.no_grad():
        return [
            model.generate(input_ids=torch.tensor([r]), generation_config=config)[
                0, len(r) :
            ].tolist()
            for r in rows
        ]


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_grouped_sdpa_decode_equals_repeated_kv(groups):
    """The GQA decode attention (query heads grouped per KV head, no K/V copy) equals attention
    over K/V repeated to every query head (transformers' repeat_kv order) with the same slot
    mask, in float64 on random inputs: the same arithmetic per row, so to rounding (1e-12)."""
    from anchorctx.models.decoding import _grouped_sdpa_decode

    torch.manual_seed(groups)
    b, kv_heads, slots, d = 3, 2, 40, 8
    heads = kv_heads * groups
    q = torch.randn(b, heads, 1, d, dtype=torch.float64)
    k, v = (torch.randn(b, kv_heads, slots, d, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(b, 1, 1, slots) < 0.6
    mask[..., 0] = True  # every row sees at least one slot
    got = _grouped_sdpa_decode(q, k, v, mask, 0.3)
    k_rep, v_rep = (t.repeat_interleave(groups, dim=1) for t in (k, v))  # [B, H_q, S, D]
    scores = (q @ k_rep.transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf"))
    want = scores.softmax(-1) @ v_rep  # [B, H_q, 1, D]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
