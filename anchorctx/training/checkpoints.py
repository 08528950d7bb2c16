"""Model checkpoints (Hugging Face format) and resume state, both written atomically.

``<run_dir>/checkpoints/step-NNNNNN/``: ``save_pretrained`` weights (safetensors), config and
tokenizer — loadable by plain ``transformers`` and lm-eval — plus ``anchorctx.json`` (step,
tokens seen, loss, variant, config hash, data manifest hash). It is built under a temporary
name and renamed into place, so a listed checkpoint is always complete; pruning (``save.keep``)
happens only after the new one exists. Under ZeRO-3 the full weights are gathered layer by layer
to rank 0 for the save.

``<run_dir>/resume/``: DeepSpeed's engine checkpoint (model, optimizer and scheduler state, one
shard per rank under ZeRO), each rank's RNG state (``rng-rankNNNNN.json``), and ``trainer.json``
(step, tokens seen, parallel layout, config fingerprint, the packed dataset's fingerprint, the
run's name and seed, and the size and sha256 of every other file), read back as a
:class:`ResumeState`. The data cursor is the step itself (batches are a pure function of seed,
dataset and step, all recorded). ``--resume`` proves the state is this run's before anything is
loaded: sizes first (a truncated file is named at once), then the content hashes (a file copied
from another run of the same config, or changed in place, is named), and after DeepSpeed's load
its client state (the step and a hash of the trainer fields, saved inside the engine files)
must match ``trainer.json``. These hashes tell another run's or a changed state from this
run's; they are no defence against an attacker, who could rewrite ``trainer.json`` as well
(the trust boundary below is). Written to ``.resume.partial`` by every rank, then swapped in by
rank 0 (``resume`` -> ``.resume.old``, ``.resume.partial`` -> ``resume``); a crash between the
two renames is undone by :func:`recover_resume`. Multi-node runs need ``run_root`` on a shared filesystem.

Trust boundary: ``trainer.json`` and the RNG files are JSON, read without pickle. DeepSpeed's
engine files (``resume/engine``) are pickles; they are read with ``torch.load(weights_only=True)``
and an allow-list of the three DeepSpeed classes they hold
(:mod:`anchorctx.training.engine_state`), so a tampered file is refused, naming it, instead of
running its payload. Checkpoints under ``checkpoints/`` are safetensors.

Write failures (a full disk above all: torch reports it as ``[enforce fail at
inline_container.cc] ... file write failed``) are one :class:`SaveError` naming the file, after
every rank has finished DeepSpeed's collectives and agreed that the save failed; the previous
``resume/`` and checkpoints are untouched and the partial directory is removed.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import errno
import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.distributed as dist

from anchorctx.io import atomic_directory, atomic_write_json, read_json, sha256_file
from anchorctx.models.checkpoints import (
    CHECKPOINT_DIR,
    META_FILE,
    checkpoint_name,
    list_checkpoints,
)
from anchorctx.models.safetensors_stream import save_weights_streamed
from anchorctx.training.engine_state import UnsafeStateError, guarded
from anchorctx.training.plan import ResumeStateError
from anchorctx.training.settings import SaveConfig

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine
    from transformers import PreTrainedModel

RESUME_DIR = "resume"
TRAINER_FILE = "trainer.json"
ENGINE_TAG = "engine"
PARTIAL_RESUME = ".resume.partial"
OLD_RESUME = ".resume.old"


def should_save(step: int, total: int, save: SaveConfig) -> bool:
    """Every ``save.every`` steps within the last ``save.last`` steps, and the final step."""
    if step == total:
        return True
    in_window = save.last is None or step > total - save.last
    return in_window and step % save.every == 0


def should_save_resume(step: int, total: int, save: SaveConfig) -> bool:
    if not save.resume:
        return False
    periodic = save.resume_every is not None and step % save.resume_every == 0
    return periodic or should_save(step, total, save)


# ------------------------------------------------------------------------------ HF checkpoints
def _stage_weights(
    ds_engine: DeepSpeedEngine, final: Path
) -> tuple[Path | None, tuple[str, BaseException] | None]:
    """Under ZeRO-3, or with the optimizer in host memory, the weights streamed one tensor at a
    time into a staging directory beside ``final`` (every rank joins each gather, rank 0
    writes), so the host never holds the whole model (anchorctx.models.safetensors_stream says
    why; an offloaded 7B optimizer leaves a one-H200 host 9 of its 125 GiB). Returns (staging
    dir, failure)."""
    if ds_engine.zero_optimization_stage() != 3 and not ds_engine.zero_cpu_offload():
        return None, None
    stage = None
    if dist.get_rank() == 0:
        stage = final.parent / f".{final.name}.weights.tmp"
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir(parents=True)
    try:
        save_weights_streamed(ds_engine.module, stage)
    except Exception as err:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
        return None, (str(stage), err)
    return stage, None


def _finish_streamed(model: PreTrainedModel, staged: Path, tmp: Path) -> None:
    """Move the streamed weights in and write what ``save_pretrained`` writes beside them."""
    for path in staged.iterdir():
        path.rename(tmp / path.name)
    staged.rmdir()
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    config.save_pretrained(tmp)
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(tmp)


def save_checkpoint(
    ds_engine: DeepSpeedEngine,
    tokenizer,
    run_dir: Path,
    step: int,
    meta: dict[str, Any],
    save: SaveConfig,
) -> Path:
    """Write ``checkpoints/step-NNNNNN`` (rank 0 writes; all ranks must call). A failed write
    (a full disk) is a :class:`SaveError` on every rank, naming the file; nothing is left
    half-written."""
    final = Path(run_dir) / CHECKPOINT_DIR / checkpoint_name(step)
    staged, failure = _stage_weights(ds_engine, final)
    if dist.get_rank() == 0 and failure is None:
        current = final
        try:
            with atomic_directory(final) as tmp:
                model = ds_engine.module
                current = tmp / "model.safetensors"
                if staged is None:
                    model.save_pretrained(tmp, safe_serialization=True)
                else:
                    _finish_streamed(model, staged, tmp)
                current = tmp / "config.json"
                _portable_config(tmp)
                current = tmp / "tokenizer.json"
                tokenizer.save_pretrained(tmp)
                current = tmp / META_FILE
                atomic_write_json(tmp / META_FILE, {"step": step, **meta})
        except Exception as err:
            failure = (str(final if current == final else final / current.name), err)
        else:
            prune_checkpoints(run_dir, save.keep)
    if _any_rank_failed(failure is not None):
        raise _save_error(failure, f"checkpoint {final}", _newest_checkpoint_hint(run_dir))
    return final


def _newest_checkpoint_hint(run_dir: Path) -> str:
    found = list_checkpoints(run_dir)
    return f"the newest complete checkpoint, {found[-1]}, is intact" if found else ""


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
@dataclass(frozen=True, kw_only=True)
class ResumeState:
    """Where a run continues from: the trainer fields of ``resume/trainer.json``.

    :meth:`none` is a fresh start (step 0); ``found``: read from ``resume/``, whose engine and
    RNG state are then loaded (:func:`load_resume`).
    """

    step: int = 0  # optimiser steps done: the data cursor too
    tokens_seen: int = 0
    loss: float | None = None  # of the last step done
    parallel: dict[str, Any] = field(default_factory=dict)  # Parallelism.to_dict() of the run
    config_fingerprint: str | None = None  # training.loop.resume_fingerprint of the run's config
    data_fingerprint: str | None = None  # the packed dataset trained on (its manifest's)
    data_dir: str | None = None  # where that dataset was
    run: dict[str, Any] = field(default_factory=dict)  # the writing run: experiment, variant, seed
    # relative path -> {"size", "sha256"} of every other file of the state (not a trainer field:
    # written beside them at save, checked at load)
    files: dict[str, Any] = field(default_factory=dict)
    found: bool = False

    @classmethod
    def none(cls) -> ResumeState:
        """No resume state: the run starts at step 0."""
        return cls()

    @classmethod
    def from_trainer_json(cls, trainer: dict[str, Any]) -> ResumeState:
        return cls(
            step=trainer["step"],
            tokens_seen=trainer.get("tokens_seen", 0),
            loss=trainer.get("loss"),
            parallel=trainer.get("parallel", {}),
            config_fingerprint=trainer.get("config_fingerprint"),
            data_fingerprint=trainer.get("data_fingerprint"),
            data_dir=trainer.get("data_dir"),
            run=trainer.get("run", {}),
            files=trainer.get("files", {}),
            found=True,
        )

    def trainer_json(self) -> dict[str, Any]:
        """The fields as ``trainer.json`` holds them, in its key order."""
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "loss": self.loss,
            "parallel": self.parallel,
            "config_fingerprint": self.config_fingerprint,
            "data_fingerprint": self.data_fingerprint,
            "data_dir": self.data_dir,
            "run": self.run,
        }

    def engine_client_state(self) -> dict[str, Any]:
        """What DeepSpeed saves inside the engine files beside its own state: the step and a
        hash of the trainer fields, so engine files and ``trainer.json`` from different runs
        (or steps) are told apart after loading (:func:`load_resume`)."""
        text = json.dumps(self.trainer_json(), sort_keys=True)
        return {"step": self.step, "trainer_sha256": hashlib.sha256(text.encode()).hexdigest()}


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    """This process's RNG state as plain JSON (no pickle needed to read it back)."""
    version, internal, gauss = random.getstate()
    # The global RandomState is always MT19937, whose legacy state (the default) is this tuple;
    # numpy types get_state() as that tuple or the dict form of other bit generators.
    legacy = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    name, keys, pos, has_gauss, cached = legacy
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = _b64(torch.cuda.get_rng_state())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unb64(state["cuda"]))


