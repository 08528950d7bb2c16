"""Run manifests: what produced an output (git revision, package versions, seeds, host, GPUs)."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anchorctx

PACKAGES = (
    "anchorctx",
    "torch",
    "transformers",
    "datasets",
    "tokenizers",
    "deepspeed",
    # the kernels a run may have used: attention engines, fused kernels and their compilers
    "flash-attn",
    "flash-attn-4",
    "nvidia-cutlass-dsl",
    "liger-kernel",
    "triton",
    "prefect",
    "lm-eval",
    "pydantic",
    "numpy",
)


# Source files whose edits can change what anchorctx produces (data, tokenizers, configs).
SOURCE_PATTERNS = ("*.py", "*.yaml", "*.json", "*.txt")
# Orchestration only: Prefect tasks and flows decide what runs, not what it computes.
ORCHESTRATION = ("tasks", "flows")


@functools.lru_cache(maxsize=16)
def code_version(include: tuple[str, ...] = ("",), exclude: tuple[str, ...] = ORCHESTRATION) -> str:
    """``<anchorctx version>+<hash>`` of the package's source files under ``include`` (paths
    relative to the package: folders or files; ``""`` is the whole package) that are not under
    ``exclude``. Editing the library changes it, so cached results of older code are not served.
    The default covers everything that computes results; the evaluation narrows it to the code
    that can change a score (``anchorctx.evaluation.results``)."""
    root = Path(anchorctx.__file__).resolve().parent
    files: set[Path] = set()
    for rel in include:
        base = root / rel
        found = (
            [base] if base.is_file() else [p for pat in SOURCE_PATTERNS for p in base.rglob(pat)]
        )
        files.update(p for p in found if "__pycache__" not in p.parts)
    skip = tuple(root / rel for rel in exclude)
    h = hashlib.sha256()
    for path in sorted(files):
        if path == root or any(path == s or s in path.parents for s in skip):
            continue
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return f"{anchorctx.__version__}+{h.hexdigest()[:12]}"


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_revision(cwd: str | Path | None = None) -> dict[str, Any]:
    """The source revision of this package's checkout (None outside a git checkout)."""
    cwd = Path(cwd) if cwd else Path(__file__).resolve().parent
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    if rev.returncode != 0:
        return {"commit": None, "dirty": None}
    return {"commit": rev.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


LOCK_FILE = "requirements/common.txt"


def lock_file_hash() -> dict[str, Any]:
    """sha256 of the dependency lock of this package's checkout (scripts/setup.sh installs it);
    None when the package runs from elsewhere (an installed wheel has no lock beside it)."""
    path = Path(__file__).resolve().parent.parent / LOCK_FILE
    if not path.is_file():
        return {"file": LOCK_FILE, "sha256": None}
    return {"file": LOCK_FILE, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def gpu_info() -> list[dict[str, Any]]:
    try:
        # Imported here: torch costs seconds to import; the CLI and the flows record manifests
        # without it.
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [
        {
            "name": torch.cuda.get_device_name(i),
            "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
        }
        for i in range(torch.cuda.device_count())
    ]


def base_manifest(**extra: Any) -> dict[str, Any]:
    """The common part of every manifest; callers add seeds, fingerprints and counts."""
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git": git_revision(),
        "packages": package_versions(),
        "lock": lock_file_hash(),
        "python": sys.version.split()[0],
        "host": {
            "name": socket.gethostname(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "gpus": gpu_info(),
        **extra,
    }
