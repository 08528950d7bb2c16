"""``anchorctx evaluate``, ``anchorctx report`` and ``anchorctx average-weights``."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from anchorctx.demo import ensure_demo_corpus, ensure_eval_fixtures
from anchorctx.evaluation.arm_comparison import write_arm_comparison
from anchorctx.evaluation.averaging import length_label, markdown_table, sorted_keys, summarize_run
from anchorctx.evaluation.records import ResultRecord
from anchorctx.evaluation.report import write_experiment_report
from anchorctx.evaluation.results import SUITES, EvaluationError, evaluate_checkpoint, load_result
from anchorctx.evaluation.settings import suite_argument
from anchorctx.evaluation.stacked_report import write_stacked_report
from anchorctx.evaluation.tracking import log_evaluation, log_report
from anchorctx.evaluation.weights import WeightAveragingError, averaged_owner
from anchorctx.evaluation.weights import average_weights as _average
from anchorctx.experiment import check_layout, load_config
from anchorctx.io import WriterLock, check_replaceable
from anchorctx.models.checkpoints import list_checkpoints
from anchorctx.packing.pipeline import prepare_data
from anchorctx.tracking import TrackingError, check_backends


def _suite(text: str) -> str:
    """A registered suite runner's name (``SUITES``), or any suite the config accepts."""
    return text if text in SUITES else suite_argument(text)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of GiB, got {text}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of GiB, got {text}")
    return value


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float as None: the plan's JSON is strict JSON (no
    ``Infinity``, which most parsers refuse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _run_checkpoints(run_dir: Path) -> list[Path]:
    return list_checkpoints(run_dir)


def _checkpoints(args: argparse.Namespace) -> list[Path]:
    """Explicit --checkpoint dirs, else the complete checkpoints of the run (newest last_k)."""
    if args.checkpoint:
        return [Path(c) for c in args.checkpoint]
    run_dir = Path(args.run_dir) if args.run_dir else args.cfg.run_dir
    found = _run_checkpoints(run_dir)
    if not found:
        raise EvaluationError(
            f"no complete checkpoints under {run_dir / 'checkpoints'}: train "
            "first, or pass --checkpoint DIR"
        )
    return found[-args.last_k :] if args.last_k else found


# ------------------------------------------------------------------------------- evaluate
def evaluate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        metavar="DIR",
        help="Checkpoint directory (repeatable). Default: every complete "
        "checkpoint of the run directory.",
    )
    parser.add_argument("--run-dir", metavar="DIR", help="Run directory. Default: the config's.")
    parser.add_argument(
        "--last-k",
        type=_positive,
        metavar="K",
        help="Only the newest K checkpoints of the run directory.",
    )
    parser.add_argument(
        "--suite",
        action="append",
        default=[],
        type=_suite,
        metavar="SUITE",
        help=f"Suite to run (repeatable): {', '.join(sorted(SUITES))} or lm_eval:<task> "
        "(lm-eval's long-context tasks, e.g. lm_eval:ruler, lm_eval:babilong). Default: "
        "evaluation.suites.",
    )
    parser.add_argument(
        "--force", action="store_true", help="Re-evaluate even when an up-to-date result exists."
    )
    parser.add_argument(
        "--all-arms",
        action="store_true",
        help="Every arm of the experiment (variants), each with its own config, on its saved "
        "checkpoints (all of them, or the newest --last-k): the report's curves over training "
        "(Figure 4) read them.",
    )


def evaluate(args: argparse.Namespace) -> int:
    cfg = args.cfg
    suites = args.suite or list(cfg.evaluation.suites)
    all_arms = getattr(args, "all_arms", False)  # scripts build the Namespace without it
    try:
        if all_arms and (args.checkpoint or args.run_dir):
            raise EvaluationError(
                "--all-arms evaluates the arms' own runs: drop --checkpoint/--run-dir"
            )
        check_backends(cfg)
        ensure_eval_fixtures(cfg)  # demo configs: the evaluation inputs
        for arm in cfg.arms() if all_arms else [cfg]:
            _evaluate_run(args, arm, suites)
    except (EvaluationError, TrackingError) as err:
        print(f"anchorctx evaluate: {err}", file=sys.stderr)
        return err.exit_code  # 2: a wrong path or setting; 1: a checkpoint that cannot load
    return 0


