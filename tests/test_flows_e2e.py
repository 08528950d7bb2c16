"""End to end against a real Prefect server: `anchorctx serve` + `prefect deployment run
full-experiment/demo --watch` on a config smaller than the demo; artifacts; cached
re-evaluation; a changed checkpoint re-evaluated. (A cancelled training run leaves no child
processes: tests/test_flows_stage_control.py, on its forced run.)

One server, one runner and one demo run serve the whole session (``served`` below, shared with
tests/test_ui_browser.py); each test only adds its own flow run.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import psutil
import pytest
import yaml
from shared_prefect import premigrated_database

from anchorctx.experiment import ExperimentConfig, load_config
from anchorctx.flows.server import PrefectServer, start_server

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 900


def small_config(tmp: Path) -> dict[str, Any]:
    """configs/demo.yaml shrunk: two arms, a tiny model, 2 steps, 2 checkpoints, few samples.
    The anchor arm evaluates two suites only (an arm override), which keeps the re-evaluation
    test short; the full arm covers all four (every report table)."""
    raw = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    corpus, fixtures = tmp / "corpus", tmp / "eval"
    raw.update(name="flowtest", run_root=str(tmp / "runs"))
    raw["model"]["tiny"].update(hidden_size=64, intermediate_size=128)
    raw["model"]["tokenizer"] = str(corpus / "tokenizer")
    # 4 documents a domain (the demo writes 40): still every domain, and far more text than the
    # 2 steps x 2 rows of 512 tokens an arm trains on. The flow writes the corpus and packs
    # (tokenizes) all of it: half the data and the time of 12 a domain.
    raw["data"].update(
        demo_corpus={"dir": str(corpus), "seed": 0, "docs_per_domain": 4},
        sources=[{"path": str(corpus / "data")}],
        seq_len=512,
        token_budget=40_000,
    )
    raw["training"].update(
        steps=2,
        global_batch_size=2,
        micro_batch_size=1,
        warmup_steps=0,
        save={"every": 1, "last": None},
    )
    ev = raw["evaluation"]
    ev.update(demo_fixtures=str(fixtures), last_k=2, batch_size=2)
    # fit tight: at 512 tokens RULER's smallest haystack overflows the demo tokenizer's budget.
    ev["ruler"].update(
        lengths=[512],
        num_samples=1,
        tasks=["niah_single_1"],
        fit="tight",
        essay_path=str(fixtures / "essays.json"),
        squad_path=str(fixtures / "squad.json"),
        hotpotqa_path=str(fixtures / "hotpotqa.json"),
        nltk_data=str(fixtures / "nltk_data"),
    )
    ev["longbench"].update(
        data_dir=str(fixtures / "longbench"),
        limit=1,
        datasets=["passage_count", "passage_retrieval_en"],
        max_length=480,
    )
    ev["harness"].update(
        mmlu_dir=str(fixtures / "mmlu"),
        hellaswag_dir=str(fixtures / "hellaswag"),
        limit=2,
        mmlu_fewshot=1,
    )
    # The study runs twice (in the demo's report and in the rope-precision deployment's run),
    # the learned-weights part once per arm: at 128 tokens every shift and two lengths are
    # still measured, in half the time of 256.
    raw["analysis"]["rope_precision"].update(
        seq_len=128, num_sequences=2, lengths=[64, 128], shifts=[0, 4, 16, 64]
    )
    raw["variants"] = [
        {"name": "full", "attention": "full"},
        {
            "name": "anchor",
            "attention": "anchor",
            "overrides": {"evaluation.suites": ["ruler", "mmlu"]},
        },
    ]
    return raw


@dataclass
class Served:
    server: PrefectServer
    runner: subprocess.Popen
    cfg: ExperimentConfig
    env: dict[str, str]
    tmp: Path
    demo: subprocess.CompletedProcess
    demo_run_id: UUID


_SHARED: dict[str, Served] = {}


def _cli(args: list[str], env: dict[str, str], timeout: float = RUN_TIMEOUT_S, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _wait_for_deployment(name: str, api_url: str, runner: subprocess.Popen, log: Path):
    """Until the runner has registered deployment ``name`` (asked through the API from this
    process: a `prefect` command per poll would cost an interpreter start each)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deadline = time.monotonic() + 180
    with (
        temporary_settings(updates={PREFECT_API_URL: api_url}),
        get_client(sync_client=True) as client,
    ):
        while time.monotonic() < deadline:
            if runner.poll() is not None:
                pytest.fail(
                    f"anchorctx serve exited ({runner.returncode}):\n{log.read_text()[-4000:]}"
                )
            try:
                client.read_deployment_by_name(name)
                return
            except ObjectNotFound:
                time.sleep(0.5)
    pytest.fail(f"deployment {name} never appeared:\n{log.read_text()[-4000:]}")


