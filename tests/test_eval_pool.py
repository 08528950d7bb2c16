"""The work-pool evaluation's planning and waiting, without a Prefect server: what the shards are
handed (absolute paths) and what happens to a shard whose node was lost (run again, or one line
naming the node). `test_eval_pool_multinode.py` runs the same on two hosts."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import prefect.deployments
import pytest
from checkpoints import save_checkpoint
from prefect.states import Completed, Crashed

from anchorctx.demo import ensure_eval_fixtures
from anchorctx.experiment import ExperimentConfig, config_from_dict
from anchorctx.flows import pool


def _paths(value, key=""):
    """Every Path (or path string) of a dumped config, with its dotted key."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, f"{key}.{k}" if key else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, f"{key}.{i}")
    elif isinstance(value, Path):
        yield key, value


def test_shards_get_absolute_paths(tmp_path, demo_corpus, monkeypatch):
    """A relative ``run_root``, evaluation data and checkpoint, as in the demo config: the
    shards (each in a temporary directory of Prefect's process worker) get them absolute."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    cfg = config_from_dict(
        {
            "name": "rel",
            "run_root": "runs",
            "model": {"tiny": {}, "tokenizer": str(demo_corpus.tokenizer_dir)},
            "evaluation": {
                "suites": ["ruler"],
                "demo_fixtures": ".demo/eval",
                "device": "cpu",
                "ruler": {"tasks": ["niah_single_1"], "lengths": [1024], "num_samples": 1},
                "work_pool": "p",
                "shards": 2,
            },
        }
    )
    ensure_eval_fixtures(cfg)
    ckpt = cfg.run_dir / "checkpoints" / "step-000010"
    assert not ckpt.is_absolute()
    save_checkpoint(ckpt, demo_corpus.tokenizer_dir, seed=3, step=10)
    handed: list[dict] = []
    monkeypatch.setattr(pool, "pool_workers", lambda name: 2)
    # raising=False: the same test runs on code without the automation (it must fail there).
    monkeypatch.setattr(pool, "ensure_lost_run_automation", lambda name: None, raising=False)
    monkeypatch.setattr(pool, "get_run_logger", lambda: logging.getLogger("test"))
    monkeypatch.setattr(pool, "_run_all", lambda name, params, *_: handed.extend(params))
    out = pool.evaluate_on_pool(cfg, [str(ckpt)], ["ruler"], force=False)

    assert handed and all(Path(p).is_absolute() for p in out)
    elsewhere = tmp_path / "elsewhere"  # a shard's working directory
    elsewhere.mkdir()
    with contextlib.chdir(elsewhere):
        for params in handed:
            assert Path(params["checkpoint"]).is_dir(), params["checkpoint"]
            shard_cfg = ExperimentConfig.model_validate(
                json.loads(Path(params["config_json"]).read_text())
            )
            relative = [k for k, p in _paths(shard_cfg.model_dump()) if not p.is_absolute()]
            assert not relative, relative
            assert shard_cfg.run_root == work / "runs"
            assert shard_cfg.evaluation.demo_fixtures == work / ".demo/eval"
            assert shard_cfg.evaluation.demo_fixtures.is_dir()


def _run(name: str, state) -> SimpleNamespace:
    return SimpleNamespace(id=name, name=name, state=state, infrastructure_pid=None)


@pytest.fixture
def submitted(monkeypatch):
    """run_deployment returns, per call, the next state of ``states`` (a list the test fills)."""
    calls: list[dict] = []
    states: list = []

    def run_deployment(name, parameters, timeout):
        calls.append(parameters)
        return _run(f"shard-{parameters['index']}", states.pop(0))

    monkeypatch.setattr(prefect.deployments, "run_deployment", run_deployment)
    monkeypatch.setattr(pool, "_wait", lambda name, run, lost_on: run)
    monkeypatch.setattr(pool, "run_node", lambda run: "node1 (10.0.0.2)")
    monkeypatch.setattr(pool, "pool_workers", lambda name: 1)
    return SimpleNamespace(calls=calls, states=states)


def test_a_lost_shard_runs_again(submitted, caplog):
    """Crashed (its node stopped sending heartbeats): the shard is submitted once more and the
    log names the node it was lost on; a Completed re-run completes the evaluation."""
    submitted.states += [Crashed(message="no heartbeat from its node for 90 s"), Completed()]
    with caplog.at_level(logging.WARNING):
        pool._run_all("p", [{"index": 1}], logging.getLogger("test"))
    assert len(submitted.calls) == 2
    (line,) = [r.getMessage() for r in caplog.records if "lost on" in r.getMessage()]
    assert "shard-1 lost on node1 (10.0.0.2) (no heartbeat" in line


def test_a_shard_lost_every_time_is_one_line_naming_the_node(submitted):
    submitted.states += [Crashed() for _ in range(pool.LOST_RETRIES + 1)]
    with pytest.raises(RuntimeError) as err:
        pool._run_all("p", [{"index": 0}], logging.getLogger("test"))
    msg = str(err.value)
    assert "\n" not in msg and "on node1 (10.0.0.2)" in msg
    assert f"lost {pool.LOST_RETRIES + 1} times" in msg
    assert len(submitted.calls) == pool.LOST_RETRIES + 1


def test_a_failed_shard_is_not_run_again(submitted):
    """Failed is the shard's own error: the same input would fail again."""
    from prefect.states import Failed

    submitted.states += [Failed(message="bad input")]
    with pytest.raises(RuntimeError, match="shard-0: Failed"):
        pool._run_all("p", [{"index": 0}], logging.getLogger("test"))
    assert len(submitted.calls) == 1


