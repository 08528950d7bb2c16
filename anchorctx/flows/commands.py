"""``anchorctx serve``: serve every deployment against the configured Prefect API."""

from __future__ import annotations

import argparse
import sys

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
    parser.add_argument("--limit", type=int, default=1, metavar="N",
                        help="Flow runs executed at once (default 1: one experiment owns the "
                             "devices; 0 for no limit).")  # fmt: skip


def api_url() -> str | None:
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


def serve(args: argparse.Namespace) -> int:
    url = api_url()
    if not url:
        print(f"anchorctx serve: {EPHEMERAL_TRAP}", file=sys.stderr)
        return 2
    from prefect import serve as prefect_serve

    from anchorctx.flows.deployments import build_deployments

    deployments = build_deployments(args.configs, args.demo_config)
    names = ", ".join(f"{d.flow_name}/{d.name}" for d in deployments)
    print(f"anchorctx serve: {len(deployments)} deployments on {url}: {names}", flush=True)
    prefect_serve(*deployments, limit=args.limit or None, print_starting_message=False)
    return 0
