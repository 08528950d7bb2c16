#!/usr/bin/env bash
# README command 2: set everything up and run every check (lint, format, the test suite).
#   scripts/test.sh                # everything CI runs
#   scripts/test.sh -k attention   # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
# The UI test drives Debian's Chromium; install it where we may (CI runs as root).
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "[test] installing chromium for the UI test"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "[test] chromium could not be installed: the UI test will be skipped"
fi
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
echo "[test] ruff"
ruff check anchorctx tests bench
ruff format --check anchorctx tests bench
echo "[test] pytest"
python -m pytest -q "$@"