def _evaluate_run(args: argparse.Namespace, cfg: Any, suites: list[str]) -> None:
    """``suites`` on the checkpoints ``args`` name, else on every saved checkpoint of ``cfg``'s
    run (the newest ``--last-k``); a run's scores go to the trackers."""
    args = argparse.Namespace(**{**vars(args), "cfg": cfg})
    for ckpt in _checkpoints(args):
        for suite in suites:
            path = evaluate_checkpoint(cfg, ckpt, suite, force=args.force)
            result = load_result(path)
            assert result is not None
            print(f"\n{cfg.variant_name} · {ckpt.name} · {suite} -> {path}")
            print(results_table(result))
    if not args.checkpoint:  # a run's checkpoints: log its scores to the trackers
        log_evaluation(cfg, Path(args.run_dir) if args.run_dir else cfg.run_dir)


def results_table(result: ResultRecord) -> str:
    """One result's scores as a Markdown table (tasks x lengths/splits), plus not-run tasks."""
    scores = result["scores"]
    keys = sorted_keys(k for by_key in scores.values() if isinstance(by_key, dict) for k in by_key)
    rows = [
        [task] + [_fmt(by_key.get(k)) for k in keys]
        for task, by_key in scores.items()
        if isinstance(by_key, dict)
    ]
    text = (
        markdown_table(["task"] + [length_label(k) for k in keys], rows) if rows else "(no scores)"
    )
    for task, why in (result.get("not_run") or {}).items():
        text += f"\nnot run: {task}: {why}"
    return text


def _fmt(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, int | float) else "—"


# --------------------------------------------------------------------------------- report
def report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "more_configs",
        nargs="*",
        metavar="CONFIG",
        help="With --stacked: further experiment configs, stacked below the first in this "
        "order (--set applies to every config).",
    )
    parser.add_argument(
        "--last-k",
        type=_positive,
        metavar="K",
        help="Average over the last K checkpoints. Default: evaluation.last_k.",
    )
    parser.add_argument(
        "--stacked",
        metavar="DIR",
        help="Instead of each experiment's own report: one RULER table across the configs in "
        "the paper's Table 5 / 6 layout (rows dataset or model family × arm, lengths longest "
        "first, the paper's "
        "numbers beside; arms scored on different task sets in separate tables), written as "
        "DIR/report.{md,json}. DIR is replaced only when it is new, empty or an earlier "
        "stacked report.",
    )


def report(args: argparse.Namespace) -> int:
    if args.stacked:
        return _stacked_report(args)
    if args.more_configs:
        print(
            "anchorctx report: several configs make one report only with --stacked DIR; "
            "without it, report one config at a time",
            file=sys.stderr,
        )
        return 2
    cfg = args.cfg
    last_k = args.last_k or cfg.evaluation.last_k
    try:
        check_backends(cfg)
    except TrackingError as err:
        print(f"anchorctx report: {err}", file=sys.stderr)
        return 2
    arms = cfg.arms()
    for arm in arms:
        if (arm.run_dir / "eval").is_dir():
            # Every result averaged is the one `evaluate` wrote (hashes of it and its records):
            # a hand-edited file is a one-line error naming it, never averaged.
            summarize_run(arm.run_dir, last_k, verify=True)
            log_evaluation(arm)
        else:
            print(f"note: {arm.run_dir} has no evaluation results yet", file=sys.stderr)
    ensure_demo_corpus(cfg, progress=False)  # demo configs: an arm's dataset may need packing
    _arm_comparison(cfg)
    out = write_experiment_report(cfg.experiment_dir, [arm.variant_name for arm in arms])
    log_report(cfg, out)
    print(out["markdown"])
    for name, path in out["paths"].items():
        print(f"{name}: {path}")
    return 0


