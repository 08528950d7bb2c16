"""The suite's pytest-xdist scheduler (tests/xdist_schedule.py) against fake workers: units stay
on one worker and go out in their order, a worker holds few tests ahead, a lost worker's tests
go out again, and workers that collected different tests run nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import SERVED_GROUP, xdist_unit
from xdist_schedule import LOOKAHEAD, UnitScheduling


class FakeNode:
    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.sent: list[list[int]] = []
        self.shutting_down = False

    def send_runtest_some(self, indices) -> None:
        self.sent.append(list(indices))

    def shutdown(self) -> None:
        self.shutting_down = True


COLLECTION = [
    "tests/a.py::test_1",
    "tests/g.py::test_grouped_1",
    "tests/a.py::test_slow",
    "tests/b.py::test_2",
    "tests/g.py::test_grouped_2",
    "tests/b.py::test_3",
]
GROUPED = {"tests/g.py::test_grouped_1", "tests/g.py::test_grouped_2"}
ORDER = {"group": 0, "tests/a.py::test_slow": 1}  # the rest after, in collection order


def _scheduler(nodes: int = 2):
    reports: list = []
    config = SimpleNamespace(
        hook=SimpleNamespace(pytest_collectreport=lambda report: reports.append(report))
    )
    sched = UnitScheduling(
        config,
        lambda nodeid: "group" if nodeid in GROUPED else nodeid,
        lambda unit: ORDER.get(unit, len(ORDER)),
        numnodes=nodes,
    )
    workers = [FakeNode(f"gw{i}") for i in range(nodes)]
    for node in workers:
        sched.add_node(node)
        sched.add_node_collection(node, COLLECTION)
    return sched, workers, reports


def _run_all(sched, workers) -> dict[str, list[str]]:
    """Complete tests in turn (the first pending of each worker) until none is left."""
    ran: dict[str, list[str]] = {n.gateway.id: [] for n in workers}
    while sched.has_pending:
        for node in workers:
            pending = sched.node2pending.get(node)
            if pending:
                ran[node.gateway.id].append(COLLECTION[pending[0]])
                sched.mark_test_complete(node, pending[0])
    return ran


def test_units_go_out_whole_in_their_order_and_every_test_runs_once():
    sched, workers, _ = _scheduler()
    assert sched.collection_is_completed and not sched.tests_finished
    sched.schedule()
    first, second = workers
    # The group first (both its tests to one worker), the slow test next, then the rest.
    assert first.sent == [[1, 4]] and second.sent == [[2], [0]]
    ran = _run_all(sched, workers)
    assert sorted(t for tests in ran.values() for t in tests) == sorted(COLLECTION)
    assert any(set(tests) >= GROUPED for tests in ran.values())
    assert sched.tests_finished and all(n.shutting_down for n in workers)


def test_a_worker_holds_at_most_lookahead_tests_beyond_a_unit():
    sched, workers, _ = _scheduler()
    sched.schedule()
    second = workers[1]
    # Single-test units: the worker gets LOOKAHEAD of them, more only as they complete.
    assert len(sched.node2pending[second]) == LOOKAHEAD
    sched.mark_test_complete(second, sched.node2pending[second][0])
    assert len(sched.node2pending[second]) == LOOKAHEAD


def test_a_lost_workers_tests_go_out_again_but_the_one_it_was_running():
    sched, workers, _ = _scheduler()
    sched.schedule()
    first, second = workers
    crashed = sched.remove_node(first)
    assert crashed == COLLECTION[1]  # the group's first test, running when the worker died
    assert sched.units[0] == [4]  # the group's other test, first out again
    ran = _run_all(sched, [second])
    assert "tests/g.py::test_grouped_2" in ran["gw1"]


def test_workers_that_collected_other_tests_are_reported_and_nothing_runs():
    sched, workers, reports = _scheduler()
    sched.add_node_collection(workers[1], COLLECTION[:-1])
    sched.schedule()
    assert not any(n.sent for n in workers) and sched.tests_finished
    assert len(reports) == 1 and "gw1 collected other tests than gw0" in reports[0].longrepr


@pytest.mark.parametrize(
    ("nodeid", "unit"),
    [
        ("tests/test_flows_e2e.py::test_x", SERVED_GROUP),
        ("tests/test_training_sp.py::test_sp2_and_dp2_equal_one_process", "sp-runs"),
        ("tests/test_io.py::test_y", "tests/test_io.py::test_y"),
    ],
)
def test_the_suites_units(nodeid, unit):
    assert xdist_unit(nodeid) == unit


def test_a_listed_test_that_is_gone_stops_the_collection(monkeypatch):
    import conftest
    import test_io

    item = SimpleNamespace(nodeid="tests/test_io.py::test_atomic_write_json_roundtrip")
    item.module = test_io
    conftest.check_listed_tests([item])  # the tables as they are
    for gone in ("tests/test_io.py::test_renamed_since", "tests/test_moved.py::test_x"):
        monkeypatch.setattr(conftest, "SLOW_FIRST", (*conftest.SLOW_FIRST, gone))
        with pytest.raises(pytest.UsageError, match="is not a test"):
            conftest.check_listed_tests([item])
