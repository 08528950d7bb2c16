"""Training as a child process group, streamed into the Prefect run log.

The task writes the arm's resolved config beside the run directory and runs
``python -m anchorctx train CONFIG [--resume/--force]`` (which itself launches torchrun when the
config asks for several processes). See :mod:`anchorctx.tasks.process` for how the process tree
is killed on cancellation, crash or deadline.
"""

from __future__ import annotations

import sys
from pathlib import Path

from prefect import get_run_logger, task

from anchorctx.config import ExperimentConfig, dump_config
from anchorctx.io import read_jsonl
from anchorctx.tasks.artifacts import Progress, artifact_key
from anchorctx.tasks.caching import train_cache_key
from anchorctx.tasks.process import run_process_group


def train_command(config_path: Path, *, resume: bool, fresh: bool = False) -> list[str]:
    """``fresh`` -> ``--force`` (the child moves an earlier run aside, under the run lock);
    else ``resume`` -> ``--resume``; neither: a run directory holding a run is an error."""
    cmd = [sys.executable, "-m", "anchorctx", "train", str(config_path)]
    if fresh:
        return [*cmd, "--force"]
    return [*cmd, "--resume"] if resume else cmd


def task_config_path(cfg: ExperimentConfig) -> Path:
    """Where the task writes the arm's config for the child: beside the run directory, not in
    it (the child may move an earlier run aside, and writes ``config.yaml`` itself)."""
    return cfg.experiment_dir / f".{cfg.variant_name}.task-config.yaml"


def last_step(metrics_path: Path) -> int:
    """The newest training step in ``metrics.jsonl`` (0 before the first log line)."""
    steps = [row["step"] for row in read_jsonl(metrics_path) if isinstance(row.get("step"), int)]
    return max(steps, default=0)


def list_checkpoint_paths(run_dir: Path) -> list[str]:
    from anchorctx.training.checkpoints import list_checkpoints

    return [str(p) for p in list_checkpoints(run_dir)] if run_dir.is_dir() else []


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
    finished one returns at once; ``fresh`` renames an earlier run directory aside first
    (``train --force``, done by the child while it holds the run directory's lock).
    """
    logger = get_run_logger()
    run_dir = cfg.run_dir
    config_path = task_config_path(cfg)
    dump_config(cfg, config_path)
    cmd = train_command(config_path, resume=resume, fresh=fresh)
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
