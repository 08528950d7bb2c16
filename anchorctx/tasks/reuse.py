"""Make reused (cached) task runs look different from recomputed ones in the UI.

Prefect names a cache hit's state "Cached" but gives it the Completed type, so in the run lists
both are the same green. Two marks are added:

- the tag ``cached`` on task runs that will be cache hits. Tags are fixed when a task run is
  created, so this is predicted before submission, the way the task engine decides: the task's
  cache key has a record in the result store and the cache is not being refreshed;
- after the run, a task run whose state is "Cached" is renamed ``<name> · cached`` (the name
  shows on every timeline, graph and list), and a flow run whose work was all reused gets the
  ``cached`` tag too.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from prefect.client.orchestration import get_client
from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError
from prefect.results import get_result_store
from prefect.runtime import flow_run

if TYPE_CHECKING:
    from uuid import UUID

    from prefect import Task
    from prefect.states import State

CACHED_TAG = "cached"
CACHED_SUFFIX = " · cached"

log = logging.getLogger(__name__)


def will_be_cached(task: Task, parameters: dict[str, Any], refresh: bool = False) -> bool:
    """Whether submitting ``task`` with ``parameters`` will be a cache hit."""
    if refresh or task.cache_key_fn is None:
        return False

    try:
        key = task.cache_key_fn(None, parameters)  # type: ignore[arg-type]  # our fns ignore it
        # the task's own view of the store, as the engine builds it (the flow's store has a
        # placeholder metadata storage that reads nothing)
        return bool(key) and get_result_store().update_for_task(task).exists(key)
    except Exception as err:  # a prediction only decides a tag; never fail the flow over it
        log.debug("cache prediction failed for %s: %s", task.name, err)
        return False


def tagged(task: Task, parameters: dict[str, Any], refresh: bool = False) -> Task:
    """``task`` with the ``cached`` tag when it will be a cache hit (else unchanged)."""
    if will_be_cached(task, parameters, refresh):
        return task.with_options(tags={*task.tags, CACHED_TAG})
    return task


def was_cached(state: State) -> bool:
    return state.name == "Cached"


def mark_cached(state: State) -> bool:
    """Rename the task run of a cache hit to ``<name> · cached``; returns whether it was one."""
    if not was_cached(state) or state.state_details.task_run_id is None:
        return False
    _rename_task_run(state.state_details.task_run_id)
    return True


def _rename_task_run(task_run_id: UUID, attempts: int = 20) -> None:
    # Task runs reach the server as events, so a cache hit's record can still be missing right
    # after the hit (seen with a second flow run in one process): wait up to ~5 s, then leave
    # the name as it is; the mark is cosmetic and never fails a flow.
    with get_client(sync_client=True) as client:
        for _ in range(attempts):
            try:
                name = client.read_task_run(task_run_id).name
                if not name.endswith(CACHED_SUFFIX):
                    # the client has no task-run update call; the REST API's PATCH takes the name
                    client.request("PATCH", "/task_runs/{id}", path_params={"id": task_run_id},
                                   json={"name": name + CACHED_SUFFIX})  # fmt: skip
                return
            except (ObjectNotFound, PrefectHTTPStatusError) as err:
                status = getattr(getattr(err, "response", None), "status_code", 404)
                if status != 404:
                    raise
                time.sleep(0.25)
        log.warning("task run %s not found: not marked cached", task_run_id)


def tag_flow_run_cached() -> None:
    """Add the ``cached`` tag to the current flow run (its work was all reused)."""
    run_id = flow_run.id
    if run_id is None:
        return
    with get_client(sync_client=True) as client:
        tags = set(client.read_flow_run(run_id).tags)
        if CACHED_TAG not in tags:
            client.update_flow_run(run_id, tags=sorted(tags | {CACHED_TAG}))
