"""``anchorctx train CONFIG [--resume]``."""

from __future__ import annotations

import argparse
import sys


def train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--resume", action="store_true",
        help="Continue from <run_dir>/resume (identical continuation); a finished run returns "
        "at once, a run without resume state starts fresh.",
    )  # fmt: skip
    nodes = parser.add_argument_group(
        "several nodes, the same command on each (Slurm, Kubernetes; no ssh)",
        "With training.nnodes > 1 every node runs `anchorctx train CONFIG` with its own "
        "--node-rank and node 0's address; under Slurm both come from SLURM_NODEID and "
        "SLURM_JOB_NODELIST, elsewhere from NODE_RANK/MASTER_ADDR (torchrun's convention). "
        "The port is training.master_port (default 29500). run_root must be shared.",
    )
    nodes.add_argument(
        "--node-rank",
        type=int,
        default=None,
        metavar="R",
        help="This node's rank, 0..training.nnodes-1 (node 0 writes the outputs).",
    )
    nodes.add_argument("--master-addr", default=None, metavar="HOST",
                       help="Address of node 0, reachable from every node.")  # fmt: skip


def train(args: argparse.Namespace) -> int:
    from anchorctx.packing import DataError
    from anchorctx.tracking import TrackingError, check_backends
    from anchorctx.training.launch import launch
    from anchorctx.training.model import ModelLoadError
    from anchorctx.training.plan import TrainingError

    try:
        check_backends(args.cfg)  # before any work: a missing tracker package is one line
        return launch(args.cfg, resume=args.resume, node_rank=args.node_rank,
                      master_addr=args.master_addr)  # fmt: skip
    except (TrainingError, ModelLoadError, DataError, TrackingError) as err:
        print(f"anchorctx train: {err}", file=sys.stderr)
        return 2
