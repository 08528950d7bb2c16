"""Stage, arm and suite control and terminal progress against the session's real server and
demo run (tests/test_flows_e2e.py's ``served``): one suite of one arm forced, one arm's training
and evaluated on one suite (followed step by step in the terminal), a forced training run
cancelled (the previous run stays, no child process is left), and the demo's TensorBoard logs.
The cache-hit marks are checked in tests/test_ui_browser.py (API and browser)."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest
from test_flows_e2e import _cli, client_for, served  # noqa: F401

from anchorctx.experiment import ExperimentConfig

pytestmark = pytest.mark.slow


def _arm(served, name: str) -> ExperimentConfig:  # noqa: F811
    return {a.variant_name: a for a in served.cfg.arms()}[name]


def _mtimes(run_dir) -> dict[str, int]:
    return {
        str(p.relative_to(run_dir)): p.stat().st_mtime_ns
        for p in (run_dir / "eval").glob("*/*.json")
    }


def _subflow_task_runs(client, parent_id, flow_prefix: str):
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterParentFlowRunId,
    )

    (sub,) = [
        r
        for r in client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])
            )
        )
        if r.name.startswith(flow_prefix)
    ]
    tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[sub.id])))
    return sub, tasks


def _run(served, *args: str):  # noqa: F811
    proc = _cli(["anchorctx", "run", "full-experiment/demo", *args], served.env, cwd=served.tmp)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (run_id,) = [
        line.rsplit("/", 1)[-1]
        for line in proc.stdout.splitlines()
        if line.startswith("[run] UI: http")
    ]
    return proc.stdout, run_id


def test_force_one_arms_training_and_one_suite_leaves_the_rest(served):  # noqa: F811
    """One run: retrain the anchor arm and evaluate its new checkpoints on RULER only, followed
    in the terminal; the anchor arm's other suite and the whole full arm are left alone."""
    anchor, full = _arm(served, "anchor"), _arm(served, "full")
    old_ckpts = sorted(p.name for p in (anchor.run_dir / "checkpoints").iterdir())
    before_full = _mtimes(full.run_dir)
    asides_before = set(anchor.run_dir.parent.glob("anchor.old-*"))
    out, run_id = _run(
        served,
        "--arm",
        "anchor",
        "--stage",
        "train",
        "--stage",
        "evaluate",
        "--suite",
        "ruler",
        "--force",
    )
    steps = anchor.training.steps
    assert f"train · anchor · step {steps}/{steps} (100.0%) · loss " in out, out
    assert "evaluate · anchor · " in out and "checkpoint × suite done" in out, out
    assert "experiment · Completed" in out and " · full " not in out, out
    with client_for(served) as client:
        _, tasks = _subflow_task_runs(client, run_id, "evaluate-")
    evals = {t.name: t.state.name for t in tasks if t.name.startswith("evaluate-")}
    assert len(evals) == len(old_ckpts) and set(evals.values()) == {"Completed"}, evals
    assert all(n.startswith("evaluate-ruler-") for n in evals), evals  # the one suite only
    assert {p.name for p in (anchor.run_dir / "eval").glob("*/*.json")} == {"ruler.json"}
    # the previous run, with its evaluation results, moved aside once the new one finished
    (aside,) = set(anchor.run_dir.parent.glob("anchor.old-*")) - asides_before
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == old_ckpts
    assert {p.name for p in (aside / "eval").glob("*/*.json")} == {"ruler.json", "mmlu.json"}
    assert _mtimes(full.run_dir) == before_full  # the other arm untouched


def test_cancelled_forced_training_keeps_the_previous_run(served):  # noqa: F811
    """A forced training run cancelled mid-way: the flow run ends Cancelled, the training child
    and everything it spawned are gone (no orphans), the previous run's checkpoints stay and
    the partial run is kept aside. (One run checks both: a second endless training and flow
    run cost ~15 s of CPU.)"""
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Cancelling

    anchor = _arm(served, "anchor")
    before = sorted(p.name for p in (anchor.run_dir / "checkpoints").iterdir())
    raw = anchor.model_dump(mode="json")
    raw["training"].update(steps=100_000, save={"every": 50_000, "last": None})
    from anchorctx.tasks.training import task_config_path

    config_path = task_config_path(anchor).resolve()
    with temporary_settings(updates={PREFECT_API_URL: served.server.api_url}):
        run = run_deployment("train/default", parameters={"cfg": raw, "force": True}, timeout=0)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not _train_children(config_path):
        time.sleep(0.5)
    assert _train_children(config_path), "the forced training never started"
    # The child writes the new run directory once its pre-flight checks pass: cancel after that,
    # so there is a partial run to keep aside.
    while time.monotonic() < deadline and not (anchor.run_dir / "config.yaml").exists():
        time.sleep(0.5)
    assert (anchor.run_dir / "config.yaml").exists(), "the forced training never wrote its run"
    time.sleep(3)  # let it get going (and spawn whatever it spawns)
    tree = _train_children(config_path)
    tree = [*tree, *(c for p in tree for c in _safe_children(p))]
    with client_for(served) as client:
        client.set_flow_run_state(run.id, Cancelling(), force=True)
        deadline = time.monotonic() + 120
        while (
            time.monotonic() < deadline
            and not (state := client.read_flow_run(run.id).state).is_final()
        ):
            time.sleep(1)
    assert state.is_cancelled(), state
    _, alive = psutil.wait_procs(tree, timeout=20)
    alive = [p for p in alive if _running(p)]
    assert not alive, f"orphaned: {[(p.pid, p.cmdline()) for p in alive]}"
    assert _train_children(config_path) == []
    assert sorted(p.name for p in (anchor.run_dir / "checkpoints").iterdir()) == before
    assert not anchor.run_dir.with_name("anchor.previous").exists()
    assert list(anchor.run_dir.parent.glob("anchor.failed-*"))  # the partial run, kept aside


def test_demo_run_logged_to_tensorboard(served):  # noqa: F811
    """The demo config tracks to TensorBoard: training steps, every evaluation score and the
    report reach event files from the flow run's processes (training child, flow process)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from test_tracking import _tb_scalars

    from anchorctx.io import read_jsonl

    assert served.cfg.tracking.backends == ["tensorboard"]
    full = _arm(served, "full")
    scalars = _tb_scalars(full.run_dir / "tensorboard")
    losses = [(r["step"], r["loss"]) for r in read_jsonl(full.run_dir / "metrics.jsonl")]
    assert [(s, pytest.approx(v, rel=1e-6)) for s, v in scalars["train/loss"]] == losses
    steps = {s for s, _ in scalars["eval/ruler/average/512"]}
    assert steps == {1, 2}  # both checkpoints' RULER scores
    assert "eval_mean/mmlu/mmlu/acc" in scalars
    report = EventAccumulator(str(served.cfg.experiment_dir / "tensorboard"))
    report.Reload()
    assert "report/ruler_by_length" in report.Tags()["images"]


# ------------------------------------------------------------------ the training child's tree
def _train_children(config_path: Path) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = p.info["cmdline"] or []
        if str(config_path) in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
            out.append(p)
    return out


def _safe_children(p: psutil.Process) -> list[psutil.Process]:
    try:
        return p.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
