#!/usr/bin/env bash
# Stop what scripts/demo.sh started. Order matters: first the flow runs the runner is executing
# (each is a child process of `anchorctx serve` in its own process group; on SIGTERM a flow run
# kills its training process group), then the runner's group, then the Prefect server's group.
# Each gets SIGTERM, and SIGKILL if it is still there after 20 s.
set -uo pipefail
cd "$(dirname "$0")/.."
PREFECT_HOME=${PREFECT_HOME:-$PWD/.prefect}

descendants() {  # every process below PID, children first
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do
    descendants "$child"
    echo "$child"
  done
}

wait_gone() {  # wait_gone SECONDS PID...
  local secs=$1; shift
  for _ in $(seq "$secs"); do
    local left=0 p
    for p in "$@"; do kill -0 "$p" 2>/dev/null && left=1; done
    [ "$left" = 0 ] && return 0
    sleep 1
  done
  return 1
}

stop_group() {  # stop_group NAME PIDFILE
  local name=$1 pidfile=$2 pid kids
  if [ ! -f "$pidfile" ]; then echo "[stop] $name: not started by scripts/demo.sh"; return; fi
  pid=$(cat "$pidfile")
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "[stop] $name: not running"; rm -f "$pidfile"; return
  fi
  kids=$(descendants "$pid")
  if [ -n "$kids" ]; then
    # shellcheck disable=SC2086
    kill -TERM $kids 2>/dev/null
    # shellcheck disable=SC2086
    wait_gone 20 $kids || kill -KILL $kids 2>/dev/null
  fi
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
  wait_gone 20 "$pid" || kill -KILL -- "-$pid" 2>/dev/null
  rm -f "$pidfile"
  echo "[stop] $name stopped"
}

stop_group "anchorctx serve" "$PREFECT_HOME/serve.pid"
stop_group "Prefect server" "$PREFECT_HOME/server.pid"
