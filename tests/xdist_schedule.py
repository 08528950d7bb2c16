"""A pytest-xdist scheduler on xdist's public scheduler protocol alone.

``pytest_xdist_make_scheduler`` (tests/conftest.py) returns a :class:`UnitScheduling`, which
implements ``xdist.scheduler.protocol.Scheduling`` and talks to the workers only through
``send_runtest_some``, ``shutdown`` and ``shutting_down``; it subclasses no xdist scheduler and
touches no private method or attribute of one. Tests run in units, each on one worker (a unit:
tests that share something started in processes of their own; any other test is a unit of its
own), handed out in a given order (longest first) to whichever worker runs low.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
from xdist.workermanage import parse_tx_spec_config

# A worker runs a test only once it knows the next (its teardown depends on it): keep this many
# tests pending on each, as xdist's own schedulers do.
LOOKAHEAD = 2


class UnitScheduling:
    """Units of tests (``unit_of(nodeid)``), sorted by ``order(unit)`` (stable: ties keep the
    order of collection), each sent whole to the first worker with fewer than
    :data:`LOOKAHEAD` tests pending."""

    def __init__(
        self,
        config: pytest.Config,
        unit_of: Callable[[str], str],
        order: Callable[[str], Any],
        numnodes: int | None = None,
    ) -> None:
        self.config = config
        # The workers the run starts (-n or --tx), as xdist's own schedulers count them.
        self.numnodes = len(parse_tx_spec_config(config)) if numnodes is None else numnodes
        self.unit_of, self.order = unit_of, order
        self.node2collection: dict[Any, list[str]] = {}
        self.node2pending: dict[Any, list[int]] = {}
        self.collection: list[str] | None = None
        self.units: list[list[int]] = []  # not sent yet, in sending order

    # ------------------------------------------------------------------ the protocol's state
    @property
    def nodes(self) -> list[Any]:
        return list(self.node2pending)

    @property
    def collection_is_completed(self) -> bool:
        return len(self.node2collection) >= self.numnodes

    @property
    def tests_finished(self) -> bool:
        if self.collection is None or self.units:  # not scheduled yet, or tests not sent
            return False
        return all(len(pending) < LOOKAHEAD for pending in self.node2pending.values())

    @property
    def has_pending(self) -> bool:
        return bool(self.units) or any(self.node2pending.values())

    # ------------------------------------------------------------------ events
    def add_node(self, node: Any) -> None:
        self.node2pending[node] = []

    def add_node_collection(self, node: Any, collection: Sequence[str]) -> None:
        self.node2collection[node] = list(collection)

    def mark_test_complete(self, node: Any, item_index: int, duration: float = 0) -> None:
        self.node2pending[node].remove(item_index)
        self._fill(node)

    def mark_test_pending(self, item: str) -> None:
        raise NotImplementedError("UnitScheduling does not take tests back")

    def remove_pending_tests_from_node(self, node: Any, indices: Sequence[int]) -> None:
        raise NotImplementedError("UnitScheduling does not steal tests")

    def remove_node(self, node: Any) -> str | None:
        """A worker gone: its pending tests but the one it was running go out again as one
        unit, first; that one is returned (None when it had none)."""
        pending = self.node2pending.pop(node)
        if not pending:
            return None
        assert self.collection is not None
        crashed = self.collection[pending[0]]
        if pending[1:]:
            self.units.insert(0, pending[1:])
        for other in self.nodes:
            self._fill(other)
        return crashed

    def schedule(self) -> None:
        if self.collection is None:
            if not self._same_collections():
                self.collection = []  # nothing runs: the collection error says why
                return
            self.collection = next(iter(self.node2collection.values()))
            self.units = self._units(self.collection)
        for node in self.nodes:
            self._fill(node)

    # ------------------------------------------------------------------ helpers
    def _units(self, collection: list[str]) -> list[list[int]]:
        units: dict[str, list[int]] = {}
        for index, nodeid in enumerate(collection):
            units.setdefault(self.unit_of(nodeid), []).append(index)
        return [units[name] for name in sorted(units, key=self.order)]

    def _fill(self, node: Any) -> None:
        if node.shutting_down:
            return
        pending = self.node2pending[node]
        while len(pending) < LOOKAHEAD and self.units:
            unit = self.units.pop(0)
            pending.extend(unit)
            node.send_runtest_some(unit)
        if not self.units:
            node.shutdown()  # it runs what it holds, then stops

    def _same_collections(self) -> bool:
        """Every worker collected the same tests; else a collection error names the worker."""
        (first, want), *others = self.node2collection.items()
        same = True
        for node, got in others:
            if got != want:
                same = False
                missing = sorted(set(want) ^ set(got))[:5]
                report = pytest.CollectReport(
                    nodeid=str(node.gateway.id),
                    outcome="failed",
                    longrepr=(
                        f"{node.gateway.id} collected other tests than {first.gateway.id} "
                        f"(first differences: {missing}, or another order)"
                    ),
                    result=[],
                )
                self.config.hook.pytest_collectreport(report=report)
        return same
