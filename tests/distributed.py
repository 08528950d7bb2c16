"""Multi-process test helper: run a function on N ranks (the code under test initialises the
process group itself: gloo on CPU, NCCL on GPUs).

    from distributed import run_distributed

    def worker(rank: int, world: int, out: Path) -> None: ...   # module level (picklable)

    run_distributed(worker, 2, tmp_path)

Each rank is a fresh spawned interpreter with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
``MASTER_ADDR``/``MASTER_PORT`` set (what torchrun would set), so library code that initialises
its own process group runs unchanged; a failing rank's traceback is re-raised in the test.
Fresh interpreters also keep process-global state (DeepSpeed groups, the Ulysses attention
registration) out of the pytest process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from anchorctx.process import free_port

# DeepSpeed JIT-builds a shared-memory comm op on CPU (~40 s); build it once per cache dir.
_EXT_ENV = "TORCH_EXTENSIONS_DIR"


def _entry(rank: int, fn: Callable, world: int, port: int, env: dict, args: tuple) -> None:
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    fn(rank, world, *args)


def run_distributed(fn: Callable[..., None], world: int, *args: Any, timeout_s: int = 600) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes and wait for all."""
    import torch.multiprocessing as mp

    env = {k: v for k, v in os.environ.items() if k == _EXT_ENV}
    ctx = mp.start_processes(
        _entry,
        args=(fn, world, free_port(), env, args),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    import time

    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"distributed test did not finish in {timeout_s} s")


@pytest.fixture(scope="session")
def torch_extensions(request) -> str:
    """A persistent ``TORCH_EXTENSIONS_DIR`` (pytest cache) for DeepSpeed's CPU comm op."""
    path = os.environ.get(_EXT_ENV) or str(request.config.cache.mkdir("torch_extensions"))
    os.environ[_EXT_ENV] = path
    return path
