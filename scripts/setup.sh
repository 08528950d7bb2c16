#!/usr/bin/env bash
# Set up the project in ./.venv from the lock file: torch first, on its own, then every other
# package at its locked version, then anchorctx itself (editable, no dependency resolution).
#
#   scripts/setup.sh                      # CPU build of torch + requirements/cpu.txt (dev, CI, demo)
#   TORCH_SPEC="torch==2.11.0" scripts/setup.sh   # your cluster's CUDA build + requirements/gpu.txt
#
# torch goes first because an unpinned torch pulled in by a dependency resolves to the newest
# CUDA build (several GB). The lock (requirements/common.txt) is refreshed with scripts/lock.sh.
# DeepSpeed's CPU comm op is compiled once into TORCH_EXTENSIONS_DIR (./.cache/torch_extensions
# unless set), so no training process waits for a compiler.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ -n "${TORCH_SPEC:-}" ]; then LOCK=${LOCK:-requirements/gpu.txt}; else LOCK=${LOCK:-requirements/cpu.txt}; fi
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
UV_VERSION=0.13.9
if ! python -c "import torch" 2>/dev/null; then
  echo "[setup] installing ${TORCH_SPEC:-torch==2.13.0}"
  python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
# Reinstall only when the lock or the project's metadata changed.
stamp=.venv/.anchorctx-installed
want=$(cat "$LOCK" requirements/common.txt pyproject.toml | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing the locked dependencies ($LOCK)"
  # uv installs the same pinned files as pip in about half the time (it downloads and unpacks in
  # parallel); pip stays the fallback when uv cannot be installed or fails. --system-certs: trust
  # the certificates pip trusts (the platform's store), as behind a proxy with its own CA.
  # --compile-bytecode: write every module's .pyc now, as pip does (uv does not by default).
  # Without them each new interpreter (every training rank, Prefect worker and evaluation
  # process) compiles transformers, DeepSpeed and Prefect from source again wherever Python may
  # not write bytecode (PYTHONDONTWRITEBYTECODE, read-only installs): 25-32 s against 17-18 s
  # for one such import on a loaded 2-core machine.
  if python -m pip install -q "uv==$UV_VERSION" 2>/dev/null \
      && uv pip install -q --system-certs --compile-bytecode --python "$(command -v python)" \
        -r "$LOCK"; then
    uv pip install -q --python "$(command -v python)" --no-deps -e .
  else
    echo "[setup] uv unavailable: installing with pip"
    python -m pip install -q -r "$LOCK"
    python -m pip install -q --no-deps -e .
  fi
  python -m pip check >/dev/null || { python -m pip check; echo "[setup] the environment is inconsistent (above)" >&2; exit 1; }
  echo "$want" >"$stamp"
fi
# The project's own bytecode too (it changes with every edit, so on every set-up; seconds).
python -m compileall -q -j 0 anchorctx >/dev/null
if ! python -c 'from anchorctx.training.deepspeed_env import ops_cache_dir
from anchorctx.training.engine import prebuild_ops
t = prebuild_ops(); print("[setup] DeepSpeed ops ready in %s (%.0f s)" % (ops_cache_dir(), t))' >.venv/.ops.log 2>&1; then
  cat .venv/.ops.log >&2; echo "[setup] building DeepSpeed's CPU ops failed (above): CPU training will fail" >&2; exit 1
fi
grep "^\[setup\]" .venv/.ops.log
echo "[setup] ready: $(python -c 'import torch, transformers, prefect; print(f"torch {torch.__version__}, transformers {transformers.__version__}, prefect {prefect.__version__}")')"
