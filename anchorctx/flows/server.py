"""Start and stop a local Prefect server (SQLite under a given PREFECT_HOME).

Used by the test suite and by anyone scripting a self-contained run. The environment matters:
a non-default port must be given as PREFECT_SERVER_API_HOST/PORT (not only ``--port``) or the
UI calls the wrong API, and clients need PREFECT_API_URL or they start an ephemeral server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from anchorctx.process import free_port


def server_env(home: str | Path, host: str, port: int) -> dict[str, str]:
    """The variables every process talking to this server needs (server, serve, clients)."""
    home = Path(home).resolve()
    return {
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": f"http://{host}:{port}/api",
        "PREFECT_SERVER_API_HOST": host,
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOCAL_STORAGE_PATH": str(home / "storage"),
        "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
    }


def is_healthy(api_url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except OSError:
        return False


@dataclass
class PrefectServer:
    home: Path
    host: str
    port: int
    process: subprocess.Popen
    log_path: Path

    @property
    def env(self) -> dict[str, str]:
        return server_env(self.home, self.host, self.port)

    @property
    def api_url(self) -> str:
        return self.env["PREFECT_API_URL"]

    @property
    def ui_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, grace_s: float = 15.0) -> None:
        """Stop the server's whole process group (uvicorn and its services)."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=wait_s)
                return


def start_server(
    home: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    timeout_s: float = 180.0,
) -> PrefectServer:
    """Start ``prefect server start`` in its own process group; return once it is healthy."""
    home = Path(home)
    (home / "logs").mkdir(parents=True, exist_ok=True)
    port = port or free_port(host)
    env = {**os.environ, **server_env(home, host, port)}
    log_path = home / "logs" / "server.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "prefect",
                "server",
                "start",
                "--host",
                host,
                "--port",
                str(port),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    server = PrefectServer(home.resolve(), host, port, proc, log_path)
    deadline = time.monotonic() + timeout_s
    while not is_healthy(server.api_url):
        if proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"Prefect server on port {port} did not become healthy:\n{tail}")
        time.sleep(0.5)
    return server
