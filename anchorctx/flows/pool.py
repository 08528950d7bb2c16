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
under it) must be on a filesystem every node mounts, at the same path. Prefect's process worker
starts each flow run in a temporary directory of its own, so every path of the config (and the
checkpoints) is made absolute before it is handed to the shards (:func:`absolute_config`).
Records merge sorted by key: the result does not depend on which worker ran which shard, nor on
how many there were.

A node that dies mid-shard: each shard run sends Prefect's flow-run heartbeat every
:data:`HEARTBEAT_S` seconds (``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``, a job variable of the
deployment), and the pool's automation (:func:`ensure_lost_run_automation`, Prefect's "zombie
flow" recipe) marks a run Crashed once :data:`LOST_AFTER_S` seconds pass without one. The
evaluate flow then runs that shard again on the pool (where a live worker takes it; it resumes
from the records the lost run wrote), at most :data:`LOST_RETRIES` times, and logs one line
naming the node that was lost; with no online worker left, or the retries spent, it fails with
one line naming the node. ``anchorctx eval-worker --lost-after S`` sets the pool's window (one a
pool; workers started without it keep the window the pool has).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import socket
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from prefect import flow, get_run_logger

from anchorctx.evaluation.results import checkpoint_hash_token, result_path
from anchorctx.evaluation.sharding import is_done, plan_shards, prepare
from anchorctx.experiment import ExperimentConfig
from anchorctx.flows.sharded import config_file
from anchorctx.process import run_process_group
from anchorctx.tasks.api import api_errors, synchronous
from anchorctx.tasks.sharding import shard_command

SHARD_FLOW = "evaluate-shard"
# Prefect's minimum heartbeat period (flow_engine.MINIMUM_HEARTBEAT_INTERVAL): a live shard
# run reports every 30 s.
HEARTBEAT_S = 30
# Three missed heartbeats, the multiple Prefect's foreman allows a worker before it marks it
# offline: a busy node whose heartbeat thread waits a while for the GIL is not taken for lost.
LOST_AFTER_S = 3 * HEARTBEAT_S
NODE_LABEL = "anchorctx.node"  # a shard run's label: the node that runs it
LOST_RETRIES = 2  # re-runs of one lost shard: a third loss is more likely the shard than a node


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
    _label_node(node)  # first: from the line below on, a lost run is named by its node
    logger.info("%s on %s", "merge" if index is None else f"shard {index + 1}/{count}", node)
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


def _label_node(node: str) -> None:
    """This flow run's :data:`NODE_LABEL`, set before the shard starts: a node that dies mid-shard
    is named by it (its log lines may have died with it, unsent)."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    # The label only names the node in a lost-run line: failing to set it must not fail the shard.
    with contextlib.suppress(Exception), get_client(sync_client=True) as client:
        client.update_flow_run_labels(flow_run.id, {NODE_LABEL: node})


def run_node(run: Any) -> str:
    """The node a shard run ran on (:data:`NODE_LABEL`); its process id where it has none."""
    node = (getattr(run, "labels", None) or {}).get(NODE_LABEL)
    if node:
        return str(node)
    return f"worker process {run.infrastructure_pid}" if run.infrastructure_pid else "unknown node"


def _lost(run: Any) -> bool:
    """Crashed: the run's node (or its process) went away under it, the run itself did not
    fail. Failed runs are not run again: the same input would fail the same way."""
    return run.state is not None and run.state.is_crashed()


def _wait(pool: str, run: Any, lost_on: str | None) -> Any:
    """The run once it is final. While no worker has taken it, the pool must keep an online
    worker: a run no worker will take is one line naming the lost node, not a wait forever."""
    from prefect.client.orchestration import get_client

    checked = time.monotonic()
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(run.id)
            if run.state is not None and run.state.is_final():
                return run
            waiting = run.state is None or run.state.is_scheduled()
            if waiting and time.monotonic() - checked > HEARTBEAT_S:
                checked = time.monotonic()
                try:
                    pool_workers(pool)
                except RuntimeError as err:
                    where = f" after a run of it was lost on {lost_on}" if lost_on else ""
                    raise RuntimeError(f"{run.name}{where}: {err}") from None
            time.sleep(2)


def _run_until_not_lost(pool: str, params: dict, logger: Any) -> tuple[Any, str | None]:
    """One ``evaluate-shard/<pool>`` run of ``params``, submitted again while it is lost
    (:func:`_lost`), at most :data:`LOST_RETRIES` times. Returns the last run and, where it
    was lost, the node it was lost on."""
    from prefect.deployments import run_deployment

    node = None
    for attempt in range(LOST_RETRIES + 1):
        run = run_deployment(f"{SHARD_FLOW}/{pool}", parameters=params, timeout=0)
        run = _wait(pool, run, node)
        if not _lost(run):
            return run, None
        node = run_node(run)
        if attempt < LOST_RETRIES:
            logger.warning(
                "%s lost on %s (%s); running it again on pool %r",
                run.name,
                node,
                (run.state.message if run.state else None) or "crashed",
                pool,
            )
    return run, node


def _run_all(pool: str, parameter_sets: list[dict], logger: Any) -> None:
    """Submit one ``evaluate-shard/<pool>`` run per parameter set, wait for all of them; a lost
    run is submitted again (:func:`_run_until_not_lost`)."""

    def one(params: dict):
        return _run_until_not_lost(pool, params, logger)

    with ThreadPoolExecutor(max_workers=max(1, len(parameter_sets))) as ex:
        # Each thread carries the flow run's context, so the runs show as its subflows.
        futures = [ex.submit(contextvars.copy_context().run, one, p) for p in parameter_sets]
        runs = [f.result() for f in futures]
    failed = [
        f"{r.name}: {r.state.name if r.state else '?'}"
        + (f" on {node}, lost {LOST_RETRIES + 1} times" if node else "")
        for r, node in runs
        if r.state is None or not r.state.is_completed()
    ]
    if failed:
        raise RuntimeError(
            f"{len(failed)} of {len(runs)} runs on pool {pool!r} failed: {'; '.join(failed[:3])}"
        )


def absolute_config(cfg: ExperimentConfig) -> ExperimentConfig:
    """``cfg`` with every relative path (``run_root`` included) made absolute against this
    process' working directory: a shard run starts in a temporary directory of its own."""

    def walk(value: Any) -> Any:
        if isinstance(value, Path):
            return Path(os.path.abspath(value))
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(walk(v) for v in value)
        return value

    return type(cfg).model_validate(walk(cfg.model_dump()))


