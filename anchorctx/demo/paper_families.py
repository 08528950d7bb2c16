"""Stand-ins for Table 6's model families in their published formats: Llama-3-8B, Mistral-7B-v0.3
and Qwen-1.5-1.8B.

Each is a Hugging Face directory with the family's ``config.json`` fields (architecture, RoPE
base, BOS/EOS ids, grouped-query ratio, attention biases), its tokenizer files and conventions,
and random fp16 safetensors weights of a *small* shape (:data:`FAMILY_SHAPE`: a few layers, a
narrow hidden size): the weights only rehearse the pipeline, the conventions are what the project's
loaders must get right. What each family ships and the stand-in keeps exactly:

- ``models/Meta-Llama-3-8B``: ``tokenizer.json`` only (no ``tokenizer.model``), byte-level BPE
  with Llama-3's split pattern, ``<|begin_of_text|>`` (BOS, the anchor) and ``<|end_of_text|>``
  (EOS) as the first two of 256 special tokens that follow the ordinary vocabulary (ids 128000 and
  128001 in the real one, N and N+1 here for an N-token vocabulary), a template that prepends
  ``<|begin_of_text|>``; ``rope_theta`` 500000 and no ``rope_scaling`` (Llama-3, not 3.1).
- ``models/Mistral-7B-v0.3``: a SentencePiece ``tokenizer.model`` of exactly 32768 pieces
  (``<unk>``/``<s>``/``</s>`` = 0/1/2, the 768 control tokens ``[INST]``.. ``[control_768]`` at
  3..770, byte fallback; pieces the demo corpus cannot fill are UNUSED), and its fast
  ``tokenizer.json``; BOS ``<s>`` is the anchor.
- ``models/Qwen1.5-1.8B``: Qwen2 architecture (q/k/v biases), byte-level BPE ``tokenizer.json``
  with ``vocab.json`` and ``merges.txt``, ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` after
  the vocabulary, and **no BOS token**: the anchor is EOS ``<|endoftext|>``
  (:func:`anchorctx.models.loading.anchor_token_id`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anchorctx.demo.fixtures import dump_json

# The published config.json fields of each family; the size fields are replaced by FAMILY_SHAPE's.
LLAMA3_CONFIG: dict[str, Any] = {
    "_name_or_path": "meta-llama/Meta-Llama-3-8B",
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0",
    "use_cache": True,
}
MISTRAL_CONFIG: dict[str, Any] = {
    "_name_or_path": "mistralai/Mistral-7B-v0.3",
    "architectures": ["MistralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.0.dev0",
    "use_cache": True,
}
QWEN_CONFIG: dict[str, Any] = {
    "_name_or_path": "Qwen/Qwen1.5-1.8B",
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 32768,
    "model_type": "qwen2",
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.37.0",
    "use_cache": True,
    "use_sliding_window": False,
}


@dataclass(frozen=True)
class FamilyShape:
    """The stand-ins' small shape; ``kv_ratio`` query heads share one KV head (GQA), as in the
    family (Llama-3-8B and Mistral-7B: 32 heads over 8 KV heads; Qwen-1.5: none shared)."""

    hidden_size: int = 64
    intermediate_size: int = 172
    num_attention_heads: int = 4
    num_hidden_layers: int = 2
    bpe_vocab: int = 1000  # ordinary byte-level BPE tokens before the special ones (a soft limit)


FAMILY_SHAPE = FamilyShape()

# Llama-3's pre-tokenizer split (tokenizer.json of meta-llama/Meta-Llama-3-8B).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's (tokenizer.json of Qwen/Qwen1.5-1.8B).
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    *(f"<|reserved_special_token_{i}|>" for i in range(4)),
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_special_token_4|>",
    "<|eot_id|>",
    *(f"<|reserved_special_token_{i}|>" for i in range(5, 251)),
)  # 256 tokens, as in Llama-3
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MISTRAL_PIECES = 32768  # Mistral-7B-v0.3's vocabulary (v0.2's 32000 + 768 control tokens)
MISTRAL_CONTROLS = (
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    *(f"[control_{i}]" for i in range(8, 769)),
)  # ids 3..770: 768 control tokens, as in v0.3


# -------------------------------------------------------------------------- tokenizers
def _byte_bpe(texts: list[str], size: int, pattern: str, specials: tuple[str, ...]):
    """A byte-level BPE trained on ``texts`` (ordinary tokens first, then ``specials``), split
    by ``pattern`` as the family's tokenizer.json does."""
    # Imported here: tokenizers loads only when a family stand-in is written.
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(list(specials))
    return tok


def _added(content: str) -> dict[str, Any]:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


def _added_decoder(tok, specials: tuple[str, ...]) -> dict[str, Any]:
    return {str(tok.token_to_id(s)): _added(s) for s in specials}


