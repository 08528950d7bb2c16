"""Every artifact kind gets the mode the user's umask asks for (docs/RELIABILITY.md, file modes).

The artifacts are written by the real writers on tiny inputs: JSON and Markdown results, the
samples journal (a header written atomically, then appended lines), the RULER sample store, the
experiment report and its RULER plot, the training-loss plot, the RoPE precision study (JSON,
table and figure), a checkpoint directory with a file its writer created 0600 (as safetensors
does), and the writer lock's file. Temporary files are created private; none may reach its final name so.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from anchorctx.evaluation.arm_comparison import LOSS_PNG, plot_loss_curves
from anchorctx.evaluation.averaging import SUMMARY_JSON, SUMMARY_MD, summarize_run
from anchorctx.evaluation.report import write_experiment_report
from anchorctx.evaluation.results import HEADER_KEY, start_samples
from anchorctx.evaluation.ruler.runner import SampleStore
from anchorctx.io import (
    WriterLock,
    append_jsonl,
    atomic_directory,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ---------------------------------------------------------------------------- writers
def write_io_files(root: Path) -> dict[str, list[Path]]:
    """The io writers themselves; the JSON file is written, then replaced."""
    atomic_write_json(root / "io" / "a.json", {"k": 1})
    return {
        "json": [atomic_write_json(root / "io" / "a.json", {"k": 2})],
        "text": [atomic_write_text(root / "io" / "a.md", "# title\n")],
        "bytes": [atomic_write_bytes(root / "io" / "a.bin", b"\0\1")],
    }


def write_samples(root: Path) -> dict[str, list[Path]]:
    """An evaluation's samples journal: header (atomic), then appended records; and a JSONL
    file that appending creates."""
    ident = {"checkpoint_hash": "c", "evaluation_fingerprint": "e", "code_version": "v"}
    samples = root / "eval" / "step-000010" / "ruler.samples.jsonl"
    start_samples(samples, ident)
    append_jsonl(samples, {"key": "niah_single_1/4096/0", "score": 100.0})
    metrics = root / "run" / "metrics.jsonl"
    append_jsonl(metrics, {"step": 1, "loss": 8.0})
    assert json.loads(samples.read_text().splitlines()[0]) == {HEADER_KEY: ident}
    # The experiment's RULER sample store (one JSON file per task, length and identity).
    store = SampleStore(root / "ruler-samples", ("identity",), "fwe", 4096)
    store.add([{"index": 0, "input": "text", "outputs": ["a"]}])
    assert store.read()[0]["input"] == "text"
    return {"jsonl": [samples, metrics], "json": [store.path]}


def write_result(run_dir: Path, step: int, score: float) -> None:
    """A per-checkpoint RULER result, the input of the summary and the report."""
    path = run_dir / "eval" / f"step-{step:06d}" / "ruler.json"
    atomic_write_json(
        path,
        {
            "suite": "ruler",
            "checkpoint_name": path.parent.name,
            "step": step,
            "scores": {"niah_single_1": {"4096": score, "8192": score / 2}},
            "counts": {},
            "not_run": {},
        },
    )


def write_report(root: Path) -> dict[str, list[Path]]:
    """Run summaries, the experiment report with its RULER plot, and the training-loss plot."""
    exp = root / "exp"
    for variant, score in (("anchor", 60.0), ("full", 40.0)):
        for step in (10, 20):
            write_result(exp / variant, step, score + step)
        summarize_run(exp / variant, 2)
    out = write_experiment_report(exp, ["anchor", "full"])
    ruler_png = Path(out["paths"]["ruler_plot"])
    loss_png = plot_loss_curves(
        {"full": [(1, 8.0), (2, 7.0)], "anchor": [(1, 8.0), (2, 6.5)]}, exp / LOSS_PNG
    )
    for png in (ruler_png, loss_png):
        assert png.read_bytes()[:8] == PNG_MAGIC
    runs = [exp / v / "eval" for v in ("anchor", "full")]
    return {
        "json": [*(r / SUMMARY_JSON for r in runs), Path(out["paths"]["json"])],
        "text": [*(r / SUMMARY_MD for r in runs), Path(out["paths"]["markdown"])],
        "png": [ruler_png, loss_png],
        "dir": [exp],
    }


def rope_result() -> dict:
    """A measured study's result, two modes on 8 tokens (what ``measure`` returns)."""
    modes = ["fp32", "bf16"]
    scale = {"fp32": 1e-7, "bf16": 1e-3}
    return {
        "schema_version": 1,
        "study": "rope_precision",
        "settings": {
            "delta2": 16,
            "compare_shift": 0,
            "shifts": [0, 4, 16],
            "seq_len": 8,
            "lengths": [4, 8],
            "num_sequences": 1,
            "modes": modes,
            "inputs": "tiny",
            "weights": "random init",
        },
        "shift_curve": {m: {"0": 2 * scale[m], "4": scale[m], "16": 0.0} for m in modes},
        "per_token": {m: [scale[m] * (8 - j) for j in range(8)] for m in modes},
        "first_token_share": {m: 8 / 36 for m in modes},
        "logit_diff_by_length": {m: {"4": scale[m], "8": 2 * scale[m]} for m in modes},
        "per_sample_shift_curve": {
            m: [{"0": 2 * scale[m], "4": scale[m], "16": 0.0}] for m in modes
        },
    }


