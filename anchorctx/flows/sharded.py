"""Evaluation over every GPU of the host: (checkpoint × suite × unit) shards, one worker per GPU.

Called from a flow. Pairs with an up-to-date result are skipped (the cached re-run); the rest
are split by :func:`anchorctx.evaluation.sharding.plan_shards` into as many shards as GPUs
evaluation has (those training holds, full-experiment's overlap, excluded), all shards of all
pairs run on a thread pool as wide as the GPU pool (each in the evaluation worker of one GPU,
kept for later calls within :func:`~anchorctx.tasks.sharding.evaluation_workers`); the
shard that completes a pair merges it and writes its result. The records, hence the
scores, are the same whatever the number of GPUs (see :mod:`anchorctx.evaluation.sharding`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from prefect.task_runners import ThreadPoolTaskRunner

from anchorctx.evaluation.results import checkpoint_hash_token, get_suite, result_path
from anchorctx.evaluation.sharding import is_done, plan_shards, prepare
from anchorctx.experiment import ExperimentConfig
from anchorctx.io import atomic_write_text
from anchorctx.tasks.sharding import (
    evaluate_shard_task,
    evaluation_gpus,
    evaluation_workers,
    finalize_task,
    gpu_slots,
)


def config_file(cfg: ExperimentConfig) -> Path:
    """The config as JSON for the shard processes, named by its content."""
    text = cfg.model_dump_json(indent=2)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    path = cfg.run_dir / "eval" / f"config-{digest}.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text + "\n")
    return path


def wait_all(futures: list, what: str) -> list:
    for f in futures:
        f.wait()
    failed = [f.state.message or str(f.task_run_id) for f in futures if f.state.is_failed()]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(futures)} {what} failed: {failed[:3]}")
    return [f.result() for f in futures]


def evaluate_sharded(
    cfg: ExperimentConfig,
    checkpoints: Sequence[str],
    suites: Sequence[str],
    force: bool,
    gpus: Sequence[str],
) -> list[str]:
    """Result paths of every (checkpoint, suite) pair, evaluated over ``gpus``."""
    pairs = [(str(c), s) for c in checkpoints for s in suites]
    todo = [(c, s) for c, s in pairs if prepare(cfg, c, s, force)]
    if todo:
        config_json = str(config_file(cfg))
        slots = gpu_slots(list(gpus))
        count = evaluation_gpus(slots)
        # prepare() hashed each checkpoint here: the shards take the hash instead of reading it.
        hashes = {c: checkpoint_hash_token(c) for c in {c for c, _ in todo}}
        with evaluation_workers(), ThreadPoolTaskRunner[str](max_workers=len(gpus)) as runner:
            shards = [
                runner.submit(evaluate_shard_task, params)
                for c, s in todo
                for params in _shard_params(
                    config_json, c, s, plan_shards(cfg, s, count), slots, checkpoint_hash=hashes[c]
                )
            ]
            wait_all(shards, "evaluation shards")
            # The shard that completed a pair merged it already; a merge task is left only
            # where that did not happen (e.g. shards resumed from another attempt's records).
            merges = [
                runner.submit(
                    finalize_task,
                    {"config_json": config_json, "checkpoint": c, "suite": s, "slots": slots},
                )
                for c, s in todo
                if not is_done(cfg, c, s)
            ]
            wait_all(merges, "evaluation merges")
    return [str(result_path(c, s, cfg)) for c, s in pairs]


def _shard_params(
    config_json: str, checkpoint: str, suite: str, plan: list[list[str]], slots: str, **how
) -> list[dict]:
    """:func:`~anchorctx.tasks.sharding.evaluate_shard_task`'s parameters for each shard of
    ``plan`` (``how``: its other options)."""
    return [
        {
            "config_json": config_json,
            "checkpoint": checkpoint,
            "suite": suite,
            "index": i,
            "count": len(plan),
            "units": units,
            "slots": slots,
            **how,
        }
        for i, units in enumerate(plan)
    ]


def compile_sharded(
    cfg: ExperimentConfig, checkpoint: str, suites: Sequence[str], gpus: Sequence[str]
) -> list[str]:
    """Compile ahead, over ``gpus``, what an evaluation of ``suites`` planned now would compile:
    one compile-only pass (:func:`anchorctx.evaluation.sharding.compile_shard`) per shard of
    each suite that decodes, with ``checkpoint`` (a model of the evaluated architecture). The
    shards are planned as :func:`evaluate_sharded` plans them (as many as GPUs evaluation has
    now), so the passes compile the batch shapes the shards will decode, spread over the GPUs
    as the shards will be. Returns each pass' last output line."""
    slots = gpu_slots(list(gpus))
    count = evaluation_gpus(slots)
    config_json = str(config_file(cfg))
    with evaluation_workers(), ThreadPoolTaskRunner[str](max_workers=len(gpus)) as runner:
        passes = [
            runner.submit(evaluate_shard_task, params)
            for s in suites
            if get_suite(s).decodes
            for params in _shard_params(
                config_json, checkpoint, s, plan_shards(cfg, s, count), slots, compile_only=True
            )
        ]
        return wait_all(passes, "compile-ahead passes")