def _stacked_report(args: argparse.Namespace) -> int:
    """One report across the configs' experiments (:mod:`~anchorctx.evaluation.stacked_report`);
    each arm's results are checked and averaged first, as for its own report."""
    cfgs = [args.cfg]
    for path in args.more_configs:
        cfg = load_config(path, args.overrides)
        check_layout(cfg, source=path)  # what `report CONFIG` checks for the first
        cfgs.append(cfg)
    experiments = []
    for cfg in cfgs:
        arms = cfg.arms()
        for arm in arms:
            if (arm.run_dir / "eval").is_dir():
                # As for one report: every result averaged is the one `evaluate` wrote.
                summarize_run(arm.run_dir, args.last_k or cfg.evaluation.last_k, verify=True)
        experiments.append((cfg.experiment_dir, [arm.variant_name for arm in arms]))
    out = write_stacked_report(experiments, Path(args.stacked))
    print(out["markdown"])
    for name, path in out["paths"].items():
        print(f"{name}: {path}")
    return 0


def _arm_comparison(cfg) -> None:
    """Loss curves, attention work and the RoPE study beside the tables (as the flow does).

    The packed dataset of each arm is looked up (packed first only when it is missing).
    """
    datasets = {}
    for arm in cfg.arms():
        if (arm.run_dir / "metrics.jsonl").is_file():  # only arms that trained
            datasets[arm.variant_name] = str(prepare_data(arm, progress=False))
    write_arm_comparison(cfg, datasets)


# ------------------------------------------------------------------------ average-weights
def average_weights_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", metavar="DIR", help="Run directory. Default: the config's.")
    parser.add_argument(
        "--last-k",
        type=_positive,
        metavar="K",
        help="Average the newest K checkpoints. Default: evaluation.last_k.",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="Output directory. Default: <run_dir>/averaged/averaged-last-K "
        "(evaluate it with --checkpoint).",
    )


def average_weights(args: argparse.Namespace) -> int:
    cfg = args.cfg
    run_dir = Path(args.run_dir) if args.run_dir else cfg.run_dir
    k = args.last_k or cfg.evaluation.last_k
    found = _run_checkpoints(run_dir)
    if not found:
        print(
            f"anchorctx average-weights: no complete checkpoints under {run_dir / 'checkpoints'}",
            file=sys.stderr,
        )
        return 2
    chosen = found[-k:]
    out = Path(args.out) if args.out else run_dir / "averaged" / f"averaged-last-{k}"
    try:
        check_replaceable(out, averaged_owner(chosen))  # refused before a lock file is made
        with _output_lock(run_dir, out):
            path = _average(chosen, out)
    except (WeightAveragingError, ValueError) as err:
        print(f"anchorctx average-weights: {err}", file=sys.stderr)
        return 2
    print(f"averaged {len(chosen)} checkpoints ({', '.join(c.name for c in chosen)}) -> {path}")
    return 0


def _output_lock(run_dir: Path, out: Path) -> WriterLock:
    """One writer: the run directory's lock when ``out`` lies inside the run (training may be
    moving it aside or pruning its checkpoints), else a lock beside ``out``."""
    if out.resolve().is_relative_to(run_dir.resolve()):
        return WriterLock.beside(run_dir, f"run directory {run_dir}")
    return WriterLock.beside(out, f"averaged checkpoint {out}")


