# Thin aliases over scripts/ (the README's two commands work without make too).
.PHONY: setup demo test check lint format stop gpu-test lock
setup:   ; scripts/setup.sh
demo:    ; scripts/demo.sh
stop:    ; scripts/stop.sh
test:    ; scripts/test.sh
check: test
lint:    ; .venv/bin/ruff check anchorctx tests bench && .venv/bin/ruff format --check anchorctx tests bench
format:  ; .venv/bin/ruff check --fix anchorctx tests bench && .venv/bin/ruff format anchorctx tests bench
gpu-test: ; .venv/bin/python -m pytest -m gpu -q
lock:    ; scripts/lock.sh
