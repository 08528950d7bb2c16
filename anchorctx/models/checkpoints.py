"""Where a run's checkpoints are and what a checkpoint directory must hold.

The one definition of the checkpoint layout (docs/ARCHITECTURE.md, checkpoints contract) that
training writes and evaluation, analysis and the orchestration read:
``<run_dir>/checkpoints/step-NNNNNN/`` with a Hugging Face model, its tokenizer and
``anchorctx.json``. Only the directory layout lives here; writing checkpoints is training's.
"""

from __future__ import annotations

import re
from pathlib import Path

from anchorctx.io import read_json

CHECKPOINT_DIR = "checkpoints"
META_FILE = "anchorctx.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_NAME = re.compile(r"^step-(\d{6,})$")  # what training writes (checkpoint_name)
_ANY_STEP = re.compile(r"step-(\d+)")  # what a reader accepts (hand-named copies too)


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def step_from_name(name: str) -> int | None:
    """The step in a ``step-N`` folder name, else None."""
    m = _ANY_STEP.fullmatch(name)
    return int(m.group(1)) if m else None


def checkpoint_step(checkpoint: str | Path) -> int | None:
    """Training step of a checkpoint: its ``anchorctx.json``, else a ``step-N`` name, else None
    (a weight-averaged or foreign checkpoint)."""
    ckpt = Path(checkpoint)
    meta = ckpt / META_FILE
    if meta.is_file():
        step = read_json(meta).get("step")
        if isinstance(step, int):
            return step
    return step_from_name(ckpt.name)


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete ``checkpoints/step-NNNNNN`` directories of a run, ascending step."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)]
    found = [p for p in found if (p / META_FILE).is_file()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))  # type: ignore[union-attr]


def model_dir_problem(path: str | Path, *, tokenizer: bool = False) -> str | None:
    """What keeps ``path`` from being a loadable Hugging Face model directory (None: nothing):
    ``"no config.json"``, or with ``tokenizer`` also ``"no tokenizer (...)"``. Callers name the
    config key or checkpoint in their own error."""
    path = Path(path)
    if not (path / "config.json").is_file():
        return "no config.json"
    if tokenizer and not any((path / f).is_file() for f in TOKENIZER_FILES):
        return f"no tokenizer ({' or '.join(TOKENIZER_FILES)})"
    return None
