"""``anchorctx serve``: serve every deployment against the configured Prefect API."""

from __future__ import annotations

import argparse
import sys
from uuid import UUID

from anchorctx.evaluation.settings import PROJECT_SUITES, suite_argument

EPHEMERAL_TRAP = """\
PREFECT_API_URL is not set. Without it every process starts its own throw-away (ephemeral)
Prefect server: `serve` would register its deployments there, no UI would show them, and
`prefect deployment run ... --watch` from another shell would wait forever.
Start a server and point at it, e.g.:
    export PREFECT_HOME=$PWD/.prefect PREFECT_SERVER_API_HOST=127.0.0.1 PREFECT_SERVER_API_PORT=4200
    prefect server start &          # or scripts/demo.sh, which does all of this
    export PREFECT_API_URL=http://127.0.0.1:4200/api
    anchorctx serve"""


def serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--configs",
        default="configs",
        metavar="DIR",
        help="Directory with demo.yaml and paper/*.yaml (default: configs).",
    )
    parser.add_argument(
        "--demo-config",
        default=None,
        metavar="YAML",
        help="Config of full-experiment/demo and the */default deployments "
        "(default: <configs>/demo.yaml).",
    )
    parser.add_argument(
        "--limit",
        type=int,
        default=1,
        metavar="N",
        help="Flow runs executed at once (default 1: one experiment owns the "
        "devices; 0 for no limit).",
    )


def api_url() -> str | None:
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


def serve(args: argparse.Namespace) -> int:
    url = api_url()
    if not url:
        print(f"anchorctx serve: {EPHEMERAL_TRAP}", file=sys.stderr)
        return 2
    # Imported here, like Prefect itself: the flows import Prefect, which `anchorctx --help`
    # and the other commands skip.
    from prefect import serve as prefect_serve

    from anchorctx.flows.deployments import build_deployments

    deployments = build_deployments(args.configs, args.demo_config)
    names = ", ".join(f"{d.flow_name}/{d.name}" for d in deployments)
    print(f"anchorctx serve: {len(deployments)} deployments on {url}: {names}", flush=True)
    prefect_serve(*deployments, limit=args.limit or None, print_starting_message=False)
    return 0


# ------------------------------------------------------------------------------ eval-worker
def eval_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pool", help="Work pool name (the config's evaluation.work_pool).")
    parser.add_argument(
        "--name", default=None, help="Worker name shown in the UI (default: Prefect's)."
    )
    parser.add_argument(
        "--lost-after",
        type=_lost_after,
        default=None,
        metavar="S",
        help="Mark a shard run Crashed (and run it again elsewhere) after S seconds without a "
        "heartbeat from its node; one window a pool, kept by workers started without this "
        "(default 90: three of Prefect's 30 s heartbeats).",
    )


def _lost_after(text: str) -> int:
    """``--lost-after``'s seconds (argparse prints the error on one line, naming the option)."""
    from anchorctx.flows.pool import check_lost_after  # imports Prefect, as eval-worker does

    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"not a whole number of seconds: {text!r}")
    try:
        return check_lost_after(int(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def eval_worker(args: argparse.Namespace) -> int:
    """Register the pool's shard deployment, then become one of its workers (one GPU slot)."""
    import os

    url = api_url()
    if not url:
        print(f"anchorctx eval-worker: {EPHEMERAL_TRAP}", file=sys.stderr)
        return 2
    from anchorctx.flows.pool import register, worker_command  # imports Prefect (see serve)
    from anchorctx.tasks.api import ServerUnreachable, unreachable  # (the same)

    try:
        register(args.pool, args.lost_after)
    except Exception as err:  # a bare httpx.ConnectError names no server: say which one
        if (lost := unreachable(err)) is None:
            raise
        hint = "start it or point PREFECT_API_URL at the running one, then start the worker again"
        raise ServerUnreachable(url, lost, hint) from None
    cmd = worker_command(args.pool, args.name)
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "all visible")
    print(f"anchorctx eval-worker: pool {args.pool!r} on {url}, GPUs: {gpu}", flush=True)
    os.execv(cmd[0], cmd)  # the worker replaces this process (signals reach it directly)
    return 0  # not reached


# ------------------------------------------------------------------------------------- run
def run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "deployment",
        nargs="?",
        default="full-experiment/demo",
        help="<flow>/<deployment> (default: full-experiment/demo).",
    )
    parser.add_argument(
        "--arm",
        action="append",
        default=[],
        metavar="NAME",
        help="Run only this arm, a name under the config's variants (repeatable; full-experiment).",
    )
    parser.add_argument(
        "--stage",
        action="append",
        default=[],
        choices=STAGES,
        help="Run only this stage (repeatable; full-experiment).",
    )
    parser.add_argument(
        "--suite",
        action="append",
        default=[],
        type=suite_argument,
        metavar="SUITE",
        help=f"Evaluate only this suite (repeatable): {', '.join(PROJECT_SUITES)} or "
        "lm_eval:<task or group> (lm-eval's long-context tasks, e.g. lm_eval:babilong).",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="Recompute instead of reusing cached results (within --arm, "
        "--stage, --suite, --force-stage); the rest stays cached.",
    )
    parser.add_argument(
        "--force-stage",
        action="append",
        default=[],
        choices=STAGES,
        help="With --force: recompute only this stage (repeatable; default: "
        "every stage that runs).",
    )
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="Any other flow parameter, e.g. --param train_timeout_s=3600.",
    )
    parser.add_argument(
        "--no-follow", action="store_true", help="Print the flow run's UI link and return at once."
    )
    parser.add_argument(
        "--follow",
        metavar="FLOW_RUN_ID",
        default=None,
        help="Follow an existing flow run instead of starting one (e.g. after the Prefect "
        "server restarted, or after Ctrl-C).",
    )


