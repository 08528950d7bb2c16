"""``launch(cfg)``: one command for any scale.

- One process (``nproc × nnodes == 1``): :func:`anchorctx.training.train` runs in this process.
- Several processes on this machine: ``torchrun --nproc-per-node N`` runs
  ``python -m anchorctx.training.worker`` as a child. On CPU, ``training.sequence_parallel=2``
  alone starts two gloo processes (``nproc`` defaults to the SP size on CPU, to the visible GPU
  count on GPU).
- Several nodes: set ``training.hostfile`` (DeepSpeed's format, one ``host slots=N`` line per
  node), ``training.nnodes`` and ``training.nproc``; ``anchorctx train`` then runs DeepSpeed's
  launcher (``deepspeed --hostfile ...``), which starts the workers over passwordless ssh. Every
  node must see the same ``run_root`` (a shared filesystem: checkpoints and resume state are
  written there) and the same environment.

The child gets its own session (process group) and inherits this process's stdout/stderr, so
its output (and its progress bar on a terminal) is forwarded as is. On any exception here —
Ctrl-C, a cancelled orchestration task — the whole group is terminated, then killed.
All pre-flight checks run here first, so a bad config fails before any GPU is touched.

The run directory's writer lock (:class:`anchorctx.io.WriterLock`) is taken here, before
anything is written, and held for the whole run: in-process, or passed to the launcher child
(``pass_fds``) so it stays held while the process group lives. Workers never take it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from anchorctx.config import ExperimentConfig, dump_config
from anchorctx.training.plan import TrainingError, plan_parallelism, processes_per_node

LAUNCH_CONFIG = ".launch-config.yaml"


def launch(cfg: ExperimentConfig, *, resume: bool = False, force: bool = False) -> int:
    """Run training in-process or as a launched process group; returns the exit status.

    ``force`` starts over: an earlier run in the run directory is renamed aside first.
    """
    from anchorctx.training import checkpoints as ckpt
    from anchorctx.training.loop import move_run_aside, preflight, restart_state, run_lock, train

    if resume and force:
        raise TrainingError("--resume and --force exclude each other: continue, or start over")
    par = plan_parallelism(cfg)
    with run_lock(cfg) as lock:
        pre = preflight(cfg, par)  # first: a bad config moves nothing aside
        if force and (old := move_run_aside(cfg.run_dir)) is not None:
            print(f"earlier run moved aside to {old}", flush=True)
        if note := ckpt.recover_resume(cfg.run_dir):
            print(note, flush=True)
        restart_state(cfg, par, resume)
        if par.world == 1:
            train(cfg, resume=resume, data_dir=pre.data_dir, hold_lock=False)
            return 0
        cfg_path = cfg.run_dir / LAUNCH_CONFIG
        dump_config(cfg, cfg_path)
        nproc = processes_per_node(cfg, par.device)
        cmd = launcher_command(cfg, nproc, cfg_path, resume, pre.data_dir)
        return run_process_group(cmd, pass_fds=(lock.fd,))


def launcher_command(
    cfg: ExperimentConfig, nproc: int, cfg_path: Path, resume: bool, data_dir: Path
) -> list[str]:
    t = cfg.training
    from anchorctx.training.engine import free_port

    port = str(t.master_port or free_port())
    worker = ["-m", "anchorctx.training.worker", str(cfg_path), "--data-dir", str(data_dir),
              *(["--resume"] if resume else [])]  # fmt: skip
    if t.hostfile is not None:
        if not Path(t.hostfile).is_file():
            raise TrainingError(f"training.hostfile not found: {t.hostfile}")
        return ["deepspeed", "--hostfile", str(t.hostfile), "--num_nodes", str(t.nnodes),
                "--num_gpus", str(nproc), "--master_port", port, "--module",
                *worker[1:]]  # fmt: skip
    if t.nnodes > 1:
        raise TrainingError(
            f"training.nnodes={t.nnodes} needs training.hostfile (DeepSpeed hostfile format: "
            "one 'hostname slots=N' line per node)"
        )
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
            f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={port}",
            *worker]  # fmt: skip


def run_process_group(
    cmd: list[str], env: dict[str, str] | None = None, pass_fds: tuple[int | None, ...] = ()
) -> int:
    """Run ``cmd`` in a new session; kill its whole process group if we are interrupted.
    ``pass_fds``: descriptors the child inherits (the run lock, so it outlives this process)."""
    print("launching: " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, start_new_session=True, env={**os.environ, **(env or {})},
                            pass_fds=tuple(fd for fd in pass_fds if fd is not None))  # fmt: skip
    try:
        return proc.wait()
    except BaseException:
        _terminate_group(proc)
        raise


def _terminate_group(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM the group (torchrun forwards it to the workers), then SIGKILL what is left."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    proc.wait()