def rng_file(rank: int) -> str:
    return f"rng-rank{rank:05d}.json"


class SaveError(RuntimeError):
    """A checkpoint or the resume state could not be written (a full disk, most often); the
    message names the file and what is still intact."""

    exit_code = 1


def _is_disk_full(err: BaseException) -> bool:
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(err)
    return any(
        s in text
        for s in (
            "No space left on device",
            "Disk quota exceeded",
            "os error 28",  # safetensors (Rust)
            # torch.save's zip writer: its message names neither the cause nor the file.
            "inline_container",
            "file write failed",
        )
    )


def _free_space(path: Path) -> str:
    for candidate in (path, *path.parents):
        try:
            free = shutil.disk_usage(candidate).free
        except OSError:
            continue
        return f"{free / (1 << 30):.1f} GiB free there now"
    return "free space unknown"


def _save_error(failure: tuple[str, BaseException] | None, what: str, intact: str) -> SaveError:
    """One line: the file, the cause (the disk is full, or the error itself) and what is
    intact. ``failure`` None: another rank failed (its own message names the file)."""
    tail = f"; {intact}" if intact else ""
    if failure is None:
        return SaveError(f"cannot write the {what}: another rank failed to write its part{tail}")
    path, err = failure
    if _is_disk_full(err):
        cause = f"the disk is full (no space left on device; {_free_space(Path(path))})"
    else:
        detail = " ".join(str(err).split()) or "no message"
        cause = f"{type(err).__name__}: {detail}"
    return SaveError(f"cannot write the {what}: {path}: {cause}{tail}")


