"""Content-addressed cache keys for the Prefect tasks.

Prefect's default cache policy includes the flow run id, so nothing is reused across runs, and
hashing a pydantic config or a checkpoint path as an *input* says nothing about the content
behind it. Each cached task therefore gets a ``cache_key_fn`` that hashes what actually
determines its output:

- packed dataset: the packing fingerprint (data config, seed, tokenizer fingerprint, input file
  listing: :func:`anchorctx.packing.pipeline.data_fingerprint`) + code version;
- training: the arm's full resolved config + the packed dataset's manifest + code version;
- evaluation: the checkpoint's content hash + the suite's evaluation fingerprint (settings and
  input data) + evaluation code version (``anchorctx.evaluation.identity``).

"Code version" is :func:`anchorctx.manifest.code_version`: the package version plus a hash of
the source that computes results, so editing the library invalidates results it produced, while
re-running unchanged code on unchanged inputs is a cache hit. A cache record only says "this
was computed"; the flows check that the output still exists on disk and refresh the task when it
does not (see ``anchorctx.flows``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anchorctx.evaluation import identity, result_path
from anchorctx.manifest import code_version
from anchorctx.packing.pipeline import dataset_fingerprint

if TYPE_CHECKING:
    from prefect.context import TaskRunContext

    from anchorctx.config import ExperimentConfig


def digest(*parts: Any) -> str:
    """A short stable hash of JSON-serialisable parts."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def data_key(cfg: ExperimentConfig) -> str:
    """Identity of the packed dataset an arm needs (arms with equal keys share one dataset):
    the packing fingerprint, so the cache and the dataset directory agree by construction."""
    return dataset_fingerprint(cfg)


# ---------------------------------------------------------------------- Prefect cache_key_fns
def prepare_data_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    return digest("prepare-data", data_key(parameters["cfg"]), code_version())


def train_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    cfg: ExperimentConfig = parameters["cfg"]
    manifest = Path(parameters["dataset"]) / "manifest.json"
    data_hash = hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else None
    dumped = cfg.model_dump(mode="json", exclude={"tracking"})  # trackers do not change results
    return digest("train", dumped, data_hash, code_version())


def evaluate_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    """The evaluation library's own result identity (checkpoint content hash, the suite's
    evaluation fingerprint including its input data, evaluation code version) plus the result
    path, because the task's product is the file at that path."""
    cfg: ExperimentConfig = parameters["cfg"]
    ckpt, suite = Path(parameters["checkpoint"]), parameters["suite"]
    return digest("evaluate", str(result_path(ckpt, suite)), identity(cfg, ckpt, suite))
