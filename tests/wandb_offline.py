"""Read a W&B offline run (``run-<id>.wandb``) back with wandb's own record schema.

wandb >= 0.19 writes offline runs only as this transaction log (its Python reader moved into
the Go core). The framing is the LevelDB log format W&B documents for it: a 7-byte file header
(``:W&B``, magic 0xBEE1, version 0), 32 KiB blocks, each record fragment prefixed by CRC-32
(4 bytes), length (2, little-endian) and type (1: full, 2: first, 3: middle, 4: last). The
payloads are ``wandb.proto.wandb_internal_pb2.Record`` messages, parsed by wandb's classes.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7


def records(path: Path, wait_s: float = 30.0) -> list[Any]:
    """Every record of a finished run. ``run.finish()`` can return before wandb's core process
    has written the log out, so this waits (up to ``wait_s``) for the run's exit record."""
    deadline = time.monotonic() + wait_s
    while True:
        out = _parse(Path(path).read_bytes(), path)
        if any(r.WhichOneof("record_type") == "exit" for r in out) or time.monotonic() > deadline:
            return out
        time.sleep(0.2)


def _parse(data: bytes, path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    if len(data) < HEADER:
        return []
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path}: not a W&B run file"
    out, pos, pending = [], HEADER, b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # too little room left for a header: block padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        payload = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:  # zero padding at a block's end
            pos += BLOCK - pos % BLOCK if pos % BLOCK else 0
            continue
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def run_file(folder: Path) -> Path:
    """The single offline run file under ``<folder>/wandb/``."""
    files = sorted(Path(folder).glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, f"expected one offline W&B run under {folder}, found {files}"
    return files[0]


def history(path: Path) -> list[dict[str, Any]]:
    """The logged rows, each ``{key: value, ..., "_step": step}``."""
    rows = []
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            rows.append(
                {
                    (i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                    for i in r.history.item
                }
            )
    return rows


def run_info(path: Path) -> Any:
    """The run record: ``display_name``, ``tags``, ``run_group``, ``job_type``, ``config``."""
    return next(r.run for r in records(path) if r.WhichOneof("record_type") == "run")
