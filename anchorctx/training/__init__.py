"""Training: model loading, DeepSpeed ZeRO + Ulysses sequence parallelism with the anchorctx
attention, the step loop, loss, checkpoints, metrics and the launcher.

``train(cfg, resume=False)`` runs in this process (one rank); ``launch(cfg, resume=False,
force=False)`` is what ``anchorctx train`` calls: in-process for one process, torchrun/DeepSpeed
for more. Both hold the run directory's writer lock and refuse to restart an existing run
silently (``resume`` continues it; ``force`` moves it aside first).
Heavy imports happen on first call so ``import anchorctx.training`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    from anchorctx.config import ExperimentConfig

__all__ = ["launch", "train"]


def train(
    cfg: ExperimentConfig,
    *,
    resume: bool = False,
    data_dir: Path | None = None,
    hold_lock: bool = True,
) -> dict[str, Any]:
    from anchorctx.training.loop import train as _train

    return _train(cfg, resume=resume, data_dir=data_dir, hold_lock=hold_lock)


def launch(cfg: ExperimentConfig, *, resume: bool = False, force: bool = False) -> int:
    from anchorctx.training.launch import launch as _launch

    return _launch(cfg, resume=resume, force=force)
