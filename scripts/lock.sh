#!/usr/bin/env bash
# Refresh the dependency lock: resolve pyproject.toml's ranges (with the dev extra) in a brand-new
# virtualenv and write the exact versions to requirements/common.txt.
#
#   scripts/lock.sh            # after changing dependencies in pyproject.toml; commit the result
#
# torch is not in the lock: requirements/cpu.txt adds the CPU build the project develops and tests
# with (torch==2.13.0, and Triton for the kernels' interpreter tests), requirements/gpu.txt
# expects the CUDA build of your cluster (which brings its Triton) installed first. Every other
# package, runtime and dev, is pinned in common.txt. Then run the test suite from a fresh clone
# (scripts/test.sh) before committing the new lock.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1
echo "[lock] resolving in a fresh virtualenv ($($PYTHON --version))"
"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "$TORCH_SPEC"
# From a copy, so the build leaves nothing in the checkout.
mkdir "$work/src" && cp -r pyproject.toml README.md anchorctx "$work/src/"
"$work/venv/bin/python" -m pip install -q "$work/src[dev]"
"$work/venv/bin/python" -m pip check
out=requirements/common.txt
{
  echo "# Exact versions of every dependency except torch (runtime and dev), resolved from"
  echo "# pyproject.toml by scripts/lock.sh on $(date -u +%Y-%m-%d) with Python $("$work/venv/bin/python" -c 'import sys; print(".".join(map(str, sys.version_info[:3])))')."
  echo "# Do not edit by hand: change pyproject.toml, run scripts/lock.sh, run the suite, commit both."
  "$work/venv/bin/python" -m pip freeze --exclude-editable \
    | grep -viE '^(anchorctx|torch)( @|==)' | LC_ALL=C sort -f
} >"$out.tmp"
mv "$out.tmp" "$out"
echo "[lock] wrote $out ($(grep -vc '^#' "$out") packages)"
