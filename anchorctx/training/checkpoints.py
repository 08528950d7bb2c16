"""Model checkpoints (Hugging Face format) and resume state, both written atomically.

``<run_dir>/checkpoints/step-NNNNNN/``: ``save_pretrained`` weights (safetensors), config and
tokenizer — loadable by plain ``transformers`` and lm-eval — plus ``anchorctx.json`` (step,
tokens seen, loss, variant, config hash, data manifest hash). It is built under a temporary
name and renamed into place, so a listed checkpoint is always complete; pruning (``save.keep``)
happens only after the new one exists. Under ZeRO-3 the full weights are gathered layer by layer
to rank 0 for the save.

``<run_dir>/resume/``: DeepSpeed's engine checkpoint (model, optimizer and scheduler state, one
shard per rank under ZeRO), each rank's RNG state, and ``trainer.json`` (step, tokens seen,
parallel layout, config fingerprint). The data cursor is the step itself (batches are a pure
function of seed and step). Written to ``.resume.partial`` by every rank, then swapped in by
rank 0; multi-node runs need ``run_root`` on a shared filesystem.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from anchorctx.config import SaveConfig
from anchorctx.io import atomic_directory, atomic_write_json, read_json

CHECKPOINT_DIR = "checkpoints"
RESUME_DIR = "resume"
META_FILE = "anchorctx.json"
TRAINER_FILE = "trainer.json"
ENGINE_TAG = "engine"
_NAME = re.compile(r"^step-(\d{6,})$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def checkpoint_step(path: Path) -> int:
    match = _NAME.match(Path(path).name)
    if not match:
        raise ValueError(f"not a checkpoint directory name: {path}")
    return int(match.group(1))


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete ``checkpoints/step-NNNNNN`` directories of a run, ascending step."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)]
    found = [p for p in found if (p / META_FILE).is_file()]
    return sorted(found, key=checkpoint_step)


def should_save(step: int, total: int, save: SaveConfig) -> bool:
    """Every ``save.every`` steps within the last ``save.last`` steps, and the final step."""
    if step == total:
        return True
    in_window = save.last is None or step > total - save.last
    return in_window and step % save.every == 0


def should_save_resume(step: int, total: int, save: SaveConfig) -> bool:
    periodic = save.resume_every is not None and step % save.resume_every == 0
    return periodic or should_save(step, total, save)


# ------------------------------------------------------------------------------ HF checkpoints
def _gathered_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """Full weights on rank 0 under ZeRO-3 (a collective: every rank must call it)."""
    if engine.zero_optimization_stage() == 3:
        return engine._zero3_consolidated_16bit_state_dict()
    return None


def save_checkpoint(
    engine, tokenizer, run_dir: Path, step: int, meta: dict[str, Any], save: SaveConfig
) -> Path:
    """Write ``checkpoints/step-NNNNNN`` (rank 0 writes; all ranks must call)."""
    state = _gathered_state_dict(engine)
    final = Path(run_dir) / CHECKPOINT_DIR / checkpoint_name(step)
    if dist.get_rank() == 0:
        with atomic_directory(final) as tmp:
            model = engine.module
            model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
            _portable_config(tmp)
            tokenizer.save_pretrained(tmp)
            atomic_write_json(tmp / META_FILE, {"step": step, **meta})
        prune_checkpoints(run_dir, save.keep)
    dist.barrier()
    return final


def _portable_config(ckpt: Path) -> None:
    """Drop the training-only attention name so plain transformers loads its default."""
    path = ckpt / "config.json"
    cfg = read_json(path)
    dropped = [cfg.pop(key, None) for key in ("_attn_implementation", "attn_implementation")]
    if any(v is not None for v in dropped):
        atomic_write_json(path, cfg)


def prune_checkpoints(run_dir: Path, keep: int | None) -> None:
    if keep is None:
        return
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------ resume state
def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}  # fmt: skip
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_resume(engine, run_dir: Path, trainer: dict[str, Any]) -> Path:
    """Write ``resume/`` atomically (collective)."""
    rank = dist.get_rank()
    final = Path(run_dir) / RESUME_DIR
    tmp = Path(run_dir) / ".resume.partial"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    engine.save_checkpoint(str(tmp), tag=ENGINE_TAG, client_state={"step": trainer["step"]},
                           save_latest=False)  # fmt: skip
    torch.save(rng_state(), tmp / f"rng-rank{rank:05d}.pt")
    dist.barrier()
    if rank == 0:
        atomic_write_json(tmp / TRAINER_FILE, trainer)
        _swap_into_place(tmp, final)
    dist.barrier()
    return final


def _swap_into_place(tmp: Path, final: Path) -> None:
    """Replace ``final`` by ``tmp``; a complete version exists at every moment."""
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def read_trainer_state(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / RESUME_DIR / TRAINER_FILE
    return read_json(path) if path.is_file() else None


def load_resume(engine, run_dir: Path) -> None:
    """Restore engine (weights, optimizer, scheduler) and this rank's RNG from ``resume/``."""
    root = Path(run_dir) / RESUME_DIR
    path, _ = engine.load_checkpoint(
        str(root), tag=ENGINE_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load the resume state in {root}")
    rng_file = root / f"rng-rank{dist.get_rank():05d}.pt"
    set_rng_state(torch.load(rng_file, weights_only=False))
