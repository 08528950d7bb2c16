"""Training as a child process group, streamed into the Prefect run log.

The task writes the arm's resolved config beside the run directory and runs
``python -m anchorctx train CONFIG [--resume]`` (which itself launches torchrun when the config
asks for several processes; the child holds the run directory's writer lock). See
:mod:`anchorctx.process` for how the process tree is killed on cancellation, crash or
deadline.
"""

from __future__ import annotations

import sys
from pathlib import Path

from prefect import get_run_logger, task

from anchorctx.config import dump_config
from anchorctx.experiment import ExperimentConfig
from anchorctx.io import move_aside, read_jsonl
from anchorctx.models.checkpoints import list_checkpoints
from anchorctx.process import run_process_group
from anchorctx.tasks.artifacts import Progress, artifact_key
from anchorctx.tasks.caching import train_cache_key
from anchorctx.training.run_dir import run_lock


def train_command(config_path: Path, *, resume: bool) -> list[str]:
    """``resume`` -> ``--resume``; without it a run directory holding a run is an error (a
    forced task run has moved the earlier run out of the way first)."""
    cmd = [sys.executable, "-m", "anchorctx", "train", str(config_path)]
    return [*cmd, "--resume"] if resume else cmd


def task_config_path(cfg: ExperimentConfig) -> Path:
    """Where the task writes the arm's config for the child: beside the run directory, not in
    it (an earlier run's ``config.yaml`` stays as it was until the child accepts the restart)."""
    return cfg.experiment_dir / f".{cfg.variant_name}.task-config.yaml"


def last_step(metrics_path: Path) -> int:
    """The newest training step in ``metrics.jsonl`` (0 before the first log line)."""
    steps = [row["step"] for row in read_jsonl(metrics_path) if isinstance(row.get("step"), int)]
    return max(steps, default=0)


def list_checkpoint_paths(run_dir: Path) -> list[str]:
    return [str(p) for p in list_checkpoints(run_dir)] if run_dir.is_dir() else []


def checkpoints_exist(checkpoints: list[str]) -> bool:
    """Every checkpoint a (cached) training run returned is still on disk."""
    return all(Path(c).is_dir() for c in checkpoints)


def previous_dir(run_dir: Path) -> Path:
    """Where a forced run keeps the previous run until it has replaced it."""
    return run_dir.with_name(f"{run_dir.name}.previous")


def restore_previous(run_dir: Path) -> Path | None:
    """Undo an unfinished forced run: its partial directory goes to ``<run>.failed-<time>``
    and the previous run comes back. Returns the restored directory (None: nothing to undo)."""
    previous = previous_dir(run_dir)
    if not previous.is_dir():
        return None
    move_aside(run_dir, "failed")
    previous.rename(run_dir)
    return run_dir


@task(name="train", cache_key_fn=train_cache_key, persist_result=True, result_serializer="json")
def train_task(
    cfg: ExperimentConfig,
    dataset: str,
    resume: bool = True,
    timeout_s: float | None = None,
    fresh: bool = False,
    gpus: list[str] | None = None,
) -> list[str]:
    """Train one arm in a child process group; returns its checkpoint directories.

    ``dataset`` (the packed dataset directory) is part of the cache key: a re-packed dataset
    retrains. With ``resume`` an interrupted run continues from ``<run_dir>/resume`` and a
    finished one returns at once; ``fresh`` trains from scratch while the earlier run directory
    waits as ``<run>.previous``: renamed ``<run>.old-<time>`` once the new run finishes, put
    back if it does not. ``gpus``: the device ids the child may use (``CUDA_VISIBLE_DEVICES``;
    default: every visible GPU).
    """
    logger = get_run_logger()
    run_dir = cfg.run_dir
    # The renames below happen while holding the run directory's lock (released just before
    # the child takes it): never move a run directory that another process is writing.
    with run_lock(cfg):
        if restore_previous(run_dir) is not None:  # a forced run was killed before it undid
            logger.warning(
                "an unfinished forced run was undone: previous run restored in %s", run_dir
            )
        # Forced: the previous run waits beside the new one and comes back if the new one does
        # not finish (cancelled, crashed, timed out): a forced run never leaves a run without
        # results.
        if fresh and run_dir.exists():
            run_dir.rename(previous_dir(run_dir))
            logger.info(
                "forced: training from scratch; previous run kept in %s until this one finishes",
                previous_dir(run_dir),
            )
    if not fresh:
        return _train(cfg, dataset, resume, timeout_s, gpus)
    try:
        checkpoints = _train(cfg, dataset, resume, timeout_s, gpus)
    except BaseException:
        if restore_previous(run_dir) is not None:
            logger.warning("forced run did not finish: previous run restored in %s", run_dir)
        raise
    if (old := move_aside(run_dir, source=previous_dir(run_dir))) is not None:
        logger.info("previous run moved aside to %s", old)
    return checkpoints


def _train(
    cfg: ExperimentConfig,
    dataset: str,
    resume: bool,
    timeout_s: float | None,
    gpus: list[str] | None,
) -> list[str]:
    logger = get_run_logger()
    run_dir = cfg.run_dir
    config_path = task_config_path(cfg)
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

    env = {"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus is not None else None
    run_process_group(cmd, on_line=logger.info, on_tick=tick, timeout_s=timeout_s, env=env)
    progress.update(1.0, force=True)
    checkpoints = list_checkpoint_paths(run_dir)
    logger.info("%d checkpoint(s) in %s", len(checkpoints), run_dir / "checkpoints")
    return checkpoints
