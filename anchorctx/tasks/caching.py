"""Content-addressed cache keys for the Prefect tasks.

Prefect's default cache policy includes the flow run id, so nothing is reused across runs, and
hashing a pydantic config or a checkpoint path as an *input* says nothing about the content
behind it. Each cached task therefore gets a ``cache_key_fn`` that hashes what actually
determines its output:

- packed dataset: data config + tokenizer content + input file listing + seed + code version;
- training: the arm's full resolved config + the packed dataset's manifest + code version;
- evaluation: the checkpoint's content hash + the suite's evaluation fingerprint (settings and
  input data) + evaluation code version (``anchorctx.evaluation.identity``).

"Code version" is the package version plus a hash of the package's source tree, so editing the
library invalidates results it produced, while re-running unchanged code on unchanged inputs
is a cache hit. A cache record only says "this was computed"; the flows check that the output
still exists on disk and refresh the task when it does not (see ``anchorctx.flows``).
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anchorctx
from anchorctx.io import hash_tree

if TYPE_CHECKING:
    from prefect.context import TaskRunContext

    from anchorctx.config import ExperimentConfig


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """``<version>+<hash of the anchorctx source tree>`` (tasks/ and flows/ excluded: they
    orchestrate, they do not change results)."""
    root = Path(anchorctx.__file__).resolve().parent
    h = hashlib.sha256()
    for sub in sorted(p for p in root.iterdir() if p.is_dir() and p.name not in {"tasks", "flows"}):
        h.update(sub.name.encode() + hash_tree(sub, ("*.py", "*.yaml", "*.json", "*.txt")).encode())
    for f in sorted(root.glob("*.py")):
        h.update(f.name.encode() + f.read_bytes())
    return f"{anchorctx.__version__}+{h.hexdigest()[:12]}"


def digest(*parts: Any) -> str:
    """A short stable hash of JSON-serialisable parts."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def _listing(path: Path) -> list[tuple[str, int, int]]:
    """(name, size, mtime_ns) of the files behind a source path: cheap change detection for
    corpora too large to hash on every flow run."""
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
    else:
        files = sorted(p for p in path.parent.glob(path.name) if p.is_file())
    return [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def data_key(cfg: ExperimentConfig) -> str:
    """Identity of the packed dataset an arm needs (arms with equal keys share one dataset)."""
    tok = cfg.model.tokenizer_path
    tok_hash = hash_tree(tok) if tok is not None and Path(tok).is_dir() else str(tok)
    data = cfg.model_dump(mode="json")["data"]
    data.pop("num_workers", None)  # parallelism does not change the packed rows
    inputs = [_listing(Path(s.path)) for s in cfg.data.sources]
    return digest("data", data, cfg.seed, tok_hash, inputs)


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
    from anchorctx.evaluation import identity, result_path

    cfg: ExperimentConfig = parameters["cfg"]
    ckpt, suite = Path(parameters["checkpoint"]), parameters["suite"]
    return digest("evaluate", str(result_path(ckpt, suite)), identity(cfg, ckpt, suite))
