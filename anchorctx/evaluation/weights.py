"""Weight averaging: one Hugging Face checkpoint whose parameters are the mean of several.

An alternative to averaging *scores* over the last k checkpoints: evaluate one model whose
weights are the uniform mean of the last k. Parameters are accumulated in float32 (summing five
bf16 tensors in bf16 loses up to ~3 bits) and cast back to each tensor's stored dtype. Work is
shard by shard, so peak memory is about two copies of one shard, not of the model.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from anchorctx.evaluation.results import check_checkpoint, checkpoint_hash
from anchorctx.io import DirectoryOwner, atomic_write_json, owned_directory
from anchorctx.models.checkpoints import checkpoint_step

_INDEX = "model.safetensors.index.json"


class WeightAveragingError(ValueError):
    """The checkpoints cannot be averaged; the message names the mismatch."""


def _shards(ckpt: Path) -> list[str]:
    """Safetensors shard names of a checkpoint (from the index when sharded)."""
    index = ckpt / _INDEX
    if index.is_file():
        try:
            return sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise WeightAveragingError(
                f"{index}: not a safetensors index ({type(err).__name__}: {err})"
            ) from err
    names = sorted(p.name for p in ckpt.glob("*.safetensors"))
    if not names:
        raise WeightAveragingError(
            f"{ckpt} has no *.safetensors weights: re-save it with save_pretrained"
            "(safe_serialization=True)"
        )
    return names


def _check_same_layout(checkpoints: list[Path]) -> list[str]:
    shards = _shards(checkpoints[0])
    for ckpt in checkpoints[1:]:
        if _shards(ckpt) != shards:
            raise WeightAveragingError(
                f"{ckpt} has shards {_shards(ckpt)}, {checkpoints[0]} has {shards}: "
                "only checkpoints of one model can be averaged"
            )
    return shards


def _average_shard(paths: list[Path]) -> tuple[dict[str, Any], dict[str, str]]:
    """Mean of one shard over checkpoints (fp32 accumulation); returns tensors and metadata."""
    # Imported here: torch and safetensors' torch half load only when averaging; the CLI imports
    # this module.
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    def header(path: str) -> dict[str, str]:
        with safe_open(path, framework="pt") as fh:
            return fh.metadata() or {}

    metadata = _read(paths[0], header)
    first = _read(paths[0], load_file)
    dtypes = {name: t.dtype for name, t in first.items()}
    acc = {name: t.to(torch.float32) for name, t in first.items()}
    del first  # hold one fp32 accumulator and one loaded shard, not a third copy
    for path in paths[1:]:
        tensors = _read(path, load_file)
        if tensors.keys() != acc.keys():
            diff = sorted(set(tensors) ^ set(acc))[:5]
            raise WeightAveragingError(f"{path}: tensor names differ from {paths[0]}: {diff}")
        for name, t in tensors.items():
            if t.shape != acc[name].shape:
                raise WeightAveragingError(
                    f"{path}: {name} has shape {tuple(t.shape)}, expected {tuple(acc[name].shape)}"
                )
            acc[name].add_(t.to(torch.float32))
    n = float(len(paths))
    return {name: (a / n).to(dtypes[name]).contiguous() for name, a in acc.items()}, metadata


def _read(path: Path, reader: Callable[[str], Any]) -> Any:
    """``reader(path)``, with a corrupt or truncated file as one error naming it (safetensors'
    own message names no file: "Error while deserializing header: HeaderTooLarge")."""
    # Imported here: as above, safetensors loads only when averaging.
    from safetensors import SafetensorError

    try:
        return reader(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        text = " ".join(str(err).split())
        raise WeightAveragingError(f"{path}: not a readable safetensors file ({text})") from err


def _source_info(ckpt: Path) -> dict[str, Any]:
    return {
        "path": str(ckpt.resolve()),
        "step": checkpoint_step(ckpt),
        "checkpoint_hash": checkpoint_hash(ckpt),
    }


def averaged_owner(checkpoints: list[Path]) -> DirectoryOwner:
    """The owner of an averaged checkpoint: ``average-weights`` for the run(s) whose
    checkpoints it averages (``<run_dir>/checkpoints/step-N``), so a re-run for the same run
    replaces its earlier output and nothing else."""
    runs = sorted({str(c.resolve().parent.parent) for c in checkpoints})
    return DirectoryOwner("average-weights", "an averaged checkpoint", ", ".join(runs))


def average_weights(
    checkpoints: Sequence[str | Path], out: str | Path, *, progress: bool = True
) -> Path:
    """Write the uniform weight average of ``checkpoints`` as an HF checkpoint at ``out``.

    Config, generation config and tokenizer files are copied from the last checkpoint (the
    newest when they are given in step order); ``anchorctx.json`` lists the sources. The output
    directory appears only when complete, and replaces only an earlier average of the same
    run(s) (:func:`anchorctx.io.check_replaceable`: anything else at ``out`` is refused).
    """
    # Imported here: safetensors.torch imports torch, which the CLI skips.
    from safetensors.torch import save_file

    ckpts = [check_checkpoint(c) for c in checkpoints]
    if not ckpts:
        raise WeightAveragingError("average_weights needs at least one checkpoint")
    out = Path(out)
    if out.resolve() in {c.resolve() for c in ckpts}:
        raise WeightAveragingError(f"output {out} is one of the inputs: choose another --out")
    shards = _check_same_layout(ckpts)
    with owned_directory(out, averaged_owner(ckpts)) as tmp:
        for name in tqdm(shards, desc="averaging shards", unit="shard", disable=not progress):
            tensors, metadata = _average_shard([c / name for c in ckpts])
            save_file(tensors, str(tmp / name), metadata={**metadata, "format": "pt"})
        _copy_non_weights(ckpts[-1], tmp)
        atomic_write_json(
            tmp / "anchorctx.json",
            {
                "averaged_from": [_source_info(c) for c in ckpts],
                "method": "uniform mean of parameters, float32 accumulation",
                "step": None,
            },
        )
    return out


def _copy_non_weights(src: Path, dst: Path) -> None:
    """Config, tokenizer and index files of ``src`` (everything but weights and anchorctx.json)."""
    for path in src.iterdir():
        if path.name == "anchorctx.json" or path.name.startswith("."):
            continue
        if path.suffix == ".safetensors" or path.name.startswith("pytorch_model"):
            continue
        if path.is_dir():
            shutil.copytree(path, dst / path.name)
        else:
            shutil.copy2(path, dst / path.name)
