"""The Prefect UI in headless Chromium shows the demo run Completed, with its artifacts, and
renders the RULER plot artifact. Uses the session's server and demo run from test_flows_e2e.

Needs Debian's chromium (`apt-get install -y chromium`) and the `playwright` package (dev extra);
skipped with the reason when either is missing. A screenshot is saved in the test's tmp dir.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from test_flows_e2e import client_for, run_deployment_cli, served  # noqa: F401  (shared session)

CHROMIUM = Path("/usr/bin/chromium")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="needs Debian chromium at /usr/bin/chromium: apt-get install -y chromium",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("playwright") is None,
        reason="needs the playwright package: pip install -e .[dev]",
    ),
]

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
]
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def page():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(TIMEOUT_MS)
        yield page
        browser.close()


def test_demo_run_completed_with_artifacts_in_ui(served, page, tmp_path):  # noqa: F811
    assert served.demo_run_id is not None, "the demo run did not start"
    page.goto(f"{served.server.ui_url}/v2/runs/flow-run/{served.demo_run_id}?tab=Artifacts")
    page.get_by_text("Completed").first.wait_for()
    page.get_by_text("full-experiment-flowtest").first.wait_for()
    for key in (
        "flowtest-report",
        "flowtest-ruler-by-length",
        "flowtest-mmlu-hellaswag",
        "flowtest-ruler-by-length-plot",
    ):
        page.get_by_text(key, exact=True).first.wait_for()
    page.screenshot(path=str(tmp_path / "demo-run-artifacts.png"), full_page=True)

    # The plot travels as a data: URI inside the image artifact: the UI must render it. The key
    # opens the artifact's history; its newest version (an 8-hex-digit id link) the content.
    page.get_by_text("flowtest-ruler-by-length-plot", exact=True).first.click()
    page.locator("a").filter(has_text=re.compile(r"^[0-9a-f]{8}$")).first.click()
    image = page.locator("img[src^='data:image/png']").first
    image.wait_for()
    width = page.wait_for_function(
        "el => el.complete && el.naturalWidth", arg=image.element_handle()
    )
    assert width.json_value() > 100
    page.screenshot(path=str(tmp_path / "ruler-plot-artifact.png"), full_page=True)


def test_cached_runs_are_marked_in_ui(served, page, tmp_path):  # noqa: F811
    """A cache-hit evaluation shows as such: its flow run carries the ``cached`` tag, and each
    reused task run says "Cached" and is named ``… · cached``."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from anchorctx.tasks.reuse import CACHED_SUFFIX, CACHED_TAG

    # The demo run evaluated the full arm: evaluating its RULER results again reuses them all.
    # (Through the CLI: playwright's sync API runs an event loop in this thread.)
    proc, run_id = run_deployment_cli(
        served.env, "evaluate/default", "variant=full", 'suites=["ruler"]', cwd=served.tmp
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with client_for(served) as client:
        run = client.read_flow_run(run_id)
        tasks = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))
        )
    evals = [t for t in tasks if t.name.startswith("evaluate-")]
    assert evals and all(t.state.name == "Cached" for t in evals), [t.name for t in tasks]
    assert all(t.name.endswith(CACHED_SUFFIX) and CACHED_TAG in t.tags for t in evals), [
        (t.name, t.tags) for t in evals
    ]
    assert CACHED_TAG in run.tags
    cached = evals

    page.goto(f"{served.server.ui_url}/v2/runs/flow-run/{run.id}")
    assert run.name == "evaluate-flowtest-full"  # named after the arm it evaluated
    page.get_by_text(run.name).first.wait_for()
    page.get_by_text(CACHED_TAG, exact=True).first.wait_for()  # the flow run's tag
    page.screenshot(path=str(tmp_path / "cached-flow-run.png"), full_page=True)

    page.goto(f"{served.server.ui_url}/v2/runs/task-run/{cached[0].id}")
    page.get_by_text(cached[0].name).first.wait_for()  # "evaluate-ruler-step-… · cached"
    page.get_by_text("Cached", exact=True).first.wait_for()  # the state
    page.get_by_text(CACHED_TAG, exact=True).first.wait_for()  # the task run's tag
    page.screenshot(path=str(tmp_path / "cached-task-run.png"), full_page=True)