def evaluate_on_pool(
    cfg: ExperimentConfig, checkpoints: Sequence[str], suites: Sequence[str], force: bool
) -> list[str]:
    """Result paths of every (checkpoint, suite) pair, evaluated on ``evaluation.work_pool``."""
    pool = cfg.evaluation.work_pool
    assert pool is not None
    logger = get_run_logger()
    cfg = absolute_config(cfg)  # the shards' config; the flow's own checks use the same
    pairs = [(os.path.abspath(c), s) for c in checkpoints for s in suites]
    todo = [(c, s) for c, s in pairs if prepare(cfg, c, s, force)]
    if todo:
        online = pool_workers(pool)
        ensure_lost_run_automation(pool)
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
        _run_all(pool, shards, logger)  # each shard's log says which node ran it
        # The shard that completed a pair merged it already; a merge run is left only where
        # that did not happen (e.g. shards resumed from another attempt's records).
        merges = [(c, s) for c, s in todo if not is_done(cfg, c, s)]
        if merges:
            _run_all(
                pool,
                [{"config_json": config_json, "checkpoint": c, "suite": s} for c, s in merges],
                logger,
            )
    return [str(result_path(c, s, cfg)) for c, s in pairs]


def check_lost_after(seconds: int) -> int:
    """``seconds`` as the lost-run window; an error unless it exceeds :data:`HEARTBEAT_S` (a
    shorter window would take every live shard run, between two heartbeats, for lost)."""
    if seconds <= HEARTBEAT_S:
        raise ValueError(
            f"lost-after must exceed the shard runs' heartbeat period of {HEARTBEAT_S} s, "
            f"got {seconds}"
        )
    return seconds


def lost_run_automation(pool: str, deployment_id: Any, lost_after_s: int = LOST_AFTER_S) -> Any:
    """Prefect's zombie-flow automation for the pool's shard runs: a run that went Pending or
    Running, or sent a heartbeat, and then sends neither a heartbeat nor a final state for
    ``lost_after_s`` seconds is marked Crashed (its node is gone)."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    final = {f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")}
    return AutomationCore(
        name=f"anchorctx: lost runs of {SHARD_FLOW}/{pool}",
        description="Marks a shard run Crashed when its node stops sending heartbeats; the "
        "evaluate flow runs it again on a live worker.",
        trigger=EventTrigger(
            # Pending: a worker took the run, but its node may die before the run starts.
            after={
                "prefect.flow-run.heartbeat",
                "prefect.flow-run.Pending",
                "prefect.flow-run.Running",
            },
            expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Running", *final},
            match=ResourceSpecification({"prefect.resource.id": "prefect.flow-run.*"}),
            match_related=ResourceSpecification(
                {
                    "prefect.resource.id": f"prefect.deployment.{deployment_id}",
                    "prefect.resource.role": "deployment",
                }
            ),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=lost_after_s),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat from its node for {lost_after_s} s",
            )
        ],
    )


def ensure_lost_run_automation(pool: str, lost_after_s: int | None = None) -> None:
    """Create :func:`lost_run_automation` for ``pool`` unless the server has it (by name), with
    ``lost_after_s`` (default :data:`LOST_AFTER_S`). Given, it also replaces the window of the
    automation the server has; None leaves that as it is."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(f"{SHARD_FLOW}/{pool}")
        automation = lost_run_automation(pool, deployment.id, lost_after_s or LOST_AFTER_S)
        existing = client.read_automations_by_name(automation.name)
        if not existing:
            client.create_automation(automation)
            return
        # the automation this module creates has an event trigger (its ``within`` window)
        window = getattr(existing[0].trigger, "within", None)
        if lost_after_s and window != timedelta(seconds=lost_after_s):
            client.update_automation(existing[0].id, automation)


def register(pool: str, lost_after_s: int | None = None) -> None:
    """Create the process work pool (if missing), its ``evaluate-shard/<pool>`` deployment (its
    runs send heartbeats) and the automation that marks a run Crashed when they stop, after
    ``lost_after_s`` seconds without one (:func:`ensure_lost_run_automation`)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.deployments.runner import EntrypointType
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client, contextlib.suppress(ObjectAlreadyExists):
        client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
    deployment = synchronous(
        evaluate_shard_flow.to_deployment(
            name=pool,
            work_pool_name=pool,
            entrypoint_type=EntrypointType.MODULE_PATH,
            description="One shard of an anchorctx evaluation, on one GPU of a worker of this pool.",
            job_variables={"env": {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S)}},
        )
    )
    deployment.apply(work_pool_name=pool)
    ensure_lost_run_automation(pool, lost_after_s)


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
