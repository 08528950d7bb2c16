#!/usr/bin/env bash
# README command 1: the full experiment on configs/demo.yaml (tiny Llama, generated corpus, CPU),
# orchestrated by a local Prefect server.
#
#   scripts/demo.sh          # install if needed, start the server and `anchorctx serve`,
#                            # run full-experiment/demo showing its progress, print the results
#                            # table and the UI address
#   scripts/demo.sh --arm anchor --stage evaluate --suite ruler --force
#                            # the same, re-running one arm's stage and suite (see anchorctx run -h)
#   scripts/stop.sh          # stop the server and the runner
#
# Idempotent: a running server and runner are reused; a second run reuses the cached packed data,
# training runs and evaluations and finishes much faster. State lives in ./.prefect (SQLite
# database, cached results, logs), outputs in ./runs/demo. Port: ANCHORCTX_PREFECT_PORT (4200).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
START=$(date +%s)
HOST=${ANCHORCTX_PREFECT_HOST:-127.0.0.1}
PORT=${ANCHORCTX_PREFECT_PORT:-4200}
say() { echo "[demo] $*"; }

# DeepSpeed's ops, compiled once by setup.sh, for every training arm the runner starts.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$ROOT/.cache/torch_extensions}
scripts/setup.sh
PY=$ROOT/.venv/bin/python

# One local server for every process: without PREFECT_API_URL each process would start its own
# ephemeral server (no UI, and `--watch` would wait forever). A non-default port must be set
# through PREFECT_SERVER_API_HOST/PORT, or the UI calls the wrong API.
export PREFECT_HOME=$ROOT/.prefect
export PREFECT_SERVER_API_HOST=$HOST PREFECT_SERVER_API_PORT=$PORT
export PREFECT_API_URL=http://$HOST:$PORT/api
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_LOCAL_STORAGE_PATH=$PREFECT_HOME/storage
LOGS=$PREFECT_HOME/logs
mkdir -p "$LOGS"

healthy() { "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
  "$PREFECT_API_URL/health" >/dev/null 2>&1; }
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
wait_for() {  # wait_for SECONDS WHAT COMMAND...
  local secs=$1 what=$2; shift 2
  for _ in $(seq "$secs"); do "$@" && return 0; sleep 1; done
  echo "[demo] $what did not come up within ${secs}s; see $LOGS" >&2; return 1
}

if healthy; then
  say "reusing the Prefect server at $PREFECT_API_URL"
else
  say "starting the Prefect server on $HOST:$PORT (SQLite in $PREFECT_HOME, log $LOGS/server.log)"
  # setsid: its own process group, so scripts/stop.sh stops uvicorn and its services together.
  setsid nohup "$ROOT/.venv/bin/prefect" server start --host "$HOST" --port "$PORT" \
    >"$LOGS/server.log" 2>&1 </dev/null &
  echo $! >"$PREFECT_HOME/server.pid"
  wait_for 180 "the Prefect server" healthy
fi

deployment_ready() { "$ROOT/.venv/bin/prefect" deployment inspect full-experiment/demo >/dev/null 2>&1; }
if alive "$PREFECT_HOME/serve.pid"; then
  say "reusing the deployment runner (pid $(cat "$PREFECT_HOME/serve.pid"))"
else
  say "starting anchorctx serve (log $LOGS/serve.log)"
  setsid nohup "$ROOT/.venv/bin/anchorctx" serve >"$LOGS/serve.log" 2>&1 </dev/null &
  echo $! >"$PREFECT_HOME/serve.pid"
fi
wait_for 120 "the full-experiment/demo deployment" deployment_ready

# `anchorctx run` starts the flow run, prints its UI link, and follows its logs: stage, arm,
# step/total, loss and ETA here; every log line is in the UI. Arguments go to it, e.g.
# `scripts/demo.sh --arm anchor --stage train --force` retrains one arm, the rest stays cached.
say "running full-experiment/demo $*"
"$ROOT/.venv/bin/anchorctx" run full-experiment/demo "$@"

EXP_DIR=$("$PY" -c 'from anchorctx.experiment import load_config; print(load_config("configs/demo.yaml").experiment_dir)')
echo
cat "$EXP_DIR/report.md"
echo
say "finished in $(($(date +%s) - START)) s; report: $EXP_DIR/report.md"
say "Prefect UI: http://$HOST:$PORT  (runs, logs, artifacts; the server stays up: scripts/stop.sh)"
