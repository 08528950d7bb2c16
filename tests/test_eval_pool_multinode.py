"""Evaluation over two hosts through one Prefect work pool: two network namespaces with their own
addresses, a Prefect server on the first, one `anchorctx eval-worker` on each. An evaluate flow
with `evaluation.work_pool` set sends its shards to the pool; both hosts run shards, and the
records and scores equal those of one process evaluating alone. A second test kills one host
mid-shard: its run is marked Crashed for want of heartbeats and runs again on the other host.
The configs of both use paths relative to the coordinator's working directory, which no shard
run (each in a temporary directory of Prefect's process worker) shares."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import netns
import pytest
from checkpoints import save_checkpoint
from distributed import free_port
from shared_prefect import premigrated_database
from test_eval_sharding import LENGTHS, _cfg, _sorted_records

from anchorctx.demo import ensure_eval_fixtures
from anchorctx.evaluation import results
from anchorctx.experiment import config_from_dict
from anchorctx.flows.pool import HEARTBEAT_S

pytestmark = pytest.mark.slow

# The workers' lost-run window (`eval-worker --lost-after`): half a period over the shard runs'
# heartbeat period (Prefect keeps it at 30 s or more), so that a live run whose heartbeat event
# reaches a busy server late is not taken for lost; the default (90 s) would be waited out in
# full after the kill.
LOST_AFTER_S = HEARTBEAT_S + HEARTBEAT_S // 2

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
# Only this config's shard runs (their checkpoints are under its run_root): the server also
# holds those of the module's other test.
COORDINATOR = """
import json, os, sys
from anchorctx.experiment import ExperimentConfig
from anchorctx.flows.experiment import evaluate_flow
cfg = ExperimentConfig.model_validate_json(open(sys.argv[1]).read())
out = evaluate_flow(cfg)
mine = os.path.abspath(cfg.run_root) + os.sep
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, LogFilter, LogFilterFlowRunId
with get_client(sync_client=True) as client:
    runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["evaluate-shard"])))
    runs = [r for r in runs if str(r.parameters.get("checkpoint", "")).startswith(mine)]
    where = {}
    for run in runs:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
        where[run.name] = [l.message for l in logs if " on " in l.message][:1]
    # One entry a flow run: a lost shard and its re-run share a name, so a dict by name kept
    # whichever the server listed last.
    states = [[r.name, r.state_name, r.state.timestamp.timestamp() if r.state else None] for r in runs]
print("RESULT " + json.dumps({"results": out["results"], "where": where, "states": states}))
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


def _relative_cfg(tmp_path: Path, demo_corpus, name: str):
    """``_cfg``'s evaluation with ``run_root`` and the evaluation data relative to ``tmp_path``
    (the coordinator's working directory), and its checkpoint."""
    raw = {
        "name": name,
        "run_root": name,
        "model": {"tiny": {}, "tokenizer": str(demo_corpus.tokenizer_dir), "dtype": "float32"},
        "evaluation": {
            "suites": ["ruler"],
            "demo_fixtures": "eval_data",
            "device": "cpu",
            "dtype": "float32",
            "batch_size": 2,
            "ruler": {
                "tasks": ["niah_single_1", "qa_1"],
                "lengths": list(LENGTHS[:1]),
                "fit": "tight",
                "num_samples": 2,
                "squad_path": "eval_data/squad.json",
            },
            "work_pool": "anchorctx-test",
            "shards": 2,
        },
    }
    with contextlib.chdir(tmp_path):
        cfg = config_from_dict(raw)
        ensure_eval_fixtures(cfg)
        ckpt = cfg.run_dir / "checkpoints" / "step-000010"
        save_checkpoint(ckpt, demo_corpus.tokenizer_dir, seed=3, step=10)
    return cfg, tmp_path / ckpt


