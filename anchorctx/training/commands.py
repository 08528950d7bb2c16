"""``anchorctx train CONFIG [--resume | --force]``."""

from __future__ import annotations

import argparse
import contextlib
import signal
import threading
from collections.abc import Iterator

from anchorctx.demo import ensure_demo_corpus
from anchorctx.tracking import check_backends


def train_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--resume",
        action="store_true",
        help="Continue from <run_dir>/resume (identical continuation); a finished run returns "
        "at once, a run without resume state starts fresh.",
    )
    mode.add_argument(
        "--force",
        action="store_true",
        help="Start over: rename an earlier run in the run directory aside (<run>.old-<time>). "
        "Without --resume or --force, a run directory holding an earlier run is an error.",
    )
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
    nodes.add_argument(
        "--master-addr",
        default=None,
        metavar="HOST",
        help="Address of node 0, reachable from every node.",
    )


def train(args: argparse.Namespace) -> int:
    # Imported here: the launcher's imports reach torch, which `anchorctx --help` skips.
    from anchorctx.training.launch import launch

    # Errors (config, data, tracker, busy or corrupt run directory) become one line in
    # anchorctx.cli, with exit status 2 or 1 (see there).
    check_backends(args.cfg)  # before any work: a missing tracker package is one line
    # Demo configs: the launcher writes the corpus where it prepares the data (node 0, under
    # the run lock), before its checks read the tokenizer.
    with sigterm_as_interrupt():
        return launch(
            args.cfg,
            resume=args.resume,
            force=args.force,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            prepare_inputs=ensure_demo_corpus,
        )


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (``kill``, a scheduler's stop, a cancelled orchestration task) stops training as
    Ctrl-C does: ``KeyboardInterrupt`` in the main thread, so the same cleanup runs (the
    launched process group is terminated, the run lock released, partial writes removed) and
    ``anchorctx.cli`` prints the same ``interrupted`` line with the same exit status (130).
    Only the first SIGTERM interrupts; more during the cleanup are ignored. The previous
    handler is restored afterwards (the command may run inside a longer-lived process)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread; the caller handles its own
        return

    def interrupt(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
