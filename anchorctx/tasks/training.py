"""Training as a child process group, streamed into the Prefect run log.

The task writes the arm's resolved config to ``<run_dir>/config.yaml`` and runs
``python -m anchorctx train <run_dir>/config.yaml`` (which itself launches torchrun when the
config asks for several processes). See :mod:`anchorctx.tasks.process` for how the process tree
is killed on cancellation, crash or deadline.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from prefect import get_run_logger, task

from anchorctx.config import ExperimentConfig, dump_config
from anchorctx.io import read_jsonl
from anchorctx.tasks.artifacts import Progress, artifact_key
from anchorctx.tasks.caching import train_cache_key
from anchorctx.tasks.process import run_process_group


def train_command(config_path: Path, *, resume: bool) -> list[str]:
    cmd = [sys.executable, "-m", "anchorctx", "train", str(config_path)]
    return [*cmd, "--resume"] if resume else cmd


def last_step(metrics_path: Path) -> int:
    """The newest training step in ``metrics.jsonl`` (0 before the first log line)."""
    steps = [row["step"] for row in read_jsonl(metrics_path) if isinstance(row.get("step"), int)]
    return max(steps, default=0)


def list_checkpoint_paths(run_dir: Path) -> list[str]:
    from anchorctx.training.checkpoints import list_checkpoints

    return [str(p) for p in list_checkpoints(run_dir)] if run_dir.is_dir() else []


def move_aside(run_dir: Path) -> Path | None:
    """Rename an earlier run out of the way (never delete results): ``<run>.old-<time>``."""
    if not run_dir.exists():
        return None
    target = run_dir.with_name(f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.rename(target)
    return target


@task(name="train", cache_key_fn=train_cache_key, persist_result=True, result_serializer="json")
def train_task(
    cfg: ExperimentConfig,
    dataset: str,
    resume: bool = True,
    timeout_s: float | None = None,
    fresh: bool = False,
) -> list[str]:
    """Train one arm in a child process group; returns its checkpoint directories.

    ``dataset`` (the packed dataset directory) is part of the cache key: a re-packed dataset
    retrains. With ``resume`` an interrupted run continues from ``<run_dir>/resume`` and a
    finished one returns at once; ``fresh`` first renames an earlier run directory aside.
    """
    logger = get_run_logger()
    run_dir = cfg.run_dir
    if fresh and (old := move_aside(run_dir)) is not None:
        logger.warning("earlier run moved aside to %s", old)
    config_path = run_dir / "config.yaml"
    dump_config(cfg, config_path)
    cmd = train_command(config_path, resume=resume)
    logger.info("launching: %s", " ".join(cmd))
    progress = Progress(
        artifact_key("train", cfg.name, cfg.variant_name),
        f"Training {cfg.name}/{cfg.variant_name}: share of {cfg.training.steps} steps done",
    )
    metrics = run_dir / "metrics.jsonl"

    def tick() -> None:
        progress.update(last_step(metrics) / cfg.training.steps)

    run_process_group(cmd, on_line=logger.info, on_tick=tick, timeout_s=timeout_s)
    progress.update(1.0, force=True)
    checkpoints = list_checkpoint_paths(run_dir)
    logger.info("%d checkpoint(s) in %s", len(checkpoints), run_dir / "checkpoints")
    return checkpoints
