"""Follow a flow run in the terminal: stage, arm, step/total, loss and ETA, and the UI link.

``prefect deployment run --watch`` prints only a heartbeat; everything the user wants to see is
in the run logs. This follows a flow run and its subflows through the Prefect API, reads their
new log lines, and prints one short line when something changes:

    [01:23:45] train · anchor · step 12/20 (60.0%) · loss 5.4321 · eta 0m42s
    [01:24:02] evaluate · anchor · 3/8 checkpoint × suite done (2 cached)
    [01:24:30] train · full · Completed (cached)

Step lines are throttled (``min_interval_s``); stage changes always print. A server that stops
answering is waited for (a restart), then reported in one line with how to resume.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any
from uuid import UUID

from anchorctx.tasks.api import ServerUnreachable, api_url, describe, unreachable

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient

# The training loop's per-step line (anchorctx.training.metrics.step_line), as streamed into
# the train task's log: "step 12/2000 (0.6%) | loss 2.3456 | ... | eta 1h02m".
STEP = re.compile(
    r"step\s+(?P<step>\d+)/(?P<total>\d+)\s+\((?P<pct>[\d.]+)%\)\s+\|\s+loss\s+(?P<loss>\S+)"
    r".*\|\s+eta\s+(?P<eta>\S+)"
)
STAGE_OF_FLOW = {
    "prepare-data": "data",
    "train": "train",
    "evaluate": "evaluate",
    "full-experiment": "experiment",
    "rope-precision": "rope-precision",
}


def parse_step(message: str) -> dict[str, str] | None:
    """The step, total, percentage, loss and ETA of a training log line (None: not one)."""
    m = STEP.search(message)
    return m.groupdict() if m else None


def arm_of(run_name: str, flow_name: str, experiment: str | None) -> str | None:
    """The arm in a stage run's name ``<flow>-<experiment>-<arm>`` (None: not per arm)."""
    prefix = f"{flow_name}-{experiment}-" if experiment else f"{flow_name}-"
    if not run_name.startswith(prefix) or flow_name in ("prepare-data", "full-experiment"):
        return None
    return run_name[len(prefix) :] or None


def step_text(stage: str, arm: str | None, step: dict[str, str]) -> str:
    where = f"{stage} · {arm}" if arm else stage
    return (
        f"{where} · step {step['step']}/{step['total']} ({step['pct']}%) · "
        f"loss {step['loss']} · eta {step['eta']}"
    )


def state_text(stage: str, arm: str | None, state_name: str, cached: bool) -> str:
    where = f"{stage} · {arm}" if arm else stage
    return f"{where} · {state_name}" + (" (cached)" if cached and state_name != "Cached" else "")


def evaluate_text(arm: str | None, done: int, total: int, cached: int) -> str:
    where = f"evaluate · {arm}" if arm else "evaluate"
    return f"{where} · {done}/{total} checkpoint × suite done ({cached} cached)"


@dataclass
class _Run:
    name: str
    stage: str
    arm: str | None
    state: str = ""
    tags: list[str] = field(default_factory=list)