def run_deployment_cli(served_env: dict[str, str], name: str, *params: str, cwd=None):
    """`prefect deployment run NAME --watch`; returns (completed process, flow run id)."""
    args = ["prefect", "deployment", "run", name, "--watch"]
    for p in params:
        args += ["--param", p]
    proc = _cli(args, served_env, cwd=cwd)
    match = re.search(r"UUID:\s*([0-9a-f-]{36})", proc.stdout)
    return proc, UUID(match.group(1)) if match else None


def _start(tmp: Path) -> Served:
    premigrated_database(tmp / "prefect-home" / "prefect.db")  # PREFECT_HOME's database
    server = start_server(tmp / "prefect-home")
    # The runner looks for new deployment runs every second (Prefect's default: every 10 s, an
    # idle wait of up to 10 s before each flow run these tests start).
    env = {**os.environ, **server.env, "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    try:
        cfg_path = tmp / "flowtest.yaml"
        cfg_path.write_text(yaml.safe_dump(small_config(tmp), sort_keys=False))
        log = tmp / "serve.log"
        with log.open("wb") as fh:
            runner = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "anchorctx",
                    "serve",
                    "--configs",
                    str(REPO / "configs"),
                    "--demo-config",
                    str(cfg_path),
                ],
                cwd=tmp,
                env=env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _wait_for_deployment("full-experiment/demo", server.api_url, runner, log)
        demo, run_id = run_deployment_cli(env, "full-experiment/demo", cwd=tmp)
    except BaseException:
        server.stop()
        raise
    return Served(server, runner, load_config(cfg_path), env, tmp, demo, run_id)


def _stop(served: Served) -> None:
    # Flow runs are the runner's children in their own process groups: stop them first (they
    # stop their training process groups), then the runner, then the server.
    with contextlib.suppress(psutil.NoSuchProcess):
        runs = psutil.Process(served.runner.pid).children(recursive=True)
        for p in runs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.terminate()
        psutil.wait_procs(runs, timeout=20)
    # The runner is killed outright: on SIGTERM it first pauses every deployment through the
    # API (~4 s of requests to a server that is stopped next anyway).
    with contextlib.suppress(ProcessLookupError):
        os.killpg(served.runner.pid, 9)
    served.runner.wait(timeout=20)
    served.server.stop()


def shared_served(tmp_path_factory, pytestconfig) -> Served:
    """The session's server + runner + completed demo run (started on first use)."""
    if "served" not in _SHARED:
        served = _start(tmp_path_factory.mktemp("flows"))
        _SHARED["served"] = served
        pytestconfig.add_cleanup(stop_served)
    return _SHARED["served"]


def stop_served() -> None:
    """Stop the runner and server (tests/conftest.py: after the last test using them; else at
    the end of the session)."""
    if (served := _SHARED.pop("served", None)) is not None:
        _stop(served)


@pytest.fixture(scope="session")
def served(tmp_path_factory, pytestconfig) -> Served:
    return shared_served(tmp_path_factory, pytestconfig)


