"""Multi-process test helper: run a function on N ranks (the code under test initialises the
process group itself: gloo on CPU, NCCL on GPUs).

    from distributed import run_distributed

    def worker(rank: int, world: int, out: Path) -> None: ...   # module level (picklable)

    run_distributed(worker, 2, tmp_path)

Each rank is a fresh interpreter with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
``MASTER_ADDR``/``MASTER_PORT`` set (what torchrun would set) and the test process' environment,
so library code that initialises its own process group runs unchanged; a failing rank's
traceback is re-raised in the test. Fresh interpreters also keep process-global state
(DeepSpeed groups, the Ulysses attention registration) out of the pytest process.

A rank is forked from multiprocessing's fork server, which imported ``PRELOAD`` once (started
on first use, one per pytest process, idle in between): a spawned interpreter spent ~8 s of
CPU importing them, for every rank of every run (five ranks in tests/test_training_sp.py).
The server only imports: no model, process group or DeepSpeed state exists in it, so each
rank starts as clean as a spawned one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from anchorctx.process import free_port

# DeepSpeed JIT-builds a shared-memory comm op on CPU (~40 s); build it once per cache dir.
_EXT_ENV = "TORCH_EXTENSIONS_DIR"
# What every rank imports (CPU seconds on two cores): torch (~1.8), the torch.compile machinery
# (~2.7) that DeepSpeed's ZeRO optimizer check imports (deepspeed/runtime/zero/muon), and
# transformers' modelling code (~3.5); pytest, for this module. Not DeepSpeed itself (~0.3 s
# after these): a rank imports it through anchorctx, which chooses its accelerator and op cache
# first, as in a spawned interpreter.
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "pytest",
)


def _entry(rank: int, fn: Callable, world: int, port: int, env: dict, args: tuple) -> None:
    import torch

    # The test process' environment, as a spawned interpreter would inherit it (a forked rank
    # has the fork server's, from when the server started).
    os.environ.clear()
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
    # torch read OMP_NUM_THREADS when the server imported it: one intra-op thread a rank, set
    # here (ranks that each spread small ops over every core contend for the cores).
    torch.set_num_threads(1)
    fn(rank, world, *args)


def run_distributed(fn: Callable[..., None], world: int, *args: Any, timeout_s: int = 600) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh processes and wait for all."""
    import multiprocessing

    import torch.multiprocessing as mp

    # Takes effect when the server starts (the first call in this process).
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    ctx = mp.start_processes(
        _entry,
        args=(fn, world, free_port(), dict(os.environ), args),
        nprocs=world,
        join=False,
        start_method="forkserver",
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
