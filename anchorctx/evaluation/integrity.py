"""Is a results file what ``evaluate`` wrote? One check for every reader of results.

``<suite>.json`` records the SHA-256 of its own content (``result_sha256``, over the canonical
JSON without that field) and of the per-sample records it was computed from
(``samples.sha256``, the file ``<suite>.samples.jsonl`` beside it). ``evaluate`` serves a cached
result only when both match (:func:`anchorctx.evaluation.results.result_matches`); ``report``
averages only results that pass the same check (:func:`anchorctx.evaluation.averaging.
collect_results` with ``verify``), so a hand-edited score is refused, never averaged.

Light on purpose (no torch, no suites): the report's reader imports it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from anchorctx.io import sha256_file


class ResultIntegrityError(ValueError):
    """A results file does not match its own digest or its per-sample records."""

    exit_code = 1  # the file on disk is wrong, not the command line


def result_digest(result: Mapping[str, Any]) -> str:
    """SHA-256 of a result's content without its own digest (canonical JSON)."""
    body = {k: v for k, v in result.items() if k != "result_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def samples_file(result_file: Path) -> Path:
    """``<suite>.samples.jsonl`` beside ``<suite>.json``."""
    return result_file.with_name(f"{result_file.stem}.samples.jsonl")


def records_problem(result: Mapping[str, Any], samples: Path) -> str | None:
    """Why ``result`` is not the file ``evaluate`` wrote from the records in ``samples``
    (None: it is)."""
    recorded = result.get("result_sha256")
    if recorded is None:
        return "it has no result_sha256 (not written by `anchorctx evaluate`)"
    if recorded != result_digest(result):
        return "its content does not match its result_sha256 (edited after it was written)"
    want = (result.get("samples") or {}).get("sha256")
    if not samples.is_file():
        return f"its per-sample records {samples.name} are missing"
    if want != sha256_file(samples):
        return f"its per-sample records {samples.name} changed since it was computed"
    return None


def check_result_file(path: Path, result: Mapping[str, Any]) -> None:
    """Raise :class:`ResultIntegrityError` naming ``path`` unless it matches its records."""
    problem = records_problem(result, samples_file(path))
    if problem is not None:
        raise ResultIntegrityError(
            f"{path}: refused: {problem}; run `anchorctx evaluate` on its checkpoint to "
            "recompute it from the per-sample records (no generation is repeated), or delete it"
        )
