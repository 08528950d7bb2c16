"""Where the two caches meet: the library's products and Prefect's cache records.

The library is the ground truth: it is idempotent by content (a packed dataset, a finished
training run, an evaluation result is reused when its content identity matches) and every
path (CLI, sharded and work-pool evaluation, a refreshed task) relies on that. Prefect's cache
sits on top, keyed by the same identities (:mod:`anchorctx.tasks.caching`): a hit skips the
task run altogether (no training child, no model load) and shows it as **Cached** in the UI.

A cache record only proves that a result was computed, not that its files are still there.
:func:`submission` is the one reconciliation of the two, decided before the task run is
created, exactly as the engine will decide (the task's key, its record in the task's result
store, ``refresh_cache``):

- ``force``: the task recomputes and overwrites its record (``refresh_cache``);
- a record whose recorded value passes ``intact``: the engine will reuse it, so the task run
  is created with the tag ``cached`` and named ``<name> · cached`` (tags and names are fixed
  when the run is created; Prefect gives a hit the state name "Cached" but the Completed
  type, the same green as a recomputed run);
- a record whose product is gone or changed: the task recomputes (``refresh_cache``);
- no record: the task runs as it is (the library may still find its product and return).

A flow run whose work was all reused gets the ``cached`` tag too (:func:`tag_flow_run_cached`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar

from prefect.client.orchestration import get_client
from prefect.results import get_result_store
from prefect.runtime import flow_run
from prefect.settings import PREFECT_TASKS_REFRESH_CACHE
from prefect.tasks import TaskRunNameCallbackWithParameters

from anchorctx.tasks.api import synchronous

if TYPE_CHECKING:
    from prefect import Task
    from prefect.states import State

CACHED_TAG = "cached"
CACHED_SUFFIX = " · cached"
CACHED_STATE = "Cached"  # the name Prefect gives a cache hit's Completed state

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class Submission(Generic[P, R]):
    """A task as it must be submitted, and what will happen to its cache record (generic in the
    task's parameters and return value, so a call of ``.task`` is checked as the task's own)."""

    task: Task[P, R]
    reused: bool = False  # the record will be used: the run shows as Cached
    refresh: bool = False  # the task recomputes and overwrites its record


def submission(
    task: Task[P, R],
    parameters: dict[str, Any],
    *,
    force: bool = False,
    intact: Callable[[Any], bool] = lambda value: True,
) -> Submission[P, R]:
    """``task`` configured for ``parameters`` (the contract is the module's docstring).
    ``intact(value)``: whether the product a record's value names still exists as written."""
    if force:
        return Submission(task.with_options(refresh_cache=True), refresh=True)
    found, value = _cache_record(task, parameters)
    if not found:
        return Submission(task)
    if not intact(value):
        log.warning("%s: cached result %s is gone or changed: computing it again", task.name, value)
        return Submission(task.with_options(refresh_cache=True), refresh=True)
    reused = task.with_options(tags={*task.tags, CACHED_TAG}, task_run_name=_cached_name(task))
    return Submission(reused, reused=True)


def _cached_name(task: Task[P, R]) -> Callable[..., str] | str:
    """The task's run name with `` · cached`` after it (the default name: the task's). A
    callable name keeps its signature: Prefect passes ``parameters`` to one that asks for them."""
    name = task.task_run_name
    if callable(name) and TaskRunNameCallbackWithParameters.is_callback_with_parameters(name):
        with_parameters = name  # narrowed here; the closure below must not re-read `name`
        return lambda parameters: f"{with_parameters(parameters)}{CACHED_SUFFIX}"
    if callable(name):
        plain = name
        return lambda: f"{plain()}{CACHED_SUFFIX}"
    return f"{name or task.name}{CACHED_SUFFIX}"


def _cache_record(task: Task[P, R], parameters: dict[str, Any]) -> tuple[bool, Any]:
    """(whether the engine will find a record for this task run, its value)."""
    refresh = task.refresh_cache
    if refresh or (refresh is None and PREFECT_TASKS_REFRESH_CACHE.value()):
        return False, None
    if task.cache_key_fn is None:
        return False, None
    try:
        key = task.cache_key_fn(None, parameters)  # type: ignore[arg-type]  # ours ignore it
        # the task's own view of the store, as the engine builds it (the flow's store has a
        # placeholder metadata storage that reads nothing)
        store = synchronous(get_result_store().update_for_task(task))
        if not key or not store.exists(key):
            return False, None
        return True, store.read(key).result
    except Exception as err:  # the engine decides again; a failed look-up only costs the mark
        log.debug("cache look-up failed for %s: %s", task.name, err)
        return False, None


def was_cached(state: State) -> bool:
    """The task run reused its cache record."""
    return state.name == CACHED_STATE


def tag_flow_run_cached() -> None:
    """Add the ``cached`` tag to the current flow run (its work was all reused)."""
    run_id = flow_run.id
    if run_id is None:
        return
    with get_client(sync_client=True) as client:
        tags = set(client.read_flow_run(run_id).tags)
        if CACHED_TAG not in tags:
            client.update_flow_run(run_id, tags=sorted(tags | {CACHED_TAG}))