# ------------------------------------------------------------------------------ anchorctx plan
def plan_arguments(parser: argparse.ArgumentParser) -> None:
    # Imported here: the plan's module reads the RULER task table, which `anchorctx --help`
    # skips.
    from anchorctx.training.cost_plan import DEFAULT_HOST_GIB, GPUS, KNOWN_SHAPES

    parser.add_argument(
        "--gpu",
        choices=sorted(GPUS),
        default="h200",
        help="GPU kind: h200 and h100 use the project's measured step, prefill and decode "
        "times; a100-80g scales them by its peak compute and memory bandwidth (an estimate). "
        "Default: h200.",
    )
    parser.add_argument(
        "--gpus",
        type=_positive,
        default=None,
        metavar="N",
        help="GPUs per node. Default: training.nproc, else 1. The sequence-parallel degree is "
        "training.sequence_parallel, or the largest divisor of the GPU count below it.",
    )
    parser.add_argument(
        "--nodes",
        type=_positive,
        default=None,
        metavar="M",
        help="Nodes. Default: training.nnodes.",
    )
    parser.add_argument(
        "--host-gib",
        type=_positive_gib,
        default=DEFAULT_HOST_GIB,
        metavar="GIB",
        help=f"Host memory per GPU for offloaded state (default {DEFAULT_HOST_GIB:g}).",
    )
    parser.add_argument(
        "--shape",
        choices=sorted(KNOWN_SHAPES),
        default=None,
        help="The model's shape, where model.path's config.json is not on this machine "
        "(default: read it, else recognise the directory's name).",
    )
    parser.add_argument("--json", action="store_true", help="Print the plan as one JSON object.")
    parser.add_argument(
        "--per-billion-tokens",
        metavar="DIR",
        help="Instead of the plan: each arm's training time per 1B tokens on --gpus GPUs of "
        "each kind (A100-80G, H100, H200; the paper's Figure 6), printed and written as "
        "DIR/time_per_1b_tokens.{md,json,png}.",
    )


def plan(args: argparse.Namespace) -> int:
    """Predicted memory, step time and GPU-hours of the experiment; a run that does not fit
    is a one-line error naming the option or GPU count that would make it fit (exit 2). The
    document-masked arms' attention work is read from the packed dataset when ``prepare-data``
    has written it, else assumed; the report (and ``--json``) says which."""
    # Imported here: the plan reads the RULER and LongBench tables, which `--help` skips.
    import json

    from anchorctx.evaluation.cost_plan import format_plan, plan_experiment

    t = args.cfg.training
    if getattr(args, "per_billion_tokens", None):
        return _per_billion_tokens(args)
    result = plan_experiment(
        args.cfg,
        gpu=args.gpu,
        gpus=args.gpus or t.nproc or 1,
        nodes=args.nodes or t.nnodes,
        host_gib=args.host_gib,
        shape_name=args.shape,
    )
    if args.json:
        print(json.dumps(_finite(result.to_dict()), indent=2, allow_nan=False))
    else:
        print(format_plan(result))
    return 0


def _per_billion_tokens(args: argparse.Namespace) -> int:
    """Figure 6: hours per 1B training tokens per arm and GPU kind, printed and written."""
    # Imported here: the plan reads the RULER and LongBench tables, which `--help` skips.
    from anchorctx.evaluation.token_time import token_time_markdown, token_times, write_token_time

    t = args.cfg.training
    rows = token_times(
        args.cfg,
        gpus=args.gpus or t.nproc or 1,
        nodes=args.nodes or t.nnodes,
        host_gib=args.host_gib,
        shape_name=args.shape,
    )
    paths = write_token_time(rows, Path(args.per_billion_tokens))
    print(token_time_markdown(rows))
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


# ----------------------------------------------------------------------------------- lm-eval
def lm_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "Example: anchorctx lm-eval --model anchorctx --model_args pretrained=DIR,dtype=bfloat16 "
        "--device cuda --batch_size 8 --tasks ruler. Pass --device and --batch_size as options, "
        "not in --model_args (lm-eval sends both to the model itself)."
    )
    parser.add_argument(
        "lm_eval_args",
        nargs="*",
        metavar="ARGS",
        help="lm-eval's own options, passed on verbatim (lm_eval --help lists them).",
    )


def lm_eval(args: argparse.Namespace) -> int:
    """lm-eval's command line with the ``anchorctx`` model registered (the project's static
    decoder and anchor rule behind lm-eval's LM interface)."""
    from anchorctx.evaluation.lm_eval.model import main  # imports lm-eval and torch

    main(args.lm_eval_args)
    return 0
