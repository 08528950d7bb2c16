"""The ``model`` section: which model an experiment trains (a Hugging Face directory or an
in-config random model), its tokenizer, dtype and RoPE options. Read by
:mod:`anchorctx.models.loading`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from anchorctx.config import Dtype, Seed, Strict


class TinyModelConfig(Strict):
    """A randomly initialised model defined in the config (demo, tests, benchmarks)."""

    architecture: Literal["llama", "mistral", "qwen2"] = "llama"
    hidden_size: int = Field(64, gt=0)
    intermediate_size: int = Field(128, gt=0)
    num_hidden_layers: int = Field(2, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_key_value_heads: int = Field(2, gt=0)
    head_dim: int | None = Field(
        None, gt=0, description="Default: hidden_size // num_attention_heads (even: RoPE)."
    )
    vocab_size: int | None = Field(None, gt=0, description="Default: the tokenizer's length.")
    init_seed: Seed = 0

    @model_validator(mode="after")
    def _shapes_fit(self) -> TinyModelConfig:
        """The shape rules transformers enforces when it builds the model (after pages of its
        own output), checked when the config is read; each message starts with the key."""
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads} (grouped-query attention)"
            )
        if self.hidden_size % self.num_attention_heads:  # LlamaConfig.validate_architecture
            raise ValueError(
                f"hidden_size={self.hidden_size} must be a multiple of "
                f"num_attention_heads={self.num_attention_heads}"
            )
        head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if head_dim % 2:  # RoPE rotates pairs of dimensions
            key = "head_dim" if self.head_dim else "hidden_size"
            raise ValueError(
                f"{key}={getattr(self, key)} gives head_dim={head_dim}; RoPE needs an even "
                "head_dim (hidden_size / num_attention_heads)"
            )
        return self


class RopeScalingConfig(Strict):
    """``model.rope_scaling``: the RoPE extension method (paper Table 2), applied where the HF
    config is built (:func:`anchorctx.models.loading.build_hf_config`) and saved with every
    checkpoint, so evaluation uses what training used.

    - ``keep`` (default): the checkpoint's own ``rope_scaling`` (e.g. Llama-3.1's ``llama3``)
      stays, also when ``model.rope_theta`` overrides the base; that case is logged once.
    - ``none``: drop the checkpoint's ``rope_scaling``: plain RoPE with the (possibly
      overridden) base, as the paper's "base 1e7" on Llama-3-8B means.
    - ``yarn``: transformers' ``yarn`` scaling with ``factor`` over
      ``original_max_position_embeddings`` (paper: 16 = 64K / 4K for Llama-2).
    - ``ntk``: NTK-aware scaling as the paper configures it: the base is raised to
      ``base * factor ** (d / (d - 2))`` (d: head dimension), positions are not scaled.
    """

    type: Literal["keep", "none", "yarn", "ntk"] = "keep"
    factor: float | None = Field(
        None, gt=1, description="yarn / ntk: new length / original length (paper: 16)."
    )
    original_max_position_embeddings: int | None = Field(
        None,
        gt=0,
        description="yarn: the pretrained context length. Default: the checkpoint's "
        "max_position_embeddings before any override.",
    )

    @model_validator(mode="after")
    def _factor_fits_type(self) -> RopeScalingConfig:
        if self.type in ("yarn", "ntk") and self.factor is None:
            raise ValueError(f"factor is required with type={self.type!r} (e.g. 16)")
        if self.type in ("keep", "none") and self.factor is not None:
            raise ValueError(f"factor={self.factor} applies only to type yarn or ntk")
        if self.type != "yarn" and self.original_max_position_embeddings is not None:
            raise ValueError("original_max_position_embeddings applies only to type yarn")
        return self


class ModelConfig(Strict):
    path: Path | None = Field(None, description="Local Hugging Face model directory.")
    tiny: TinyModelConfig | None = Field(None, description="In-config random model (demo/tests).")
    tokenizer: Path | None = Field(
        None, description="Tokenizer directory. Default: model.path. Required with model.tiny."
    )
    rope_theta: float | None = Field(None, gt=0, description="RoPE base override (Table 1).")
    max_position_embeddings: int | None = Field(
        None, gt=0, description="Default when rope_theta is overridden: data.seq_len."
    )
    rope_scaling: RopeScalingConfig = Field(
        default_factory=RopeScalingConfig,
        description="RoPE extension (Table 2): keep | none | yarn | ntk; see RopeScalingConfig.",
    )
    dtype: Dtype = "bfloat16"
    rope_fp32: bool = Field(
        False,
        description="Apply RoPE to q/k in float32 inside a bf16 model, rounding the rotated q/k "
        "to bf16 once (anchorctx.models.rope.enable_fp32_rope). A no-op in float32.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.path is None) == (self.tiny is None):
            raise ValueError("set exactly one of model.path or model.tiny")
        if self.tiny is not None and self.tokenizer is None:
            raise ValueError("model.tiny needs model.tokenizer (e.g. the demo corpus tokenizer)")
        return self

    @property
    def tokenizer_path(self) -> Path:
        return self.tokenizer if self.tokenizer is not None else self.path  # type: ignore[return-value]
