"""What evaluation applies on top of a checkpoint's own config, and where its results go: the
one rule every path that loads an evaluation model follows (the suites through
:func:`anchorctx.evaluation.results.cached_model`, the lm-eval model ``anchorctx`` given a
checkpoint directory and ``config=``). Light (no torch), so both may import it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from anchorctx.experiment import ExperimentConfig


def is_external(checkpoint: str | Path, cfg: ExperimentConfig) -> bool:
    """Whether the checkpoint's own ``eval`` directory (``checkpoint.parent.parent/eval``) lies
    outside ``cfg.run_root``: then its results go under the experiment directory instead."""
    run_dir = Path(checkpoint).resolve().parent.parent
    root = Path(cfg.run_root).resolve()
    return run_dir != root and root not in run_dir.parents


def eval_model_overrides(cfg: ExperimentConfig, checkpoint: str | Path) -> dict[str, Any]:
    """``model.*`` settings evaluation applies on top of the checkpoint's config: for a checkpoint
    outside the run (``evaluate --checkpoint``: a base model) with ``model.rope_scaling`` set to
    other than ``keep``, that scaling and ``model.max_position_embeddings`` (Table 2's Free*
    YaRN / NTK rows: the base model with a RoPE extension and no training). A run's own
    checkpoints carry the RoPE their training used in their config.json, so nothing is applied
    to them (a second YaRN would scale over the already extended length)."""
    rope = cfg.model.rope_scaling
    if rope.type == "keep" or not is_external(checkpoint, cfg):
        return {}
    out: dict[str, Any] = {"rope_scaling": rope.model_dump(mode="json", exclude_none=True)}
    if cfg.model.max_position_embeddings:
        out["max_position_embeddings"] = cfg.model.max_position_embeddings
    return out
