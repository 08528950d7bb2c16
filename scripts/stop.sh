#!/usr/bin/env bash
# Stop what scripts/demo.sh started: the deployment runner (anchorctx serve) first, so that it
# can cancel and clean up its flow runs, then the Prefect server. Each was started in its own
# process group; the whole group is stopped (SIGTERM, then SIGKILL after 20 s).
set -uo pipefail
cd "$(dirname "$0")/.."
PREFECT_HOME=${PREFECT_HOME:-$PWD/.prefect}

stop_group() {  # stop_group NAME PIDFILE
  local name=$1 pidfile=$2 pid
  if [ ! -f "$pidfile" ]; then echo "[stop] $name: not started by scripts/demo.sh"; return; fi
  pid=$(cat "$pidfile")
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "[stop] $name: not running"; rm -f "$pidfile"; return
  fi
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
  for _ in $(seq 20); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 1; done
  if kill -0 -- "-$pid" 2>/dev/null; then kill -KILL -- "-$pid" 2>/dev/null; fi
  rm -f "$pidfile"
  echo "[stop] $name stopped (process group $pid)"
}

stop_group "anchorctx serve" "$PREFECT_HOME/serve.pid"
stop_group "Prefect server" "$PREFECT_HOME/server.pid"
