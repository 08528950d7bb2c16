"""The ``anchorctx`` command.

Each subcommand lives beside the library code it drives (``<package>/commands.py``) and provides
two functions: ``<name>_arguments(parser)`` adds its options, ``<name>(args) -> int`` runs it.
Commands that take an experiment config get ``CONFIG`` and ``--set a.b=value`` here, and find the
validated config in ``args.cfg``. Heavy imports (torch, transformers) happen inside the command,
so ``anchorctx --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NamedTuple

from anchorctx.config import ConfigError, load_config


class Command(NamedTuple):
    module: str
    function: str
    help: str
    takes_config: bool


COMMANDS: dict[str, Command] = {
    "config": Command("anchorctx.cli", "show_config", "Validate a config and print it resolved.", True),
    "demo-corpus": Command("anchorctx.packing.commands", "demo_corpus",
                           "Write the seeded synthetic corpus and its tokenizer.", False),
    "prepare-data": Command("anchorctx.packing.commands", "prepare_data",
                            "Sample, tokenise and pack the corpus into a packed dataset.", True),
    "train": Command("anchorctx.training.commands", "train",
                     "Train one variant (in-process, or launching torchrun for several ranks).", True),
    "evaluate": Command("anchorctx.evaluation.commands", "evaluate",
                        "Evaluate checkpoints: RULER, LongBench, MMLU, HellaSwag.", True),
    "average-weights": Command("anchorctx.evaluation.commands", "average_weights",
                               "Write a weight-averaged checkpoint of the last k checkpoints.", True),
    "report": Command("anchorctx.evaluation.commands", "report",
                      "Average the last k checkpoints and write the experiment report.", True),
    "rope-precision": Command("anchorctx.analysis.commands", "rope_precision",
                              "The BF16 RoPE precision study (paper Section 2).", True),
    "serve": Command("anchorctx.flows.commands", "serve",
                     "Serve all Prefect deployments against the configured Prefect API.", False),
    "run": Command("anchorctx.flows.commands", "run",
                   "Run a deployment (full-experiment/demo by default), optionally one arm, stage "
                   "or suite, and follow its progress in the terminal.", False),
    "eval-worker": Command("anchorctx.flows.commands", "eval_worker",
                           "Run one evaluation worker (one GPU slot) of a Prefect work pool.", False),
}  # fmt: skip


def show_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arms", action="store_true", help="Print every experiment arm's config.")


def show_config(args: argparse.Namespace) -> int:
    cfgs = args.cfg.arms() if args.arms else [args.cfg]
    for cfg in cfgs:
        print(f"# run directory: {cfg.run_dir}")
        print(cfg.to_yaml())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="anchorctx",
        description="Long-context continual training with AnchorAttention: data packing, "
        "training, evaluation and reports. Each command takes an experiment config "
        "(configs/*.yaml) and dotted overrides: --set training.steps=10.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        if cmd.takes_config:
            p.add_argument("config", metavar="CONFIG", help="Experiment config YAML.")
            p.add_argument(
                "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                help="Override a config value, e.g. --set training.steps=20 (repeatable).",
            )  # fmt: skip
        module = importlib.import_module(cmd.module)
        getattr(module, f"{cmd.function}_arguments")(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cmd = COMMANDS[args.command]
    try:
        if cmd.takes_config:
            args.cfg = load_config(args.config, args.overrides)
        return int(getattr(importlib.import_module(cmd.module), cmd.function)(args) or 0)
    except ConfigError as err:
        print(f"anchorctx {args.command}: config error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"anchorctx {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