class Follower:
    """Polls one flow run and its subflows; ``poll()`` prints what changed and returns the root
    run's state (final once the run has finished)."""

    def __init__(
        self,
        client: SyncPrefectClient,
        flow_run_id: UUID,
        *,
        out: Callable[[str], None] = print,
        min_interval_s: float = 5.0,
    ) -> None:
        self.client = client
        self.root = flow_run_id
        self.out = out
        self.min_interval_s = min_interval_s
        self.runs: dict[UUID, _Run] = {}
        self.flow_names: dict[UUID, str] = {}
        self.experiment: str | None = None
        self.since: datetime | None = None
        self.seen_logs: set[UUID] = set()
        self.last_step: dict[UUID, tuple[float, str]] = {}
        self.eval_text: dict[UUID, str] = {}
        self.eval_final: set[UUID] = set()

    def _say(self, text: str) -> None:
        self.out(f"[{time.strftime('%H:%M:%S')}] {text}")

    def _flow_name(self, flow_id: UUID) -> str:
        if flow_id not in self.flow_names:
            self.flow_names[flow_id] = self.client.read_flow(flow_id).name
        return self.flow_names[flow_id]

    def _tree(self) -> list[Any]:
        """The root flow run and every subflow run below it."""
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

        root = self.client.read_flow_run(self.root)
        if self.experiment is None:
            cfg = (root.parameters or {}).get("cfg")
            self.experiment = cfg.get("name") if isinstance(cfg, dict) else None
        runs, frontier = [root], [root.id]
        while frontier:
            children = self.client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=frontier)
                )
            )
            runs += children
            frontier = [c.id for c in children]
        return runs

    def poll(self) -> Any:
        runs = self._tree()
        for run in runs:
            self._state(run)
        self._logs([r.id for r in runs])
        for run in runs:
            info = self.runs[run.id]
            # while it runs, and once more at its end (short runs finish between two polls)
            if info.stage == "evaluate" and (
                info.state == "Running" or (run.state.is_final() and run.id not in self.eval_final)
            ):
                self._evaluation(run.id, info)
                if run.state.is_final():
                    self.eval_final.add(run.id)
        return runs[0].state

    def _state(self, run: Any) -> None:
        flow = self._flow_name(run.flow_id)
        info = self.runs.get(run.id)
        if info is None:
            stage = STAGE_OF_FLOW.get(flow, flow)
            info = self.runs[run.id] = _Run(
                run.name, stage, arm_of(run.name, flow, self.experiment)
            )
        elif info.name != run.name:
            # A subflow run can be read before its name is rendered from the flow's run-name
            # template (Prefect names it at creation, then renames it): take the arm from the
            # name it has now, or every line of that run would lack it.
            info.name, info.arm = run.name, arm_of(run.name, flow, self.experiment)
        state = run.state.name if run.state else "Pending"
        if state != info.state:
            info.state = state
            if run.id != self.root or run.state.is_final():
                cached = "cached" in (run.tags or [])
                self._say(state_text(info.stage, info.arm, state, cached))

    def _logs(self, run_ids: list[UUID]) -> None:
        from prefect.client.schemas.filters import (
            LogFilter,
            LogFilterFlowRunId,
            LogFilterTimestamp,
        )
        from prefect.client.schemas.sorting import LogSort

        log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=run_ids))
        if self.since is not None:
            log_filter.timestamp = LogFilterTimestamp(after_=self.since)
        for entry in self.client.read_logs(log_filter, limit=200, sort=LogSort.TIMESTAMP_ASC):
            if entry.id in self.seen_logs:  # ``after_`` includes the boundary timestamp
                continue
            self.seen_logs.add(entry.id)
            self.since = entry.timestamp
            run_id = entry.flow_run_id
            step = parse_step(entry.message)
            info = self.runs.get(run_id) if run_id else None
            if step is None or info is None or run_id is None:
                continue
            text = step_text(info.stage, info.arm, step)
            last_t, _ = self.last_step.get(run_id, (0.0, ""))
            final = step["step"] == step["total"]
            if final or time.monotonic() - last_t >= self.min_interval_s:
                self.last_step[run_id] = (time.monotonic(), text)
                self._say(text)

    def _evaluation(self, run_id: UUID, info: _Run) -> None:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        tasks = self.client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))
        )
        evals = [t for t in tasks if t.name.startswith("evaluate-")]
        if not evals:
            return
        done = [t.state for t in evals if t.state is not None and t.state.is_final()]
        cached = sum(state.name == "Cached" for state in done)
        text = evaluate_text(info.arm, len(done), len(evals), cached)
        if text != self.eval_text.get(run_id):
            self.eval_text[run_id] = text
            self._say(text)


def flow_run_url(flow_run_id: UUID) -> str | None:
    from prefect.utilities.urls import url_for

    return url_for("flow-run", obj_id=flow_run_id)


def resume_hint(flow_run_id: UUID) -> str:
    """How to pick a run up again after losing the server (one line's tail)."""
    return (
        f"the flow run goes on in its own process (`anchorctx serve`) as long as it needs no "
        f"answer from the server: when the server is back, follow it again with `anchorctx run "
        f"--follow {flow_run_id}`; if it failed meanwhile, run the same `anchorctx run` command "
        "again (finished stages are reused from the caches, training resumes)"
    )


def follow(
    client: SyncPrefectClient,
    flow_run_id: UUID,
    *,
    poll_s: float = 2.0,
    out: Callable[[str], None] = print,
    min_interval_s: float = 5.0,
    reconnect_s: float = 120.0,
    clock: Callable[[], float] = time.monotonic,
) -> Any:
    """Print progress until the flow run is final; returns its final state.

    The server going away (a restart) is waited out for ``reconnect_s`` seconds, with one line
    saying so; after that :class:`~anchorctx.tasks.api.ServerUnreachable` says in one line which
    server did not answer and how to resume."""
    follower = Follower(client, flow_run_id, out=out, min_interval_s=min_interval_s)
    lost_since: float | None = None
    final_state = None
    while True:
        try:
            if final_state is not None:
                follower.poll()  # the last log lines arrive after the final state
                return final_state
            state = follower.poll()
        except Exception as err:
            lost = unreachable(err)
            if lost is None:
                raise
            now = clock()
            if lost_since is None:
                lost_since = now
                follower._say(
                    f"the Prefect server at {api_url()} does not answer ({describe(lost)}); "
                    f"waiting up to {reconnect_s:.0f} s for it"
                )
            elif now - lost_since >= reconnect_s:
                raise ServerUnreachable(api_url(), lost, resume_hint(flow_run_id)) from None
            time.sleep(poll_s)
            continue
        if lost_since is not None:
            follower._say(f"the Prefect server at {api_url()} answers again")
            lost_since = None
        if state is not None and state.is_final():
            final_state = state
            continue
        time.sleep(poll_s)
