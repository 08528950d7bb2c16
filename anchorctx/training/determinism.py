"""Deterministic training (``training.deterministic``): what makes a rerun bit-identical.

Training is a pure function of the config and seed except for the order in which GPU kernels
add floating-point numbers (float addition is not associative, so a different order rounds
differently, and the difference grows step by step). The sources, and what closes each:

- **Kernels that accumulate with atomics** (CUDA ``index_add``/``scatter_add`` as in the
  embedding backward, SDPA's flash and memory-efficient backwards with split keys):
  ``torch.use_deterministic_algorithms(True)`` swaps in their deterministic versions, and an op
  that has none raises an error naming it (strict mode, not warn-only: a warning in a
  200-step log would let a run that is not deterministic pass as one).
- **cuBLAS' split-K reductions**, whose order depends on the workspace each stream gets:
  ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` fixes it. cuBLAS reads it when a handle is created, so the
  launcher sets it before any CUDA call (:func:`environment`), for every rank it starts.
- **cuDNN's autotuner** (``benchmark``) may pick a different algorithm per run: off, and
  cuDNN limited to its deterministic algorithms.
- **Attention engines**: each declares where its backward is deterministic
  (``Capabilities.deterministic_backward``); under the deterministic mode ``auto`` skips the
  others and a named one is an error (:mod:`anchorctx.attention.engines.base`).

Not covered: NCCL's reductions over several GPUs are deterministic for a fixed world size and
algorithm choice in practice, but NCCL does not promise it; bit-identical reruns were measured
on one GPU (docs/runs/2026-11-25-deterministic-training.md).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, MutableMapping
from typing import Any

# torch is imported by the functions that use it: the launcher calls environment() on every
# node, and a node that only starts torchrun never needs torch itself (~2 s of imports).

# ":4096:8": eight 4 MiB cuBLAS workspaces (":16:8", the other value cuBLAS documents as
# deterministic, is smaller and can be slower).
CUBLAS_WORKSPACE_CONFIG = ":4096:8"
DETERMINISTIC_WORKSPACES = (":4096:8", ":16:8")


def environment(deterministic: bool, environ: MutableMapping[str, str]) -> str | None:
    """Set ``CUBLAS_WORKSPACE_CONFIG`` for a deterministic run unless it already holds one of
    cuBLAS' deterministic values (read when the first cuBLAS handle is created: the launcher
    calls this before any CUDA work, so the in-process run and every rank see it). Returns the
    start-up line saying so, or None."""
    if not deterministic or environ.get("CUBLAS_WORKSPACE_CONFIG") in DETERMINISTIC_WORKSPACES:
        return None
    environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE_CONFIG
    return (
        "deterministic training: torch deterministic algorithms, cuDNN deterministic, "
        f"CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE_CONFIG}"
    )


@contextlib.contextmanager
def deterministic_mode(deterministic: bool, seed: int) -> Iterator[None]:
    """Inside: torch's deterministic algorithms (strict), cuDNN deterministic without the
    autotuner, and every device's generator seeded with ``seed``; the previous settings come
    back on exit (an in-process run leaves its caller's process as it found it). Nothing when
    ``deterministic`` is False."""
    if not deterministic:
        yield
        return
    import torch

    environment(True, os.environ)  # a caller that did not go through the launcher
    cudnn = torch.backends.cudnn
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        cudnn.benchmark,
        cudnn.deterministic,
    )
    torch.use_deterministic_algorithms(True)
    cudnn.benchmark, cudnn.deterministic = False, True
    torch.manual_seed(seed)  # CPU and every CUDA device
    try:
        yield
    finally:
        enabled, warn_only, cudnn.benchmark, cudnn.deterministic = before
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def record(deterministic: bool) -> dict[str, Any]:
    """The run manifest's ``deterministic`` entry: what was asked for and what was in force
    when the run directory was prepared (inside :func:`deterministic_mode`)."""
    import torch

    return {
        "requested": deterministic,
        "torch_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }
