"""A directory of the user's is never replaced: every writer of a whole directory (averaged
checkpoints, demo and evaluation data, paper stand-ins, packed datasets) refuses one it did not
write, in one line naming it, and leaves every file in it as it was (anchorctx.io's
``check_replaceable``). Its own earlier output is still replaced (re-runs, ``--force``); a full
disk names the file and the space needed; two writers of one directory: one is refused."""

from __future__ import annotations

import errno
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from anchorctx import io as aio
from anchorctx.cli import main
from anchorctx.io import (
    OWNER_FILE,
    DirectoryOwner,
    DiskFullError,
    ForeignDirectoryError,
    WriterLock,
    check_replaceable,
    owned_directory,
)

REPO = Path(__file__).resolve().parents[1]
OWNER = DirectoryOwner("tester", "a test output", "run-a")


# ------------------------------------------------------------------------------- helpers
def user_dir(path: Path) -> dict[str, bytes]:
    """A directory of someone's own files (a thesis, real weights, real benchmark data);
    returns its content to compare with afterwards."""
    (path / "models" / "Llama-2-7b-hf").mkdir(parents=True)
    (path / "data" / "ruler").mkdir(parents=True)
    (path / "thesis.tex").write_text("\\chapter{Results}\n")
    (path / "models" / "Llama-2-7b-hf" / "model.safetensors").write_bytes(b"real weights")
    (path / "data" / "ruler" / "PaulGrahamEssays.json").write_text('{"text": "real"}')
    return snapshot(path)


def snapshot(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def fake_checkpoint(path: Path, step: int, value: float) -> Path:
    """The least an averaged checkpoint needs: config.json, one safetensors file, the step."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    save_file({"w": torch.full((2, 2), value)}, str(path / "model.safetensors"))
    (path / "config.json").write_text("{}")
    (path / "anchorctx.json").write_text(json.dumps({"step": step}))
    return path


def run_checkpoints(run_dir: Path) -> list[Path]:
    return [fake_checkpoint(run_dir / "checkpoints" / f"step-{s:06d}", s, float(s)) for s in (1, 2)]


def config_file(tmp_path: Path, **extra: object) -> Path:
    """A minimal experiment config whose run directory is ``<tmp>/runs/exp/anchor``."""
    body = {
        "name": "exp",
        "run_root": str(tmp_path / "runs"),
        "variant": "anchor",
        "model": {"path": str(tmp_path / "model")},
        **extra,
    }
    path = tmp_path / "exp.yaml"
    path.write_text(json.dumps(body))
    return path


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


# ------------------------------------------------------------------------- the one rule
def test_absent_and_empty_directories_are_written(tmp_path):
    for final in (tmp_path / "new", tmp_path / "empty"):
        if final.name == "empty":
            final.mkdir()
        with owned_directory(final, OWNER) as tmp:
            (tmp / "a.txt").write_text("a")
        assert (final / "a.txt").read_text() == "a"
        assert json.loads((final / OWNER_FILE).read_text())["writer"] == "tester"


def test_own_output_is_replaced_and_nothing_else(tmp_path):
    final = tmp_path / "out"
    with owned_directory(final, OWNER) as tmp:
        (tmp / "a.txt").write_text("first")
    with owned_directory(final, OWNER) as tmp:  # a re-run of the same writer, same identity
        (tmp / "a.txt").write_text("second")
    assert (final / "a.txt").read_text() == "second"
    for other in (
        DirectoryOwner("tester", "a test output", "run-b"),  # another run's output
        DirectoryOwner("someone-else", "a test output", "run-a"),  # another writer's
    ):
        with pytest.raises(ForeignDirectoryError, match=re.escape(str(final))):
            check_replaceable(final, other)
    (final / "a.txt").unlink()  # a file of ours deleted since: nothing of anyone's is lost
    check_replaceable(final, OWNER)


@pytest.mark.parametrize("change", ["added", "edited", "link"])
def test_a_file_put_into_our_output_makes_it_the_users(tmp_path, change):
    final = tmp_path / "out"
    with owned_directory(final, OWNER) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "ours.txt").write_text("ours")
    if change == "added":
        (final / "sub" / "notes.md").write_text("mine")
        name = "sub/notes.md"
    elif change == "edited":
        (final / "sub" / "ours.txt").write_text("replaced by the real file")
        name = "sub/ours.txt"
    else:
        (final / "sub" / "mine").symlink_to(tmp_path)
        name = "sub/mine"
    before = snapshot(final)
    with pytest.raises(ForeignDirectoryError, match=re.escape(name)), owned_directory(final, OWNER):
        pytest.fail("refused before any work")
    assert snapshot(final) == before


def test_nested_owned_directories_answer_for_their_own_files(tmp_path):
    inner = DirectoryOwner("inner", "an inner output")
    final = tmp_path / "out"
    with owned_directory(final, OWNER) as tmp, owned_directory(tmp / "nested", inner) as sub:
        (sub / "x.txt").write_text("x")
    check_replaceable(final, OWNER)
    (final / "nested" / "y.txt").write_text("the user's")
    with pytest.raises(ForeignDirectoryError, match=r"nested/y\.txt"):
        check_replaceable(final, OWNER)


def test_a_file_or_link_is_never_a_directory_to_replace(tmp_path):
    (tmp_path / "f").write_text("mine")
    (tmp_path / "link").symlink_to(tmp_path / "f")
    for target in ("f", "link"):
        with pytest.raises(ForeignDirectoryError, match="not a directory"):
            check_replaceable(tmp_path / target, OWNER)
    assert (tmp_path / "f").read_text() == "mine"


def test_files_put_in_while_writing_are_kept(tmp_path):
    """Checked again just before the swap: a file that appeared meanwhile is not lost."""
    final = tmp_path / "out"
    with (
        pytest.raises(ForeignDirectoryError, match=r"late\.txt"),
        owned_directory(final, OWNER) as tmp,
    ):
        (tmp / "a.txt").write_text("a")
        final.mkdir()
        (final / "late.txt").write_text("mine")
    assert (final / "late.txt").read_text() == "mine"


def test_full_disk_names_the_file_and_the_space_needed(tmp_path):
    final = tmp_path / "out"
    with (
        pytest.raises(DiskFullError) as caught,
        owned_directory(final, OWNER, needs=3 << 30) as tmp,
    ):
        (tmp / "model.safetensors").write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")  # as a failed write() says
    text = str(caught.value)
    assert str(final / "model.safetensors") in text and "about 3.00 GiB" in text
    assert "GiB free" in text and not final.exists()
    assert caught.value.exit_code == 1


def test_atomic_write_names_the_file_on_a_full_disk(tmp_path, monkeypatch):
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(aio.os, "fsync", full)
    with pytest.raises(OSError, match=re.escape(str(tmp_path / "r.json"))) as caught:
        aio.atomic_write_json(tmp_path / "r.json", {"a": 1})
    assert caught.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind


# ----------------------------------------------- every writer of a directory, on the user's
def _library_writers(tmp_path: Path) -> dict[str, Callable[[Path], object]]:
    from anchorctx.demo.corpus import write_demo_corpus
    from anchorctx.demo.fixtures import write_eval_fixtures, write_ruler_fixtures
    from anchorctx.demo.heldout_eval import write_heldout_eval
    from anchorctx.demo.paper_assets import write_paper_assets
    from anchorctx.demo.pretrain_corpus import write_pretrain_corpus
    from anchorctx.evaluation.stacked_report import write_stacked_report
    from anchorctx.evaluation.weights import average_weights

    ckpts = run_checkpoints(tmp_path / "runs" / "exp" / "anchor")
    return {
        "average_weights": lambda d: average_weights(ckpts, d, progress=False),
        "write_eval_fixtures": lambda d: write_eval_fixtures(d, essay_words=200),
        "write_ruler_fixtures": write_ruler_fixtures,
        "write_heldout_eval": lambda d: write_heldout_eval(d, essay_words=200, items=2),
        "write_demo_corpus": lambda d: write_demo_corpus(d, docs_per_domain=1, progress=False),
        "write_pretrain_corpus": lambda d: write_pretrain_corpus(d, documents=2),
        "write_paper_assets": lambda d: write_paper_assets(d, tiny=True, progress=False),
        # no experiments: an empty report, so only the directory rule is exercised
        "write_stacked_report": lambda d: write_stacked_report([], d),
    }


LIBRARY_WRITERS = [
    "average_weights",
    "write_eval_fixtures",
    "write_ruler_fixtures",
    "write_heldout_eval",
    "write_demo_corpus",
    "write_pretrain_corpus",
    "write_paper_assets",
    "write_stacked_report",
]


@pytest.mark.parametrize("writer", LIBRARY_WRITERS)
def test_library_writer_refuses_a_users_directory(tmp_path, writer):
    mine = tmp_path / "mine"
    mine.mkdir()
    before = user_dir(mine)
    with pytest.raises(ForeignDirectoryError, match=re.escape(str(mine))):
        _library_writers(tmp_path)[writer](mine)
    assert snapshot(mine) == before


def test_prepare_data_refuses_a_users_output_dir(tiny_config, tmp_path):
    from anchorctx.packing import prepare_data

    mine = tmp_path / "mine"
    mine.mkdir()
    before = user_dir(mine)
    (mine / "manifest.json").write_text("{}")  # a file named like the dataset's own marker
    before = snapshot(mine)
    cfg = tiny_config.model_copy(
        update={"data": tiny_config.data.model_copy(update={"output_dir": str(mine)})}
    )
    with pytest.raises(ForeignDirectoryError, match=re.escape(str(mine))):
        prepare_data(cfg, progress=False)
    assert snapshot(mine) == before


@pytest.mark.parametrize("key", ["demo_fixtures", "heldout_data"])
def test_config_named_evaluation_data_refuses_a_users_directory(tmp_path, key):
    """Row 3: ``evaluation.demo_fixtures`` / ``evaluation.heldout_data`` pointed at a
    directory of the user's: refused before anything is written."""
    from anchorctx.demo.fixtures import ensure_eval_fixtures
    from anchorctx.demo.heldout_eval import ensure_heldout_eval
    from anchorctx.experiment import load_config

    mine = tmp_path / "mine"
    mine.mkdir()
    user_dir(mine)
    (mine / "manifest.json").write_text("% not JSON: the user's own file of that name\n")
    before = snapshot(mine)
    cfg = load_config(config_file(tmp_path), [f"evaluation.{key}={mine}"])
    ensure = ensure_eval_fixtures if key == "demo_fixtures" else ensure_heldout_eval
    with pytest.raises(ForeignDirectoryError, match=re.escape(str(mine))):
        ensure(cfg)
    assert snapshot(mine) == before


def _commands(tmp_path: Path, mine: Path) -> dict[str, list[str]]:
    cfg = str(config_file(tmp_path))
    return {
        "average-weights": ["average-weights", cfg, "--out", str(mine)],
        "demo-assets": ["demo-assets", "--paper", str(mine), "--tiny", "--quiet"],
        "evaluate": ["evaluate", cfg, "--set", f"evaluation.demo_fixtures={mine}"],
        "demo-corpus": ["demo-corpus", str(mine), "--quiet"],
    }


@pytest.mark.parametrize("command", ["average-weights", "demo-assets", "evaluate", "demo-corpus"])
def test_command_refuses_a_users_directory_in_one_line(tmp_path, capsys, command):
    mine = tmp_path / "thesis"
    mine.mkdir()
    before = user_dir(mine)
    run_checkpoints(tmp_path / "runs" / "exp" / "anchor")
    code = main(_commands(tmp_path, mine)[command])
    line = one_line(capsys.readouterr().err)
    assert code in (1, 2) and str(mine) in line and "thesis.tex" in line, (code, line)
    assert snapshot(mine) == before
    assert not (tmp_path / ".thesis.lock").exists()  # nothing left beside it either


def test_every_directory_writer_is_walked_here():
    """A new writer of whole directories must join the walk above (or say why not)."""
    covered = {
        "anchorctx/evaluation/weights.py",
        "anchorctx/evaluation/stacked_report.py",
        "anchorctx/demo/fixtures.py",
        "anchorctx/demo/heldout_eval.py",
        "anchorctx/demo/corpus.py",
        "anchorctx/demo/pretrain_corpus.py",
        "anchorctx/demo/paper_assets.py",
        "anchorctx/packing/pipeline.py",
    }
    exempt = {
        "anchorctx/io.py": "the definitions",
        # step-NNNNNN directories inside the run's own checkpoints/, under the run lock; the
        # run directory itself is moved aside by `train --force`, never deleted
        "anchorctx/training/checkpoints.py": "run-internal",
    }
    pattern = re.compile(r"\b(atomic_directory|owned_directory|claim_directory)\(")
    found = {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "anchorctx").rglob("*.py")
        if pattern.search(p.read_text())
    }
    assert found - set(exempt) == covered


# -------------------------------------------------------------- row 1: average-weights
def test_average_weights_replaces_only_its_own_output_for_the_same_run(tmp_path, capsys):
    cfg = str(config_file(tmp_path))
    run = tmp_path / "runs" / "exp" / "anchor"
    run_checkpoints(run)
    assert main(["average-weights", cfg, "--last-k", "2"]) == 0
    out = run / "averaged" / "averaged-last-2"
    assert main(["average-weights", cfg, "--last-k", "2"]) == 0  # a re-run replaces its own
    assert json.loads((out / OWNER_FILE).read_text())["identity"] == str(run.resolve())
    # The run directory itself (what --out DIR replaced before): refused, intact.
    before = snapshot(run)
    capsys.readouterr()
    assert main(["average-weights", cfg, "--out", str(run)]) == 2
    assert str(run) in one_line(capsys.readouterr().err)
    assert snapshot(run) == before
    # Another run's averaged checkpoint is not this run's to replace.
    other = tmp_path / "runs" / "exp" / "base"
    run_checkpoints(other)
    assert main(["average-weights", cfg, "--run-dir", str(other), "--out", str(out)]) == 2
    assert "for " + str(run.resolve()) in one_line(capsys.readouterr().err)


def test_average_weights_takes_the_run_lock(tmp_path, capsys):
    cfg = str(config_file(tmp_path))
    run = tmp_path / "runs" / "exp" / "anchor"
    run_checkpoints(run)
    with WriterLock.beside(run, f"run directory {run}"):  # a training run holds it
        assert main(["average-weights", cfg]) == 1
    assert "being written by another process" in one_line(capsys.readouterr().err)
    assert not (run / "averaged").exists()
    assert main(["average-weights", cfg]) == 0


@pytest.mark.parametrize("name", ["model.safetensors", "model.safetensors.index.json"])
def test_average_weights_names_a_corrupt_safetensors_file(tmp_path, capsys, name):
    cfg = str(config_file(tmp_path))
    run = tmp_path / "runs" / "exp" / "anchor"
    bad = run_checkpoints(run)[1] / name
    bad.write_bytes(b"\xff" * 64)
    assert main(["average-weights", cfg]) == 2
    err = capsys.readouterr().err.replace("\r", "\n")  # tqdm's bar redraws with \r
    line = one_line("\n".join(t for t in err.splitlines() if "averaging shards" not in t))
    assert str(bad) in line and "not a safetensors" in line.replace("readable ", ""), line


# ----------------------------------------------------------------- row 2: demo-assets
@pytest.fixture(scope="module")
def assets_root(tmp_path_factory) -> Path:
    from anchorctx.demo.paper_assets import write_paper_assets

    root = tmp_path_factory.mktemp("assets") / "paper"
    write_paper_assets(root, tiny=True, progress=False)
    return root


def test_demo_assets_rerun_and_force_keep_working(assets_root, capsys):
    assert main(["demo-assets", "--paper", str(assets_root), "--tiny", "--quiet"]) == 0
    assert main(["demo-assets", "--paper", str(assets_root), "--tiny", "--quiet", "--force"]) == 0
    assert (assets_root / "assets.json").is_file()


@pytest.mark.parametrize(
    "rel",
    [
        "models/Llama-2-7b-hf/model-00001-of-00002.safetensors",  # real weights copied over ours
        "data/mmlu/test/abstract_algebra.jsonl",  # the real benchmark file put in its place
        "models/my-model/config.json",  # a model of the user's beside ours
        "paper-assets.yaml",  # edited by hand
    ],
)
def test_demo_assets_never_replaces_a_file_it_did_not_write(assets_root, capsys, rel, tmp_path):
    import shutil

    root = tmp_path / "paper"
    shutil.copytree(assets_root, root, symlinks=True)  # copy2 keeps the recorded mtimes
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_bytes(b"the user's real file")
    before = snapshot(root)
    capsys.readouterr()
    assert main(["demo-assets", "--paper", str(root), "--tiny", "--quiet", "--force"]) == 2
    line = one_line(capsys.readouterr().err)
    assert Path(rel).name in line, line
    assert snapshot(root) == before


def test_second_demo_assets_writer_is_refused_in_one_line(tmp_path, capsys):
    root = tmp_path / "paper"
    with WriterLock.beside(root, f"paper assets directory {root}"):  # the first writer
        assert main(["demo-assets", "--paper", str(root), "--tiny", "--quiet"]) == 1
    line = one_line(capsys.readouterr().err)
    assert "being written by another process" in line and str(root) in line
    assert not root.exists() or not any(root.iterdir())


def test_demo_assets_on_a_full_disk_names_the_file_and_the_space(tmp_path, capsys, monkeypatch):
    """Row 12: the write of a weight shard fails as a full disk fails it."""
    from anchorctx.demo import model_files

    def write_until_full(path: Path, entries: list, pieces) -> int:
        with path.open("wb") as fh:
            fh.write(b"\0" * 64)
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(model_files, "write_safetensors", write_until_full)
    root = tmp_path / "paper"
    assert main(["demo-assets", "--paper", str(root), "--tiny", "--quiet"]) == 1
    line = one_line(capsys.readouterr().err)
    shard = root / "models" / "Llama-2-7b-hf" / "model-00001-of-00002.safetensors"
    assert str(shard) in line and "no space left on device" in line, line
    assert re.search(r"needs about \d+\.\d+ GiB \(\d+\.\d+ GiB free\)", line), line
    assert not (root / "models" / "Llama-2-7b-hf").exists()
