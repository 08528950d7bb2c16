"""The persistent evaluation worker: requests in one process, failures, its end.

The requests here are cheap runs of the sharding command line (``--help``, a missing config):
the protocol and the process' life are what is tested. A shard run through workers, records
compared with an unsharded evaluation, is tests/test_eval_sharding.py's flow test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from anchorctx.evaluation.worker import EvalWorker
from anchorctx.process import ProcessFailed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too: its parent (this process) has not reaped it yet.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def _wait_dead(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_requests_share_one_process_and_failures_say_what_failed(tmp_path):
    worker = EvalWorker("-1")  # no GPU: the requests need none
    seen: list[str] = []
    try:
        lines = worker.run(["--help"], seen.append)
        pid = worker.pid
        assert seen[0] == "evaluation worker on GPU -1: starting one"
        assert any("--compile-only" in line for line in lines)  # the sharding command's help
        assert lines == seen[1:]
        # A refusal (argparse: status 2) fails the request; the worker stays.
        with pytest.raises(ProcessFailed) as refused:
            worker.run(["--suite", "ruler"])
        assert refused.value.returncode == 2
        assert "the following arguments are required: --config" in str(refused.value)
        assert worker.run(["--help"]) == lines and worker.pid == pid
        # A request that raises: its traceback in the error; the worker ends with it, and the
        # next request starts another one, saying so.
        missing = tmp_path / "missing.json"
        argv = ["--config", str(missing), "--checkpoint", "x", "--suite", "ruler", "--finalize"]
        with pytest.raises(ProcessFailed) as raised:
            worker.run(argv)
        assert "FileNotFoundError" in str(raised.value) and str(missing) in str(raised.value)
        # At once: the ending worker must not be handed the next request (it was, on a GPU
        # host, which failed that request with no output).
        seen.clear()
        worker.run(["--help"], seen.append)
        assert seen[0] == "evaluation worker on GPU -1: the last one ended; starting one"
        assert worker.pid != pid and worker.started == 2
        assert _wait_dead(pid, 10)
    finally:
        worker.close()
    assert worker.pid is None and _wait_dead(pid, 10)


def test_close_ends_an_idle_worker_and_kills_a_busy_one(tmp_path, monkeypatch):
    """An idle worker ends at the close of its stdin; one inside a request (a cancelled flow)
    is killed, and the request fails instead of waiting."""
    worker = EvalWorker("-1")
    worker.run(["--help"])
    idle = worker.pid
    worker.close()
    assert _wait_dead(idle, 10)

    # A request that blocks: its config is a FIFO nobody writes.
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    argv = ["--config", str(fifo), "--checkpoint", "x", "--suite", "ruler", "--finalize"]
    failure: list[BaseException] = []

    def request() -> None:
        try:
            worker.run(argv)
        except BaseException as err:  # the test reads it below
            failure.append(err)

    thread = threading.Thread(target=request)
    thread.start()
    deadline = time.monotonic() + 30
    while worker.pid is None and time.monotonic() < deadline:
        time.sleep(0.05)
    busy = worker.pid
    time.sleep(0.5)  # inside the request, blocked on the FIFO
    worker.close()
    thread.join(timeout=30)
    assert not thread.is_alive() and _wait_dead(busy, 10)
    assert len(failure) == 1 and isinstance(failure[0], ProcessFailed)


def test_a_worker_ends_when_the_process_that_started_it_dies(tmp_path):
    """A flow process killed with SIGKILL cannot close its workers: they watch their parent."""
    script = textwrap.dedent(
        """
        import os
        from anchorctx.evaluation.worker import EvalWorker
        w = EvalWorker("-1")
        w.run(["--help"])
        print(w.pid, flush=True)
        os._exit(0)  # as SIGKILL would: no close, no atexit
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    pid = int(out.stdout.split()[-1])
    assert _wait_dead(pid, 10), f"worker {pid} outlived its parent"


def test_release_keeps_the_worker(tmp_path):
    """Before training takes its GPU a worker drops its model and frees its memory, but the
    process stays (what it compiled serves the evaluation after the training); no worker: a
    release does nothing."""
    worker = EvalWorker("-1")
    try:
        assert worker.release() == []  # none started yet
        worker.run(["--help"])
        pid = worker.pid
        assert worker.release() == ["evaluation worker: released (no CUDA memory held)"]
        assert worker.pid == pid and _alive(pid)
        assert any("--compile-only" in line for line in worker.run(["--help"]))
        assert worker.pid == pid and worker.started == 1
    finally:
        worker.close()
    assert _wait_dead(pid, 10)


def test_workers_live_until_the_outermost_scope_ends_and_release_for_training(monkeypatch):
    """A flow keeps one worker per GPU across its evaluations (nested scopes: full-experiment
    around each evaluation's own); training taking a GPU has that GPU's worker release its
    memory, and one whose release fails is ended."""
    from anchorctx.tasks import sharding as tasks

    closed: list[str] = []
    released: list[str] = []

    class Worker:
        def __init__(self, gpu: str) -> None:
            self.gpu = gpu

        def release(self) -> list[str]:
            if self.gpu == "13":
                raise ProcessFailed(["worker"], 1, ["CUDA error"])
            released.append(self.gpu)
            return [f"released {self.gpu}"]

        def close(self) -> None:
            closed.append(self.gpu)

    monkeypatch.setattr(tasks, "EvalWorker", Worker)
    monkeypatch.setattr(tasks, "_WORKERS", {})
    slots = tasks.gpu_slots(["11", "12", "13"])
    with tasks.evaluation_workers():
        with tasks.evaluation_workers():  # an evaluation inside the flow
            assert [tasks._worker(g).gpu for g in ("11", "12", "13")] == ["11", "12", "13"]
        assert closed == []  # kept for the next arm
        held = tasks.take_gpus(slots, 2)
        assert released == held and closed == []
        tasks.give_gpus(slots, held)
        tasks.release_workers()  # training on every GPU
        assert sorted(released) == sorted([*held, "11", "12"]) and closed == ["13"]
    assert sorted(closed) == ["11", "12", "13", "13"]