def _any_rank_failed(failed: bool) -> bool:
    """Every rank learns whether any rank failed (a collective: all ranks must call)."""
    return bool(_reduce_int(1 if failed else 0, dist.ReduceOp.MAX))


def _reduce_int(value: int, op: dist.ReduceOp.RedOpType) -> int:
    """``value`` reduced over all ranks with ``op`` (a collective: all ranks must call)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    flag = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=op)
    return int(flag.item())


def save_resume(ds_engine: DeepSpeedEngine, run_dir: Path, state: ResumeState) -> Path:
    """Write ``resume/`` atomically (collective): ``state`` with the engine's and every rank's
    RNG state, and the size and sha256 of every file. A failed write (a full disk) is a
    :class:`SaveError` on every rank naming the file; the previous ``resume/`` is untouched and
    ``.resume.partial`` removed."""
    rank = dist.get_rank()
    final = Path(run_dir) / RESUME_DIR
    tmp = Path(run_dir) / PARTIAL_RESUME
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    failure: tuple[str, BaseException] | None = None
    written: dict[str, str] = {}
    try:
        with guarded(ds_engine) as guard:
            ds_engine.save_checkpoint(
                str(tmp),
                tag=ENGINE_TAG,
                client_state=state.engine_client_state(),
                save_latest=False,
            )
        failure, written = guard.failure, guard.written
    except OSError as err:  # DeepSpeed's own directory or metadata writes
        failure = (str(err.filename or tmp / ENGINE_TAG), err)
    if failure is None:
        failure = _write_rank_files(tmp, rank, written)
    if not _any_rank_failed(failure is not None) and rank == 0:
        current = tmp / TRAINER_FILE
        try:
            files = _file_records(tmp, dist.get_world_size())
            trainer = {**state.trainer_json(), "world": dist.get_world_size(), "files": files}
            atomic_write_json(current, trainer)
        except (OSError, ValueError) as err:
            failure = (str(getattr(err, "filename", None) or current), err)
        else:
            _swap_into_place(tmp, final)
    if _any_rank_failed(failure is not None):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # frees what the partial state took
        raise _save_error(_as_final(failure, tmp, final), "resume state", _intact_resume(run_dir))
    return final


def _hash_list(rank: int) -> str:
    """A rank's hashes of the files it wrote, merged into ``trainer.json`` and removed."""
    return f".sha256-rank{rank:05d}.json"


