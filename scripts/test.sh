#!/usr/bin/env bash
# README command 2: set everything up and run every check (lint, format, the test suite).
#   scripts/test.sh                # everything CI runs
#   scripts/test.sh -k attention   # extra arguments go to pytest
#   PYTEST_WORKERS=4 scripts/test.sh   # pytest workers (default 2; 0: no workers)
set -euo pipefail
cd "$(dirname "$0")/.."
# The UI test drives Debian's Chromium; install it where we may (CI runs as root), meanwhile
# setting up the environment.
chromium=
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "[test] installing chromium for the UI test (in the background)"
  ( (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
      >/dev/null 2>&1 || echo "[test] chromium could not be installed: the UI test will be skipped"
  ) &
  chromium=$!
fi
scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
# One Prefect database migrated to this Prefect's schema, made beside the lint: the suite's
# servers start on copies of it (tests/shared_prefect.py: ~6 s of CPU less a server).
db_dir=.cache/prefect-db-$(python -c 'import importlib.metadata as m; print(m.version("prefect"))')
mkdir -p .cache
if [ ! -f "$db_dir/prefect.db" ]; then
  ( tmp=$(mktemp -d .cache/prefect-db-tmp.XXXXXX) \
    && PREFECT_HOME="$PWD/$tmp" PREFECT_SERVER_ANALYTICS_ENABLED=false \
      python -m prefect server database upgrade -y >"$tmp/upgrade.log" 2>&1 \
    && mkdir -p "$db_dir" && mv "$tmp/prefect.db" "$db_dir/prefect.db"; rm -rf "$tmp" ) &
  migrating=$!
fi
# mypy (~75 s of one core on a cold cache, as from a fresh clone) checks beside ruff and pytest,
# at a lower priority: it takes the CPU the suite leaves idle (a test waiting on its processes),
# not the suite's. Its report and verdict come after pytest's.
echo "[test] mypy (in the background; its report follows pytest's)"
mypy_log=$(mktemp)
nice -n 10 python -m mypy anchorctx >"$mypy_log" 2>&1 &
mypy=$!
trap 'kill "$mypy" 2>/dev/null || true; rm -f "$mypy_log"' EXIT
echo "[test] ruff"
ruff check anchorctx tests bench
ruff format --check anchorctx tests bench
if [ -n "${migrating:-}" ]; then wait "$migrating" || true; fi
if [ -f "$db_dir/prefect.db" ]; then export ANCHORCTX_TEST_PREFECT_DB="$PWD/$db_dir/prefect.db"; fi
# Two workers by default (CI has two cores); PYTEST_WORKERS=0 runs in this process, `auto` one
# per core. Tests that share one Prefect server stay on one worker (--dist loadgroup, set in
# pyproject.toml). The 15 slowest tests are listed at the end.
if [ -n "$chromium" ]; then wait "$chromium"; fi
echo "[test] pytest"
pytest_status=0
python -m pytest -q -n "${PYTEST_WORKERS:-2}" --durations=15 "$@" || pytest_status=$?
echo "[test] mypy"
mypy_status=0
wait "$mypy" || mypy_status=$?
cat "$mypy_log"
if [ "$pytest_status" != 0 ]; then exit "$pytest_status"; fi
exit "$mypy_status"
