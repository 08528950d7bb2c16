"""``launch(cfg)``: one command for any scale.

- One process (``nproc × nnodes == 1``): :func:`anchorctx.training.loop.train` runs in this
  process, given the plan, pre-flight result and restart state computed here.
- Several processes on this machine: ``torchrun --nproc-per-node N`` runs
  ``python -m anchorctx.training.worker`` as a child. On CPU, ``training.sequence_parallel=2``
  alone starts two gloo processes (``nproc`` defaults to the SP size on CPU, to the visible GPU
  count on GPU).
- Several nodes, two conventions. (a) The same command on every node (Slurm, Kubernetes; no
  ssh): ``training.nnodes`` > 1, this node's rank and node 0's address from ``--node-rank`` /
  ``--master-addr`` or the scheduler's environment (:mod:`anchorctx.training.nodes`); each node
  runs torchrun with a static rendezvous. Only node 0 prepares the data; the others wait for it
  inside the job. (b) ``training.hostfile`` (DeepSpeed's format, one ``host slots=N`` line per
  node): ``anchorctx train`` on the first host runs DeepSpeed's launcher, which starts the workers
  over passwordless ssh. Either way every node must see the same ``run_root`` (checked at start:
  checkpoints and resume state are written there) and the same environment.

The child gets its own session (process group) and inherits this process's stdout/stderr, so
its output (and its progress bar on a terminal) is forwarded as is. On any exception here —
Ctrl-C, SIGTERM (which ``anchorctx train`` turns into the same interrupt), a cancelled
orchestration task — the whole group is terminated, then killed. The child is torchrun through
:mod:`anchorctx.training.torchrun`, which folds torchrun's traceback on such a stop (and its
``ChildFailedError`` block when a rank fails) into one line.
All pre-flight checks run here first, so a bad config fails before any GPU is touched; with
``--resume`` the data is checked against the resume state before anything is packed.

The run directory's writer lock (:class:`anchorctx.io.WriterLock`) is taken here, before
anything is written, and held for the whole run: in-process, or passed to the launcher child
(``pass_fds``) so it stays held while the process group lives. Workers never take it; in a
multi-node job only node 0 (or the host that runs DeepSpeed's launcher) holds it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, MutableMapping
from pathlib import Path

from anchorctx.config import dump_config
from anchorctx.experiment import ExperimentConfig
from anchorctx.io import atomic_write_json, move_aside
from anchorctx.process import free_port, run_process_group
from anchorctx.training import determinism, memory_choice
from anchorctx.training.nodes import NodeSpec, rendezvous_args, resolve_nodes
from anchorctx.training.plan import (
    Parallelism,
    TrainingError,
    plan_parallelism,
    processes_per_node,
)
from anchorctx.training.run_dir import run_lock

LAUNCH_CONFIG = ".launch-config.yaml"
# torchrun (``torch.distributed.run``) with its stop-by-signal traceback folded into one line.
TORCHRUN = "anchorctx.training.torchrun"


def launch(
    cfg: ExperimentConfig,
    *,
    resume: bool = False,
    force: bool = False,
    node_rank: int | None = None,
    master_addr: str | None = None,
    prepare_inputs: Callable[[ExperimentConfig], object] | None = None,
) -> int:
    """Run training in-process or as a launched process group; returns the exit status.

    ``force`` starts over: an earlier run in the run directory is renamed aside first.
    ``node_rank``/``master_addr``: this node's place in a multi-node job started on every node
    (default: from the scheduler's environment, see :mod:`anchorctx.training.nodes`).
    ``prepare_inputs(cfg)``: writes generated inputs (the demo corpus) on the node that prepares
    the data, under the run lock, before the pre-flight checks read them.
    """
    if resume and force:
        raise TrainingError("--resume and --force exclude each other: continue, or start over")
    par = plan_parallelism(cfg)
    if note := cuda_allocator_settings(par.device, os.environ):
        print(note, flush=True)
    deterministic = cfg.training.deterministic and par.device == "cuda"
    if note := determinism.environment(deterministic, os.environ):
        print(note, flush=True)
    choice = None
    if par.device == "cuda" and memory_choice.plans_layout(cfg):
        cfg, choice, note = memory_choice.for_launch(
            cfg, processes_per_node(cfg, par.device), cfg.training.nnodes
        )
        print(note, flush=True)
        par = plan_parallelism(cfg)  # the ZeRO stage's default follows the offload chosen
    nodes = None
    if cfg.training.nnodes > 1 and cfg.training.hostfile is None:
        nodes = resolve_nodes(
            cfg.training.nnodes,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=cfg.training.master_port,
        )
    elif node_rank is not None or master_addr is not None:
        raise TrainingError("--node-rank/--master-addr need training.nnodes > 1 (and no hostfile)")
    if nodes is not None and nodes.node_rank != 0:
        # Node 0 alone writes the run directory: it holds the lock, moves an earlier run aside,
        # recovers and checks the resume state and prepares the data; this node's workers check
        # the restart state inside the job, after node 0 is done (loop.train).
        return _launch_group(cfg, par, resume, None, nodes, lock_fd=None)
    # Imported here, past the other nodes' return: the run directory's work below needs torch
    # and transformers (~4 s of imports), which a node that only starts torchrun never uses.
    from anchorctx.training import checkpoints as ckpt
    from anchorctx.training.loop import (
        Prepared,
        check_resume_data,
        preflight,
        restart_state,
        train,
    )

    with run_lock(cfg) as lock:
        if prepare_inputs is not None:
            prepare_inputs(cfg)
        if resume:
            if note := ckpt.recover_resume(cfg.run_dir):
                print(note, flush=True)
            # Before preflight packs: changed inputs would be packed into a new dataset (or over
            # the old one, with a fixed data.output_dir) only to be refused.
            check_resume_data(cfg)
        pre = preflight(cfg, par)  # first: a bad config moves nothing aside
        if force and (old := move_aside(cfg.run_dir)) is not None:
            print(f"earlier run moved aside to {old}", flush=True)
        if note := ckpt.recover_resume(cfg.run_dir):
            print(note, flush=True)
        if choice is not None:
            cfg.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_json(cfg.run_dir / memory_choice.RECORD, choice.record())
        state = restart_state(cfg, par, resume, pre=pre)
        if par.world == 1:
            train(cfg, resume=resume, hold_lock=False, prepared=Prepared(par, pre, state))
            return 0
        return _launch_group(cfg, par, resume, pre.data_dir, nodes, lock_fd=lock.fd)


# Expandable segments let the caching allocator grow a segment instead of keeping freed blocks
# of the wrong size: without them the default 128K step on an H100 asked for 15.6 GiB with
# 14.6 free and 15.5 GiB reserved but unallocated (fragmentation), and failed on its second step,
# although the memory model said it fits (docs/benchmarks/2026-11-25-memory-auto.md). With them it
# ran.
CUDA_ALLOC_CONF = "expandable_segments:True"


def cuda_allocator_settings(device: str, environ: MutableMapping[str, str]) -> str | None:
    """Set ``PYTORCH_CUDA_ALLOC_CONF`` for CUDA training unless the user set it (it is read at
    the first CUDA allocation, so here, before any, reaches the in-process run and every rank).
    Returns the start-up line saying so, or None."""
    if device != "cuda" or "PYTORCH_CUDA_ALLOC_CONF" in environ:
        return None
    environ["PYTORCH_CUDA_ALLOC_CONF"] = CUDA_ALLOC_CONF
    return (
        f"CUDA allocator: PYTORCH_CUDA_ALLOC_CONF={CUDA_ALLOC_CONF} (avoids fragmentation "
        "failures on long rows; set the variable yourself to choose otherwise)"
    )


def host_threads_settings(
    device: str, nproc: int, environ: MutableMapping[str, str], cores: int | None = None
) -> str | None:
    """Set ``OMP_NUM_THREADS`` to this host's cores shared among its ``nproc`` CUDA ranks,
    unless the user set it. Returns the start-up line saying so, or None.

    torchrun sets it to 1 for every rank when it is unset. The ranks' host work then runs on
    one core each: DeepSpeed's CPU Adam over the offloaded optimizer state and the pageable
    copies to and from the GPU. The full-depth 7B step at 512K with SP=2 on two H200s took
    49.4 s with torchrun's 1 and 41.2 s with 32 threads a rank on a 64-core host: the optimizer
    step went from 12.2 to 3.4 s (docs/benchmarks/2026-11-27-sp2-512k-host-threads.md). CPU runs
    keep torchrun's 1: their ranks' own arithmetic already fills the cores."""
    if device != "cuda" or nproc < 2 or "OMP_NUM_THREADS" in environ:
        return None
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    threads = max(1, cores // nproc)
    environ["OMP_NUM_THREADS"] = str(threads)
    return (
        f"host threads: OMP_NUM_THREADS={threads} a rank ({cores} cores, {nproc} ranks; "
        "set the variable yourself to choose otherwise)"
    )


def _launch_group(
    cfg: ExperimentConfig,
    par: Parallelism,
    resume: bool,
    data_dir: Path | None,
    nodes: NodeSpec | None,
    lock_fd: int | None,
) -> int:
    """Start the launcher child (passing it the run lock, so the group keeps it held)."""
    nproc = processes_per_node(cfg, par.device)
    if note := host_threads_settings(par.device, nproc, os.environ):
        print(note, flush=True)
    if nodes is None:
        cfg_path = cfg.run_dir / LAUNCH_CONFIG
    else:  # beside the run directory: node 0 may move an earlier run aside (--force) meanwhile
        cfg_path = (
            cfg.run_dir.parent / f".{cfg.run_dir.name}.launch-config-node{nodes.node_rank}.yaml"
        )
    dump_config(cfg, cfg_path)
    cmd = launcher_command(cfg, nproc, cfg_path, resume, data_dir, nodes)
    print("launching: " + " ".join(cmd), flush=True)
    # Output inherited: the ranks' lines (and a progress bar on a terminal) pass through as is.
    code = run_process_group(cmd, on_line=None, pass_fds=(lock_fd,), check=False)
    if code != 0 and nodes is not None:
        print(
            f"anchorctx train: node {nodes.node_rank} of {nodes.nnodes}: the distributed job "
            f"failed (exit {code}); if a node died, start every node again with --resume",
            file=sys.stderr,
            flush=True,
        )
    return code


def launcher_command(
    cfg: ExperimentConfig,
    nproc: int,
    cfg_path: Path,
    resume: bool,
    data_dir: Path | None,
    nodes: NodeSpec | None = None,
) -> list[str]:
    t = cfg.training
    worker = [
        "-m",
        "anchorctx.training.worker",
        str(cfg_path),
        *(["--data-dir", str(data_dir)] if data_dir is not None else []),
        *(["--resume"] if resume else []),
    ]
    if nodes is not None:
        return [
            sys.executable,
            "-m",
            TORCHRUN,
            *rendezvous_args(nodes, nproc),
            *worker,
        ]
    port = str(t.master_port or free_port())
    if t.hostfile is not None:
        if not Path(t.hostfile).is_file():
            raise TrainingError(f"training.hostfile not found: {t.hostfile}")
        return [
            "deepspeed",
            "--hostfile",
            str(t.hostfile),
            "--num_nodes",
            str(t.nnodes),
            "--num_gpus",
            str(nproc),
            "--master_port",
            port,
            "--module",
            *worker[1:],
        ]
    return [
        sys.executable,
        "-m",
        TORCHRUN,
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        *worker,
    ]
