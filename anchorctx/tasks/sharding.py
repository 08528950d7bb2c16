"""Evaluation shards as Prefect tasks: each one runs in the evaluation worker of one free GPU.

GPU slots are a per-flow-process pool of device ids: a task takes one, runs its shard in that
GPU's worker (:class:`anchorctx.evaluation.worker.EvalWorker`, a child process with
``CUDA_VISIBLE_DEVICES`` set to it, so it sees one GPU as ``cuda:0``) and gives the slot back.
A worker lives from its GPU's first shard to the end of the flow (:func:`evaluation_workers`),
so its imports and compiled decode steps serve every later shard, compile-ahead passes
included. Training on its GPU has it release its memory first but keep its CUDA context and
what is compiled (:func:`take_gpus`, :func:`release_workers`), so the evaluation after the
training starts warm; that holds on one GPU too, where the flow evaluates through this module
as on several.
The flow runs these tasks on a thread pool as wide as the pool, so every GPU stays busy.
full-experiment holds its training GPUs out of the same pool while training (so evaluation
shards run on the others) and returns them when training ends.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from prefect import get_run_logger, task
from prefect.exceptions import MissingContextError
from prefect.runtime import task_run

from anchorctx.evaluation.worker import EvalWorker
from anchorctx.process import ProcessFailed

_POOLS: dict[str, queue.Queue[str]] = {}
_HELD: dict[str, int] = {}  # per pool: device ids training holds out of it (take_gpus)
_WORKERS: dict[str, EvalWorker] = {}  # per device id: its evaluation worker (one a GPU)
_LOCK = threading.Lock()


def visible_gpus() -> list[str]:
    """Device ids this process may use: ``CUDA_VISIBLE_DEVICES`` if set, else every GPU."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    # Imported here: torch costs seconds to import; only counting GPUs without CUDA_VISIBLE_DEVICES
    # needs it.
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def gpu_slots(gpus: Sequence[str]) -> str:
    """A pool holding ``gpus``; returns its name (task parameters must stay plain data)."""
    name = ",".join(gpus)
    with _LOCK:
        if name not in _POOLS:
            pool: queue.Queue[str] = queue.Queue()
            for gpu in gpus:
                pool.put(gpu)
            _POOLS[name] = pool
    return name


def take_gpus(slots: str, count: int) -> list[str]:
    """Hold ``count`` device ids of the pool (waiting for them to be free) until
    :func:`give_gpus`; shards meanwhile run on the rest. Their evaluation workers release their
    memory for training (:func:`release_workers`)."""
    pool = _POOLS[slots]
    taken = [pool.get() for _ in range(count)]
    with _LOCK:
        _HELD[slots] = _HELD.get(slots, 0) + count
    release_workers(taken)
    return taken


def give_gpus(slots: str, gpus: Sequence[str]) -> None:
    """Return held device ids: shards waiting for a slot start on them at once."""
    with _LOCK:
        _HELD[slots] = _HELD.get(slots, 0) - len(gpus)
    for gpu in gpus:
        _POOLS[slots].put(gpu)


def evaluation_gpus(slots: str) -> int:
    """How many of the pool's GPUs evaluation has now: all of them but those training holds
    (at least one). An evaluation planned while training holds GPUs is split into this many
    shards, not one per GPU of the pool: its shards could only queue on the GPUs left, each
    paying its own setup and model load (~30 s for a 147M model on an H100 with a process per
    shard, run 10 in docs/runs/2026-11-26-run-10-three-seeds.md; 0.4-3.8 s in a GPU's worker), and
    arms waiting behind it take the freed GPUs instead."""
    total = len(slots.split(","))
    with _LOCK:
        return min(total, max(1, total - _HELD.get(slots, 0)))


@dataclass(frozen=True)
class TrainingGpus:
    """full-experiment's GPUs while arms train: ``held`` (training's, possibly none: training
    on CPU) are out of the slot pool of ``gpus``, every GPU evaluation shards draw from."""

    gpus: list[str]
    held: list[str]


@contextmanager
def hold_training_gpus(gpus: Sequence[str], count: int) -> Iterator[TrainingGpus]:
    """Hold ``count`` GPUs of the slot pool of ``gpus`` for training for the block (the
    schedule's overlap, ``evaluation.schedule.Overlap``), so evaluation shards meanwhile run on
    the others. On exit, even on failure, they go back: shards waiting for a slot start on them
    at once."""
    slots = gpu_slots(gpus)
    held = take_gpus(slots, count)
    try:
        yield TrainingGpus(list(gpus), held)
    finally:
        give_gpus(slots, held)


