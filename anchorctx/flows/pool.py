"""Evaluation over several machines: a Prefect process work pool, one worker per GPU.

Every GPU of every node runs one worker of the pool (``anchorctx eval-worker POOL``, with
``CUDA_VISIBLE_DEVICES`` naming its GPU), which registers the ``evaluate-shard/<POOL>``
deployment and then runs ``prefect worker start --type process --limit 1``: the limit of one
flow run per worker is the GPU slot. With ``evaluation.work_pool`` set, the evaluate flow splits
each (checkpoint, suite) pair into shards (:mod:`anchorctx.evaluation.sharding`), submits each as
a run of that deployment and waits; Prefect hands the runs to whichever workers are free, on
any node. The shard that completes a pair merges it and writes ``<suite>.json`` (its model is
loaded already); a merge run is left, on the pool too, only where none did (it may load the model
to generate what a failed shard left), so the flow's own process needs no GPU.

Shards write their records next to the checkpoint, so ``run_root`` (and the config JSON written
under it) must be on a filesystem every node mounts. Records merge sorted by key: the result
does not depend on which worker ran which shard, nor on how many there were.
"""

from __future__ import annotations

import contextlib
import contextvars
import socket
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

from prefect import flow, get_run_logger

from anchorctx.evaluation.results import checkpoint_hash_token, result_path
from anchorctx.evaluation.sharding import is_done, plan_shards, prepare
from anchorctx.experiment import ExperimentConfig
from anchorctx.flows.sharded import config_file
from anchorctx.process import run_process_group
from anchorctx.tasks.api import api_errors
from anchorctx.tasks.sharding import shard_command

SHARD_FLOW = "evaluate-shard"


def node_address() -> str:
    """``host (address)`` of this node as the Prefect server sees it (the source address of the
    route to the API host), so the logs say which machine ran a shard."""
    from prefect.settings import get_current_settings

    host = urlparse(get_current_settings().api.url or "").hostname or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP: no packet is sent, only the route is chosen
            addr = s.getsockname()[0]
    except OSError:
        addr = "?"
    return f"{socket.gethostname()} ({addr})"


def _shard_name() -> str:
    from prefect.runtime import flow_run

    p = flow_run.parameters
    which = "merge" if p.get("index") is None else f"{p['index'] + 1}-of-{p['count']}"
    return f"evaluate-{p['suite']}-{Path(p['checkpoint']).name}-{which}"


@flow(name=SHARD_FLOW, flow_run_name=_shard_name)
@api_errors
def evaluate_shard_flow(
    config_json: str,
    checkpoint: str,
    suite: str,
    index: int | None = None,
    count: int = 1,
    units: list[str] | None = None,
    merge: bool = False,
    checkpoint_hash: str | None = None,
) -> str:
    """One shard of one evaluation (or, with ``index=None``, the merge), on this worker's GPU.
    ``merge``: the shard that completes the evaluation merges it in its own process, where the
    model is loaded already. ``checkpoint_hash``: the planner's hash token of the checkpoint,
    used where this node sees the same files (a shared file system keeps their inodes and
    times), so the shard does not read the whole checkpoint once more to hash it."""
    logger = get_run_logger()
    node = node_address()
    shard = None if index is None else (index, count)
    cmd = shard_command(
        config_json,
        checkpoint,
        suite,
        shard=shard,
        units=units or [],
        merge=merge,
        checkpoint_hash=checkpoint_hash,
    )
    logger.info("%s on %s", "merge" if shard is None else f"shard {index + 1}/{count}", node)
    lines: list[str] = []

    def on_line(line: str) -> None:
        lines.append(line)
        logger.info(line)

    run_process_group(cmd, on_line=on_line)
    return lines[-1].strip() if lines else ""


