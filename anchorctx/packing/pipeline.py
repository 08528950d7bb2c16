"""``prepare_data``: sources -> tokens -> mixture plan -> packed rows -> dataset + manifest.

Stages: (1) stream every source once, tokenising in parallel batches into a temporary token
store; (2) plan which documents (and how many of their tokens) to use from the per-document
index alone; (3) pack the planned documents from the memory-mapped store into an Arrow file;
(4) ``save_to_disk`` it with ``manifest.json``, statistics and the document index beside it,
all inside a temporary directory renamed into place. The output directory is keyed by a
fingerprint of the inputs, the data config, the seed and the tokenizer, so calling again with
the same inputs returns the existing dataset, once it is shown whole: the manifest records the
size and sha256 of every Arrow file, and a file missing or of another size (truncated on a full
disk, by a copy cut short) makes ``prepare_data`` pack it again and :func:`load_packed` refuse
it, naming the file and the fix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from anchorctx.io import (
    DirectoryOwner,
    WriterLock,
    atomic_write_json,
    check_replaceable,
    owned_directory,
    read_json,
    sha256_file,
)
from anchorctx.manifest import base_manifest
from anchorctx.models.loading import anchor_token_id, load_tokenizer, tokenizer_fingerprint
from anchorctx.packing import mixture, pack, stats
from anchorctx.packing.settings import DataConfig, SourceConfig
from anchorctx.packing.sources import (
    BadInput,
    DataError,
    Record,
    input_fingerprints,
    read_file,
    resolve_files,
)
from anchorctx.packing.tokens import DocIndex, TokenStore, encode_batches, encode_texts, scan

if TYPE_CHECKING:
    import datasets

    from anchorctx.experiment import ExperimentConfig

# 2: rows hold seq_len + 1 tokens (seq_len inputs and seq_len targets per row, the reference's
# row); datasets of schema 1 (rows of seq_len tokens) are rebuilt, never read.
SCHEMA_VERSION = 2
MANIFEST = "manifest.json"
# Settings that change how fast the data is produced, never what is produced.
NON_SEMANTIC = ("output_dir", "num_workers", "tokenize_batch_size", "demo_corpus")

log = logging.getLogger("anchorctx.packing")


# ------------------------------------------------------------------------------ fingerprints
def semantic_config(data: DataConfig) -> dict[str, Any]:
    return data.model_dump(mode="json", exclude=set(NON_SEMANTIC))


def data_fingerprint(
    data: DataConfig, seed: int, tokenizer_fp: str, inputs: list[dict[str, Any]]
) -> str:
    """The packed dataset's identity, the one rule for "same dataset" (its directory name, the
    orchestration's cache key and arms sharing a dataset all use it). What counts: the data
    config without the NON_SEMANTIC settings, the seed, the tokenizer's fingerprint (its
    vocabulary, merges and special tokens, not its path) and the path, size and mtime of every
    resolved input file, plus the packed format's SCHEMA_VERSION."""
    payload = {
        "schema": SCHEMA_VERSION,
        "data": semantic_config(data),
        "seed": seed,
        "tokenizer": tokenizer_fp,
        "inputs": inputs,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def dataset_fingerprint(cfg: ExperimentConfig) -> str:
    """:func:`data_fingerprint` of ``cfg``'s packed dataset, computed without packing (loads the
    tokenizer and lists the inputs)."""
    return dataset_identity(cfg)[0]


def dataset_identity(cfg: ExperimentConfig) -> tuple[str, list[dict[str, Any]]]:
    """``(fingerprint, input fingerprints)`` of ``cfg``'s packed dataset, without packing: what
    prepare-data would build now (its ``manifest.json`` records both)."""
    files = _resolve_inputs(cfg.data, BadInput(skip=cfg.data.on_bad_input == "skip"))
    tok = tokenizer_fingerprint(load_tokenizer(cfg.model))
    inputs = input_fingerprints(files)
    return data_fingerprint(cfg.data, cfg.seed, tok, inputs), inputs


def input_change(before: list[dict[str, Any]], now: list[dict[str, Any]]) -> str | None:
    """The first input file that differs between two input-fingerprint lists (a manifest's
    ``inputs`` and :func:`dataset_identity`'s), in words; None when they are equal."""
    old = {i.get("path"): i for i in before if isinstance(i, dict)}
    new = {i.get("path"): i for i in now if isinstance(i, dict)}
    for path in sorted(set(old) | set(new), key=str):
        a, b = old.get(path), new.get(path)
        if a is None:
            return f"{path} is new"
        if b is None:
            return f"{path} is gone"
        if a.get("size") != b.get("size"):
            return f"{path} changed size ({a.get('size')} -> {b.get('size')} bytes)"
        if a.get("mtime_ns") != b.get("mtime_ns"):
            return f"{path} was modified (same size, new modification time)"
    return None


def _is_complete(out: Path, fingerprint: str, *, note: bool = False) -> bool:
    """``out`` holds the dataset of ``fingerprint``, whole (:func:`dataset_problem`); ``note``:
    log why a damaged one is packed again."""
    try:
        manifest = read_json(out / MANIFEST)
    except (OSError, ValueError):
        return False
    if manifest.get("fingerprint") != fingerprint or not (out / "state.json").is_file():
        return False
    if problem := dataset_problem(out, manifest):
        if note:
            log.warning("packed dataset %s is damaged (%s): packing it again", out, problem)
        return False
    return True


def _file_records(out: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of the dataset's Arrow files, for the manifest. The sizes make the check
    on every reuse and load a ``stat`` (:func:`dataset_problem`); the hashes pin the content
    (a checkpoint's ``data_manifest_hash`` covers them). Hashing reads the rows once more, at
    about 1.2 GB/s, once per build."""
    return {
        p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(out.glob("*.arrow"))
    }


def dataset_problem(path: Path, manifest: dict[str, Any]) -> str | None:
    """What is wrong with the packed dataset's Arrow files (None: nothing), naming the file: one
    the manifest records that is missing or of another size. A dataset packed before the sizes
    were recorded has each Arrow stream read to its end instead (memory-mapped, so only the
    message headers are touched)."""
    files = manifest.get("files")
    if isinstance(files, dict):
        for name, record in sorted(files.items()):
            f, size = path / name, (record or {}).get("size")
            if not f.is_file():
                return f"{f}: missing"
            if f.stat().st_size != size:
                return f"{f}: {f.stat().st_size} bytes, written as {size} (truncated or changed)"
        return None
    for f in sorted(path.glob("*.arrow")):
        try:
            with pa.memory_map(str(f)) as mm:
                pa.ipc.open_stream(mm).read_all()
        except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
            return f"{f}: unreadable ({' '.join(str(err).split())})"
    return None


def _damaged(path: Path, problem: str) -> DataError:
    return DataError(
        f"packed dataset {path} is damaged: {problem}; `anchorctx prepare-data CONFIG` packs "
        f"it again (or delete {path} and run the command again)"
    )


# --------------------------------------------------------------------------------- resolving
def _resolve_inputs(data: DataConfig, bad: BadInput) -> list[tuple[SourceConfig, Path]]:
    if not data.sources:
        raise DataError("data.sources is empty: add at least one {path: ...} source")
    files: list[tuple[SourceConfig, Path]] = []
    for src in data.sources:
        try:
            files += [(src, p) for p in resolve_files(src)]
        except DataError as err:
            bad.report("unreadable_file", str(src.path), str(err))
    if not files:
        raise DataError("no readable input files in data.sources")
    return files


def _records(
    files: list[tuple[SourceConfig, Path]], bad: BadInput, domains: set[str] | None
) -> Iterator[Record]:
    for i, (src, path) in enumerate(files):
        yield from read_file(src, path, i, bad, domains)


def separator_ids(data: DataConfig, tok: Any) -> np.ndarray:
    """The token ids ``data.separator`` puts after each document (int64, maybe empty); also the
    perplexity suite's, so held-out rows are packed as training rows are."""
    if data.separator == "eos":
        if tok.eos_token_id is None:
            raise DataError("data.separator=eos but the tokenizer has no EOS token; set a text")
        return np.array([tok.eos_token_id], dtype=np.int64)
    if data.separator == "none":
        return np.zeros(0, dtype=np.int64)
    return encode_texts(tok, [data.separator])[0]


def _special_tokens(data: DataConfig, tok: Any, domains: list[str]) -> tuple[dict, np.ndarray]:
    sep = separator_ids(data, tok)
    tags: dict[str, np.ndarray] = {}
    if data.domain_tags:
        for d in domains:
            try:
                text = data.tag_template.format(domain=d)
            except (KeyError, IndexError, ValueError) as err:
                raise DataError(
                    f"data.tag_template {data.tag_template!r} is invalid ({err!r}); "
                    "the only field is {domain}"
                ) from None
            tags[d] = encode_texts(tok, [text])[0]
    return tags, sep


# Tokens scanned at a time when looking for the anchor id in content (bounded memory).
_SCAN_CHUNK = 1 << 26


def check_anchor_free(
    index: DocIndex, tokens: np.ndarray, plan: mixture.DocumentPlan, anchor: int, files: list
) -> None:
    """AnchorContext asserts that the anchor id never occurs inside document content: the one
    anchor of a row must be the token at index 0. A planned document containing it (e.g. its text
    spells the tokenizer's BOS, or EOS for Qwen) is an error naming the first such document."""
    hits = [
        start + np.flatnonzero(tokens[start : start + _SCAN_CHUNK] == anchor)
        for start in range(0, tokens.shape[0], _SCAN_CHUNK)
    ]
    found = np.concatenate(hits) if hits else np.zeros(0, dtype=np.int64)
    if found.size == 0:
        return
    owner = np.searchsorted(index.offset, found, side="right") - 1  # document of each hit
    bad = np.intersect1d(owner, plan.doc)
    if bad.size:
        first = int(bad[0])
        where = f"{files[int(index.file[first])][1]}:{int(index.line[first])}"
        raise DataError(
            f"{bad.size} sampled documents contain the anchor token id {anchor} in their text "
            f"(first: {where}); the anchor may only open a row (as AnchorContext asserts): "
            "remove the special-token text from the corpus"
        )


def _check_seq_len(seq_len: int, tags: dict[str, np.ndarray], sep: np.ndarray) -> None:
    overhead = 1 + max((t.size for t in tags.values()), default=0) + sep.size
    if seq_len <= overhead:
        raise DataError(
            f"impossible data.seq_len={seq_len}: the anchor, a domain tag and the separator "
            f"alone take {overhead} tokens; use a seq_len well above that"
        )


# ------------------------------------------------------------------------------------- stages
def _tokenize_all(
    cfg: ExperimentConfig, tok: Any, files, bad: BadInput, work: Path, progress: bool
) -> tuple[DocIndex, TokenStore]:
    data = cfg.data
    allowed = set(data.mixture) if isinstance(data.mixture, dict) else None
    store = TokenStore(work / "tokens.bin", len(tok))
    encoded = encode_batches(
        _records(files, bad, allowed),
        tok,
        str(cfg.model.tokenizer_path),
        batch_size=data.tokenize_batch_size,
        num_workers=data.num_workers,
    )
    try:
        index = scan(encoded, store, bad, [p for _, p in files], progress)
    except BaseException:
        store.close()  # a bad input raises mid-scan: leave no open file behind
        raise
    return index, store


def _pack(
    cfg: ExperimentConfig,
    index: DocIndex,
    store: TokenStore,
    plan: mixture.DocumentPlan,
    tags: dict,
    sep: np.ndarray,
    anchor: int,
    arrow: Path,
    progress: bool,
) -> pack.RowPacker:
    data = cfg.data
    if data.interleave_chunks:
        units = pack.interleaved_chunks(plan, data.chunks_per_document, cfg.seed)
    else:
        units = pack.whole_documents(plan)
    packer = pack.RowPacker(data.seq_len, anchor, len(plan))
    rows = pack.pack_rows(units, plan, index, store.view(), packer, tags, sep)
    row_len = packer.row_len
    expected = int((plan.take.sum() + len(plan) * (1 + sep.size)) // row_len)
    bar = tqdm(
        desc="pack",
        unit="tok",
        unit_scale=True,
        total=expected * row_len,
        disable=not progress,
    )
    n = pack.write_arrow(_counted(rows, bar, row_len), arrow)
    bar.close()
    if n == 0:
        raise DataError(
            f"impossible data.seq_len={data.seq_len}: the sampled {int(plan.take.sum())} tokens "
            "do not fill a single row; lower seq_len or raise data.token_budget"
        )
    return packer


def _counted(rows: Iterator[dict], bar: Any, seq_len: int) -> Iterator[dict]:
    for row in rows:
        bar.update(seq_len)
        yield row


# ------------------------------------------------------------------------------------ outputs
def _documents_table(
    index: DocIndex, plan: mixture.DocumentPlan, emitted: np.ndarray, files, path: Path
):
    """Document id (seg_doc) -> input file and line, tokens used: every token is traceable."""
    src = plan.doc
    table = pa.table(
        {
            "doc": np.arange(len(plan), dtype=np.int32),
            "domain": pa.array([index.domains[c] for c in index.domain[src]]).dictionary_encode(),
            "file": pa.DictionaryArray.from_arrays(
                pa.array(index.file[src]), pa.array([str(p) for _, p in files])
            ),
            "line": index.line[src],
            "tokens": index.length[src],
            "taken": plan.take,
            "repeat": plan.repeat,
            "packed": emitted,
        }
    )
    pq.write_table(table, path)


def _manifest(cfg, tok_info, anchor, fingerprint, inputs, plan, packer, index, bad, sep) -> dict:
    st = packer.stats
    return base_manifest(
        schema_version=SCHEMA_VERSION,
        fingerprint=fingerprint,
        seq_len=cfg.data.seq_len,
        anchor_token_id=anchor,
        tokenizer=tok_info,
        data=cfg.data.model_dump(mode="json"),
        seed=cfg.seed,
        counts={
            "rows": st.rows,
            "tokens": st.rows * packer.row_len,
            "documents": int(packer.emitted.sum()),
            "text_tokens": int(sum(st.text_tokens.values())),
            "tag_tokens": st.tag_tokens,
            "separator_tokens": st.separator_tokens,
            "by_domain": _by_domain(index, plan, packer),
            "input_documents": len(index),
            "input_tokens": int(index.length.sum()),
            "truncated_documents": int((plan.take < index.length[plan.doc]).sum()),
            "repeated_documents": int((plan.repeat > 0).sum()),
            "dropped_final_row_tokens": st.dropped_tokens,
            "documents_only_in_dropped_row": int((~packer.emitted).sum()),
        },
        mixture=mixture.describe(plan),
        separator={"setting": cfg.data.separator, "token_ids": [int(t) for t in sep]},
        skipped=bad.as_dict(),
        inputs=inputs,
    )


def _by_domain(index: DocIndex, plan: mixture.DocumentPlan, packer: pack.RowPacker) -> dict:
    dom = index.domain[plan.doc[packer.emitted]]
    docs = np.bincount(dom, minlength=len(index.domains))
    return {
        d: {"documents": int(docs[i]), "tokens": int(packer.stats.text_tokens.get(d, 0))}
        for i, d in enumerate(index.domains)
        if docs[i] or packer.stats.text_tokens.get(d)
    }


# --------------------------------------------------------------------------------------- API
# Any packed dataset may replace another at data.output_dir (a changed config rebuilds it in
# place); nothing else is ever replaced.
PACKED_OWNER = DirectoryOwner("prepare-data", "a packed dataset")


def default_output_dir(cfg: ExperimentConfig, fingerprint: str) -> Path:
    return (
        Path(cfg.data.output_dir)
        if cfg.data.output_dir
        else cfg.experiment_dir / "data" / fingerprint
    )


def prepare_data(cfg: ExperimentConfig, *, force: bool = False, progress: bool = True) -> Path:
    """Build (or reuse) the packed dataset of ``cfg``; return its directory."""
    tok = load_tokenizer(cfg.model)
    tok_info = {"path": str(cfg.model.tokenizer_path), "fingerprint": tokenizer_fingerprint(tok)}
    bad = BadInput(skip=cfg.data.on_bad_input == "skip")
    files = _resolve_inputs(cfg.data, bad)
    inputs = input_fingerprints(files)
    fingerprint = data_fingerprint(cfg.data, cfg.seed, tok_info["fingerprint"], inputs)
    out = default_output_dir(cfg, fingerprint)
    if not force and _is_complete(out, fingerprint):
        return out  # complete datasets are only read: no lock needed
    with WriterLock.beside(out, f"packed dataset {out}"):
        if not force and _is_complete(out, fingerprint, note=True):
            return out  # the writer we would have waited for just finished it
        # Before tokenising: it may hold the user's data. This config's own dataset, found
        # damaged above, may have its Arrow files changed: replacing them is the repair.
        repair = _own_arrow_files(out, fingerprint)
        check_replaceable(out, PACKED_OWNER, repair)
        start = time.perf_counter()
        work = Path(tempfile.mkdtemp(prefix=f".{out.name}.work.", dir=out.parent))
        try:
            manifest, table = _build(
                cfg, tok, tok_info, files, inputs, fingerprint, bad, work, out, progress, repair
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if progress:
        _print_summary(out, manifest, table, time.perf_counter() - start)
    return out


def _own_arrow_files(out: Path, fingerprint: str) -> tuple[str, ...]:
    """The Arrow files of ``out`` when it is the dataset of ``fingerprint`` by its own manifest
    (those the manifest records, or every one for a manifest from before the records); else
    none."""
    try:
        manifest = read_json(out / MANIFEST)
    except (OSError, ValueError):
        return ()
    if not isinstance(manifest, dict) or manifest.get("fingerprint") != fingerprint:
        return ()
    files = manifest.get("files")
    if isinstance(files, dict):
        return tuple(files)
    return tuple(p.name for p in out.glob("*.arrow"))


def _build(cfg, tok, tok_info, files, inputs, fingerprint, bad, work, out, progress, repair=()):
    # Imported here: datasets takes most of a second to import, which the CLI and fingerprinting
    # skip.
    import datasets

    anchor = anchor_token_id(tok)
    index, store = _tokenize_all(cfg, tok, files, bad, work, progress)
    tags, sep = _special_tokens(cfg.data, tok, index.domains)
    _check_seq_len(cfg.data.seq_len, tags, sep)
    plan = mixture.plan_documents(cfg.data, index, cfg.seed, bad, n_files=len(files))
    check_anchor_free(index, store.view(), plan, anchor, files)
    packer = _pack(cfg, index, store, plan, tags, sep, anchor, work / "rows.arrow", progress)
    manifest = _manifest(cfg, tok_info, anchor, fingerprint, inputs, plan, packer, index, bad, sep)
    summary = stats.compute(index, plan, packer.stats, packer.emitted)
    with owned_directory(out, PACKED_OWNER, damaged=repair) as tmp:
        _save(datasets, work / "rows.arrow", tmp, progress)
        manifest["files"] = _file_records(tmp)
        _documents_table(index, plan, packer.emitted, files, tmp / "documents.parquet")
        table = stats.write(summary, tmp)
        stats.length_histogram(index, plan, packer.emitted, tmp / "doc_lengths.png")
        atomic_write_json(tmp / "resolved_config.json", cfg.model_dump(mode="json"))
        atomic_write_json(tmp / MANIFEST, manifest)  # last: marks the dataset complete
    return manifest, table


def _save(datasets: Any, arrow: Path, out: Path, progress: bool) -> None:
    was_enabled = datasets.is_progress_bar_enabled()
    if not progress:
        datasets.disable_progress_bars()
    try:
        ds = datasets.Dataset.from_file(str(arrow))  # memory-mapped, not loaded
        ds.save_to_disk(str(out), max_shard_size="500MB")
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def _print_summary(out: Path, manifest: dict, table: str, seconds: float) -> None:
    c = manifest["counts"]
    print(f"packed dataset: {out} ({seconds:.1f} s)")
    print(
        f"  rows {c['rows']} x {manifest['seq_len'] + 1} tokens; documents {c['documents']}; "
        f"text tokens {c['text_tokens']}; dropped final-row tokens {c['dropped_final_row_tokens']}"
    )
    if manifest["skipped"]["counts"]:
        print(f"  skipped input: {manifest['skipped']['counts']}")
    print(table)


def load_packed(path: str | Path) -> tuple[datasets.Dataset, dict[str, Any]]:
    """The packed dataset at ``path`` and its manifest."""
    # Imported here: datasets takes most of a second to import, which the CLI and fingerprinting
    # skip.
    import datasets

    path = Path(path)
    if not (path / MANIFEST).is_file() or not (path / "state.json").is_file():
        raise DataError(
            f"{path} is not a packed dataset (no {MANIFEST} / state.json); "
            "create one with `anchorctx prepare-data CONFIG`"
        )
    try:
        manifest = read_json(path / MANIFEST)
    except (OSError, ValueError) as err:
        raise _damaged(path, f"{path / MANIFEST}: unreadable ({err})") from None
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise DataError(
            f"{path}: packed dataset schema {manifest.get('schema_version')} is not "
            f"{SCHEMA_VERSION}; re-run prepare-data"
        )
    if problem := dataset_problem(path, manifest):
        raise _damaged(path, problem)
    try:
        ds = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as err:  # what the checks above cannot see (state.json, ...)
        detail = " ".join(str(err).split())
        raise _damaged(path, f"unreadable ({type(err).__name__}: {detail})") from err
    if not isinstance(ds, datasets.Dataset):
        raise DataError(f"{path} holds a DatasetDict, not a packed dataset")
    return ds, manifest
