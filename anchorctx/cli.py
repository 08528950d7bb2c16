"""The ``anchorctx`` command.

Each subcommand lives beside the library code it drives (``<package>/commands.py``) and provides
two functions, listed in :data:`COMMANDS`: ``<name>_arguments(parser)`` adds its options,
``<name>(args) -> int`` runs it. Commands that take an experiment config get ``CONFIG`` and
``--set a.b=value`` here, and find the validated config in ``args.cfg``. Heavy imports (torch,
transformers, Prefect, DeepSpeed) happen inside the command, so ``anchorctx --help`` stays fast.

Errors: every failure is one line on stderr, ``anchorctx <command>: <what went wrong>``, with
exit status 2 for a usage or config mistake (fix the command line or the config) and 1 for a
failure at run time (bad input data, a corrupt file, a busy run directory, a full disk). The
traceback is printed only with ``anchorctx --debug <command> ...``.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from typing import NamedTuple

from anchorctx.analysis import commands as analysis_commands
from anchorctx.config import ConfigError
from anchorctx.demo import commands as demo_commands
from anchorctx.errors import error_line, exit_code
from anchorctx.evaluation import commands as evaluation_commands
from anchorctx.experiment import check_layout, load_config
from anchorctx.flows import commands as flows_commands
from anchorctx.packing import commands as packing_commands
from anchorctx.training import commands as training_commands


class Command(NamedTuple):
    run: Callable[[argparse.Namespace], int]
    arguments: Callable[[argparse.ArgumentParser], None]
    help: str
    takes_config: bool


def show_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arms", action="store_true", help="Print every experiment arm's config.")


def show_config(args: argparse.Namespace) -> int:
    cfgs = args.cfg.arms() if args.arms else [args.cfg]
    for cfg in cfgs:
        print(f"# run directory: {cfg.run_dir}")
        print(cfg.to_yaml())
    return 0


COMMANDS: dict[str, Command] = {
    "config": Command(
        show_config, show_config_arguments, "Validate a config and print it resolved.", True
    ),
    "demo-corpus": Command(
        packing_commands.demo_corpus,
        packing_commands.demo_corpus_arguments,
        "Write the seeded synthetic corpus and its tokenizer.",
        False,
    ),
    "demo-assets": Command(
        demo_commands.demo_assets,
        demo_commands.demo_assets_arguments,
        "Write stand-ins, in the published formats, for every input the paper configs name.",
        False,
    ),
    "prepare-data": Command(
        packing_commands.prepare_data,
        packing_commands.prepare_data_arguments,
        "Sample, tokenise and pack the corpus into a packed dataset.",
        True,
    ),
    "train": Command(
        training_commands.train,
        training_commands.train_arguments,
        "Train one variant (in-process, or launching torchrun for several ranks).",
        True,
    ),
    "evaluate": Command(
        evaluation_commands.evaluate,
        evaluation_commands.evaluate_arguments,
        "Evaluate checkpoints: RULER, LongBench, MMLU, HellaSwag, perplexity.",
        True,
    ),
    "average-weights": Command(
        evaluation_commands.average_weights,
        evaluation_commands.average_weights_arguments,
        "Write a weight-averaged checkpoint of the last k checkpoints.",
        True,
    ),
    "report": Command(
        evaluation_commands.report,
        evaluation_commands.report_arguments,
        "Average the last k checkpoints and write the experiment report (--stacked DIR: one "
        "report across several experiments, the paper's Tables 5 and 6).",
        True,
    ),
    "plan": Command(
        evaluation_commands.plan,
        evaluation_commands.plan_arguments,
        "Predict memory per GPU, step time and GPU-hours of training and evaluation before a "
        "run; refuse a run that cannot fit, naming the fix.",
        True,
    ),
    "rope-precision": Command(
        analysis_commands.rope_precision,
        analysis_commands.rope_precision_arguments,
        "The BF16 RoPE precision study (paper Section 2: Figure 1, and Figure 7's "
        "per-sequence curves).",
        True,
    ),
    "serve": Command(
        flows_commands.serve,
        flows_commands.serve_arguments,
        "Serve all Prefect deployments against the configured Prefect API.",
        False,
    ),
    "run": Command(
        flows_commands.run,
        flows_commands.run_arguments,
        "Run a deployment (full-experiment/demo by default), optionally one arm, stage "
        "or suite, and follow its progress in the terminal.",
        False,
    ),
    "eval-worker": Command(
        flows_commands.eval_worker,
        flows_commands.eval_worker_arguments,
        "Run one evaluation worker (one GPU slot) of a Prefect work pool.",
        False,
    ),
    "lm-eval": Command(
        evaluation_commands.lm_eval,
        evaluation_commands.lm_eval_arguments,
        "lm-eval's command line with the 'anchorctx' model (the static decoder) registered.",
        False,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="anchorctx",
        description="Long-context continual training with AnchorAttention: data packing, "
        "training, evaluation and reports. Each command takes an experiment config "
        "(configs/*.yaml) and dotted overrides: --set training.steps=10.",
    )
    parser.add_argument(
        "--debug", action="store_true", help="Print the full traceback of an error."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        if cmd.takes_config:
            p.add_argument("config", metavar="CONFIG", help="Experiment config YAML.")
            p.add_argument(
                "--set",
                dest="overrides",
                action="append",
                default=[],
                metavar="KEY=VALUE",
                help="Override a config value, e.g. --set training.steps=20 (repeatable).",
            )
        cmd.arguments(p)
    return parser


# Exception class names (anywhere in the MRO) that mean "fix the command line or the config":
# exit 2. Names, not classes, so this module does not import torch-heavy packages.
class UsageError(ValueError):
    """A command-line mistake a command detects itself (e.g. ``--resume`` with ``--force``)."""


PASSTHROUGH = "lm-eval"  # everything after it is lm-eval's own command line, verbatim


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    passed: list[str] | None = None
    if PASSTHROUGH in argv:  # argparse would read lm-eval's --options as its own
        at = argv.index(PASSTHROUGH)
        alone = argv[at + 1 :] in (["-h"], ["--help"])  # this command's help, not lm-eval's
        if all(a.startswith("-") for a in argv[:at]) and not alone:  # global options before it
            argv, passed = argv[: at + 1], argv[at + 1 :]
    args = parser.parse_args(argv)
    if passed is not None:
        args.lm_eval_args = passed
    cmd = COMMANDS[args.command]
    if args.debug:
        os.environ["ANCHORCTX_DEBUG"] = "1"  # launched workers print tracebacks too
    try:
        if cmd.takes_config:
            args.cfg = load_config(args.config, args.overrides)
            check_layout(args.cfg, source=args.config)  # what `train` would refuse at launch
        return int(cmd.run(args) or 0)
    except KeyboardInterrupt:
        print(f"anchorctx {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # the one place that turns any failure into a one-line error
        if args.debug:
            traceback.print_exc()
        prefix = "config error: " if isinstance(err, ConfigError) else ""
        hint = "" if args.debug else _debug_hint(err)
        print(f"anchorctx {args.command}: {prefix}{error_line(err)}{hint}", file=sys.stderr)
        return exit_code(err)


def _debug_hint(err: BaseException) -> str:
    # Errors of our own say what to fix; a foreign one may need its traceback.
    own = type(err).__module__.startswith("anchorctx") or isinstance(err, OSError)
    return "" if own else " (run `anchorctx --debug ...` for the traceback)"


if __name__ == "__main__":
    sys.exit(main())