@contextlib.contextmanager
def _pool_on_two_hosts(tmp_path: Path, while_server_starts):
    """Two hosts, a Prefect server on the first and one ``anchorctx eval-worker`` on each,
    both polling the pool. Yields ``(hosts, env, procs, worker_logs, ready)``: ``procs[1:]`` are
    the workers; ``ready``: what ``while_server_starts()`` returned (run during the server's
    start, ~4-10 s of CPU). Everything started is killed on the way out."""
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
        # to one host shows in the assertions whether the other polled and what it saw.
        worker_env = {**env, "PREFECT_LOGGING_LOGGERS_PREFECT_WORKERS_LEVEL": "DEBUG"}
        worker_logs = [tmp_path / f"worker{node}.log" for node in (0, 1)]
        premigrated_database(tmp_path / "prefect" / "prefect.db")  # PREFECT_HOME's database
        server = [sys.executable, "-m", "prefect", "server", "start"]
        server += ["--host", hosts[0][1], "--port", str(port)]
        procs = [_in(hosts, 0, server, server_env, tmp_path / "server.log")]
        try:
            ready = while_server_starts()
            health = f"import urllib.request; urllib.request.urlopen('{api}/health', timeout=2)"
            deadline = time.monotonic() + 180
            while subprocess.run(
                ["ip", "netns", "exec", hosts[0][0], sys.executable, "-c", health],
                capture_output=True,
            ).returncode:
                assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-3000:]
                time.sleep(1)
            for node in (0, 1):  # one worker per host: each is one slot of the pool
                worker = [sys.executable, "-m", "anchorctx", "eval-worker", "anchorctx-test"]
                worker += ["--name", f"node{node}", "--lost-after", str(LOST_AFTER_S)]
                procs.append(_in(hosts, node, worker, worker_env, worker_logs[node]))
            wait = [sys.executable, "-c", WAIT_FOR_WORKERS, "anchorctx-test"]
            online = subprocess.run(
                ["ip", "netns", "exec", hosts[0][0], *wait],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert online.returncode == 0, online.stderr[-3000:] + "".join(
                log.read_text()[-2000:] for log in worker_logs
            )
            # Online is not yet polling: a worker polls only once its first sync with the server
            # is complete (Prefect's worker loop). Until both have polled, a shard could finish
            # on one host before the other ever looks, and the hosts assertions would fail on
            # timing alone.
            deadline = time.monotonic() + 120
            while not all(POLLED in log.read_text() for log in worker_logs):
                assert time.monotonic() < deadline, "\n".join(map(_worker_story, worker_logs))
                time.sleep(0.5)
            yield hosts, env, procs, worker_logs, ready
        finally:
            for p in procs:
                netns.kill_tree(p.pid)


@dataclass
class Pool:
    """The module's two hosts, server and workers (:func:`_pool_on_two_hosts`) and the reference
    evaluation of one process alone; ``root``: the tests' working directory."""

    root: Path
    hosts: list
    env: dict
    procs: list[subprocess.Popen]
    worker_logs: list[Path]
    ref_ckpt: Path
    ref: dict


@pytest.fixture(scope="module")
def pool(tmp_path_factory, demo_corpus) -> Iterator[Pool]:
    """One server and two workers for both tests (the lost-host test, which kills host 1, runs
    last): their start is ~20 s of interpreters and polls, the reference evaluation ~10 s more.
    With pytest-xdist the two tests run on one worker (tests/conftest.py: TOGETHER)."""
    root = tmp_path_factory.mktemp("pool")
    with _pool_on_two_hosts(root, lambda: _alone(root, demo_corpus)) as (
        hosts,
        env,
        procs,
        worker_logs,
        (ref_ckpt, ref),
    ):
        yield Pool(root, hosts, env, procs, worker_logs, ref_ckpt, ref)


def _coordinator(hosts, env: dict, cfg_json: Path, cwd: Path) -> subprocess.Popen:
    """The evaluate flow on the pool, from node 0, in ``cwd`` (the configs' relative paths)."""
    return subprocess.Popen(
        ["ip", "netns", "exec", hosts[0][0], sys.executable, "-c", COORDINATOR, str(cfg_json)],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _report(stdout: str) -> dict:
    line = next(x for x in stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def _assert_equal_to_alone(ckpt: Path, ref_ckpt: Path, ref: dict) -> None:
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


def _alone(tmp_path: Path, demo_corpus):
    """One process alone: the reference records and scores. One length: two units."""
    ref_cfg, ref_ckpt = _cfg(tmp_path, demo_corpus, "alone", lengths=LENGTHS[:1])
    ref = results.load_result(
        results.evaluate_checkpoint(ref_cfg, ref_ckpt, "ruler", progress=False)
    )
    return ref_ckpt, ref


def test_shards_run_on_both_hosts_and_equal_one_process(pool, demo_corpus):
    hosts, worker_logs = pool.hosts, pool.worker_logs
    cfg, ckpt = _relative_cfg(pool.root, demo_corpus, "pool")
    cfg_json = pool.root / "pool.json"
    cfg_json.write_text(cfg.model_dump_json())
    proc = _coordinator(hosts, pool.env, cfg_json, pool.root)
    out, err = proc.communicate(timeout=600)
    logs = "\n".join(log.read_text()[-2000:] for log in worker_logs)
    assert proc.returncode == 0, err[-6000:] + logs
    report = _report(out)
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
    _assert_equal_to_alone(ckpt, pool.ref_ckpt, pool.ref)


def test_a_host_lost_mid_shard_is_run_again_on_the_other(pool, demo_corpus):
    """Host 1 dies (its worker, the shard's flow run and its process, at once) while it runs a
    shard: within LOST_AFTER_S (+ slack) of its last heartbeat the run is Crashed, the flow logs
    one line naming host 1 and runs that shard again on host 0; the result equals one process's.
    (The module's last test: host 1 stays dead.)"""
    hosts, worker_logs = pool.hosts, pool.worker_logs
    cfg, ckpt = _relative_cfg(pool.root, demo_corpus, "lost")
    cfg_json = pool.root / "lost.json"
    cfg_json.write_text(cfg.model_dump_json())
    seen = len(worker_logs[1].read_text())  # host 1's log before this test's shards
    proc = _coordinator(hosts, pool.env, cfg_json, pool.root)
    started = re.compile(rf"shard \d/2 on .*\({re.escape(hosts[1][1])}\)")
    deadline = time.monotonic() + 300
    while not started.search(worker_logs[1].read_text()[seen:]):
        assert proc.poll() is None, proc.communicate()[1][-6000:]
        assert time.monotonic() < deadline, "\n".join(map(_worker_story, worker_logs))
        time.sleep(0.2)
    netns.kill_tree(pool.procs[2].pid)  # host 1 dies mid-shard: its worker and the run's processes
    killed = time.time()
    out, err = proc.communicate(timeout=600)
    logs = "\n".join(log.read_text()[-3000:] for log in worker_logs)
    assert proc.returncode == 0, err[-6000:] + logs
    lost = [x for x in (out + err).splitlines() if "lost on" in x]
    assert len(lost) == 1 and f"({hosts[1][1]})" in lost[0], (out + err)[-6000:]
    assert f"no heartbeat from its node for {LOST_AFTER_S} s" in lost[0], lost[0]
    report = _report(out)
    crashed = [t for _, state, t in report["states"] if state == "Crashed"]
    # Slack: Prefect's proactive triggers are evaluated every 5 s, the last heartbeat may come
    # up to one period after the kill is noticed, and this 2-core machine runs both hosts.
    assert len(crashed) == 1 and crashed[0] - killed <= LOST_AFTER_S + 45, report["states"]
    _assert_equal_to_alone(ckpt, pool.ref_ckpt, pool.ref)
