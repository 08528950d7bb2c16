"""The ``analysis`` section: the BF16 RoPE precision study (paper Section 2). Read by
:mod:`anchorctx.analysis.rope_precision`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from anchorctx.config import Device, Strict

# The paper's Figure 1 / Eq. 4 shift list (Δ1 values, with Δ2 = 16).
PAPER_SHIFTS = [0, 2, 4, 6, 8, 10, 12, 14, 15, 16, 17, 18, 20, 22, 50, 100, 200, 500, 1000, 2000]


class RopePrecisionConfig(Strict):
    """The BF16 RoPE precision study (paper Section 2, Figure 1; ``anchorctx rope-precision``)."""

    shifts: list[int] = Field(
        default_factory=lambda: list(PAPER_SHIFTS), description="Δ1 values of Eq. 4 (≥ 0)."
    )
    delta2: int = Field(16, ge=0, description="Reference shift Δ2 of Eq. 4.")
    compare_shift: int = Field(
        0, ge=0, description="Δ1 of the per-token split (Fig. 1 middle) and of D_logit (Eq. 5)."
    )
    seq_len: int = Field(4096, gt=1, description="Tokens per sequence for the shift curve.")
    num_sequences: int = Field(50, gt=0)
    lengths: list[int] = Field(
        default_factory=lambda: [64, 128, 256, 512, 1024, 2048, 4096, 8192],
        description="Sequence lengths of the first-token logit difference (Fig. 1 right).",
    )
    precisions: list[Literal["bf16", "fp32", "bf16_rope_fp32"]] = Field(
        default_factory=lambda: ["bf16", "bf16_rope_fp32", "fp32"],  # type: ignore[arg-type]  # mypy infers a plain list, not the Literal items
        description="bf16_rope_fp32: bf16 model with model.rope_fp32 (RoPE applied in fp32).",
    )
    text_files: list[Path] = Field(
        default_factory=list, description="Text inputs; default: the packed dataset."
    )
    random_init: bool = Field(False, description="Ignore model.path weights: random init.")
    device: Device = "auto"
    in_report: bool = Field(
        False,
        description="full-experiment (and `anchorctx report`) also runs the study on the "
        "experiment's model and shows its figure in the report; off by default because at "
        "the paper's settings it takes GPU-hours.",
    )
    learned_weights: bool = Field(
        True,
        description="With in_report: also measure random init, the pretrained base model and "
        "every arm's final checkpoint, each with and without the anchor token, at "
        "compare_shift only (two passes per sequence, mode and input; seq_len and "
        "num_sequences apply).",
    )

    @model_validator(mode="after")
    def _valid_positions(self) -> RopePrecisionConfig:
        if not self.shifts or min(self.shifts) < 0:
            raise ValueError(f"shifts must be a non-empty list of values >= 0 (got {self.shifts})")
        if not self.lengths or min(self.lengths) < 2:
            raise ValueError(
                f"lengths must be a non-empty list of values >= 2 (got {self.lengths})"
            )
        if not self.precisions or len(set(self.precisions)) != len(self.precisions):
            raise ValueError(f"precisions must be non-empty and distinct (got {self.precisions})")
        return self


class AnalysisConfig(Strict):
    rope_precision: RopePrecisionConfig = Field(default_factory=RopePrecisionConfig)
