"""Run a command as its own process group, stream its output, never leave it behind; and a
free local port for the rendezvous of such a group.

The one way anchorctx starts process trees: ``anchorctx train`` starts its ``torchrun`` /
DeepSpeed launcher (output inherited, so a progress bar on a terminal works as is), the Prefect
tasks start training and evaluation shards (output streamed line by line into the task log). A
crash, an OOM or a NCCL hang then cannot take the starting process down with it. Three things
can orphan such a tree, and each is handled here:

- Prefect cancels a flow run by sending SIGTERM to the flow run's process group and SIGKILL
  30 s later. The child runs in a *new session* (its own process group), so that signal does not
  reach it directly; Prefect turns SIGTERM into a ``TerminationSignal`` (a ``BaseException``)
  in the main thread, and the ``except BaseException`` below kills the whole child group.
- SIGKILL of the orchestrating process cannot be caught: the child asks the kernel for SIGTERM
  when its parent dies (``PR_SET_PDEATHSIG``; torchrun forwards it to its ranks).
- Prefect's ``timeout_seconds`` does not kill children, so the deadline is enforced here.

A child that serves requests instead (an evaluation worker, :mod:`anchorctx.evaluation.worker`)
starts through :func:`start_server`: a new session as well, ended with :func:`kill_group`.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1


class ProcessFailed(RuntimeError):
    """The child exited with a non-zero status; the message carries the tail of its output."""

    def __init__(self, cmd: Sequence[str], returncode: int, tail: list[str]) -> None:
        self.returncode = returncode
        self.tail = tail
        lines = "\n".join(tail[-40:])
        super().__init__(f"{' '.join(cmd)} exited with status {returncode}; last output:\n{lines}")


class ProcessTimeout(TimeoutError):
    """The child ran past its deadline and was killed."""


def _die_with_parent() -> None:  # pragma: no cover - runs in the forked child
    """Ask Linux to SIGTERM this process when the thread that forked it exits."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the child's process group, wait up to ``grace_s``, then SIGKILL it."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait_s)
        if not _group_alive(proc.pid):
            break
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=1.0)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pump(stream, lines: queue.Queue) -> None:
    """Reader thread: the child's output lines into a queue (the logger lives in the main
    thread, where the Prefect run context is)."""
    with stream:  # closed at EOF: the child and its group are gone (a kill also ends here)
        for line in iter(stream.readline, ""):
            lines.put(line.rstrip("\n"))
    lines.put(None)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it; a rendezvous or server binds it next)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def run_process_group(
    cmd: Sequence[str],
    *,
    on_line: Callable[[str], None] | None = None,
    on_tick: Callable[[], None] | None = None,
    tick_s: float = 5.0,
    timeout_s: float | None = None,
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
    on_start: Callable[[int], None] | None = None,
    pass_fds: Sequence[int | None] = (),
    check: bool = True,
) -> int:
    """Run ``cmd`` in a new session; call ``on_line`` per output line (``None``: the child
    writes to this process's stdout/stderr directly) and ``on_tick`` every ``tick_s`` seconds.
    ``pass_fds``: descriptors the child inherits (a writer lock, so it outlives this process).
    Returns the exit status; with ``check`` a non-zero one raises ``ProcessFailed``. A deadline
    raises ``ProcessTimeout``; on any exception (cancellation included) the whole process group
    is killed before it propagates."""
    full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    in_main = threading.current_thread() is threading.main_thread()
    piped: dict[str, Any] = {
        "stdout": subprocess.PIPE,
        "stderr": subprocess.STDOUT,
        "stdin": subprocess.DEVNULL,
        "text": True,
        "bufsize": 1,
        "errors": "replace",
    }
    proc = subprocess.Popen(
        list(cmd),
        cwd=cwd,
        env=full_env,
        start_new_session=True,
        pass_fds=tuple(fd for fd in pass_fds if fd is not None),
        # PDEATHSIG follows the forking *thread*; only arm it where that thread outlives the child.
        preexec_fn=_die_with_parent if in_main else None,
        **(piped if on_line is not None else {}),
    )
    if on_start is not None:
        on_start(proc.pid)
    lines: queue.Queue = queue.Queue()
    if proc.stdout is not None:
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
    else:  # inherited output: only the exit matters; the queue just paces the ticks

        def wait_then_end() -> None:
            proc.wait()
            lines.put(None)

        threading.Thread(target=wait_then_end, daemon=True).start()
    tail: list[str] = []
    deadline = time.monotonic() + timeout_s if timeout_s else None
    next_tick = time.monotonic() + tick_s
    try:
        _drain(lines, tail, on_line or (lambda _: None), on_tick, deadline, next_tick, tick_s)
        returncode = proc.wait()
    except BaseException:
        kill_group(proc)
        raise
    finally:
        # Ranks of a torchrun tree may outlive their launcher; leave no member of the group.
        if _group_alive(proc.pid):
            kill_group(proc, grace_s=5.0)
    if on_tick is not None:
        on_tick()
    if returncode != 0 and check:
        raise ProcessFailed(cmd, returncode, tail)
    return returncode


def start_server(cmd: Sequence[str], *, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` in a new session, its stdin and its output (stderr merged) text pipes, for
    a child that serves requests until its stdin closes. It may be started from any thread,
    so no ``PR_SET_PDEATHSIG`` (that follows the forking thread, which may end first): such a
    child watches its parent itself. The caller ends it with :func:`kill_group`."""
    return subprocess.Popen(
        list(cmd),
        env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        errors="replace",
        start_new_session=True,
    )


def _drain(lines, tail, on_line, on_tick, deadline, next_tick, tick_s) -> None:
    while True:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            line = ""
        if line is None:  # the child closed its output: it is exiting
            return
        if line:
            tail.append(line)
            del tail[:-200]
            on_line(line)
        now = time.monotonic()
        if deadline is not None and now > deadline:
            raise ProcessTimeout("the process ran past its deadline and was killed")
        if on_tick is not None and now >= next_tick:
            on_tick()
            next_tick = now + tick_s


def spawn_pool(workers: int) -> ProcessPoolExecutor:
    """A process pool of ``workers`` spawned (not forked) processes: a parent that holds a Rust
    tokenizer's threads must not fork, which would copy them half-alive."""
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
