"""Model and tokenizer loading shared by training, evaluation and analysis.

A model comes from ``model.path`` (any local Hugging Face causal LM directory) or from
``model.tiny`` (a random Llama/Mistral/Qwen2 built from the config, for the demo and tests).
The RoPE base override of the paper's Table 1 is applied to the HF config before weights load,
and the anchorctx attention implementation is selected by name through transformers'
``AttentionInterface`` registry — no library file or module is patched.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anchorctx.io import read_json
from anchorctx.models.checkpoints import META_FILE, model_dir_problem

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from anchorctx.models.settings import ModelConfig

log = logging.getLogger("anchorctx.models")
_NOTED: set[str] = set()

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


def lengths_beyond(model: Any, lengths: list[int]) -> tuple[int | None, list[int]]:
    """(the model's ``max_position_embeddings`` or None, the ``lengths`` above it)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    return limit, [n for n in lengths if limit is not None and n > limit]


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


def read_model_config(path: str | Path) -> dict[str, Any]:
    """A model directory's ``config.json`` as a dict. Every reader of a checkpoint's config goes
    through here (or checks with it before transformers reads the file): a malformed one is one
    :class:`ModelFileError` naming the file, with the line and column for invalid JSON."""
    file = Path(path) / "config.json"
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ModelFileError(
            f"{file}: not valid JSON (line {err.lineno} column {err.colno}: {err.msg}); restore "
            "it from where the model came from"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ModelFileError(f"{file}: unreadable ({err})") from None
    if not isinstance(config, dict):
        raise ModelFileError(f"{file}: expected a JSON object, found {type(config).__name__}")
    return config


def load_tokenizer(model_cfg: ModelConfig) -> PreTrainedTokenizerBase:
    # Imported here: transformers costs seconds to import, which the light callers of this module
    # skip.
    from transformers import AutoTokenizer

    path = model_cfg.tokenizer_path
    if not Path(path).is_dir():
        raise ModelLoadError(f"tokenizer directory not found: {path} (model.tokenizer/model.path)")
    return AutoTokenizer.from_pretrained(str(path))


class AnchorTokenError(ModelLoadError):
    """The tokenizer's anchor token is not a real BOS, or disagrees with the model or with the
    anchor a checkpoint was trained with; the message names the tokenizer or checkpoint."""


def anchor_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The shared anchor: the tokenizer's BOS, or its EOS for a tokenizer that has no BOS token
    at all (Qwen). Either must be a real token of the vocabulary: a BOS that resolves to the
    unknown token (``bos_token="<unk>"``, or a name the vocabulary lacks) is an error, never a
    silent ``<unk>`` anchor. The model-side rule is :func:`anchor_decision`."""
    if tokenizer.bos_token is not None:
        role, token, tok_id = "BOS", tokenizer.bos_token, tokenizer.bos_token_id
    elif tokenizer.eos_token is not None:
        role, token, tok_id = "EOS", tokenizer.eos_token, tokenizer.eos_token_id
    else:
        raise AnchorTokenError(
            f"tokenizer {_tokenizer_name(tokenizer)} has neither a BOS nor an EOS token: no "
            "anchor token (set bos_token in its tokenizer_config.json)"
        )
    unk = tokenizer.unk_token_id
    if tok_id is None or (unk is not None and tok_id == unk):
        resolves = "nothing" if tok_id is None else f"the unknown token, id {unk}"
        raise AnchorTokenError(
            f"tokenizer {_tokenizer_name(tokenizer)}: its {role} token {token!r} is not a real "
            f"token (it resolves to {resolves}), so it cannot be the anchor; set bos_token in "
            "its tokenizer_config.json to the model's BOS"
        )
    return int(tok_id)


def _tokenizer_name(tokenizer: PreTrainedTokenizerBase) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or "(in memory)")


def anchor_decision(
    tokenizer: PreTrainedTokenizerBase, hf_config: PretrainedConfig, where: str
) -> tuple[int, str | None]:
    """The one anchor rule between a tokenizer and a model config: ``(anchor id, note)``.

    The tokenizer decides (:func:`anchor_token_id`: its BOS; EOS only without a BOS token).
    Where the model's ``config.json`` names another ``bos_token_id`` the tokenizer wins and
    ``note`` records the decision (callers set the config's ``bos_token_id`` to the anchor, so
    a checkpoint written later is consistent, and log or record the note); ``note`` is None
    when they agree. One case is an error instead: a tokenizer without a BOS token for a model
    that declares one (other than that EOS): its BOS went missing, and the EOS fallback would
    give the model an anchor it was never trained with. ``where`` names the model in messages.
    """
    anchor = anchor_token_id(tokenizer)
    declared = getattr(hf_config, "bos_token_id", None)
    if isinstance(declared, list | tuple):
        declared = declared[0] if len(declared) == 1 else (anchor if anchor in declared else None)
    if declared is None or int(declared) == anchor:
        return anchor, None
    if tokenizer.bos_token is None:
        raise AnchorTokenError(
            f"tokenizer {_tokenizer_name(tokenizer)} has no BOS token, but the model "
            f"({where}) declares bos_token_id={declared}: the anchor would be its EOS "
            f"{tokenizer.eos_token!r} (id {anchor}) instead of the BOS the model was trained "
            "with; use the model's own tokenizer (or set its bos_token)"
        )
    return anchor, (
        f"the model config ({where}) names bos_token_id={declared}, the tokenizer "
        f"{_tokenizer_name(tokenizer)} BOS {tokenizer.bos_token!r}={anchor}: the tokenizer's "
        "BOS is the anchor (config bos_token_id set to it)"
    )


def check_trained_anchor(checkpoint: str | Path, anchor: int) -> None:
    """A checkpoint written by anchorctx records the anchor it was trained with
    (``anchorctx.json`` ``anchor_token_id``); another anchor now is an error naming it."""
    meta_path = Path(checkpoint) / META_FILE
    if not meta_path.is_file():
        return
    try:
        trained = read_json(meta_path).get("anchor_token_id")
    except (OSError, ValueError, AttributeError):
        return  # unreadable meta: the checkpoint checks name it where it matters
    if isinstance(trained, int) and trained != anchor:
        raise AnchorTokenError(
            f"checkpoint {checkpoint} was trained with anchor token id {trained} "
            f"({META_FILE}), but its tokenizer now gives {anchor}: restore the checkpoint's "
            "tokenizer files (tokenizer_config.json, special_tokens_map.json)"
        )


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
    model_cfg: ModelConfig,
    *,
    seq_len: int | None,
    vocab_size: int | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> PretrainedConfig:
    """The HF config with the RoPE base override and the position limit it implies.

    With ``tokenizer``, the anchor rule is applied (:func:`anchor_decision`): a tiny model takes
    the tokenizer's special-token ids, and a model directory's ``bos_token_id`` becomes the
    tokenizer's anchor (logged when they differed)."""
    # Imported here: transformers costs seconds to import, which the light callers of this module
    # skip.
    from transformers import AutoConfig

    if model_cfg.path is not None:
        if problem := model_dir_problem(model_cfg.path):
            raise ModelLoadError(f"model.path has {problem}: {model_cfg.path}")
        read_model_config(model_cfg.path)  # transformers' own error names no line or column
        hf = AutoConfig.from_pretrained(str(model_cfg.path))
    else:
        hf = _tiny_config(model_cfg, vocab_size, tokenizer)
    if tokenizer is not None:
        _apply_anchor(hf, tokenizer, model_cfg)
    if model_cfg.rope_theta is not None:
        _set_rope_theta(hf, model_cfg.rope_theta)
    apply_rope_scaling(hf, model_cfg)
    limit = position_limit(model_cfg, seq_len)
    if limit is not None and limit > getattr(hf, "max_position_embeddings", 0):
        hf.max_position_embeddings = int(limit)
    hf.use_cache = False
    return hf


def position_limit(model_cfg: ModelConfig, seq_len: int | None) -> int | None:
    """The position limit a model trained with ``model_cfg`` at ``seq_len`` gets (at least; a
    larger one of the model's own stays): ``model.max_position_embeddings``, else the training
    length when the RoPE base is set for it; None: the model's own."""
    if model_cfg.max_position_embeddings:
        return model_cfg.max_position_embeddings
    extended = model_cfg.rope_theta is not None or model_cfg.rope_scaling.type in ("yarn", "ntk")
    return seq_len if extended else None


def _apply_anchor(
    hf: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, model_cfg: ModelConfig
) -> None:
    where = str(model_cfg.path) if model_cfg.path is not None else "model.tiny"
    anchor, note = anchor_decision(tokenizer, hf, where)
    if model_cfg.path is not None:
        check_trained_anchor(model_cfg.path, anchor)
    if note is not None:
        hf.bos_token_id = anchor
        if note not in _NOTED:  # once per process: training builds the config twice
            _NOTED.add(note)
            log.warning("anchorctx: %s", note)


def rope_type(hf: PretrainedConfig) -> str:
    """The RoPE scaling type of an HF config ("default": plain RoPE), transformers 4 or 5."""
    params = getattr(hf, "rope_parameters", None)
    if not isinstance(params, dict):
        params = getattr(hf, "rope_scaling", None)
    if not isinstance(params, dict):
        return "default"
    return str(params.get("rope_type") or params.get("type") or "default")


def rope_theta(hf: PretrainedConfig) -> float:
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return float(getattr(hf, "rope_theta", None) or 10000.0)


def ntk_theta(theta: float, factor: float, head_dim: int) -> float:
    """NTK-aware scaling as the paper configures it (LocalLLaMA 2023): the base raised by
    ``factor ** (d / (d - 2))``, so the lowest frequency is slowed by ``factor``."""
    return theta * factor ** (head_dim / (head_dim - 2))


def apply_rope_scaling(hf: PretrainedConfig, model_cfg: ModelConfig) -> None:
    """``model.rope_scaling`` on the HF config (see
    :class:`~anchorctx.models.settings.RopeScalingConfig`). The checkpoint's own scaling is kept
    (``keep``), dropped (``none``) or replaced (``yarn``, ``ntk``); each case that changes or
    keeps a checkpoint's non-default scaling under an overridden base is logged once."""
    want = model_cfg.rope_scaling
    where = str(model_cfg.path) if model_cfg.path is not None else "model.tiny"
    had = rope_type(hf)
    if want.type == "keep":
        if had != "default" and model_cfg.rope_theta is not None:
            _note(
                f"model.rope_theta={model_cfg.rope_theta:g} keeps {where}'s {had!r} rope_scaling "
                "(model.rope_scaling.type: keep); set model.rope_scaling.type=none for plain "
                "RoPE with this base"
            )
        return
    theta = rope_theta(hf)
    if want.type == "none":
        _set_rope_parameters(hf, {"rope_type": "default", "rope_theta": theta})
        if had != "default":
            _note(f"dropped {where}'s {had!r} rope_scaling (model.rope_scaling.type: none)")
        return
    if had != "default":
        _note(f"replaced {where}'s {had!r} rope_scaling by {want.type!r} (model.rope_scaling)")
    assert want.factor is not None  # RopeScalingConfig requires it for yarn and ntk
    if want.type == "ntk":
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        raised = ntk_theta(theta, want.factor, head_dim)
        _set_rope_parameters(hf, {"rope_type": "default", "rope_theta": raised})
        _note(
            f"NTK-aware RoPE on {where}: base {theta:g} x {want.factor:g}^({head_dim}/"
            f"{head_dim - 2}) = {raised:.6g}"
        )
        return
    original = want.original_max_position_embeddings or int(hf.max_position_embeddings)
    _set_rope_parameters(
        hf,
        {
            "rope_type": "yarn",
            "factor": float(want.factor),
            "original_max_position_embeddings": original,
            "rope_theta": theta,
        },
    )


def _set_rope_parameters(hf: PretrainedConfig, params: dict[str, Any]) -> None:
    # transformers 5 keeps the base and the scaling in ``rope_parameters`` (``rope_scaling`` is
    # its alias); 4.x keeps ``rope_theta`` and ``rope_scaling`` (None: plain RoPE) apart.
    if isinstance(getattr(hf, "rope_parameters", None), dict):
        hf.rope_parameters = dict(params)
    else:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        hf.rope_scaling = None if scaling["rope_type"] == "default" else scaling
    hf.rope_theta = float(params["rope_theta"])


def _note(note: str) -> None:
    if note not in _NOTED:  # once per process: training builds the config twice
        _NOTED.add(note)
        log.warning("anchorctx: %s", note)


def _set_rope_theta(hf: PretrainedConfig, theta: float) -> None:
    # transformers 5 keeps RoPE settings in ``rope_parameters``; 4.x in ``rope_theta``.
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict):
        params["rope_theta"] = float(theta)
    hf.rope_theta = float(theta)


def _tiny_config(
    model_cfg: ModelConfig,
    vocab_size: int | None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> PretrainedConfig:
    # Imported here: transformers costs seconds to import, which the light callers of this module
    # skip.
    from transformers import AutoConfig

    tiny = model_cfg.tiny
    assert tiny is not None
    vocab = tiny.vocab_size or vocab_size
    if vocab is None:
        raise ModelLoadError("model.tiny.vocab_size unknown: pass the tokenizer's length")
    head_dim = tiny.head_dim or tiny.hidden_size // tiny.num_attention_heads
    # BOS and EOS ids are the tokenizer's (transformers' Llama defaults, bos=1 and eos=2, are
    # another tokenizer's: the demo's has <s>=0, </s>=1), so its checkpoints are consistent.
    # Not pad_token_id: it would zero that embedding row and change the random weights.
    specials = {}
    if tokenizer is not None:
        specials = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
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
        **specials,
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
    hf = build_hf_config(model_cfg, seq_len=seq_len, vocab_size=vocab, tokenizer=tokenizer)
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if model_cfg.path is not None:
        info: dict[str, Any]  # missing / unexpected / mismatched keys
        try:
            # On a GPU the weights are read straight into device memory, not first into host
            # memory and then copied: no host copy of a 7B model per evaluation shard process.
            if torch.device(device).type != "cpu":
                extra["device_map"] = str(device)
            # Mismatched shapes are reported in the loading info (checked below, naming the
            # key) rather than raised after a page-long report; that report is muted.
            with _quiet_load_report():
                # transformers types the return as the model alone, also with
                # output_loading_info=True, which returns (model, loading info).
                model, info = AutoModelForCausalLM.from_pretrained(  # type: ignore[misc]
                    str(model_cfg.path),
                    config=hf,
                    dtype=torch_dtype,
                    output_loading_info=True,
                    ignore_mismatched_sizes=True,
                    **extra,
                )
        except Exception as err:  # SafetensorError, torn or foreign files: name model.path
            detail = " ".join(str(err).split())
            raise ModelFileError(
                f"cannot load the weights in model.path {model_cfg.path} ({type(err).__name__}: "
                f"{detail}); they may be truncated or corrupt"
            ) from err
        check_loaded_weights(model_cfg.path, info)
    else:
        assert model_cfg.tiny is not None
        torch.manual_seed(model_cfg.tiny.init_seed)  # the same tiny weights on every rank
        model = AutoModelForCausalLM.from_config(hf, dtype=torch_dtype, **extra)
    if model_cfg.rope_fp32:
        # The ablation of the paper's Section 2: rotate q/k in float32 inside bf16 training.
        # Anything that wraps attention by name must then use attention_name(model).
        model = enable_fp32_rope(model)
    return model.to(device)


@contextlib.contextmanager
def _quiet_load_report() -> Iterator[None]:
    """Mute transformers' weight-loading report (a table on stderr): its findings are raised by
    :func:`check_loaded_weights` as one line."""
    logger = logging.getLogger("transformers.modeling_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _natural(key: str) -> list:
    """Sort key: ``layers.2`` before ``layers.10``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


def check_loaded_weights(path: str | Path, info: dict) -> None:
    """The checkpoint's tensors are exactly the model's: none missing (they would be randomly
    initialised), none unexpected (dropped: e.g. a ``config.json`` with fewer layers than the
    weights) and every shape equal. ``info`` is transformers' ``output_loading_info`` (which
    already accounts for tied embeddings and the buffers it recomputes). Raises
    :class:`ModelFileError` naming ``path`` and the first offending key."""
    problems = []
    missing = sorted(info.get("missing_keys") or (), key=_natural)
    unexpected = sorted(info.get("unexpected_keys") or (), key=_natural)
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda m: _natural(m[0]))
    if unexpected:
        problems.append(
            f"{len(unexpected)} tensor(s) in the weights that config.json has no place for "
            f"(first: {unexpected[0]}; they would be dropped)"
        )
    if missing:
        problems.append(
            f"{len(missing)} tensor(s) config.json needs but the weights lack (first: "
            f"{missing[0]}; they would be random)"
        )
    if mismatched:
        key, theirs, ours = [*mismatched[0], None, None][:3]
        shapes = f": weights {_shape(theirs)}, config.json {_shape(ours)}" if ours else ""
        problems.append(f"{len(mismatched)} tensor(s) of another shape (first: {key}{shapes})")
    if problems:
        raise ModelFileError(
            f"checkpoint {path}: its weights do not match its config.json: "
            f"{'; '.join(problems)}; fix config.json (layers, sizes) or use the matching weights"
        )


def _shape(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]" if shape is not None else "?"
