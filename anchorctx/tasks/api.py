"""The connection to the Prefect API: a lost server is one line, and cancelling still works
after the server restarts.

Two things go wrong when the Prefect server restarts under a running flow (docs/RELIABILITY.md):

- Every API call of the flow process fails until the server answers again; Prefect's client
  retries for a while, then raises a bare ``httpx.ConnectError``. :func:`unreachable` finds such
  an error (however wrapped), :class:`ServerUnreachable` says in one line which server did not
  answer and how to resume, and :func:`api_errors` turns a flow body's lost connection into it.
  Calls that only report (the training progress artifact) skip while the server is away: the
  training child runs on.
- The runner (``anchorctx serve``) learns of a cancel from the server's event stream, falling
  back to polling; when both fail for ~30 s (a restart), Prefect gives up watching for the rest
  of the runner's life: a later cancel stays "Cancelling" and training runs to its end.
  :class:`CancelWatch`, a thread in every flow process a runner or worker starts, asks the API
  itself (tolerating any outage): when the flow run is Cancelling and the runner has not
  stopped it after ``grace_s``, it marks the run Cancelled and stops the process the runner's
  way (its "cancel" intent, then SIGTERM): Prefect's SIGTERM bridge raises in the flow, and
  :func:`anchorctx.process.run_process_group` kills the training process group.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar
from uuid import UUID

import httpx

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

# Status codes a restarting server (or a proxy in front of it) answers with.
UNAVAILABLE_STATUS = frozenset({502, 503, 504})


# Prefect is imported inside the functions that use it: the follower of `anchorctx run` and the
# error path import this module for :func:`unreachable` before (or without) loading Prefect.


def api_url() -> str:
    """The API the clients of this process talk to (``PREFECT_API_URL``)."""
    from prefect.settings import get_current_settings

    return get_current_settings().api.url or "(PREFECT_API_URL is not set)"


def synchronous(value: T | Coroutine[Any, Any, T]) -> T:
    """The value of one of Prefect's sync-or-async functions (``async_dispatch``: its type is
    ``T | Coroutine``) called from synchronous code, where it returns ``T``. A coroutine means
    it was called inside an event loop, which this project never does: an error, not a
    coroutine passed on never awaited."""
    if isinstance(value, Coroutine):
        value.close()
        raise TypeError("a Prefect call returned a coroutine: it ran inside an event loop")
    return value


def unreachable(err: BaseException | None) -> BaseException | None:
    """The connection error behind ``err`` (a transport error such as ``httpx.ConnectError``, or
    a 502/503/504 answer), following ``__cause__`` / ``__context__``; None: not one."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, httpx.TransportError):
            return err
        if isinstance(err, httpx.HTTPStatusError) and (
            err.response.status_code in UNAVAILABLE_STATUS
        ):
            return err
        if isinstance(err, ServerUnreachable):
            return err.error
        err = err.__cause__ or err.__context__
    return None