def _write_rank_files(
    tmp: Path, rank: int, written: dict[str, str]
) -> tuple[str, BaseException] | None:
    """This rank's RNG state, then the sha256 of every file it wrote; returns the failure."""
    current = tmp / rng_file(rank)
    try:
        atomic_write_json(current, rng_state())
        written = {**written, str(current): sha256_file(current)}
        hashes = {}
        for path, digest in written.items():
            with contextlib.suppress(ValueError):  # not under tmp: rank 0 hashes what it lists
                hashes[Path(path).relative_to(tmp).as_posix()] = digest
        current = tmp / _hash_list(rank)
        atomic_write_json(current, hashes)
    except OSError as err:
        return str(current), err
    return None


def _file_records(tmp: Path, world: int) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file of the partial state: the hashes the ranks took of what
    each wrote, and for the rest (the recovery script DeepSpeed copies in) hashed here."""
    hashed: dict[str, str] = {}
    for rank in range(world):
        part = tmp / _hash_list(rank)
        hashed.update(read_json(part))
        part.unlink()
    records = {}
    for path in sorted(tmp.rglob("*")):
        if path.is_file():
            rel = path.relative_to(tmp).as_posix()
            digest = hashed.get(rel) or sha256_file(path)
            records[rel] = {"size": path.stat().st_size, "sha256": digest}
    return records


def _as_final(
    failure: tuple[str, BaseException] | None, tmp: Path, final: Path
) -> tuple[str, BaseException] | None:
    """Name the file as it would have been in ``resume/`` (``.resume.partial`` is removed)."""
    if failure is None:
        return None
    path, err = failure
    with contextlib.suppress(ValueError):
        path = str(final / Path(path).relative_to(tmp))
    return path, err


def resume_step(run_dir: Path) -> int | None:
    """The step of the complete resume state in ``resume/`` (None: none, or unreadable)."""
    try:
        step = read_json(Path(run_dir) / RESUME_DIR / TRAINER_FILE).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def _intact_resume(run_dir: Path) -> str:
    step = resume_step(run_dir)
    if step is None:
        return "no earlier resume state was touched"
    return (
        f"the resume state of step {step} in {Path(run_dir) / RESUME_DIR} is intact: free "
        "space, then continue with --resume"
    )


def _swap_into_place(tmp: Path, final: Path) -> None:
    """Replace ``final`` by ``tmp``; a complete version exists at every moment."""
    old = final.with_name(OLD_RESUME)
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def recover_resume(run_dir: Path) -> str | None:
    """Finish or undo a resume swap cut short by a crash; returns what was done (or None).

    ``trainer.json`` is written last, so a directory holding it is complete. Without
    ``resume/``, the newer complete ``.resume.partial`` wins over ``.resume.old``. Call from one
    process only (the launcher, or rank 0 before the others look).
    """
    run_dir = Path(run_dir)
    final = run_dir / RESUME_DIR
    if final.exists():
        return None
    for name in (PARTIAL_RESUME, OLD_RESUME):
        candidate = run_dir / name
        if (candidate / TRAINER_FILE).is_file():
            os.replace(candidate, final)
            return f"recovered the resume state from {candidate} (a save was interrupted)"
    return None


def has_resume_state(run_dir: Path) -> bool:
    return (Path(run_dir) / RESUME_DIR).exists()


def _corrupt(run_dir: Path, path: Path, problem: str) -> ResumeStateError:
    found = list_checkpoints(run_dir)
    if found:
        hint = (
            f"the newest complete checkpoint is {found[-1]}: continue from its weights in a "
            f"new run (--set model.path={found[-1]} and another name), or start over with "
            "--force"
        )
    else:
        hint = "there is no complete checkpoint to fall back to: start over with --force"
    return ResumeStateError(f"corrupt resume state: {path}: {problem}; {hint}")


def read_trainer_state(run_dir: Path, world: int | None = None) -> ResumeState:
    """``resume/trainer.json`` after checking every file of the resume state is there and
    whole (:meth:`ResumeState.none`: no resume state). Raises :class:`ResumeStateError` naming
    the bad file. The per-rank RNG files are checked for the process count the state was
    written with; ``world`` (this launch's) only skips that check when it differs, since
    the layout comparison then explains the refusal."""
    run_dir = Path(run_dir)
    root = run_dir / RESUME_DIR
    if not root.exists():
        return ResumeState.none()
    path = root / TRAINER_FILE
    if not path.is_file():
        raise _corrupt(run_dir, path, "missing (the resume state is incomplete)")
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _corrupt(run_dir, path, f"unreadable ({err})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise _corrupt(run_dir, path, "has no integer 'step'")
    files = state.get("files")
    if not isinstance(files, dict):
        raise _corrupt(
            run_dir,
            path,
            "lists no files (written by an older anchorctx whose RNG "
            "state needs pickle; it is not loaded)",
        )
    for rel, record in files.items():
        f = root / rel
        if not isinstance(record, dict) or not isinstance(record.get("sha256"), str):
            raise _corrupt(
                run_dir,
                path,
                f"records no content hash for {rel} (written by an older anchorctx, or edited): "
                "nothing shows its files are this run's; it is not loaded",
            )
        size = record.get("size")
        if not f.is_file():
            raise _corrupt(run_dir, f, "missing")
        if f.stat().st_size != size:
            raise _corrupt(
                run_dir, f, f"{f.stat().st_size} bytes, written as {size} (truncated or changed)"
            )
    if not (root / ENGINE_TAG).is_dir():
        raise _corrupt(run_dir, root / ENGINE_TAG, "missing (DeepSpeed's engine state)")
    recorded = state.get("world", 1)
    if world is not None and world != recorded:
        # Another process count is a layout change, which the caller reports as such
        # (training.loop.restart_state), not a missing rank file.
        return ResumeState.from_trainer_json(state)
    for rank in range(recorded if isinstance(recorded, int) else 1):
        if rng_file(rank) not in files:
            raise _corrupt(run_dir, root / rng_file(rank), "missing")
    return ResumeState.from_trainer_json(state)


def load_resume(ds_engine: DeepSpeedEngine, run_dir: Path, state: ResumeState) -> None:
    """Restore the DeepSpeed engine (weights, optimizer, scheduler) and this rank's RNG from
    ``resume/`` (collective), once every file's content is the one ``state`` (its
    ``trainer.json``) recorded. The engine files are read without running code
    (:mod:`anchorctx.training.engine_state`): one that would is refused, naming it. The engine's
    client state must then be ``state``'s (step and trainer fields)."""
    root = Path(run_dir) / RESUME_DIR
    _check_contents(run_dir, root, state.files)
    try:
        with guarded(ds_engine):
            path, client = ds_engine.load_checkpoint(
                str(root),
                tag=ENGINE_TAG,
                load_optimizer_states=True,
                load_lr_scheduler_states=True,
            )
    except UnsafeStateError as err:
        raise _corrupt(run_dir, Path(err.path), str(err)[len(err.path) + 2 :]) from None
    except Exception as err:  # DeepSpeed raises anything from AssertionError to pickle errors
        detail = " ".join(str(err).split()) or "no message"
        raise _corrupt(
            run_dir, root / ENGINE_TAG, f"DeepSpeed cannot load it ({type(err).__name__}: {detail})"
        ) from err
    if path is None:
        raise _corrupt(run_dir, root / ENGINE_TAG, "DeepSpeed found no checkpoint in it")
    _check_client_state(run_dir, root, client, state)
    rng_path = root / rng_file(dist.get_rank())
    try:
        set_rng_state(read_json(rng_path))
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as err:
        raise _corrupt(run_dir, rng_path, f"unreadable RNG state ({err})") from None