def write_rope_study(root: Path) -> dict[str, list[Path]]:
    """The RoPE precision study's outputs: JSON, Markdown table, three-panel figure, and the
    per-sequence curves (Figure 7) with their figure."""
    # Imported here: the study imports torch and transformers.
    from anchorctx.analysis.rope_precision import (
        MD_NAME,
        PER_SAMPLE_JSON,
        PER_SAMPLE_PNG,
        PNG_NAME,
        write_study,
    )

    path = write_study(rope_result(), root / "rope")
    pngs = [path.with_name(PNG_NAME), path.with_name(PER_SAMPLE_PNG)]
    assert all(png.read_bytes()[:8] == PNG_MAGIC for png in pngs)
    return {
        "json": [path, path.with_name(PER_SAMPLE_JSON)],
        "text": [path.with_name(MD_NAME)],
        "png": pngs,
    }


def write_checkpoint(root: Path) -> dict[str, list[Path]]:
    """A checkpoint directory: a weights file created 0600 and a private subdirectory."""
    final = root / "run" / "checkpoints" / "step-000010"
    with atomic_directory(final) as tmp:
        fd = os.open(tmp / "model.safetensors", os.O_CREAT | os.O_WRONLY, 0o600)
        os.write(fd, b"weights")
        os.close(fd)
        os.mkdir(tmp / "tokenizer", 0o700)
        (tmp / "tokenizer" / "tokenizer.json").write_text("{}")
        atomic_write_json(tmp / "anchorctx.json", {"step": 10})
    return {
        "dir": [final, final / "tokenizer"],
        "checkpoint": [
            final / "model.safetensors",
            final / "tokenizer" / "tokenizer.json",
            final / "anchorctx.json",
        ],
    }


def write_lock(root: Path) -> dict[str, list[Path]]:
    lock = WriterLock.beside(root / "run", "run directory")
    with lock:
        pass
    return {"lock": [lock.path]}


WRITERS = (
    write_io_files,
    write_samples,
    write_report,
    write_rope_study,
    write_checkpoint,
    write_lock,
)
FILE_KINDS = ("json", "text", "bytes", "jsonl", "png", "checkpoint", "lock")


def write_everything(root: Path) -> dict[str, list[Path]]:
    kinds: dict[str, list[Path]] = {}
    for writer in WRITERS:
        for kind, paths in writer(root).items():
            kinds.setdefault(kind, []).extend(paths)
    return kinds


# ------------------------------------------------------------------------------ tests
@pytest.mark.parametrize(
    ("mask", "file", "directory"), [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)]
)
def test_every_artifact_has_the_umask_mode(tmp_path, mask, file, directory):
    with umask(mask):
        kinds = write_everything(tmp_path)
    assert set(kinds) == {*FILE_KINDS, "dir"}
    got = {str(p.relative_to(tmp_path)): oct(mode(p)) for paths in kinds.values() for p in paths}
    want = {
        str(p.relative_to(tmp_path)): oct(directory if kind == "dir" else file)
        for kind, paths in kinds.items()
        for p in paths
    }
    assert got == want
    # No temporary file or directory is left behind anywhere.
    leftovers = [p for p in tmp_path.rglob("*") if p.name.endswith((".tmp", ".tmp.png"))]
    assert leftovers == []