def describe(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


class ServerUnreachable(RuntimeError):
    """The Prefect server did not answer; one line: which server, why, how to resume."""

    exit_code = 1

    def __init__(self, url: str, error: BaseException, resume: str) -> None:
        self.url, self.error = url, error
        super().__init__(
            f"the Prefect server at {url} is unreachable ({describe(error)}); {resume}"
        )


def flow_resume_hint() -> str:
    """What to do about a flow run that stopped because the server went away."""
    from prefect.runtime import deployment, flow_run

    name = flow_run.flow_name
    target = f"{name}/{deployment.name}" if deployment.name else None
    again = f"`anchorctx run {target}` (with the same options)" if target else "this flow"
    return (
        f"this flow run stopped, its finished work is kept: once the server answers, run "
        f"{again} again: cached stages are reused and training resumes from its resume state"
    )


def api_errors(fn: F) -> F:
    """For a flow body: start the :class:`CancelWatch` of this process, and turn a lost API
    connection escaping the body into :class:`ServerUnreachable` (the run's state message and
    the flow's error are then one line that names the server and how to resume)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start_cancel_watch()
        try:
            return fn(*args, **kwargs)
        except ServerUnreachable:
            raise
        except Exception as err:
            lost = unreachable(err)
            if lost is None:
                raise
            raise ServerUnreachable(api_url(), lost, flow_resume_hint()) from err

    # ``fn``'s signature with its annotations resolved in ``fn``'s module: Prefect builds the
    # parameter model from the signature but resolves names in the wrapper's module, which
    # does not define the names a flow's string annotations use.
    wrapper.__signature__ = inspect.signature(fn, eval_str=True)  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


# --------------------------------------------------------------------- reporting calls
class Reporting:
    """Wraps API calls that only report (progress): while the server is away they are skipped
    with one warning, so a restart never kills the work they report on."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.away = False

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            result = fn(*args, **kwargs)
        except Exception as err:
            lost = unreachable(err)
            if lost is None:
                raise
            if not self.away:
                log.warning(
                    "the Prefect server at %s is unreachable (%s): %s not updated until it "
                    "answers again; the work goes on",
                    api_url(),
                    describe(lost),
                    self.what,
                )
                self.away = True
            return None
        if self.away:
            log.info("the Prefect server at %s answers again: %s updated", api_url(), self.what)
            self.away = False
        return result


# ------------------------------------------------------------------------ cancellation
def _read_state(flow_run_id: UUID) -> Any:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state


def _mark_cancelled(flow_run_id: UUID, message: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Cancelled(message=message), force=True)


def _runner_intent() -> str | None:
    """The control intent the runner delivered to this process (it does so before its
    SIGTERM); None: the runner has not acted."""
    try:
        from prefect._internal.control_listener import get_intent
    except ImportError:  # another Prefect: no control channel
        return None
    return get_intent()


def _commit_cancel_intent() -> None:
    """Tell Prefect's flow engine that the coming SIGTERM is a cancellation (as the runner's
    control channel does), so nested flow runs end Cancelled rather than Crashed."""
    # Prefect 3.8.8's own intent flag (private: pinned by the lock; without it the flow runs
    # inside end Crashed, the process is stopped all the same).
    with contextlib.suppress(ImportError, AttributeError):
        from prefect._internal.control_listener import _set_intent

        _set_intent("cancel")


def _terminate_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


class CancelWatch:
    """Polls the state of this process' flow run and stops the process when it was cancelled
    and the runner did not stop it (the runner's own watch dies with a server restart)."""

    def __init__(
        self,
        flow_run_id: UUID,
        *,
        interval_s: float = 10.0,
        grace_s: float = 45.0,
        read_state: Callable[[UUID], Any] = _read_state,
        mark_cancelled: Callable[[UUID, str], None] = _mark_cancelled,
        terminate: Callable[[], None] = _terminate_self,
        runner_intent: Callable[[], str | None] = _runner_intent,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.flow_run_id = flow_run_id
        self.interval_s = interval_s
        # Longer than the runner's own kill (SIGTERM, SIGKILL 30 s later): a runner that still
        # watches has always acted first.
        self.grace_s = grace_s
        self._read_state = read_state
        self._mark_cancelled = mark_cancelled
        self._terminate = terminate
        self._runner_intent = runner_intent
        self._clock = clock
        self._seen: float | None = None  # when the cancel was first seen
        self._away = False
        self.stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> str:
        """One look at the flow run; returns what happened ("running", "unreachable",
        "cancelling", "runner", "stopped")."""
        try:
            state = self._read_state(self.flow_run_id)
        except Exception as err:
            lost = unreachable(err)
            if lost is None:
                log.debug("cancel watch: cannot read flow run %s: %s", self.flow_run_id, err)
                return "error"
            if not self._away:
                log.warning(
                    "the Prefect server at %s is unreachable (%s): the run goes on; a cancel is "
                    "noticed once the server answers again",
                    api_url(),
                    describe(lost),
                )
                self._away = True
            return "unreachable"
        if self._away:
            log.info("the Prefect server at %s answers again", api_url())
            self._away = False
        if state is None or not (state.is_cancelling() or state.is_cancelled()):
            self._seen = None
            return "running"
        now = self._clock()
        if self._seen is None:
            self._seen = now
        if now - self._seen < self.grace_s:
            return "cancelling"
        if self._runner_intent() is not None:
            return "runner"  # the runner delivered its intent: its SIGTERM is on the way
        self.stop_run(state)
        return "stopped"

    def stop_run(self, state: Any) -> None:
        """Mark the run Cancelled (what the runner would do once the process ended) and stop
        this process the runner's way."""
        message = (
            f"cancelled: the flow run stayed {state.name} for {self.grace_s:.0f} s without the "
            "runner stopping it (its cancellation watch ends when the Prefect server restarts); "
            "stopped by the flow process itself, its child processes killed"
        )
        log.warning("flow run %s %s", self.flow_run_id, message)
        if state.is_cancelling():
            try:
                self._mark_cancelled(self.flow_run_id, message)
            except Exception as err:  # the process is stopped regardless
                log.warning("could not mark flow run %s Cancelled: %s", self.flow_run_id, err)
        self.stopped.set()
        _commit_cancel_intent()
        self._terminate()

    def _loop(self) -> None:
        while not self.stopped.is_set():
            try:
                self.poll()
            except Exception as err:  # never let the watch die silently
                log.debug("cancel watch: %s", err)
            self.stopped.wait(self.interval_s)

    def start(self) -> CancelWatch:
        self._thread = threading.Thread(
            target=self._loop, name="anchorctx-cancel-watch", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        self.stopped.set()


_WATCH: CancelWatch | None = None
_WATCH_LOCK = threading.Lock()


def start_cancel_watch(**options: Any) -> CancelWatch | None:
    """Start this process' :class:`CancelWatch` once; only in a process a runner or worker
    started for a flow run (``PREFECT__FLOW_RUN_ID``) and only from the main thread (where
    Prefect's SIGTERM bridge lives). None elsewhere (flows called in-process, tests)."""
    global _WATCH
    raw = os.environ.get("PREFECT__FLOW_RUN_ID")
    if not raw or threading.current_thread() is not threading.main_thread():
        return None
    try:
        flow_run_id = UUID(raw)
    except ValueError:
        return None
    with _WATCH_LOCK:
        if _WATCH is None or _WATCH.flow_run_id != flow_run_id:
            if _WATCH is not None:
                _WATCH.close()
            _WATCH = CancelWatch(flow_run_id, **options).start()
        return _WATCH
