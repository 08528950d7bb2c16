"""Entry point of one launched rank: ``python -m anchorctx.training.worker CONFIG [--resume]``.

Started by :func:`anchorctx.training.launch` through torchrun or DeepSpeed's launcher, which set
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``; users run ``anchorctx train`` instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from anchorctx.config import ConfigError, load_config
from anchorctx.training.plan import TrainingError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="anchorctx.training.worker")
    parser.add_argument("config")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--data-dir", type=Path, default=None, help="Prepared packed dataset.")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import torch.distributed as dist

    from anchorctx.training.loop import train

    try:
        train(load_config(args.config), resume=args.resume, data_dir=args.data_dir)
    except (ConfigError, TrainingError) as err:
        print(f"anchorctx train: {err}", file=sys.stderr)
        return 2
    except (dist.DistError, RuntimeError) as err:
        if not _lost_peer(err):
            raise
        rank = os.environ.get("RANK", "?")
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"anchorctx train: rank {rank} lost contact with the other processes ({first}); "
              "another node or process has failed", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _lost_peer(err: BaseException) -> bool:
    """A collective failed because a peer went away (its process or node died)."""
    import torch.distributed as dist

    text = str(err).lower()
    return isinstance(err, dist.DistError) or any(
        s in text for s in ("connection closed", "connection reset", "broken pipe", "timed out")
    )


if __name__ == "__main__":
    sys.exit(main())
