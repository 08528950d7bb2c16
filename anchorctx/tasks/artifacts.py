"""Prefect artifacts: run summaries, result tables, plots, live progress.

Artifact keys must be lowercase letters, digits and dashes; keyed artifacts are versioned
across runs (the Artifacts page shows the latest, each flow run its own). Plots are local PNG
files that the UI's browser cannot fetch, so they travel inside the artifact as ``data:`` URIs.
"""

from __future__ import annotations

import base64
import json
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect.artifacts import (
    create_image_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from anchorctx.io import read_json
from anchorctx.manifest import base_manifest
from anchorctx.tasks.api import Reporting, synchronous

if TYPE_CHECKING:
    from uuid import UUID

    from anchorctx.experiment import ExperimentConfig

# Inline plots above this size are linked instead (the artifact lives in the API database).
MAX_INLINE_IMAGE_BYTES = 2_000_000


def artifact_key(*parts: str) -> str:
    """A valid artifact key from free text: ``("anchor_tags", "RULER")`` -> ``anchor-tags-ruler``."""
    key = re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower()).strip("-")
    return key[:100] or "artifact"


def md_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of homogeneous dict rows (column order of the first row)."""
    if not rows:
        return "_(no rows)_"
    cols = list(rows[0])
    for row in rows[1:]:
        cols += [c for c in row if c not in cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c)) for c in cols) + " |")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def data_fingerprint(dataset: str | Path | None) -> dict[str, Any]:
    """What identifies a packed dataset: its path, manifest fingerprint fields and counts."""
    if dataset is None:
        return {}
    manifest_path = Path(dataset) / "manifest.json"
    if not manifest_path.is_file():
        return {"path": str(dataset)}
    manifest = read_json(manifest_path)
    keep = (
        "fingerprint",
        "data_fingerprint",
        "input_fingerprints",
        "tokenizer",
        "seq_len",
        "seed",
        "counts",
        "anchor_token_id",
    )
    return {"path": str(dataset), **{k: manifest[k] for k in keep if k in manifest}}


def run_summary_markdown(
    title: str,
    cfg: ExperimentConfig,
    *,
    dataset: str | Path | None = None,
    outputs: dict[str, Any] | None = None,
    code_version: str | None = None,
    arms: list[ExperimentConfig] | None = None,
) -> str:
    """The provenance block every flow run publishes: config, revision, versions, seeds, data.

    ``arms``: the arms of an experiment-level run, each named with its attention and run dir
    (one arm's variant would misname the whole experiment).
    """
    manifest = base_manifest()
    git = manifest["git"]
    packages = {k: v for k, v in manifest["packages"].items() if v}
    if arms:
        scope = f"- experiment: `{cfg.name}`, {len(arms)} arms: " + ", ".join(
            f"`{a.variant_name}` ({a.training.attention}, run dir `{a.run_dir}`)" for a in arms
        )
    else:
        scope = (
            f"- experiment: `{cfg.name}`, variant: `{cfg.variant_name}`, run dir: `{cfg.run_dir}`"
        )
    lines = [
        f"# {title}",
        "",
        scope,
        f"- seed: `{cfg.seed}`, evaluation seed (RULER): `{cfg.evaluation.ruler.seed}`",
        f"- config fingerprint: `{cfg.fingerprint()}`",
        f"- git: `{git.get('commit')}`" + (" (uncommitted changes)" if git.get("dirty") else ""),
        f"- code version: `{code_version}`" if code_version else "",
        f"- host: `{manifest['host']['name']}`, GPUs: {len(manifest['gpus'])}",
        "- packages: " + ", ".join(f"{k} {v}" for k, v in packages.items()),
    ]
    fp = data_fingerprint(dataset)
    if fp:
        lines += ["", "## Data", "", "```json", _json(fp), "```"]
    if outputs:
        lines += ["", "## Outputs", ""] + [f"- {k}: `{v}`" for k, v in outputs.items()]
    lines += ["", "## Resolved config", "", "```yaml", cfg.to_yaml().rstrip(), "```"]
    return "\n".join(line for line in lines if line is not None)


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str)


def publish_summary(key: str, markdown: str, description: str) -> None:
    create_markdown_artifact(markdown=markdown, key=artifact_key(key), description=description)


def publish_table(key: str, rows: list[dict[str, Any]], description: str) -> None:
    """A table artifact (skipped when there is nothing to show)."""
    if rows:
        create_table_artifact(table=rows, key=artifact_key(key), description=description)


def png_data_uri(path: str | Path) -> str | None:
    data = Path(path).read_bytes()
    if len(data) > MAX_INLINE_IMAGE_BYTES:
        return None
    return "data:image/png;base64," + base64.b64encode(data).decode()


def publish_plot(key: str, path: str | Path, description: str) -> None:
    """An image artifact rendered by the UI, with the file path in its description."""
    uri = png_data_uri(path)
    desc = f"{description} (file: `{path}`)"
    if uri is None:
        create_markdown_artifact(
            markdown=f"Plot too large to inline: `{path}`", key=artifact_key(key), description=desc
        )
        return
    create_image_artifact(image_url=uri, key=artifact_key(key), description=desc)


class Progress:
    """A progress artifact updated at most every ``min_interval_s`` seconds (API-friendly).

    An update while the Prefect server is unreachable (a restart) is skipped with one warning,
    never raised: it is called from the training task's tick, where an exception would kill
    the training process group."""

    def __init__(self, key: str, description: str, min_interval_s: float = 2.0) -> None:
        self.artifact_id: UUID = synchronous(
            create_progress_artifact(progress=0.0, key=artifact_key(key), description=description)
        )
        self.min_interval_s = min_interval_s
        self._last_sent = 0.0
        self._last_value = 0.0
        self._api = Reporting(f"progress artifact {artifact_key(key)!r}")

    def update(self, fraction: float, *, force: bool = False) -> None:
        value = round(max(0.0, min(1.0, fraction)) * 100, 1)
        now = time.monotonic()
        if value == self._last_value or (not force and now - self._last_sent < self.min_interval_s):
            return
        self._last_sent = now
        if self._api.call(update_progress_artifact, artifact_id=self.artifact_id, progress=value):
            self._last_value = value
