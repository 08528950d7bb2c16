"""``prefect_test_harness`` on one Prefect test server per pytest process.

    def test_flow(prefect_harness):       # the fixture (tests/conftest.py) is this module's
        with prefect_harness():           # shared_prefect_harness
            my_flow()                     # against a local SQLite-backed server

What ``prefect.testing.utilities.prefect_test_harness`` sets up for the ``with`` block (the API
URL, the default server that flow code asking for an ephemeral one finds, the process-global
settings context; logs and events drained at the end), except that the server, a subprocess
that takes ~10 s of CPU to start and migrate its database (~4 s on a copy of a premigrated one,
``premigrated_database``), is started once, on first use, and
serves every later block of the same process (pytest-xdist worker) until
``stop_shared_server()`` (tests/conftest.py: after the last test using it). A test that reads
flow runs back filters them to its own (by name and start time), since the database is shared.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from anchorctx.process import free_port

_SERVER: list[Any] = []  # the SubprocessASGIServer, once started

# A Prefect database already migrated to this Prefect's schema (scripts/test.sh makes it once,
# beside the lint, and names it here). A server started on a copy of it is healthy after ~4.4 s
# of CPU instead of ~10.6 s on an empty one: the migrations are most of a start, and the suite
# starts four servers (measured on the 2-core machine,
# docs/benchmarks/2026-11-23-cpu-demo-and-test-suite.md).
PREMIGRATED_DB_ENV = "ANCHORCTX_TEST_PREFECT_DB"


def premigrated_database(db: Path) -> None:
    """Put the premigrated database at ``db`` (a server's database file, before it starts),
    if there is one; without it the server migrates its new database itself, as before."""
    template = os.environ.get(PREMIGRATED_DB_ENV)
    if template and Path(template).is_file() and not db.exists():
        db.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, db)


def _server() -> Any:
    """The process' test server (started on first use; stopped at the end of the session)."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL, temporary_settings

    if _SERVER and _SERVER[0].running:
        return _SERVER[0]
    _SERVER.clear()
    home = tempfile.mkdtemp(prefix="prefect-test-")
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    db = Path(home) / "prefect-test.db"
    premigrated_database(db)
    # The server subprocess takes its settings (this database) from the current ones.
    with temporary_settings(
        updates={PREFECT_SERVER_DATABASE_CONNECTION_URL: f"sqlite+aiosqlite:///{db}"}
    ):
        server = SubprocessASGIServer(port=free_port())
        server.start(timeout=120)  # registers its stop with atexit
    _SERVER.append(server)
    return server


@contextlib.contextmanager
def shared_prefect_harness() -> Iterator[Any]:
    """Flows run against the process' test server inside the block (yields the server)."""
    import prefect.context
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.utilities.asyncutils import run_coro_as_sync

    server = _server()
    # Flow code that asks for the default (ephemeral) server gets this one, as in the harness.
    prior = SubprocessASGIServer._instances.get(None)
    SubprocessASGIServer._instances[None] = server
    try:
        with (
            temporary_settings(updates={PREFECT_API_URL: server.api_url}),
            prefect.context._temporary_global_settings_context(
                prefect.context.get_settings_context()
            ),
        ):
            yield server

            # As the harness: logs and events sent before the block ends, none left over.
            async def drain() -> None:
                try:
                    result = APILogWorker.instance().drain()
                    if inspect.isawaitable(result):
                        await result
                except RuntimeError:  # no log worker was started
                    pass
                result = EventsWorker.drain_all()
                if inspect.isawaitable(result):
                    await result

            run_coro_as_sync(drain())
    finally:
        if prior is not None:
            SubprocessASGIServer._instances[None] = prior
        else:
            SubprocessASGIServer._instances.pop(None, None)


def stop_shared_server() -> None:
    """Stop the process' test server, if one was started (tests/conftest.py, at session end)."""
    while _SERVER:
        _SERVER.pop().stop()