def test_waiting_on_a_pool_without_workers_is_one_line(monkeypatch):
    """A re-run that no worker takes (every node gone): one line naming the lost node."""
    scheduled = SimpleNamespace(
        id="r",
        name="shard-0",
        state=SimpleNamespace(is_final=lambda: False, is_scheduled=lambda: True),
    )

    class Client:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read_flow_run(self, run_id):
            return scheduled

    def no_workers(name):
        raise RuntimeError(f"evaluation.work_pool={name!r} has no online worker")

    monkeypatch.setattr("prefect.client.orchestration.get_client", lambda sync_client: Client())
    monkeypatch.setattr(pool, "pool_workers", no_workers)
    monkeypatch.setattr(pool, "HEARTBEAT_S", 0)
    monkeypatch.setattr("time.sleep", lambda s: None)
    with pytest.raises(RuntimeError) as err:
        pool._wait("p", scheduled, "node1 (10.0.0.2)")
    assert str(err.value) == (
        "shard-0 after a run of it was lost on node1 (10.0.0.2): "
        "evaluation.work_pool='p' has no online worker"
    )


def test_the_lost_node_is_the_runs_label():
    """The shard labels its run with its node before it starts (a log line may die unsent with
    the node); a run without the label is named by its process."""
    labelled = SimpleNamespace(labels={pool.NODE_LABEL: "gpu-7 (10.0.0.7)"}, infrastructure_pid="9")
    assert pool.run_node(labelled) == "gpu-7 (10.0.0.7)"
    assert pool.run_node(SimpleNamespace(labels={}, infrastructure_pid="9")) == "worker process 9"


class _AutomationClient:
    """The automation calls of a sync Prefect client, on a server holding ``existing``."""

    def __init__(self, existing: list):
        self.existing, self.created, self.updated = existing, [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def read_deployment_by_name(self, name):
        return SimpleNamespace(id="00000000-0000-0000-0000-000000000001")

    def read_automations_by_name(self, name):
        return [a for a in self.existing if a.name == name]

    def create_automation(self, automation):
        self.created.append(automation)

    def update_automation(self, automation_id, automation):
        self.updated.append((automation_id, automation))


def _windows(automations) -> list[float]:
    return [a.trigger.within.total_seconds() for a in automations]


def test_a_workers_lost_after_sets_the_pools_window(monkeypatch):
    """``eval-worker --lost-after S`` creates the pool's automation with an S-second window or
    replaces the window of the one the server has; without it (a worker or the evaluate flow)
    a missing automation gets the default and an existing one keeps its window."""
    server = _AutomationClient([])
    monkeypatch.setattr("prefect.client.orchestration.get_client", lambda sync_client: server)
    pool.ensure_lost_run_automation("p")
    assert _windows(server.created) == [pool.LOST_AFTER_S]
    assert "for 90 s" in server.created[0].actions[0].message

    custom = pool.lost_run_automation("p", "00000000-0000-0000-0000-000000000001", 40)
    server = _AutomationClient([SimpleNamespace(id="a1", name=custom.name, trigger=custom.trigger)])
    monkeypatch.setattr("prefect.client.orchestration.get_client", lambda sync_client: server)
    pool.ensure_lost_run_automation("p")  # the evaluate flow: the pool's window stays
    pool.ensure_lost_run_automation("p", 40)  # the same window: nothing to update
    assert not server.created and not server.updated
    pool.ensure_lost_run_automation("p", 60)
    assert [i for i, _ in server.updated] == ["a1"]
    assert _windows(a for _, a in server.updated) == [60]
    assert "for 60 s" in server.updated[0][1].actions[0].message


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("30", "lost-after must exceed the shard runs' heartbeat period of 30 s, got 30"),
        ("1.5", "not a whole number of seconds: '1.5'"),
    ],
)
def test_eval_worker_refuses_a_lost_after_a_live_run_would_meet(value, message, capsys):
    """A window no longer than the heartbeat period would crash live runs: one line, and the
    worker never registers."""
    from anchorctx.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["eval-worker", "p", "--lost-after", value])
    assert exit_.value.code == 2
    assert f"argument --lost-after: {message}" in capsys.readouterr().err
