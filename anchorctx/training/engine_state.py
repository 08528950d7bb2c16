"""DeepSpeed's engine state (``resume/engine``) read without running code, written without
leaving a rank behind.

DeepSpeed reads and writes its checkpoint files through the engine's ``checkpoint_engine``
(``TorchCheckpointEngine``: ``torch.save``, and ``torch.load(weights_only=False)``, which runs
whatever a pickle asks for). :func:`guarded` puts :class:`GuardedCheckpointEngine` in its place
for one save or load:

- ``load`` reads with ``torch.load(weights_only=True)``: tensors, containers and plain values,
  plus the few DeepSpeed classes its state holds (:data:`ALLOWED_GLOBALS`, found by
  ``torch.serialization.get_unsafe_globals_in_checkpoint`` on the resume state of every ZeRO
  stage, fp32 and bf16, with and without optimizer offload). A file that asks for anything
  else (``os.system``, ``builtins.exec``, any other class) is refused before any of it runs:
  :class:`UnsafeStateError` names the file and the global.
- ``save`` records the first failure instead of raising inside DeepSpeed's
  ``save_checkpoint``, which holds collectives (a barrier at its end): a rank that raised there
  would leave the others waiting. The caller reads :attr:`GuardedCheckpointEngine.failure`
  after DeepSpeed returns and all ranks agree on the outcome
  (:func:`anchorctx.training.checkpoints.save_resume`). It also hashes (sha256) each file it
  wrote, right after writing it, while the file is still in the page cache
  (:attr:`GuardedCheckpointEngine.written`): ``trainer.json`` records the hashes, and
  ``--resume`` refuses a file whose content is not the one this run wrote.
"""

from __future__ import annotations

import contextlib
import importlib
import pickle
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from anchorctx.io import sha256_file

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine

# "module:attribute" of every non-torch global in DeepSpeed's engine state (see above).
ALLOWED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler:LossScaler",
    "deepspeed.runtime.zero.config:ZeroStageEnum",
    "deepspeed.utils.tensor_fragment:fragment_address",
)


class UnsafeStateError(Exception):
    """An engine state file asks the unpickler for a global outside the allow-list."""

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        super().__init__(f"{path}: {detail}")


def _allowed() -> list[Any]:
    out = []
    for spec in ALLOWED_GLOBALS:
        module, name = spec.split(":")
        with contextlib.suppress(ImportError, AttributeError):  # another DeepSpeed version
            out.append(getattr(importlib.import_module(module), name))
    return out


def _unsupported_global(err: BaseException) -> str:
    """What torch's weights-only unpickler refused, from its message (which goes on to suggest
    allow-listing it: not advice to pass on)."""
    text = str(err)
    if found := re.search(r"Unsupported global: GLOBAL (\S+)", text):
        return f"it asks for the global {found.group(1)}"
    if found := re.search(r"Unsupported operand[^.\n]*", text):
        return found.group(0)
    return " ".join(text.split())[:200]


class GuardedCheckpointEngine:
    """DeepSpeed's checkpoint engine with a weights-only ``load`` and a deferred-failure
    ``save`` (module docstring); everything else is the wrapped engine's."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.failure: tuple[str, BaseException] | None = None  # (path, error) of the first save
        self.written: dict[str, str] = {}  # path -> sha256 of each file this rank saved

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def load(self, path: str, map_location: Any = None) -> Any:
        # Imported here: torch is loaded wherever a DeepSpeed engine exists; this module's
        # constants serve light callers.
        import torch

        try:
            with torch.serialization.safe_globals(_allowed()):
                return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeStateError(
                str(path),
                "refused: loading it would run code or build objects outside the allow-list "
                f"({_unsupported_global(err)}); it was not loaded",
            ) from None

    def save(self, state_dict: Any, path: str) -> None:
        if self.failure is not None:
            return  # the state is already incomplete: write nothing more
        try:
            self._inner.save(state_dict, path)
            # Read back once more to hash it, on the rank that wrote it, so the ranks hash their
            # own shards in parallel. sha256 ran at 1.2 GB/s on one core of the development
            # machine: a 7B run's engine state (~100 GB: bf16 weights, fp32 master and Adam
            # moments) costs ~10 s a save on 8 ranks, ~80 s on one (a one-GPU offloaded run),
            # more where the page cache no longer holds the file.
            self.written[str(path)] = sha256_file(path)
        except Exception as err:  # reported after DeepSpeed's collectives (module docstring)
            self.failure = (str(path), err)


@contextlib.contextmanager
def guarded(ds_engine: DeepSpeedEngine) -> Iterator[GuardedCheckpointEngine]:
    """``ds_engine`` saves and loads through a :class:`GuardedCheckpointEngine` inside."""
    inner = ds_engine.checkpoint_engine
    guard = GuardedCheckpointEngine(inner)
    ds_engine.checkpoint_engine = guard
    try:
        yield guard
    finally:
        ds_engine.checkpoint_engine = inner