def shard_args(
    config_json: str | Path,
    checkpoint: str,
    suite: str,
    *,
    shard: tuple[int, int] | None,
    units: Sequence[str] = (),
    merge: bool = False,
    compile_only: bool = False,
    checkpoint_hash: str | None = None,
) -> list[str]:
    """The arguments of ``python -m anchorctx.evaluation.sharding`` for one shard (``shard``:
    index and count) or the merge (None). ``merge``: the shard that completes the evaluation
    also merges it (saves a model load per evaluation; the merge task then finds the result
    done). ``compile_only``: the shard's compile-ahead pass instead (``sharding.compile_shard``).
    ``checkpoint_hash``: the checkpoint's hash token (``results.checkpoint_hash_token``), so
    the shard does not read the checkpoint again to hash it."""
    args = ["--config", str(config_json), "--checkpoint", checkpoint, "--suite", suite]
    if checkpoint_hash:
        args += ["--checkpoint-hash", checkpoint_hash]
    if shard is None:
        return [*args, "--finalize"]
    merging = ["--finalize-when-complete"] if merge else []
    merging += ["--compile-only"] if compile_only else []
    return [*args, "--shard", str(shard[0]), str(shard[1]), *merging, "--units", *units]


def shard_command(config_json: str | Path, checkpoint: str, suite: str, **how) -> list[str]:
    """:func:`shard_args` as a command of its own process (a work pool's worker runs it)."""
    args = shard_args(config_json, checkpoint, suite, **how)
    return [sys.executable, "-m", "anchorctx.evaluation.sharding", *args]


def _worker(gpu: str) -> EvalWorker:
    with _LOCK:
        if gpu not in _WORKERS:
            _WORKERS[gpu] = EvalWorker(gpu)
        return _WORKERS[gpu]


def _logger() -> logging.Logger | logging.LoggerAdapter:
    """The run's logger (shown in the UI), or this module's outside a flow or task run."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


def _workers_of(gpus: Sequence[str] | None) -> list[EvalWorker]:
    with _LOCK:
        return [w for g, w in _WORKERS.items() if gpus is None or g in gpus]


def close_workers(gpus: Sequence[str] | None = None) -> None:
    """End the evaluation workers of ``gpus`` (default: all), freeing all their GPU memory; a
    later shard on such a GPU starts a new one."""
    for worker in _workers_of(gpus):
        worker.close()


def release_workers(gpus: Sequence[str] | None = None) -> None:
    """Before training takes ``gpus`` (default: all): their evaluation workers drop their
    models and free their GPU memory but their CUDA contexts (``EvalWorker.release``); one
    that fails to is ended instead. The lines they print go to the run's log."""
    logger = _logger()
    for worker in _workers_of(gpus):
        try:
            for line in worker.release():
                logger.info("[gpu %s] %s", worker.gpu, line)
        except ProcessFailed as err:
            logger.warning("[gpu %s] release failed, ending the worker: %s", worker.gpu, err)
            worker.close()


_SCOPES = [0]  # open evaluation_workers blocks in this process


@contextmanager
def evaluation_workers() -> Iterator[None]:
    """The lifetime of this process' evaluation workers: they end when the outermost such
    block exits (a flow that evaluates: full-experiment, evaluate), failed or cancelled too."""
    with _LOCK:
        _SCOPES[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _SCOPES[0] -= 1
            last = _SCOPES[0] == 0
        if last:
            close_workers()


def _run_on_gpu(args: list[str], slots: str) -> str:
    """Run the sharding command ``args`` in the evaluation worker of a free GPU of the pool;
    its last output line (a path) is the result."""
    logger = get_run_logger()
    pool = _POOLS[slots]
    gpu = pool.get()

    def on_line(line: str) -> None:
        logger.info("[gpu %s] %s", gpu, line)

    try:
        lines = _worker(gpu).run(args, on_line)
    finally:
        pool.put(gpu)
    return lines[-1].strip() if lines else ""


def _shard_run_name() -> str:
    p = task_run.parameters
    which = f"{p['index']}-of-{p['count']}" if p.get("index") is not None else "merge"
    if p.get("compile_only"):
        return f"compile-ahead-{p['suite']}-{which}"
    return f"evaluate-{p['suite']}-{Path(p['checkpoint']).name}-{which}"


@task(name="evaluate-shard", task_run_name=_shard_run_name)
def evaluate_shard_task(
    config_json: str,
    checkpoint: str,
    suite: str,
    index: int,
    count: int,
    units: list[str],
    slots: str,
    compile_only: bool = False,
    checkpoint_hash: str | None = None,
) -> str:
    """One shard of one (checkpoint, suite) evaluation; returns its records file. With
    ``compile_only``, its compile-ahead pass instead (``sharding.compile_shard``; any
    checkpoint of the evaluated architecture): returns its last output line.
    ``checkpoint_hash``: see :func:`shard_args`."""
    args = shard_args(
        config_json,
        checkpoint,
        suite,
        shard=(index, count),
        units=units,
        merge=not compile_only,
        compile_only=compile_only,
        checkpoint_hash=checkpoint_hash,
    )
    return _run_on_gpu(args, slots)


@task(name="evaluate-merge", task_run_name=_shard_run_name)
def finalize_task(config_json: str, checkpoint: str, suite: str, slots: str) -> str:
    """Merge the shards of one evaluation and write its result; returns the result path."""
    return _run_on_gpu(shard_args(config_json, checkpoint, suite, shard=None), slots)