def pool_workers(pool: str) -> int:
    """Online workers of ``pool``; an error when the pool has no shard deployment or no online
    worker (the shard runs would otherwise wait for one forever)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    start = f"start `anchorctx eval-worker {pool}` on every GPU node (one per GPU)"
    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(f"{SHARD_FLOW}/{pool}")
            workers = client.read_workers_for_work_pool(pool)
        except ObjectNotFound:
            raise RuntimeError(
                f"evaluation.work_pool={pool!r}: no such pool or deployment; {start}"
            ) from None
    online = sum(1 for w in workers if str(getattr(w, "status", "")).endswith("ONLINE"))
    if not online:
        raise RuntimeError(f"evaluation.work_pool={pool!r} has no online worker; {start}")
    return online


def _run_all(pool: str, parameter_sets: list[dict]) -> None:
    """Submit one ``evaluate-shard/<pool>`` run per parameter set, wait for all of them."""
    from prefect.deployments import run_deployment

    def one(params: dict):
        return run_deployment(
            f"{SHARD_FLOW}/{pool}", parameters=params, timeout=None, poll_interval=2
        )

    with ThreadPoolExecutor(max_workers=max(1, len(parameter_sets))) as ex:
        # Each thread carries the flow run's context, so the runs show as its subflows.
        futures = [ex.submit(contextvars.copy_context().run, one, p) for p in parameter_sets]
        runs = [f.result() for f in futures]
    failed = [
        f"{r.name}: {r.state.name if r.state else '?'}"
        for r in runs
        if r.state is None or not r.state.is_completed()
    ]
    if failed:
        raise RuntimeError(
            f"{len(failed)} of {len(runs)} runs on pool {pool!r} failed: {failed[:3]}"
        )


def evaluate_on_pool(
    cfg: ExperimentConfig, checkpoints: Sequence[str], suites: Sequence[str], force: bool
) -> list[str]:
    """Result paths of every (checkpoint, suite) pair, evaluated on ``evaluation.work_pool``."""
    pool = cfg.evaluation.work_pool
    assert pool is not None
    logger = get_run_logger()
    pairs = [(str(c), s) for c in checkpoints for s in suites]
    todo = [(c, s) for c, s in pairs if prepare(cfg, c, s, force)]
    if todo:
        online = pool_workers(pool)
        count = cfg.evaluation.shards or online
        config_json = str(config_file(cfg))
        # prepare() hashed each checkpoint here: the shards take the hash instead of reading it.
        hashes = {c: checkpoint_hash_token(c) for c in {c for c, _ in todo}}
        shards = [
            {
                "config_json": config_json,
                "checkpoint": c,
                "suite": s,
                "index": i,
                "count": len(plan),
                "units": units,
                "merge": True,
                "checkpoint_hash": hashes[c],
            }
            for c, s in todo
            for plan in [plan_shards(cfg, s, count)]
            for i, units in enumerate(plan)
        ]
        logger.info("%d pairs to evaluate: %d shards on work pool %r", len(todo), len(shards), pool)
        _run_all(pool, shards)  # each shard's log says which node ran it
        # The shard that completed a pair merged it already; a merge run is left only where
        # that did not happen (e.g. shards resumed from another attempt's records).
        merges = [(c, s) for c, s in todo if not is_done(cfg, c, s)]
        if merges:
            _run_all(
                pool, [{"config_json": config_json, "checkpoint": c, "suite": s} for c, s in merges]
            )
    return [str(result_path(c, s, cfg)) for c, s in pairs]


def register(pool: str) -> None:
    """Create the process work pool (if missing) and its ``evaluate-shard/<pool>`` deployment."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.deployments.runner import EntrypointType
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client, contextlib.suppress(ObjectAlreadyExists):
        client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
    deployment = evaluate_shard_flow.to_deployment(
        name=pool,
        work_pool_name=pool,
        entrypoint_type=EntrypointType.MODULE_PATH,
        description="One shard of an anchorctx evaluation, on one GPU of a worker of this pool.",
    )
    deployment.apply(work_pool_name=pool)


def worker_command(pool: str, name: str | None = None) -> list[str]:
    """``prefect worker start`` for one GPU slot of ``pool``."""
    cmd = [
        sys.executable,
        "-m",
        "prefect",
        "worker",
        "start",
        "--pool",
        pool,
        "--type",
        "process",
        "--limit",
        "1",
    ]
    return [*cmd, "--name", name] if name else cmd
