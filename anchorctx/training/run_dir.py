"""The run directory's writer lock, apart from the training loop.

The launcher takes it before anything is written and the flow's training task takes it around
its renames (:mod:`anchorctx.tasks.training`); neither imports torch, transformers or DeepSpeed
for it (the loop module does: ~6 s of imports in every flow process that trains).
"""

from __future__ import annotations

from anchorctx.experiment import ExperimentConfig
from anchorctx.io import WriterLock


def run_lock(cfg: ExperimentConfig) -> WriterLock:
    """The writer lock of the run directory (``.<variant>.lock`` beside it)."""
    return WriterLock.beside(cfg.run_dir, f"run directory {cfg.run_dir}")
