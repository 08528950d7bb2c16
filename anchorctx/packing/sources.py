"""Streaming document sources: SlimPajama-layout jsonl / jsonl.zst / parquet files, or a
Hugging Face dataset (a ``save_to_disk`` directory or a hub name).

Records are read one at a time, so memory does not grow with the corpus. Every bad record is
either an error that names the file and line, or (``on_bad_input: skip``) a counted skip by
reason; nothing is dropped silently. JSON lines are parsed here rather than by the ``datasets``
JSON builder because that builder reports neither the file nor the line of a bad record.

Compressed files are all or nothing: a ``.jsonl.zst`` is first decompressed once without
parsing to check that every frame is complete (a truncated download ends mid-frame without
any error from the stream reader). A damaged file contributes no documents; it is counted as
``unreadable_file`` and the documents it held up to the damage as ``lost_documents`` (what
followed the damage cannot be counted). Text that is not valid Unicode (a lone surrogate such
as ``"\ud800"`` from a JSON escape) is the counted skip ``undecodable_text``, naming file:line.
"""

from __future__ import annotations

import glob
import io
import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import zstandard

from anchorctx.packing.settings import SourceConfig

SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".zst": "jsonl.zst", ".parquet": "parquet"}
SKIP_REASONS = (
    "unreadable_file",
    "invalid_json",
    "missing_text",
    "empty_text",
    "non_string_text",
    "missing_domain",
    "unknown_domain",
    "budget_exceeds_corpus",
    "lost_documents",
    "undecodable_text",
    "truncated_file",
)
_ZSTD_CHUNK = 1 << 20
# Re-reading a damaged file in pieces this small loses at most the blocks that end inside the
# piece holding the damage (the documents of one block at most, in practice).
_ZSTD_RECOUNT_CHUNK = 64


class DataError(ValueError):
    """Bad input data or an impossible data config; the message names the file and line."""


@dataclass
class BadInput:
    """Policy and accounting for bad input: raise, or count skips by reason."""

    skip: bool
    counts: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)  # reason -> first location

    def report(self, reason: str, where: str, detail: str, amount: int = 1) -> None:
        if not self.skip:
            raise DataError(f"{where}: {detail} (set data.on_bad_input=skip to skip and count)")
        self.counts[reason] += amount
        self.examples.setdefault(reason, f"{where}: {detail}")

    def as_dict(self) -> dict[str, Any]:
        return {"counts": dict(sorted(self.counts.items())), "first": self.examples}


@dataclass(frozen=True)
class Record:
    text: str
    domain: str
    file_index: int  # into resolve_files() of all sources, in order
    line: int  # 1-based line (jsonl) or row (parquet, hf)


def source_format(path: Path, declared: str) -> str:
    if declared != "auto":
        return declared
    name = path.name
    if name.endswith(".jsonl.zst") or name.endswith(".json.zst"):
        return "jsonl.zst"
    fmt = SUFFIXES.get(path.suffix)
    if fmt is None:
        raise DataError(
            f"{path}: cannot tell the format from the name; set format to one of "
            "jsonl, jsonl.zst, parquet, hf"
        )
    return fmt


def resolve_files(src: SourceConfig) -> list[Path]:
    """The files of one source, sorted (deterministic); ``hf`` sources are one entry."""
    path = Path(src.path)
    if src.format == "hf":
        return [path]
    if path.is_dir():
        files = [p for p in path.rglob("*") if p.is_file() and _known_suffix(p)]
    elif any(ch in str(path) for ch in "*?["):
        files = [Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file()]
    elif path.is_file():
        files = [path]
    else:
        raise DataError(f"data source {path} does not exist")
    files = sorted(files, key=lambda p: p.as_posix())
    if not files:
        raise DataError(f"data source {path} matches no .jsonl, .jsonl.zst or .parquet files")
    return files


def _known_suffix(p: Path) -> bool:
    # Directory walks skip plain .json (metadata files such as dataset_info.json live beside
    # data); name a JSON-lines file with a .json suffix explicitly to read it.
    return p.suffix in SUFFIXES and p.suffix != ".json" and not p.name.startswith(".")


