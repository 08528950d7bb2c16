"""Entry point of one launched rank: ``python -m anchorctx.training.worker CONFIG [--resume]``.

Started by :func:`anchorctx.training.launch` through torchrun or DeepSpeed's launcher, which set
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``; users run ``anchorctx train`` instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

import torch.distributed as dist

from anchorctx.errors import error_line, exit_code
from anchorctx.experiment import load_config
from anchorctx.training.loop import train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="anchorctx.training.worker")
    parser.add_argument("config")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--data-dir", type=Path, default=None, help="Prepared packed dataset.")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        # The launcher (``anchorctx train``) holds the run directory's lock for the group.
        train(load_config(args.config), resume=args.resume, data_dir=args.data_dir, hold_lock=False)
    except Exception as err:  # one line per rank, like the CLI; traceback with --debug
        if os.environ.get("ANCHORCTX_DEBUG"):
            traceback.print_exc()
        rank = os.environ.get("RANK", "?")
        if isinstance(err, dist.DistError | RuntimeError) and _lost_peer(err):
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            print(
                f"anchorctx train: rank {rank} lost contact with the other processes ({first}); "
                "another node or process has failed",
                file=sys.stderr,
            )
            return 1
        print(f"anchorctx train (rank {rank}): {error_line(err)}", file=sys.stderr)
        return exit_code(err)
    return 0


def _lost_peer(err: BaseException) -> bool:
    """A collective failed because a peer went away (its process or node died)."""
    text = str(err).lower()
    return isinstance(err, dist.DistError) or any(
        s in text for s in ("connection closed", "connection reset", "broken pipe", "timed out")
    )


if __name__ == "__main__":
    sys.exit(main())
