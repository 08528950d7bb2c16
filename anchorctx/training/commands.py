"""``anchorctx train CONFIG [--resume | --force]``."""

from __future__ import annotations

import argparse


def train_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--resume", action="store_true",
        help="Continue from <run_dir>/resume (identical continuation); a finished run returns "
        "at once, a run without resume state starts fresh.",
    )  # fmt: skip
    mode.add_argument(
        "--force", action="store_true",
        help="Start over: rename an earlier run in the run directory aside (<run>.old-<time>). "
        "Without --resume or --force, a run directory holding an earlier run is an error.",
    )  # fmt: skip


def train(args: argparse.Namespace) -> int:
    from anchorctx.training.launch import launch

    # Errors (config, data, busy or corrupt run directory) become one line in anchorctx.cli.
    return launch(args.cfg, resume=args.resume, force=args.force)
