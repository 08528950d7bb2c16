"""The process-group runner behind the training task: streaming, failures, deadlines, and no
orphans when the orchestrating code is interrupted (what a Prefect cancellation raises)."""

from __future__ import annotations

import sys
import time

import psutil
import pytest

from anchorctx.process import ProcessFailed, ProcessTimeout, run_process_group

# A child that starts a grandchild in its own process group, reports both pids, then waits.
TREE = (
    "import os, subprocess, sys, time\n"
    "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "print('pids', os.getpid(), g.pid, flush=True)\n"
    "time.sleep(120)\n"
)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(pids: list[int], timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def test_streams_lines_in_order_and_ticks():
    lines: list[str] = []
    ticks: list[float] = []
    code = "import time\nfor i in range(3):\n    print('line', i, flush=True); time.sleep(0.2)\n"
    rc = run_process_group(
        [sys.executable, "-c", code],
        on_line=lines.append,
        on_tick=lambda: ticks.append(time.monotonic()),
        tick_s=0.1,
    )
    assert rc == 0
    assert lines == ["line 0", "line 1", "line 2"]
    assert ticks, "on_tick must run at least once (final tick after exit)"


def test_failure_raises_with_output_tail():
    code = "import sys\nprint('about to fail', flush=True)\nsys.exit(3)\n"
    with pytest.raises(ProcessFailed) as err:
        run_process_group([sys.executable, "-c", code], on_line=lambda _: None)
    assert err.value.returncode == 3
    assert "about to fail" in str(err.value)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, RuntimeError])
def test_interrupt_kills_whole_process_group(exc):
    """Any exception while the child runs (Prefect raises TerminationSignal on cancellation)
    must kill the child and its grandchildren before propagating."""
    pids: list[int] = []

    def on_line(line: str) -> None:
        if line.startswith("pids"):
            pids.extend(int(p) for p in line.split()[1:])
            raise exc("cancelled")

    with pytest.raises(exc):
        run_process_group([sys.executable, "-c", TREE], on_line=on_line)
    assert len(pids) == 2
    assert _wait_gone(pids) == [], "child or grandchild survived the interruption"


def test_deadline_kills_process_group():
    pids: list[int] = []

    def on_line(line: str) -> None:
        if line.startswith("pids"):
            pids.extend(int(p) for p in line.split()[1:])

    with pytest.raises(ProcessTimeout):
        run_process_group([sys.executable, "-c", TREE], on_line=on_line, timeout_s=3.0)
    assert len(pids) == 2
    assert _wait_gone(pids) == []


def test_inherited_output_returns_when_the_child_exits():
    """``on_line=None`` (the child writes to this process's own output, as `anchorctx train`
    runs its ranks): the call returns with the child's status as soon as it exits. A waiter
    thread that is never started left this waiting for its deadline; the deadline here fails
    the test in seconds instead of the suite's 15 minutes."""
    t0 = time.monotonic()
    assert run_process_group([sys.executable, "-c", "pass"], timeout_s=30, tick_s=0.1) == 0
    assert time.monotonic() - t0 < 20
    with pytest.raises(ProcessFailed):
        run_process_group([sys.executable, "-c", "raise SystemExit(3)"], timeout_s=30)
