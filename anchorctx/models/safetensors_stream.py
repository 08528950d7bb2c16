"""Write safetensors files tensor by tensor, and a Hugging Face checkpoint's weights that way.

``save_pretrained`` builds the whole state dict in host memory and safetensors then copies each
shard once more; under ZeRO-3 the gathered 16-bit state dict comes on top. For a 7B model with
its fp32 optimizer state offloaded to the host (about 12 bytes per parameter, 81 GB), that
extra ~55 GB at the save is what the host runs out of (measured on a 125 GB host: 72 GB in use
during training, killed by the OOM killer at the first checkpoint). Here each parameter is
gathered (ZeRO-3), copied to the host and written before the next: the host holds one tensor.

The files are the ones ``save_pretrained`` writes: shards ``model-0000K-of-0000N.safetensors``
of at most ``max_shard_bytes`` with ``model.safetensors.index.json`` (a single
``model.safetensors`` when one shard holds everything), ``{"format": "pt"}`` metadata, the
state dict's key names, and tied weights stored once (under the name ``named_parameters``
gives them, the input embedding for tied LM heads, as transformers does).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from anchorctx.io import atomic_write_json

# safetensors' dtype codes for the dtypes checkpoints hold
DTYPE_CODES = {
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
MAX_SHARD_BYTES = 5 * 1024**3  # transformers' default max_shard_size ("5GB")
INDEX_FILE = "model.safetensors.index.json"

Entry = tuple[str, str, tuple[int, ...], int]  # name, dtype code, shape, bytes


def write_safetensors(path: Path, entries: list[Entry], pieces: Iterable[Any]) -> int:
    """Stream tensors into ``path``: the header (names, dtypes, shapes) is known up front and
    ``pieces`` yields each tensor's bytes in order (bytes-like objects, in any number of
    pieces). Returns the data bytes written; a count that disagrees with the header raises."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, code, shape, size in entries:
        header[name] = {
            "dtype": code,
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format aligns the data start to 8 bytes
    written = 0
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for piece in pieces:
            fh.write(piece)
            written += memoryview(piece).nbytes
    if written != offset:  # a shape and its bytes disagree: never leave such a file behind
        raise RuntimeError(f"{path}: wrote {written} data bytes, the header says {offset}")
    return offset


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def plan_shards(sizes: list[int], max_shard_bytes: int) -> list[list[int]]:
    """Consecutive tensors per shard, each shard at most ``max_shard_bytes`` (a larger tensor
    gets a shard of its own), as transformers splits them."""
    shards: list[list[int]] = [[]]
    used = 0
    for i, size in enumerate(sizes):
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += size
    return [s for s in shards if s]


def _checkpoint_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The state dict's tensors as (key, parameter or buffer), tied parameters once."""
    keys = set(module.state_dict(keep_vars=True))  # persistent buffers only
    tensors: list[tuple[str, torch.Tensor]] = [
        (n, p) for n, p in module.named_parameters() if n in keys
    ]  # dedups tied weights
    tensors += [(n, b) for n, b in module.named_buffers() if n in keys]
    return tensors


def _full_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(t, "ds_shape", t.shape))  # ZeRO-3 keeps the full shape here


def _host_bytes(t: torch.Tensor) -> memoryview:
    host = t.detach().to("cpu", copy=True).contiguous()
    return memoryview(host.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers; its stubs do not say so for Python 3.11


def save_weights_streamed(
    module: torch.nn.Module, out_dir: Path | None, max_shard_bytes: int = MAX_SHARD_BYTES
) -> None:
    """Write ``module``'s weights into ``out_dir`` one tensor at a time. Under ZeRO-3 every rank
    must call this (each parameter is gathered, a collective); only the rank given an
    ``out_dir`` writes, the others pass None. A write error on the writing rank is raised after
    the loop, so the other ranks never wait on a gather it skipped."""
    # a no-op for parameters ZeRO-3 does not own
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    tensors = _checkpoint_tensors(module)
    entries: list[Entry] = []
    for name, t in tensors:
        if t.dtype not in DTYPE_CODES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors code")
        shape = _full_shape(t)
        entries.append((name, DTYPE_CODES[t.dtype], shape, t.element_size() * _numel(shape)))
    plan = plan_shards([e[3] for e in entries], max_shard_bytes)
    names = shard_names(len(plan))

    def gathered(indices: list[int]) -> Iterator[memoryview]:
        for i in indices:
            with GatheredParameters([tensors[i][1]], modifier_rank=None):
                if out_dir is not None and error is None:
                    yield _host_bytes(tensors[i][1])

    error: BaseException | None = None
    for shard, indices in zip(names, plan, strict=True):
        pieces = gathered(indices)
        if out_dir is not None and error is None:
            try:
                write_safetensors(out_dir / shard, [entries[i] for i in indices], pieces)
            except Exception as err:
                error = err
        for _ in pieces:  # a failed write still joins the rest of the gathers
            pass
    if error is not None:
        raise error
    if out_dir is not None and len(plan) > 1:
        weight_map = {entries[i][0]: shard for shard, idx in zip(names, plan) for i in idx}
        total = sum(e[3] for e in entries)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        atomic_write_json(out_dir / INDEX_FILE, index)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
