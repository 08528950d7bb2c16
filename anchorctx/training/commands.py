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


def train(args: argparse.Namespace) -> int:
    from anchorctx.packing import DataError
    from anchorctx.tracking import TrackingError, check_backends
    from anchorctx.training.launch import launch
    from anchorctx.training.model import ModelLoadError
    from anchorctx.training.plan import TrainingError

    try:
        check_backends(args.cfg)  # before any work: a missing tracker package is one line
        return launch(args.cfg, resume=args.resume)
    except (TrainingError, ModelLoadError, DataError, TrackingError) as err:
        print(f"anchorctx train: {err}", file=sys.stderr)
        return 2
