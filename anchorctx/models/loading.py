"""Model and tokenizer loading shared by training, evaluation and analysis.

A model comes from ``model.path`` (any local Hugging Face causal LM directory) or from
``model.tiny`` (a random Llama/Mistral/Qwen2 built from the config, for the demo and tests).
The RoPE base override of the paper's Table 1 is applied to the HF config before weights load,
and the anchorctx attention implementation is selected by name through transformers'
``AttentionInterface`` registry — no library file or module is patched.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from anchorctx.models.checkpoints import model_dir_problem

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from anchorctx.models.settings import ModelConfig

DTYPES = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16"}


class ModelLoadError(ValueError):
    """The model or tokenizer named in the config cannot be used."""

    exit_code = 2  # the config names it (anchorctx.cli)


class ModelFileError(ModelLoadError):
    """The model's files exist but cannot be read (truncated or corrupt weights)."""

    exit_code = 1


class DeviceError(ValueError):
    """A config asks for a device this machine does not have."""

    exit_code = 2  # the config names it (anchorctx.cli)


def resolve_device(want: str | None, key: str) -> str:
    """The device a config value (``key``) asks for: ``auto``/None is CUDA when a GPU is
    visible, else CPU; ``cuda`` without a visible GPU is an error naming ``key``."""
    # Imported here: torch costs seconds to import; the CLI and pre-flight checks resolve devices
    # without a model.
    import torch

    if want in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if want.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError(f"{key}={want} but no CUDA GPU is visible; use {key}=cpu")
    return want


def load_tokenizer(model_cfg: ModelConfig) -> PreTrainedTokenizerBase:
    # Imported here: transformers costs seconds to import, which the light callers of this module
    # skip.
    from transformers import AutoTokenizer

    path = model_cfg.tokenizer_path
    if not Path(path).is_dir():
        raise ModelLoadError(f"tokenizer directory not found: {path} (model.tokenizer/model.path)")
    return AutoTokenizer.from_pretrained(str(path))


def anchor_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The shared anchor: BOS, or EOS for tokenizers without BOS (Qwen)."""
    tok_id = (
        tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    )
    if tok_id is None:
        raise ModelLoadError("tokenizer has neither a BOS nor an EOS token: no anchor token")
    return int(tok_id)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Hash of the vocabulary, merges/normaliser and special tokens: equal iff same tokenisation."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = (
        backend.to_str()
        if backend is not None
        else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    )
    specials = json.dumps(
        {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "len": len(tokenizer)},
        sort_keys=True,
    )
    return hashlib.sha256((state + specials).encode()).hexdigest()[:16]


def build_hf_config(
    model_cfg: ModelConfig, *, seq_len: int | None, vocab_size: int | None = None
) -> PretrainedConfig:
    """The HF config with the RoPE base override and the position limit it implies."""
    # Imported here: transformers costs seconds to import, which the light callers of this module
    # skip.
    from transformers import AutoConfig

    if model_cfg.path is not None:
        if problem := model_dir_problem(model_cfg.path):
            raise ModelLoadError(f"model.path has {problem}: {model_cfg.path}")
        hf = AutoConfig.from_pretrained(str(model_cfg.path))
    else:
        hf = _tiny_config(model_cfg, vocab_size)
    if model_cfg.rope_theta is not None:
        _set_rope_theta(hf, model_cfg.rope_theta)
    limit = model_cfg.max_position_embeddings or (seq_len if model_cfg.rope_theta else None)
    if limit is not None and limit > getattr(hf, "max_position_embeddings", 0):
        hf.max_position_embeddings = int(limit)
    hf.use_cache = False
    return hf


def _set_rope_theta(hf: PretrainedConfig, theta: float) -> None:
    # transformers 5 keeps RoPE settings in ``rope_parameters``; 4.x in ``rope_theta``.
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict):
        params["rope_theta"] = float(theta)
    hf.rope_theta = float(theta)


def _tiny_config(model_cfg: ModelConfig, vocab_size: int | None) -> PretrainedConfig:
    # Imported here: transformers costs seconds to import, which the light callers of this module
    # skip.
    from transformers import AutoConfig

    tiny = model_cfg.tiny
    assert tiny is not None
    vocab = tiny.vocab_size or vocab_size
    if vocab is None:
        raise ModelLoadError("model.tiny.vocab_size unknown: pass the tokenizer's length")
    head_dim = tiny.head_dim or tiny.hidden_size // tiny.num_attention_heads
    return AutoConfig.for_model(
        tiny.architecture,
        vocab_size=vocab,
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def load_model(
    model_cfg: ModelConfig,
    *,
    seq_len: int | None = None,
    dtype: str | None = None,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = "anchorctx",
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> PreTrainedModel:
    """Load (or build, for ``model.tiny``) the causal LM with the anchorctx attention selected.

    ``attn_implementation=None`` keeps the model's stock attention (used as the reference in
    tests); ``"anchorctx"`` registers and selects the project's implementation.

    The vocabulary is the checkpoint's own: AnchorContext's ``[PAD]`` token and resize to 32001
    rows for Llama-2 is not applied (the row is never an input or a target; docs/FIDELITY.md,
    "Model: Llama-2 vocabulary"), and checkpoints that carry it load with their 32001 rows.
    """
    # Imported here: torch and transformers cost seconds, and the tokenizer rule, device and
    # directory checks in this module serve light callers (the CLI, packing, pre-flight checks).
    import torch
    from transformers import AutoModelForCausalLM

    from anchorctx.attention.hf import register
    from anchorctx.models.rope import enable_fp32_rope

    torch_dtype = getattr(torch, DTYPES[dtype or model_cfg.dtype])
    if attn_implementation == "anchorctx":
        attn_implementation = register()
    vocab = len(tokenizer) if tokenizer is not None else None
    hf = build_hf_config(model_cfg, seq_len=seq_len, vocab_size=vocab)
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if model_cfg.path is not None:
        try:
            # On a GPU the weights are read straight into device memory, not first into host
            # memory and then copied: no host copy of a 7B model per evaluation shard process.
            if torch.device(device).type != "cpu":
                extra["device_map"] = str(device)
            model = AutoModelForCausalLM.from_pretrained(
                str(model_cfg.path), config=hf, dtype=torch_dtype, **extra
            )
        except Exception as err:  # SafetensorError, torn or foreign files: name model.path
            detail = " ".join(str(err).split())
            raise ModelFileError(
                f"cannot load the weights in model.path {model_cfg.path} ({type(err).__name__}: "
                f"{detail}); they may be truncated or corrupt"
            ) from err
    else:
        assert model_cfg.tiny is not None
        torch.manual_seed(model_cfg.tiny.init_seed)  # the same tiny weights on every rank
        model = AutoModelForCausalLM.from_config(hf, dtype=torch_dtype, **extra)
    if model_cfg.rope_fp32:
        # The ablation of the paper's Section 2: rotate q/k in float32 inside bf16 training.
        # Anything that wraps attention by name must then use attention_name(model).
        model = enable_fp32_rope(model)
    return model.to(device)