def _check_contents(run_dir: Path, root: Path, files: dict[str, Any]) -> None:
    """Every file's sha256 is the one recorded at save (collective). The ranks share the work
    (rank r hashes every world-th file) and agree on the first mismatch, so each names the
    same file. sha256 ran at 1.2 GB/s on one core of the development machine: a 7B run's
    ~100 GB engine state costs ~10 s on 8 ranks (~80 s on one), before DeepSpeed reads it
    again."""
    names = sorted(files)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    bad = len(names)
    for i in range(rank, len(names), world):
        try:
            same = sha256_file(root / names[i]) == files[names[i]]["sha256"]
        except OSError:
            same = False
        if not same:
            bad = i
            break
    bad = _reduce_int(bad, dist.ReduceOp.MIN)
    if bad < len(names):
        raise _corrupt(
            run_dir,
            root / names[bad],
            f"its content is not what this run wrote (its sha256 differs from {TRAINER_FILE}'s "
            "record): it was replaced or changed since (copied from another run?); it is not "
            "loaded",
        )


def _check_client_state(
    run_dir: Path, root: Path, client: dict[str, Any] | None, state: ResumeState
) -> None:
    want = state.engine_client_state()
    got = {key: (client or {}).get(key) for key in want}
    if got != want:
        step = got["step"] if got["step"] is not None else "unknown"
        raise _corrupt(
            run_dir,
            root / ENGINE_TAG,
            f"DeepSpeed's engine state (step {step}) was not saved with this {TRAINER_FILE} "
            f"(step {state.step}): the engine files come from another run or step",
        )
