"""Prefect cache keys, each one of the library's own content identities.

The library is idempotent by content: a packed dataset lives in a directory named by its
fingerprint, an evaluation result is reused only when its identity matches, a finished training
run returns at once on ``--resume``. Prefect's cache sits on top of it and keys its records by
the same identities, so that the two never disagree about what "the same result" is:

- packed dataset: :func:`anchorctx.packing.pipeline.dataset_fingerprint` (data config, seed,
  tokenizer fingerprint, input file listing, packed schema version) and the directory that
  fingerprint names;
- training: the arm's resolved config (trackers aside: they change where numbers are logged,
  not what they are), the packed dataset's manifest hash (the checkpoints' ``data_manifest_hash``)
  and the code version; the library keeps no in-process identity of a finished run;
- evaluation: :func:`anchorctx.evaluation.identity` (checkpoint content hash, the suite's
  evaluation fingerprint including its input data, evaluation code version) and the result
  path, the file the task produces.

"Code version" is :func:`anchorctx.manifest.code_version`. A cache record only says "this was
computed"; :func:`anchorctx.tasks.reuse.submission` accepts it only while its product is intact.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anchorctx.evaluation import identity, result_path
from anchorctx.io import sha256_file
from anchorctx.manifest import code_version
from anchorctx.packing.pipeline import dataset_fingerprint, default_output_dir

if TYPE_CHECKING:
    from prefect.context import TaskRunContext

    from anchorctx.experiment import ExperimentConfig


def digest(*parts: Any) -> str:
    """A short stable hash of JSON-serialisable parts."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def data_key(cfg: ExperimentConfig) -> str:
    """Identity of the packed dataset an arm needs (arms with equal keys share one dataset):
    the packing fingerprint, so the cache and the dataset directory agree by construction."""
    return dataset_fingerprint(cfg)


# ---------------------------------------------------------------------- Prefect cache_key_fns
def prepare_data_cache_key(context: TaskRunContext | None, parameters: dict[str, Any]) -> str:
    cfg: ExperimentConfig = parameters["cfg"]
    fingerprint = data_key(cfg)
    return digest("prepare-data", fingerprint, str(default_output_dir(cfg, fingerprint)))


def train_cache_key(context: TaskRunContext | None, parameters: dict[str, Any]) -> str:
    cfg: ExperimentConfig = parameters["cfg"]
    manifest = Path(parameters["dataset"]) / "manifest.json"
    data_hash = sha256_file(manifest) if manifest.is_file() else None
    dumped = cfg.model_dump(mode="json", exclude={"tracking"})
    return digest("train", dumped, data_hash, code_version())


def evaluate_cache_key(context: TaskRunContext | None, parameters: dict[str, Any]) -> str:
    cfg: ExperimentConfig = parameters["cfg"]
    ckpt, suite = Path(parameters["checkpoint"]), parameters["suite"]
    return digest("evaluate", str(result_path(ckpt, suite, cfg)), identity(cfg, ckpt, suite))