@contextlib.contextmanager
def client_for(served: Served):
    """A synchronous Prefect client bound to the test server (not the process-wide settings)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    # Sequential: the client is created once the temporary settings apply.
    with (
        temporary_settings(updates={PREFECT_API_URL: served.server.api_url}),
        get_client(sync_client=True) as client,
    ):
        yield client


# ------------------------------------------------------------------------------------- tests
def test_serve_refuses_without_api_url(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = str(tmp_path)
    proc = _cli(["anchorctx", "serve"], env, timeout=120)
    assert proc.returncode == 2
    assert "PREFECT_API_URL is not set" in proc.stderr and "ephemeral" in proc.stderr


def test_demo_deployment_completes_with_artifacts(served):
    assert served.demo.returncode == 0, served.demo.stdout[-4000:] + served.demo.stderr[-4000:]
    assert served.demo_run_id is not None
    with client_for(served) as client:
        run = client.read_flow_run(served.demo_run_id)
        assert run.state.is_completed()
        flows = {f.id: f.name for f in client.read_flows()}
        runs = client.read_flow_runs()
        by_flow: dict[str, list] = {}
        for r in runs:
            by_flow.setdefault(flows[r.flow_id], []).append(r)
        keys = {(a.key, a.type) for a in client.read_artifacts()}
    # One prepare-data (both arms share the data), a train and an evaluate run per arm.
    assert len(by_flow["prepare-data"]) == 1
    assert len(by_flow["train"]) == 2 and len(by_flow["evaluate"]) == 2
    assert all(r.state.is_completed() for rs in by_flow.values() for r in rs)
    for key, kind in [
        ("flowtest-ruler-by-length", "table"),
        ("flowtest-longbench-categories", "table"),
        ("flowtest-mmlu-hellaswag", "table"),
        ("flowtest-ruler-by-length-plot", "image"),
        ("flowtest-training-loss-plot", "image"),
        ("flowtest-rope-precision-plot", "image"),
        ("flowtest-report", "markdown"),
        ("flowtest-anchor-train", "markdown"),
        ("train-flowtest-anchor", "progress"),
        ("evaluate-flowtest-anchor", "progress"),
    ]:
        assert (key, kind) in keys, f"missing {kind} artifact {key}: {sorted(keys, key=str)}"
    report = served.cfg.experiment_dir / "report.md"
    assert report.is_file() and "anchor" in report.read_text()
    # What differs among the arms, and the provenance naming every arm.
    text = report.read_text()
    for section in (
        "## Experiment",
        "### Training loss",
        "### Attention work",
        "### BF16 vs FP32 RoPE",
        "(at chance)",
    ):
        assert section in text, f"report.md lacks {section!r}"
    for arm in served.cfg.arms():
        assert f"| `{arm.variant_name}` | {arm.training.attention} |" in text
    for png in ("training_loss.png", "rope_precision/rope_precision.png"):
        assert (served.cfg.experiment_dir / png).is_file()
    with client_for(served) as client:
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

        arts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["flowtest-report"]))
        )
    assert arts
    for art in arts:  # one version per full-experiment run of this session
        # The plots travel inline (the UI cannot fetch local files); the provenance names
        # every arm.
        assert "data:image/png;base64," in art.data and "](training_loss.png)" not in art.data
        assert "](rope_precision/rope_precision.png)" not in art.data
        assert "- experiment: `flowtest`, 2 arms: `full` (full" in art.data


def test_second_evaluate_is_cached_and_changed_checkpoint_reevaluates(served):
    from anchorctx.models.checkpoints import list_checkpoints

    arm = {a.variant_name: a for a in served.cfg.arms()}["anchor"]
    checkpoints = list_checkpoints(arm.run_dir)
    assert len(checkpoints) == 2
    changed = checkpoints[0]
    (changed / "NOTE.txt").write_text("edited after evaluation: new content hash\n")
    proc, run_id = run_deployment_cli(
        served.env, "evaluate/default", "variant=anchor", cwd=served.tmp
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with client_for(served) as client:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))
        )
    evals = [t for t in task_runs if t.name.startswith("evaluate-")]
    assert len(evals) == len(checkpoints) * len(arm.evaluation.suites)
    states = {t.name: t.state.name for t in evals}
    for name, state in states.items():
        expected = "Completed" if name.endswith(changed.name) else "Cached"
        assert state == expected, states


def test_rope_precision_deployment_publishes_plot_and_summary(served):
    proc, run_id = run_deployment_cli(served.env, "rope-precision/default", cwd=served.tmp)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with client_for(served) as client:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        arts = client.read_artifacts(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))
        )
    kinds = {a.key: a.type for a in arts}
    assert kinds.get("flowtest-rope-precision") == "image", kinds
    assert kinds.get("flowtest-rope-precision-summary") == "markdown", kinds
