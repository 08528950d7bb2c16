"""The files of a Hugging Face checkpoint written from nothing: the Llama layout's tensors,
safetensors shards of seeded random weights streamed tensor by tensor, and SentencePiece
tokenizers with Llama's special-token files. Shared by the paper stand-ins
(:mod:`anchorctx.demo.paper_assets`) and the Table 6 families
(:mod:`anchorctx.demo.paper_families`)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from anchorctx.demo.fixtures import dump_json
from anchorctx.models.safetensors_stream import write_safetensors

SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2, as in Llama's tokenizer.model

# transformers' VERY_LARGE_INTEGER, int(1e30): the value Llama-2's tokenizer_config.json holds.
MODEL_MAX_LENGTH = int(1e30)


@dataclass(frozen=True)
class AssetSizes:
    """How big each stand-in is; the file layout and field names never depend on it."""

    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    num_hidden_layers: int = 32
    vocab_size: int = 32000  # model and tokenizer (the tokenizer may get fewer: see below)
    shards: int = 2  # Llama-2-7b-hf is published in two safetensors files
    docs_per_domain: int = 40
    chunks: int = 2
    files_per_chunk: int = 4
    essay_words: int = 160_000  # more than a 128K-token haystack needs
    english_words: int = 30_000  # CWE's list near 128K: more than wonderwords' ~8.2K words
    squad_titles: int = 120
    squad_paragraphs: int = 10
    hotpotqa_questions: int = 300
    hotpotqa_pool: int = 8000
    longbench_samples: int = 5
    mmlu_subjects: int = 57
    mmlu_dev: int = 5
    mmlu_test: int = 10
    hellaswag: int = 200


def llama_tensors(sizes: AssetSizes) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every weight, in the order transformers' state dict lists them."""
    h, f, v = sizes.hidden_size, sizes.intermediate_size, sizes.vocab_size
    head = h // sizes.num_attention_heads
    kv = head * sizes.num_key_value_heads
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for i in range(sizes.num_hidden_layers):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.self_attn.q_proj.weight", (h, h)),
            (f"{p}.self_attn.k_proj.weight", (kv, h)),
            (f"{p}.self_attn.v_proj.weight", (kv, h)),
            (f"{p}.self_attn.o_proj.weight", (h, h)),
            (f"{p}.mlp.gate_proj.weight", (f, h)),
            (f"{p}.mlp.up_proj.weight", (f, h)),
            (f"{p}.mlp.down_proj.weight", (h, f)),
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
        ]
    return [*out, ("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


# Elements generated at a time: bounds memory (64 MiB of float32) whatever the tensor's size.
_CHUNK = 1 << 24
# Uniform on [-a, a] has standard deviation a / sqrt(3): 0.02, Llama's initializer_range. A
# uniform draw is about 4x cheaper than a normal one, which matters for 6.7B weights.
_HALF_WIDTH = 0.02 * 3**0.5


def _tensor_chunks(seed: int, index: int, name: str, shape: tuple[int, ...]) -> Iterator[bytes]:
    """The fp16 bytes of one random weight, a chunk at a time. One stream per tensor: the
    weights do not depend on the shard layout."""
    n = int(np.prod(shape))
    if name.endswith("norm.weight"):
        yield np.ones(n, dtype=np.float16).tobytes()
        return
    rng = np.random.default_rng([seed, index])
    for start in range(0, n, _CHUNK):
        x = rng.random(min(_CHUNK, n - start), dtype=np.float32)
        x -= 0.5
        x *= 2 * _HALF_WIDTH
        yield x.astype(np.float16).tobytes()


def _shard_plan(tensors: list[tuple[str, tuple[int, ...]]], shards: int) -> list[list[int]]:
    """Tensor indices per shard, in order, cut where the running size passes k/shards."""
    sizes = [2 * int(np.prod(shape)) for _, shape in tensors]
    plan: list[list[int]] = [[] for _ in range(shards)]
    total, acc = sum(sizes), 0
    for i, size in enumerate(sizes):
        k = min(shards - 1, acc * shards // total)
        plan[k].append(i)
        acc += size
    return [p for p in plan if p]


def write_checkpoint_weights(
    model_dir: Path,
    sizes: AssetSizes,
    seed: int,
    tensors: list[tuple[str, tuple[int, ...]]] | None = None,
) -> dict[str, Any]:
    """Sharded fp16 safetensors and their index (Llama's tensors unless ``tensors`` names
    others); returns the index. One shard is ``model.safetensors`` with no index, as Hugging Face
    publishes a single-file model."""
    tensors = llama_tensors(sizes) if tensors is None else tensors
    plan = _shard_plan(tensors, sizes.shards)
    weight_map: dict[str, str] = {}
    total = 0
    for k, indices in enumerate(plan, 1):
        name = (
            "model.safetensors"
            if len(plan) == 1
            else f"model-{k:05d}-of-{len(plan):05d}.safetensors"
        )
        meta = [tensors[i] for i in indices]
        data = (piece for i in indices for piece in _tensor_chunks(seed, i, *tensors[i]))
        entries = [(n, "F16", shape, 2 * int(np.prod(shape))) for n, shape in meta]
        total += write_safetensors(model_dir / name, entries, data)
        weight_map.update({tensors[i][0]: name for i in indices})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    if len(plan) > 1:
        dump_json(model_dir / "model.safetensors.index.json", index)
    return index


# ------------------------------------------------------------------------------- tokenizer
def _added_token(content: str) -> dict[str, Any]:
    return {
        "__type": "AddedToken",
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
    }


def tokenizer_config() -> dict[str, Any]:
    """``tokenizer_config.json`` with the fields Llama-2-7b-hf ships."""
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": _added_token("<s>"),
        "clean_up_tokenization_spaces": False,
        "eos_token": _added_token("</s>"),
        "legacy": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": None,
        "padding_side": "right",
        "sp_model_kwargs": {},
        "tokenizer_class": "LlamaTokenizer",
        "unk_token": _added_token("<unk>"),
    }


def special_tokens_map() -> dict[str, Any]:
    def token(content: str) -> dict[str, Any]:
        return {k: v for k, v in _added_token(content).items() if k != "__type"}

    return {"bos_token": token("<s>"), "eos_token": token("</s>"), "unk_token": token("<unk>")}


def _training_lines(texts: list[str], limit: int = 4000) -> Iterator[str]:
    # SentencePiece skips sentences over max_sentence_length (4192 bytes by default): feed lines,
    # cut to fit, as Llama's tokenizer was trained on text lines.
    for text in texts:
        for line in text.split("\n"):
            if line.strip():
                yield line[:limit]


def train_sentencepiece(
    texts: list[str], vocab_size: int, control_symbols: tuple[str, ...] = ()
) -> tuple[bytes, int]:
    """A Llama-style SentencePiece BPE model trained on ``texts``: (model bytes, pieces).

    The trainer options are those recorded in Llama-2's ``tokenizer.model`` (its trainer_spec):
    BPE, byte fallback, digits split, a dummy prefix, no normalisation, ``<unk>``/``<s>``/``</s>``
    at 0/1/2 and no pad piece. ``vocab_size`` is a soft limit: a small corpus yields fewer pieces
    (the second value says how many), never an error. ``control_symbols`` follow ``</s>`` (Mistral
    v0.3's ``[INST]``.. control tokens).
    """
    try:
        # Imported here: sentencepiece is needed only to write a new tokenizer.model.
        import sentencepiece as spm
    except ImportError:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "writing the Llama-style tokenizer.model needs the sentencepiece package "
            "(pip install sentencepiece)"
        ) from None
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=_training_lines(texts),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        hard_vocab_limit=False,
        byte_fallback=True,
        split_digits=True,
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        normalization_rule_name="identity",
        character_coverage=0.99995,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        control_symbols=list(control_symbols),
        num_threads=2,
        minloglevel=2,
    )
    data = model.getvalue()
    processor = spm.SentencePieceProcessor(model_proto=data)
    pieces = processor.get_piece_size()
    if [processor.id_to_piece(i) for i in range(3)] != list(SPECIALS):
        raise RuntimeError("sentencepiece did not put <unk>, <s>, </s> at ids 0, 1, 2")
    return data, pieces
