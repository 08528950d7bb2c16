#!/usr/bin/env bash
# Set up the project in ./.venv: torch first, on its own, then anchorctx with its dev extras.
#
#   scripts/setup.sh                      # CPU build of torch (development, CI, the demo)
#   TORCH_SPEC="torch==2.11.0" scripts/setup.sh   # or whatever CUDA build your cluster uses
#
# torch goes first because an unpinned torch pulled in by a dependency resolves to the newest
# CUDA build (several GB); once a torch is installed, the project's range is already satisfied.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch" 2>/dev/null; then
  echo "[setup] installing ${TORCH_SPEC:-torch==2.13.0}"
  python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
stamp=.venv/.anchorctx-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "[setup] installing anchorctx and its dependencies"
  python -m pip install -q -e ".[dev]"
  touch "$stamp"
fi
echo "[setup] ready: $(python -c 'import torch, transformers, prefect; print(f"torch {torch.__version__}, transformers {transformers.__version__}, prefect {prefect.__version__}")')"