def input_fingerprints(files: list[tuple[SourceConfig, Path]]) -> list[dict[str, Any]]:
    """Path, size and mtime of every input file: cheap, and changes whenever content does."""
    out = []
    for _, path in files:
        try:
            st = os.stat(path)
            out.append({"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
        except OSError:
            out.append({"path": str(path), "size": None, "mtime_ns": None})
    return out


def dotted_get(record: Any, dotted: str) -> Any:
    node = record
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


# ------------------------------------------------------------------------------------ readers
def _jsonl_lines(path: Path, fmt: str) -> Iterator[tuple[int, bytes]]:
    with path.open("rb") as raw:
        if fmt == "jsonl.zst":
            # read_across_frames: a file of several frames (concatenated streams) is one document
            # sequence; by default the reader stops silently after the first frame.
            reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
            stream: Any = io.BufferedReader(reader)
        else:
            stream = raw
        yield from enumerate(stream, start=1)


class StreamDamaged(Exception):
    """A compressed file is truncated or corrupt; ``lines`` complete lines came before it."""

    def __init__(self, detail: str, lines: int) -> None:
        super().__init__(detail)
        self.lines = lines


def check_zstd_stream(path: Path, chunk: int = _ZSTD_CHUNK) -> None:
    """Decompress ``path`` without keeping the output; raise :class:`StreamDamaged` if a frame
    is corrupt or the file ends inside a frame (the stream reader reports neither reliably).

    The output of the call that hits corrupt data is discarded by zstd, so after an error the
    file is read again in small pieces: every block before the damage is then counted.
    """
    lines, started, dobj = 0, False, zstandard.ZstdDecompressor().decompressobj()
    with path.open("rb") as fh:
        try:
            while piece := fh.read(chunk):
                while piece:
                    if dobj.eof:  # a file may hold several frames: one decompressor each
                        dobj = zstandard.ZstdDecompressor().decompressobj()
                    lines += dobj.decompress(piece).count(b"\n")
                    started = True
                    piece = dobj.unused_data if dobj.eof else b""
        except zstandard.ZstdError as err:
            if chunk > _ZSTD_RECOUNT_CHUNK:
                return check_zstd_stream(path, _ZSTD_RECOUNT_CHUNK)
            raise StreamDamaged(f"corrupt zstd data after line {lines} ({err})", lines) from None
    if not started:  # a compressor writes a frame even for empty input: this is a cut file
        raise StreamDamaged("empty file (no zstd frame)", 0)
    if not dobj.eof:
        raise StreamDamaged(
            f"truncated zstd stream: it ends inside a frame after line {lines}", lines
        )
    return None


def _jsonl_records(path: Path, fmt: str, bad: BadInput) -> Iterator[tuple[int, Any]]:
    for lineno, line in _jsonl_lines(path, fmt):
        if not line.strip():
            continue  # a blank line holds no record
        try:
            yield lineno, json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            bad.report("invalid_json", f"{path}:{lineno}", f"invalid JSON line ({err})")


def _parquet_records(path: Path) -> Iterator[tuple[int, Any]]:
    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for rec in batch.to_pylist():
            row += 1
            yield row, rec


def _hf_records(src: SourceConfig) -> Iterator[tuple[int, Any]]:
    # Imported here: datasets takes most of a second to import; only Hugging Face sources need it.
    import datasets

    path = Path(src.path)
    saved = (path / "dataset_info.json").exists() or (path / "state.json").exists()
    if path.is_dir() and saved:
        ds: Any = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"]
    else:
        ds = datasets.load_dataset(str(path), split="train", streaming=True)
    yield from enumerate(ds, start=1)


def _raw_records(src: SourceConfig, path: Path, bad: BadInput) -> Iterator[tuple[int, Any]]:
    fmt = source_format(path, src.format)
    if fmt == "hf":
        return _hf_records(src)
    if fmt == "parquet":
        return _parquet_records(path)
    return _jsonl_records(path, fmt, bad)


def read_file(
    src: SourceConfig, path: Path, file_index: int, bad: BadInput, domains: set[str] | None
) -> Iterator[Record]:
    """Valid records of one file. ``domains``: the allowed domains (None: any)."""
    fmt = source_format(path, src.format)
    if fmt == "jsonl.zst":
        try:
            check_zstd_stream(path)
        except StreamDamaged as err:
            _report_damaged(bad, path, str(err), err.lines)
            return
        except OSError as err:
            _report_damaged(bad, path, _one_line(err), 0)
            return
    line = 0
    try:
        for line, rec in _raw_records(src, path, bad):
            record = _validate(src, path, line, rec, bad, domains, file_index)
            if record is not None:
                yield record
    except DataError:
        raise
    except Exception as err:  # unreadable or corrupt file (OSError, zstd, parquet, hf errors)
        detail = f"cannot read file ({type(err).__name__}: {_one_line(err)})"
        if line == 0:
            bad.report("unreadable_file", str(path), detail)
        else:  # its first records are already in use: say so rather than call it unreadable
            bad.report(
                "truncated_file",
                f"{path}:{line}",
                f"{detail}; records up to line {line} were used, the rest is lost",
            )


def _report_damaged(bad: BadInput, path: Path, detail: str, lines: int) -> None:
    bad.report(
        "unreadable_file",
        str(path),
        f"cannot read file: {detail}; no document of this file is used",
    )
    if lines:
        bad.report(
            "lost_documents",
            str(path),
            f"{lines} line(s) before the damage (more may have followed)",
            amount=lines,
        )


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def _is_unicode(text: str) -> bool:
    """False for strings the tokenizer cannot take: lone surrogates from JSON escapes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _validate(
    src: SourceConfig,
    path: Path,
    line: int,
    rec: Any,
    bad: BadInput,
    domains: set[str] | None,
    file_index: int,
) -> Record | None:
    where = f"{path}:{line}"
    text = dotted_get(rec, src.text_field)
    if text is None:
        bad.report("missing_text", where, f"record has no {src.text_field!r} field")
        return None
    if not isinstance(text, str):
        bad.report("non_string_text", where, f"{src.text_field!r} is {type(text).__name__}")
        return None
    if not text.strip():
        bad.report("empty_text", where, f"{src.text_field!r} is empty")
        return None
    if not _is_unicode(text):
        bad.report(
            "undecodable_text",
            where,
            f"{src.text_field!r} is not valid Unicode (a lone surrogate escape such as \\ud800)",
        )
        return None
    domain = src.domain if src.domain is not None else dotted_get(rec, src.domain_field)
    if not isinstance(domain, str) or not domain:
        bad.report("missing_domain", where, f"record has no {src.domain_field!r} (or set domain)")
        return None
    if not _is_unicode(domain):
        bad.report("undecodable_text", where, f"{src.domain_field!r} is not valid Unicode")
        return None
    if domains is not None and domain not in domains:
        bad.report(
            "unknown_domain",
            where,
            f"domain {domain!r} is not in data.mixture ({', '.join(sorted(domains))})",
        )
        return None
    return Record(text, domain, file_index, line)
