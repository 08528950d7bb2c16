"""Several nodes without ssh: which node this is, where node 0 listens, and a shared run_root.

Clusters start one process per node through their scheduler (Slurm's ``srun``, a Kubernetes
Job or PyTorchJob), with no ssh between nodes. Every node then runs the same command,
``anchorctx train CONFIG``, and this module answers the two questions torchrun's static
rendezvous needs, in this order of precedence:

1. flags: ``--node-rank R --master-addr HOST`` (and ``training.master_port``);
2. Slurm: ``SLURM_NODEID``, the first host of ``SLURM_JOB_NODELIST``;
3. torchrun's own variables: ``PET_NODE_RANK``/``PET_MASTER_ADDR``/``PET_MASTER_PORT``, then the
   conventional ``NODE_RANK``/``MASTER_ADDR``/``MASTER_PORT`` (Kubernetes PyTorchJob and most
   launch templates set these).

The node count is ``training.nnodes`` (one setting, one place); under Slurm it must equal
``SLURM_NNODES``, and a mismatch is an error rather than a guess. The port defaults to 29500
(every node must know it in advance, so it cannot be picked at random). DeepSpeed's hostfile
launcher (``training.hostfile``, ssh) stays the other way to start several nodes.

Global rank = ``node_rank × nproc + local_rank`` (static rendezvous), so rank 0 — the only writer
of checkpoints, metrics and the manifest — always runs on node 0. :func:`check_shared_run_dir`
proves at start-up that every rank sees the files rank 0 writes.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from anchorctx.io import atomic_write_text
from anchorctx.training.plan import TrainingError

DEFAULT_PORT = 29500
_CHECK_FILE = ".shared-run-check"


@dataclass(frozen=True)
class NodeSpec:
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    source: str  # where node rank and address came from: "flags", "slurm", "environment"


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``gpu[07-09,12],cpu1`` -> ``gpu07``."""
    m = re.match(r"\s*([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m or not m.group(1).strip():
        raise TrainingError(f"cannot read a host from SLURM_JOB_NODELIST={nodelist!r}")
    prefix, ranges = m.group(1).strip(), m.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]  # zero padding is part of the name: keep it
    return prefix + first


def _int(value: str, name: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise TrainingError(f"{name}={value!r} is not an integer") from None


def resolve_nodes(
    nnodes: int,
    *,
    node_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    environ: Mapping[str, str] = os.environ,
) -> NodeSpec:
    """This node's place in an ``nnodes``-node job, from flags, Slurm or torchrun variables."""
    env = environ
    if "SLURM_NNODES" in env and "SLURM_NODEID" in env:
        slurm_nodes = _int(env["SLURM_NNODES"], "SLURM_NNODES")
        if slurm_nodes != nnodes:
            raise TrainingError(
                f"training.nnodes={nnodes} but Slurm allocated {slurm_nodes} nodes "
                f"(SLURM_NNODES); set --set training.nnodes={slurm_nodes}"
            )
    source = "flags"
    if node_rank is None:
        for key, where in (
            ("SLURM_NODEID", "slurm"),
            ("PET_NODE_RANK", "environment"),
            ("NODE_RANK", "environment"),
        ):
            if key in env:
                node_rank, source = _int(env[key], key), where
                break
    if master_addr is None:
        if "SLURM_JOB_NODELIST" in env:
            master_addr = first_host(env["SLURM_JOB_NODELIST"])
        else:
            master_addr = env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR")
    if master_port is None:
        port = env.get("PET_MASTER_PORT") or env.get("MASTER_PORT")
        master_port = _int(port, "MASTER_PORT") if port else DEFAULT_PORT
    if node_rank is None or not master_addr:
        missing = " and ".join(
            what
            for what, value in (("--node-rank", node_rank), ("--master-addr", master_addr))
            if value is None or value == ""
        )
        raise TrainingError(
            f"training.nnodes={nnodes} needs this node's {missing} (or run under Slurm, or set "
            "NODE_RANK/MASTER_ADDR as torchrun and Kubernetes do; or give training.hostfile to "
            "start every node from this one over ssh)"
        )
    if not 0 <= node_rank < nnodes:
        raise TrainingError(f"node rank {node_rank} is outside 0..{nnodes - 1} (training.nnodes)")
    return NodeSpec(nnodes, node_rank, master_addr, master_port, source)


def rendezvous_args(spec: NodeSpec, nproc: int) -> list[str]:
    """torchrun's static rendezvous: fixed node rank, so global rank 0 is on node 0."""
    return [
        f"--nnodes={spec.nnodes}",
        f"--node-rank={spec.node_rank}",
        f"--nproc-per-node={nproc}",
        f"--master-addr={spec.master_addr}",
        f"--master-port={spec.master_port}",
    ]


def check_shared_run_dir(run_dir: Path, rank: int, world: int) -> None:
    """Collective: rank 0 writes a fresh token into ``run_dir``; every rank must read it back.

    A node with its own (unshared) ``run_root`` would otherwise train happily and lose its
    share of resume state, or read stale checkpoints. Every rank learns the outcome (all-gather),
    so all fail together with one message instead of some hanging at the next collective.
    """
    # Imported here: torch costs seconds to import, which the node checks before training skip.
    import torch.distributed as dist

    path = Path(run_dir) / _CHECK_FILE
    token: list[str | None] = [None]  # filled by the broadcast on ranks other than 0
    if rank == 0:
        token[0] = mine = secrets.token_hex(16)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, mine)
    dist.broadcast_object_list(token, src=0)
    dist.barrier()  # rank 0's rename is done before anyone reads
    try:
        seen = path.read_text() == token[0]
    except OSError:
        seen = False
    gathered: list[tuple[bool, str] | None] = [None] * world
    dist.all_gather_object(gathered, (seen, socket.gethostname()))
    views = cast(list[tuple[bool, str]], gathered)  # all_gather_object filled every slot
    blind = [f"rank {r} ({host})" for r, (ok, host) in enumerate(views) if not ok]
    if blind:
        raise TrainingError(
            f"run_root is not shared: {', '.join(blind)} cannot see {path}, written by rank 0 "
            f"({views[0][1]}); every node must mount the same run_root"
        )
