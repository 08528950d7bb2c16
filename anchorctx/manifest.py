"""Run manifests: what produced an output (git revision, package versions, seeds, host, GPUs)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PACKAGES = (
    "anchorctx", "torch", "transformers", "datasets", "tokenizers", "deepspeed", "flash-attn",
    "prefect", "lm-eval", "pydantic", "numpy",
)  # fmt: skip


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
            cwd=cwd, capture_output=True, text=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    if rev.returncode != 0:
        return {"commit": None, "dirty": None}
    return {"commit": rev.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


LOCK_FILE = "requirements/common.txt"


def lock_file_hash() -> dict[str, Any]:
    """sha256 of the dependency lock of this package's checkout (scripts/setup.sh installs it);
    None when the package runs from elsewhere (an installed wheel has no lock beside it)."""
    import hashlib

    path = Path(__file__).resolve().parent.parent / LOCK_FILE
    if not path.is_file():
        return {"file": LOCK_FILE, "sha256": None}
    return {"file": LOCK_FILE, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def gpu_info() -> list[dict[str, Any]]:
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [
        {"name": torch.cuda.get_device_name(i),
         "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
        for i in range(torch.cuda.device_count())
    ]  # fmt: skip


def base_manifest(**extra: Any) -> dict[str, Any]:
    """The common part of every manifest; callers add seeds, fingerprints and counts."""
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git": git_revision(),
        "packages": package_versions(),
        "lock": lock_file_hash(),
        "python": sys.version.split()[0],
        "host": {"name": socket.gethostname(), "platform": platform.platform(),
                 "cpus": os.cpu_count()},
        "gpus": gpu_info(),
        **extra,
    }  # fmt: skip