def write_llama3_tokenizer(model_dir: Path, texts: list[str], shape: FamilyShape) -> int:
    """tokenizer.json (BOS prepended by its template), tokenizer_config.json and
    special_tokens_map.json as Meta-Llama-3-8B ships them; returns the vocabulary size."""
    from tokenizers import processors

    tok = _byte_bpe(texts, shape.bpe_vocab, LLAMA3_PATTERN, LLAMA3_SPECIALS)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
                special_tokens=[("<|begin_of_text|>", bos)],
            ),
        ]
    )
    tok.save(str(model_dir / "tokenizer.json"))
    dump_json(
        model_dir / "tokenizer_config.json",
        {
            "added_tokens_decoder": _added_decoder(tok, LLAMA3_SPECIALS),
            "bos_token": "<|begin_of_text|>",
            "clean_up_tokenization_spaces": True,
            "eos_token": "<|end_of_text|>",
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": 1000000000000000019884624838656,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    dump_json(
        model_dir / "special_tokens_map.json",
        {"bos_token": _plain("<|begin_of_text|>"), "eos_token": _plain("<|end_of_text|>")},
    )
    return tok.get_vocab_size()


def write_qwen_tokenizer(model_dir: Path, texts: list[str], shape: FamilyShape) -> int:
    """tokenizer.json, vocab.json, merges.txt and tokenizer_config.json as Qwen1.5-1.8B ships
    them: ``bos_token`` null, EOS and pad ``<|endoftext|>``; returns the vocabulary size."""
    tok = _byte_bpe(texts, shape.bpe_vocab, QWEN_PATTERN, QWEN_SPECIALS)
    tok.save(str(model_dir / "tokenizer.json"))
    tok.model.save(str(model_dir))  # vocab.json and merges.txt, as Qwen ships beside it
    dump_json(
        model_dir / "tokenizer_config.json",
        {
            "add_prefix_space": False,
            "added_tokens_decoder": _added_decoder(tok, QWEN_SPECIALS),
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "bos_token": None,
            "chat_template": None,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|endoftext|>",
            "errors": "replace",
            "model_max_length": 32768,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        },
    )
    return tok.get_vocab_size()


def _plain(content: str) -> dict[str, Any]:
    return {k: v for k, v in _added(content).items() if k != "special"}


def mistral_sentencepiece(texts: list[str], shape: FamilyShape) -> bytes:
    """Mistral-7B-v0.3's tokenizer.model layout: Llama's trainer options with the 768 control
    tokens at 3..770, padded with UNUSED pieces to exactly :data:`MISTRAL_PIECES`."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    from anchorctx.demo.model_files import train_sentencepiece

    trained, _ = train_sentencepiece(
        texts, len(MISTRAL_CONTROLS) + 256 + shape.bpe_vocab, control_symbols=MISTRAL_CONTROLS
    )
    proto = pb.ModelProto()  # type: ignore[attr-defined]  # protobuf's generated class: no stubs
    proto.ParseFromString(trained)
    # A small corpus yields fewer pieces than 32768; the rest are never produced (UNUSED), so
    # ids, vocabulary size and the special pieces are v0.3's while the merges are the corpus's.
    low = min(p.score for p in proto.pieces) - 1.0
    for i in range(len(proto.pieces), MISTRAL_PIECES):
        piece = proto.pieces.add()
        piece.piece, piece.score, piece.type = (
            f"<unused_{i}>",
            low,
            pb.ModelProto.SentencePiece.UNUSED,  # type: ignore[attr-defined]  # as above
        )
    proto.trainer_spec.vocab_size = MISTRAL_PIECES
    return proto.SerializeToString()


def write_mistral_tokenizer(model_dir: Path, texts: list[str], shape: FamilyShape) -> int:
    from anchorctx.demo.model_files import special_tokens_map, tokenizer_config

    (model_dir / "tokenizer.model").write_bytes(mistral_sentencepiece(texts, shape))
    dump_json(model_dir / "tokenizer_config.json", tokenizer_config())
    dump_json(model_dir / "special_tokens_map.json", special_tokens_map())
    from transformers import AutoTokenizer

    fast = AutoTokenizer.from_pretrained(str(model_dir))
    fast.backend_tokenizer.save(str(model_dir / "tokenizer.json"))
    return MISTRAL_PIECES


# ---------------------------------------------------------------------------- families
@dataclass(frozen=True)
class Family:
    """One Table 6 family: its directory, published config, tokenizer writer, KV sharing, whether
    q/k/v carry biases (Qwen2), its safetensors shard count and the anchor its tokenizer gives."""

    directory: str
    config: dict[str, Any]
    write_tokenizer: Callable[[Path, list[str], FamilyShape], int]
    kv_ratio: int
    qkv_bias: bool
    shards: int
    anchor: str


FAMILIES: dict[str, Family] = {
    "llama3": Family(
        "models/Meta-Llama-3-8B",
        LLAMA3_CONFIG,
        write_llama3_tokenizer,
        4,
        False,
        4,
        "<|begin_of_text|>",
    ),
    "mistral": Family(
        "models/Mistral-7B-v0.3", MISTRAL_CONFIG, write_mistral_tokenizer, 4, False, 3, "<s>"
    ),
    "qwen": Family(
        "models/Qwen1.5-1.8B", QWEN_CONFIG, write_qwen_tokenizer, 1, True, 1, "<|endoftext|>"
    ),
}


def family_config(
    family: Family, shape: FamilyShape, vocab: int, bos: int | None, eos: int
) -> dict[str, Any]:
    """The family's config.json with the small shape and the tokenizer's special ids (Qwen's
    bos_token_id is its EOS id, as Qwen1.5 publishes it)."""
    heads = shape.num_attention_heads
    cfg = dict(family.config)
    cfg.update(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_attention_heads=heads,
        num_hidden_layers=shape.num_hidden_layers,
        num_key_value_heads=heads // family.kv_ratio,
        vocab_size=vocab,
        bos_token_id=eos if bos is None else bos,
        eos_token_id=eos,
    )
    if family.config["model_type"] == "qwen2":
        cfg["max_window_layers"] = shape.num_hidden_layers
    return dict(sorted(cfg.items()))


def family_tensors(family: Family, shape: FamilyShape, vocab: int):
    """(name, shape) of every weight: Llama's list, with q/k/v biases for Qwen2."""
    from anchorctx.demo.model_files import AssetSizes, llama_tensors

    heads = shape.num_attention_heads
    sizes = AssetSizes(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=heads // family.kv_ratio,
        num_hidden_layers=shape.num_hidden_layers,
        vocab_size=vocab,
        shards=family.shards,
    )
    tensors = llama_tensors(sizes)
    if not family.qkv_bias:
        return sizes, tensors
    kv = shape.hidden_size // family.kv_ratio
    out = []
    for name, dims in tensors:
        out.append((name, dims))
        for proj, width in (("q_proj", shape.hidden_size), ("k_proj", kv), ("v_proj", kv)):
            if name.endswith(f"self_attn.{proj}.weight"):
                out.append((name.replace(".weight", ".bias"), (width,)))
    return sizes, out


def write_family(model_dir: Path, family: Family, texts: list[str], seed: int) -> dict[str, Any]:
    """Tokenizer files, config.json, generation_config.json and fp16 safetensors of one family
    into ``model_dir``; returns a summary."""
    from transformers import PreTrainedTokenizerFast

    from anchorctx.demo.model_files import write_checkpoint_weights

    shape = FAMILY_SHAPE
    vocab = family.write_tokenizer(model_dir, texts, shape)
    fast = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    cfg_tok = json.loads((model_dir / "tokenizer_config.json").read_text())
    bos = cfg_tok.get("bos_token")
    bos_id = None if bos is None else _id(fast, bos)
    eos_id = _id(fast, cfg_tok["eos_token"])
    dump_json(model_dir / "config.json", family_config(family, shape, vocab, bos_id, eos_id))
    generation = {"bos_token_id": eos_id if bos_id is None else bos_id, "eos_token_id": eos_id}
    dump_json(model_dir / "generation_config.json", generation)
    sizes, tensors = family_tensors(family, shape, vocab)
    index = write_checkpoint_weights(model_dir, sizes, seed, tensors=tensors)
    return {"vocab": vocab, "bos_token_id": bos_id, "eos_token_id": eos_id, "shards": index}


def _id(fast, token: Any) -> int:
    content = token["content"] if isinstance(token, dict) else token
    tok_id = fast.convert_tokens_to_ids(content)
    if tok_id is None:  # pragma: no cover - the writers above add every special token
        raise RuntimeError(f"special token {content!r} missing from the written tokenizer")
    return int(tok_id)


def family_bytes(family: Family) -> int:
    """Bytes of the fp16 weights at most (the space check before writing): a byte-level BPE
    stand-in has at most its ordinary tokens plus Llama-3's 256 special ones."""
    import numpy as np

    if family.write_tokenizer is write_mistral_tokenizer:
        vocab = MISTRAL_PIECES
    else:
        vocab = FAMILY_SHAPE.bpe_vocab + len(LLAMA3_SPECIALS)
    _, tensors = family_tensors(family, FAMILY_SHAPE, vocab)
    return sum(2 * int(np.prod(dims)) for _, dims in tensors)