STAGES = ("pretrain", "data", "train", "evaluate", "report")


def run_parameters(args: argparse.Namespace) -> dict[str, object]:
    """The flow parameters the options ask for (only those given: the deployment's defaults,
    its config included, stay as they are)."""
    import json

    params: dict[str, object] = {}
    for key, value in (
        ("arms", args.arm),
        ("stages", args.stage),
        ("suites", args.suite),
        ("force_stages", args.force_stage),
    ):
        if value:
            params[key] = list(dict.fromkeys(value))
    if args.force:
        params["force"] = True
    elif args.force_stage:
        raise ValueError("--force-stage needs --force")
    for item in args.param:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--param {item!r} must look like KEY=JSON")
        try:
            params[key] = json.loads(text)
        except json.JSONDecodeError:
            params[key] = text  # a bare string
    if args.deployment.startswith("full-experiment/"):
        return params
    # the stage flows know only force and suites (evaluate); say so instead of a 422
    extra = sorted(set(params) & {"arms", "stages", "force_stages"})
    if extra:
        raise ValueError(f"{', '.join(extra)}: only full-experiment deployments take these")
    return params


def run(args: argparse.Namespace) -> int:
    url = api_url()
    if not url:
        print(f"anchorctx run: {EPHEMERAL_TRAP}", file=sys.stderr)
        return 2
    try:
        params = run_parameters(args)
    except ValueError as err:
        print(f"anchorctx run: {err}", file=sys.stderr)
        return 2
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    from anchorctx.flows.follow import flow_run_url, follow  # imports Prefect (see serve)
    from anchorctx.tasks.api import ServerUnreachable, unreachable  # (the same)

    try:
        flow_run = _start_or_find(args, params)
    except ObjectNotFound:
        what = f"flow run {args.follow}" if args.follow else f"deployment {args.deployment!r}"
        print(
            f"anchorctx run: no {what} on {url} (is `anchorctx serve` running? "
            "`prefect deployment ls` and `prefect flow-run ls` list them)",
            file=sys.stderr,
        )
        return 2
    except ValueError as err:  # --follow with something that is not a flow run id
        print(f"anchorctx run: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        if (lost := unreachable(err)) is None:
            raise
        hint = (
            "start it (scripts/demo.sh does, or `prefect server start`) or point PREFECT_API_URL "
            "at the running one, then run this command again"
        )
        print(f"anchorctx run: {ServerUnreachable(url, lost, hint)}", file=sys.stderr)
        return 1
    link = flow_run_url(flow_run.id) or url
    if args.follow:
        print(f"[run] following flow run {flow_run.name} ({flow_run.id})", flush=True)
    else:
        shown = ", ".join(f"{k}={v}" for k, v in params.items()) or "deployment defaults"
        print(f"[run] {args.deployment}: flow run {flow_run.name} ({shown})", flush=True)
    print(f"[run] UI: {link}", flush=True)
    if args.no_follow:
        return 0
    try:
        with get_client(sync_client=True) as client:
            state = follow(client, flow_run.id, out=lambda line: print(line, flush=True))
    except KeyboardInterrupt:
        print(
            f"[run] stopped following; the run goes on: {link} "
            f"(follow again: anchorctx run --follow {flow_run.id}; "
            f"cancel: prefect flow-run cancel {flow_run.id})",
            file=sys.stderr,
        )
        return 130
    except ServerUnreachable as err:
        print(f"anchorctx run: {err}", file=sys.stderr)
        return 1
    why = (
        f" ({' '.join(state.message.split())})"
        if state.message and not state.is_completed()
        else ""
    )
    print(f"[run] {flow_run.name}: {state.name}{why}. UI: {link}", flush=True)
    return 0 if state.is_completed() else 1


def _start_or_find(args: argparse.Namespace, params: dict[str, object]):
    """The flow run to follow: ``--follow ID``'s, else a new run of the deployment."""
    # Imported here: Prefect, which `anchorctx --help` and the other commands skip (see serve).
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    if args.follow:
        try:
            run_id = UUID(args.follow)
        except ValueError:
            raise ValueError(f"--follow {args.follow!r} is not a flow run id (a UUID)") from None
        with get_client(sync_client=True) as client:
            return client.read_flow_run(run_id)
    return run_deployment(args.deployment, parameters=params, timeout=0)
