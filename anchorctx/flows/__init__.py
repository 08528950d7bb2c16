"""Prefect flows and deployments: ``full-experiment`` and its stages.

The flows live in :mod:`anchorctx.flows.experiment` (imported on first use, so that the
``anchorctx`` command starts without importing Prefect); the deployments that
``anchorctx serve`` serves in :mod:`anchorctx.flows.deployments`.
"""

from __future__ import annotations

from typing import Any

_FLOWS = (
    "full_experiment",
    "prepare_data_flow",
    "train_flow",
    "evaluate_flow",
    "rope_precision_flow",
)


def __getattr__(name: str) -> Any:
    if name in _FLOWS:
        from anchorctx.flows import experiment

        return getattr(experiment, name)
    raise AttributeError(f"module 'anchorctx.flows' has no attribute {name!r}")


__all__ = list(_FLOWS)
