"""Evaluation over two hosts through one Prefect work pool: two network namespaces with their own
addresses, a Prefect server on the first, one `anchorctx eval-worker` on each. An evaluate flow
with `evaluation.work_pool` set sends its shards to the pool; both hosts run shards, and the
records and scores equal those of one process evaluating alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import netns
import pytest
from distributed import free_port
from shared_prefect import premigrated_database
from test_eval_sharding import LENGTHS, _cfg, _sorted_records

from anchorctx.evaluation import results

pytestmark = pytest.mark.slow

# Run inside node 0: wait until both workers have registered and are online.
WAIT_FOR_WORKERS = """
import sys, time
from anchorctx.flows.pool import pool_workers
deadline = time.monotonic() + 180
while True:
    try:
        if pool_workers(sys.argv[1]) >= 2:
            break
    except RuntimeError:
        pass
    if time.monotonic() > deadline:
        sys.exit("the two workers did not come online within 180 s")
    time.sleep(1)
"""

# Run inside node 0: the evaluate flow on the pool, then which host ran each shard (its log).
COORDINATOR = """
import json, sys
from anchorctx.experiment import ExperimentConfig
from anchorctx.flows.experiment import evaluate_flow
cfg = ExperimentConfig.model_validate_json(open(sys.argv[1]).read())
out = evaluate_flow(cfg)
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, LogFilter, LogFilterFlowRunId
with get_client(sync_client=True) as client:
    runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["evaluate-shard"])))
    where = {}
    for run in runs:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
        where[run.name] = [l.message for l in logs if " on " in l.message][:1]
print("RESULT " + json.dumps({"results": out["results"], "where": where}))
"""


def _in(hosts, node: int, cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    with log.open("w") as out:  # the process writes to its own copy of the file descriptor
        return subprocess.Popen(
            ["ip", "netns", "exec", hosts[node][0], *cmd],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


# A worker's DEBUG line after each completed poll of the pool.
POLLED = "scheduled_flow_runs"


def _worker_story(log: Path) -> str:
    """A worker's log without its routine polls (those that found nothing): when it synced,
    what each poll that found runs saw, what it submitted or skipped."""
    routine = ("Querying for flow runs", "Discovered 0 ", "Starting run of")
    lines = [x for x in log.read_text().splitlines() if not any(r in x for r in routine)]
    return f"== {log.name}\n" + "\n".join(lines[-40:])


def test_shards_run_on_both_hosts_and_equal_one_process(tmp_path, demo_corpus):
    if reason := netns.unavailable():
        pytest.skip(reason)

    with netns.two_hosts() as hosts:
        port = free_port()
        api = f"http://{hosts[0][1]}:{port}/api"
        env = {
            **os.environ,
            "PREFECT_HOME": str(tmp_path / "prefect"),
            "PREFECT_API_URL": api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_LOGGING_LEVEL": "INFO",
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        }
        server_env = {
            **env,
            "PREFECT_SERVER_API_HOST": hosts[0][1],
            "PREFECT_SERVER_API_PORT": str(port),
        }
        # The workers log each poll of the pool (DEBUG, one line a second), so that a shard left
        # to one host shows in the assertion below whether the other polled and what it saw.
        worker_env = {**env, "PREFECT_LOGGING_LOGGERS_PREFECT_WORKERS_LEVEL": "DEBUG"}
        worker_logs = [tmp_path / f"worker{node}.log" for node in (0, 1)]
        premigrated_database(tmp_path / "prefect" / "prefect.db")  # PREFECT_HOME's database
        procs = [
            _in(
                hosts,
                0,
                [
                    sys.executable,
                    "-m",
                    "prefect",
                    "server",
                    "start",
                    "--host",
                    hosts[0][1],
                    "--port",
                    str(port),
                ],
                server_env,
                tmp_path / "server.log",
            )
        ]
        try:
            # While the server starts (~4-10 s of CPU: it migrates its database if new), the pool's
            # config and checkpoint, then one process alone: the reference records and scores.
            # One length: two units, one a host.
            cfg, ckpt = _cfg(tmp_path, demo_corpus, "pool", lengths=LENGTHS[:1])
            cfg = cfg.model_copy(deep=True)
            cfg.evaluation.work_pool, cfg.evaluation.shards = "anchorctx-test", 2
            cfg_json = tmp_path / "pool.json"
            cfg_json.write_text(cfg.model_dump_json())
            ref_cfg, ref_ckpt = _cfg(tmp_path, demo_corpus, "alone", lengths=LENGTHS[:1])
            ref = results.load_result(
                results.evaluate_checkpoint(ref_cfg, ref_ckpt, "ruler", progress=False)
            )
            health = f"import urllib.request; urllib.request.urlopen('{api}/health', timeout=2)"
            deadline = time.monotonic() + 180
            while subprocess.run(
                ["ip", "netns", "exec", hosts[0][0], sys.executable, "-c", health],
                capture_output=True,
            ).returncode:
                assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-3000:]
                time.sleep(1)
            for node in (0, 1):  # one worker per host: each is one slot of the pool
                procs.append(
                    _in(
                        hosts,
                        node,
                        [
                            sys.executable,
                            "-m",
                            "anchorctx",
                            "eval-worker",
                            "anchorctx-test",
                            "--name",
                            f"node{node}",
                        ],
                        worker_env,
                        worker_logs[node],
                    )
                )
            ready = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    hosts[0][0],
                    sys.executable,
                    "-c",
                    WAIT_FOR_WORKERS,
                    "anchorctx-test",
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert ready.returncode == 0, ready.stderr[-3000:] + "".join(
                log.read_text()[-2000:] for log in worker_logs
            )
            # Online is not yet polling: a worker polls only once its first sync with the server
            # is complete (Prefect's worker loop). Until both have polled, a shard could finish
            # on one host before the other ever looks, and the hosts assertion below would
            # fail on timing alone.
            deadline = time.monotonic() + 120
            while not all(POLLED in log.read_text() for log in worker_logs):
                assert time.monotonic() < deadline, "\n".join(map(_worker_story, worker_logs))
                time.sleep(0.5)
            run = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    hosts[0][0],
                    sys.executable,
                    "-c",
                    COORDINATOR,
                    str(cfg_json),
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
        finally:
            for p in procs:
                netns.kill_tree(p.pid)
    logs = "\n".join(log.read_text()[-2000:] for log in worker_logs)
    assert run.returncode == 0, run.stderr[-6000:] + logs
    report = json.loads(
        next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[
            len("RESULT ") :
        ]
    )
    shards = {name: msgs for name, msgs in report["where"].items() if "merge" not in name}
    assert len(shards) == 2, report["where"]
    hosts_used = {
        addr
        for msgs in shards.values()
        for m in msgs
        for addr in (hosts[0][1], hosts[1][1])
        if f"({addr})" in m
    }
    assert hosts_used == {hosts[0][1], hosts[1][1]}, f"{report['where']}\n" + "\n".join(
        map(_worker_story, worker_logs)
    )

    got = results.load_result(results.result_path(ckpt, "ruler"))
    assert got["scores"] == ref["scores"] and got["counts"] == ref["counts"]
    strip = [
        {k: v for k, v in r.items() if k != "elapsed_s"}
        for r in _sorted_records(results.samples_path(ref_ckpt, "ruler"))
    ]
    mine = [
        {k: v for k, v in r.items() if k != "elapsed_s"}
        for r in _sorted_records(results.samples_path(ckpt, "ruler"))
    ]
    assert mine == strip
