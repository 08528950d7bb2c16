"""Reliability: one writer per output, no silent restarts, one-line errors, honest skip counts,
results keyed by checkpoint identity, verified caches, safe loading, umask modes, variant checks.

One test (or a few) per row of the fault-injection table that motivated these rules, plus a
property-based test of the corpus readers on random and corrupted JSONL/zstd input.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zstandard
from distributed import torch_extensions  # noqa: F401  (fixture)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_eval_core_results import NUM_SAMPLES, FakeSuite, save_tiny_checkpoint

from anchorctx.cli import main
from anchorctx.config import ConfigError, dump_config
from anchorctx.evaluation import results
from anchorctx.evaluation.results import (
    CheckpointLoadError,
    EvaluationError,
    Suite,
    eval_dir,
    evaluate_checkpoint,
    result_is_intact,
    result_path,
)
from anchorctx.experiment import config_from_dict
from anchorctx.io import (
    LockHeldError,
    WriterLock,
    atomic_directory,
    atomic_write_text,
    file_mode,
    sha256_file,
)
from anchorctx.models.checkpoints import list_checkpoints
from anchorctx.packing.settings import SourceConfig
from anchorctx.packing.sources import BadInput, DataError, read_file
from anchorctx.training import checkpoints as ckpt
from anchorctx.training.launch import launch
from anchorctx.training.loop import restart_state, train
from anchorctx.training.plan import ResumeStateError, TrainingError, plan_parallelism


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def _one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert err.startswith(f"anchorctx {command}: "), err
    return err


# ------------------------------------------------------------------------- the writer lock
HOLD = """
import sys, time
from anchorctx.io import WriterLock
lock = WriterLock(sys.argv[1], "test output").acquire()
print("held", flush=True)
time.sleep(60)
"""


@pytest.fixture
def holder(tmp_path):
    """Start a process that holds a lock file; yields (start(path), its Popen)."""
    procs: list[subprocess.Popen] = []

    def start(path: Path) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_second_writer_fails_at_once_naming_the_holder(tmp_path, holder):
    path = tmp_path / ".out.lock"
    proc = holder(path)
    started = time.monotonic()
    with pytest.raises(LockHeldError, match=rf"pid {proc.pid} on host {os.uname().nodename}"):
        WriterLock(path, "test output").acquire()
    assert time.monotonic() - started < 2  # no waiting
    proc.kill()  # the OS releases the lock of a dead process: no stale lock
    proc.wait()
    # A second acquisition in one process is refused too.
    with WriterLock(path, "test output"), pytest.raises(LockHeldError):
        WriterLock(path, "test output").acquire()
    WriterLock(path, "test output").acquire().release()  # released on exit


LAUNCH = """
import subprocess, sys
from anchorctx.io import WriterLock
lock = WriterLock(sys.argv[1], "run").acquire()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=(lock.fd,),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(child.pid, flush=True)
"""


def test_lock_is_inherited_by_a_launched_child(tmp_path):
    """A launcher passes its lock to the process group: held while any of it lives, even when
    the launcher itself was killed."""
    path = tmp_path / ".run.lock"
    out = subprocess.run(
        [sys.executable, "-c", LAUNCH, str(path)], capture_output=True, text=True, check=True
    )
    child = int(out.stdout.strip())
    try:
        with pytest.raises(LockHeldError, match="it has exited, but processes it launched"):
            WriterLock(path, "run").acquire()
    finally:
        os.kill(child, 9)
    deadline = time.monotonic() + 10
    while True:  # the child is not ours to wait for: poll until the OS has released the lock
        try:
            WriterLock(path, "run").acquire().release()
            break
        except LockHeldError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


# --------------------------------------------------------------------- a real tiny training
def _cfg(tiny_config, packed_demo, name: str, steps: int = 2):
    raw = tiny_config.model_dump(mode="json")
    raw["name"] = name
    # The session's packed dataset: with the data config unchanged (seq_len included) its
    # fingerprint matches, so it is reused as is and never rebuilt into this shared directory.
    raw["data"]["output_dir"] = str(packed_demo)
    raw["training"].update(steps=steps, lr=1e-3, warmup_steps=1)
    return config_from_dict(raw)


@pytest.fixture(scope="module")
def trained(tiny_config, packed_demo, torch_extensions):  # noqa: F811
    """A finished 2-step run (checkpoint and resume state at step 2), written under umask 022."""
    cfg = _cfg(tiny_config, packed_demo, "reliable")
    manifest = (packed_demo / "manifest.json").read_text()
    with umask(0o022):
        train(cfg)  # prepares its data through the config: must find the shared dataset
    assert (packed_demo / "manifest.json").read_text() == manifest
    return cfg


def _clone(trained, tiny_config, packed_demo, name: str, steps: int = 2):
    """A copy of the trained run under another experiment name (same resume fingerprint)."""
    cfg = _cfg(tiny_config, packed_demo, name, steps)
    shutil.rmtree(cfg.experiment_dir, ignore_errors=True)
    shutil.copytree(trained.run_dir, cfg.run_dir)
    return cfg


def test_two_trainings_of_one_run_directory(trained, tiny_config, packed_demo, holder, capsys):
    cfg = _cfg(tiny_config, packed_demo, "busy")
    proc = holder(cfg.run_dir.parent / f".{cfg.run_dir.name}.lock")
    config = cfg.run_dir.parent / "config.yaml"
    dump_config(cfg, config)
    assert main(["train", str(config), "--set", "training.lr=0.01"]) == 1
    err = _one_line_error(capsys, "train")
    assert f"pid {proc.pid}" in err and "being written by another process" in err
    assert not cfg.run_dir.exists()  # nothing was written


def test_resume_state_without_checkpoints_needs_resume_or_force(trained, tiny_config, packed_demo):
    cfg = _clone(trained, tiny_config, packed_demo, "nockpt")
    shutil.rmtree(cfg.run_dir / "checkpoints")  # most of a paper run: checkpoints come last
    metrics = (cfg.run_dir / "metrics.jsonl").read_text()
    par = plan_parallelism(cfg)
    with pytest.raises(TrainingError, match=r"resume state.*--resume, or start over with --force"):
        restart_state(cfg, par, resume=False)
    with pytest.raises(TrainingError, match="--resume"):
        launch(cfg)
    assert (cfg.run_dir / "metrics.jsonl").read_text() == metrics  # nothing truncated
    assert restart_state(cfg, par, resume=True).step == 2
    # --force starts over, moving the earlier run aside (never deleting it).
    assert launch(cfg, force=True) == 0
    aside = [
        p for p in cfg.experiment_dir.iterdir() if p.name.startswith(f"{cfg.run_dir.name}.old-")
    ]
    assert len(aside) == 1 and (aside[0] / "resume" / "trainer.json").is_file()
    assert (aside[0] / "metrics.jsonl").read_text() == metrics
    rows = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2]


@pytest.mark.parametrize("leftover", [".resume.old", ".resume.partial"])
def test_interrupted_resume_swap_is_recovered(trained, tiny_config, packed_demo, leftover):
    cfg = _clone(trained, tiny_config, packed_demo, f"swap{leftover[8:]}")
    os.replace(cfg.run_dir / "resume", cfg.run_dir / leftover)  # crash between the renames
    assert launch(cfg, resume=True) == 0  # recovered, found complete at step 2
    assert (cfg.run_dir / "resume" / "trainer.json").is_file()
    assert not (cfg.run_dir / leftover).exists()


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _engine_file(run_dir: Path) -> Path:
    return max((run_dir / "resume" / "engine").rglob("*.pt"), key=lambda p: p.stat().st_size)


CORRUPTIONS = {
    "truncated trainer.json": (lambda d: _truncate(d / "resume" / "trainer.json"), "trainer.json"),
    "zero-byte rng file": (
        lambda d: (d / "resume" / "rng-rank00000.json").write_bytes(b""),
        r"rng-rank00000\.json: 0 bytes",
    ),
    "truncated engine file": (lambda d: _truncate(_engine_file(d)), r"engine/.*\.pt: \d+ bytes"),
    "missing engine/": (lambda d: shutil.rmtree(d / "resume" / "engine"), r"engine/.*: missing"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_resume_state_is_one_error_naming_the_file(
    trained, tiny_config, packed_demo, case, capsys
):
    cfg = _clone(trained, tiny_config, packed_demo, "corrupt-" + case.split()[-1].strip("/"))
    damage, pattern = CORRUPTIONS[case]
    damage(cfg.run_dir)
    with pytest.raises(ResumeStateError, match=pattern) as err:
        restart_state(cfg, plan_parallelism(cfg), resume=True)
    assert "newest complete checkpoint is" in str(err.value) and "step-000002" in str(err.value)
    config = cfg.experiment_dir / "config.yaml"
    dump_config(cfg, config)
    assert main(["train", str(config), "--resume"]) == 1  # runtime: the files are bad
    assert "corrupt resume state" in _one_line_error(capsys, "train")


def test_engine_state_deepspeed_cannot_load_is_named(trained, tiny_config, packed_demo):
    """Same size, garbage bytes: only DeepSpeed notices; its error is wrapped, naming engine/."""
    cfg = _clone(trained, tiny_config, packed_demo, "garbage", steps=3)
    path = _engine_file(cfg.run_dir)
    path.write_bytes(b"\0" * path.stat().st_size)
    trainer_path = cfg.run_dir / "resume" / "trainer.json"
    trainer = json.loads(trainer_path.read_text())
    rel = path.relative_to(cfg.run_dir / "resume").as_posix()
    pristine = trainer["files"][rel]["sha256"]
    with pytest.raises(ResumeStateError, match=rf"{rel}: its content is not what this run wrote"):
        train(cfg, resume=True, data_dir=Path(cfg.data.output_dir))
    # Its hash re-recorded too (by hand or by an attacker): DeepSpeed's error, named.
    trainer["files"][rel]["sha256"] = sha256_file(path)
    trainer_path.write_text(json.dumps(trainer))
    assert trainer["files"][rel]["sha256"] != pristine
    with pytest.raises(ResumeStateError, match=r"resume/engine: DeepSpeed cannot load it"):
        train(cfg, resume=True, data_dir=Path(cfg.data.output_dir))


def test_resume_state_needs_no_pickle(trained):
    resume = trained.run_dir / "resume"
    assert not list(resume.glob("rng-*.pt"))
    state = json.loads((resume / "rng-rank00000.json").read_text())  # plain JSON
    import random

    import numpy as np
    import torch

    def draw():
        return random.random(), np.random.rand(), torch.rand(1).item()

    ckpt.set_rng_state(state)
    first = draw()
    assert draw() != first
    ckpt.set_rng_state(state)
    assert draw() == first  # the state round-trips exactly through JSON
    tree = ast.parse(Path(ckpt.__file__).read_text())
    assert not [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and n.attr == "load"
        and isinstance(n.value, ast.Name)
        and n.value.id in ("torch", "pickle")
    ]
    # (DeepSpeed's own engine files are the documented exception: see checkpoints.py.)


def test_outputs_follow_the_umask(trained, tmp_path):
    run = trained.run_dir
    ck = list_checkpoints(run)[-1]
    for path in (
        run / "config.yaml",
        run / "manifest.json",
        ck / "model.safetensors",
        ck / "anchorctx.json",
        run / "resume" / "trainer.json",
    ):
        assert _mode(path) == 0o644, path
    assert _mode(ck) == 0o755 and _mode(run / "resume") == 0o755
    with umask(0o027):  # a group-shared cluster setting: neither 0600 nor 0644
        atomic_write_text(tmp_path / "a.json", "{}")
        with atomic_directory(tmp_path / "d") as tmp:
            (tmp / "x").write_text("x")
    assert _mode(tmp_path / "a.json") == 0o640 and _mode(tmp_path / "d") == 0o750


# ---------------------------------------------------------------------- corpus readers
def _zst(lines: list[bytes]) -> bytes:
    return zstandard.ZstdCompressor().compress(b"".join(lines))


def _doc(i: int) -> bytes:
    # ~2 KB each: 150 documents span several zstd blocks (128 KiB of output at most), so a
    # damaged file has a readable start whose documents must be counted as lost.
    rec = {"text": f"document {i} " * 150, "meta": {"redpajama_set_name": "RedPajamaBook"}}
    return json.dumps(rec).encode() + b"\n"


def _read(path: Path, skip: bool = True):
    bad = BadInput(skip=skip)
    records = list(read_file(SourceConfig(path=path), path, 0, bad, None))
    return records, bad


@pytest.mark.parametrize("damage", ["truncated", "corrupt frame"])
def test_damaged_zstd_file_counts_what_is_lost(tmp_path, damage):
    data = _zst([_doc(i) for i in range(150)])
    if damage == "truncated":  # a download cut short, inside the last block
        data = data[:-30]
    else:  # garbage in the last block (the first blocks are readable)
        data = data[:-40] + bytes(b ^ 0xFF for b in data[-40:-30]) + data[-30:]
    path = tmp_path / "part.jsonl.zst"
    path.write_bytes(data)
    records, bad = _read(path)
    assert records == []  # all or nothing: no partial file skews the mixture
    assert bad.counts["unreadable_file"] == 1 and "invalid_json" not in bad.counts
    assert 0 < bad.counts["lost_documents"] < 150
    assert "no document of this file is used" in bad.examples["unreadable_file"]
    with pytest.raises(DataError, match=r"part\.jsonl\.zst: cannot read file"):
        _read(path, skip=False)


def test_multi_frame_zstd_file_is_read_whole(tmp_path):
    path = tmp_path / "frames.jsonl.zst"
    path.write_bytes(_zst([_doc(i) for i in range(3)]) + _zst([_doc(i) for i in range(3, 7)]))
    records, bad = _read(path)
    assert [r.line for r in records] == list(range(1, 8)) and not bad.counts


def test_lone_surrogate_is_a_counted_skip_naming_the_line(tmp_path):
    path = tmp_path / "s.jsonl"
    bad_line = b'{"text": "ok \\ud800 not", "meta": {"redpajama_set_name": "RedPajamaBook"}}\n'
    path.write_bytes(_doc(0) + bad_line + _doc(2))
    records, bad = _read(path)
    assert [r.line for r in records] == [1, 3]
    assert bad.counts == {"undecodable_text": 1}
    assert bad.examples["undecodable_text"].startswith(f"{path}:2: ")
    with pytest.raises(DataError, match=rf"{path}:2: .*not valid Unicode"):
        _read(path, skip=False)


LINE_KINDS = st.one_of(
    st.builds(lambda t: {"text": t, "meta": {"redpajama_set_name": "Book"}}, st.text(max_size=30)),
    st.builds(lambda t: {"text": t}, st.text(max_size=10)),  # no domain
    st.builds(
        lambda v: {"text": v, "meta": {"redpajama_set_name": "Book"}},
        st.one_of(st.integers(), st.none(), st.lists(st.integers(), max_size=2)),
    ),
    st.just({"meta": {"redpajama_set_name": "Book"}}),  # no text
    st.just("surrogate"),
    st.binary(max_size=20),  # arbitrary bytes: mostly invalid JSON or invalid UTF-8
)


def _encode(kind) -> bytes:
    if kind == "surrogate":
        return b'{"text": "x\\udc00", "meta": {"redpajama_set_name": "Book"}}'
    if isinstance(kind, bytes):
        return kind.replace(b"\n", b" ")
    return json.dumps(kind).encode()


# Derandomized and without an example database: the same examples on every run, no files left.
@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    kinds=st.lists(LINE_KINDS, max_size=25),
    compressed=st.booleans(),
    damage=st.one_of(st.none(), st.tuples(st.sampled_from(["cut", "flip"]), st.floats(0, 1))),
)
def test_readers_account_for_every_line(tmp_path_factory, kinds, compressed, damage):
    """No crash on any input, and every input line is either a record (to be packed) or
    exactly one counted skip; a damaged compressed file yields nothing and is counted."""
    raw = b"".join(_encode(k) + b"\n" for k in kinds)
    data = zstandard.ZstdCompressor(write_checksum=True).compress(raw) if compressed else raw
    if damage is not None and data:
        how, where = damage
        at = min(int(where * len(data)), len(data) - 1)
        data = data[:at] if how == "cut" else data[:at] + bytes([data[at] ^ 0x5A]) + data[at + 1 :]
    path = tmp_path_factory.mktemp("prop") / ("in.jsonl.zst" if compressed else "in.jsonl")
    path.write_bytes(data)
    try:  # an independent decoder decides what the file really holds
        content = (
            zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 20)
            if compressed
            else data
        )
    except zstandard.ZstdError:
        content = None
    records, bad = _read(path)
    if content is None:
        assert records == [] and bad.counts["unreadable_file"] == 1
        assert bad.counts["lost_documents"] <= len(kinds)
        return
    lines = list(io.BytesIO(content))
    nonblank = [i for i, line in enumerate(lines, start=1) if line.strip()]
    per_line = sum(n for r, n in bad.counts.items() if r not in ("unreadable_file",))
    assert len(records) + per_line == len(nonblank)
    assert {r.line for r in records} <= set(nonblank)


# --------------------------------------------------------------------- one-line CLI errors
def test_list_index_override_is_a_config_error(capsys):
    assert main(["config", "configs/demo.yaml", "--set", "data.sources.5.path=x"]) == 2
    assert "data.sources is a list of 1 entry" in _one_line_error(capsys, "config")


def test_unwritable_run_root_is_one_line(tiny_config, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    raw = tiny_config.model_dump(mode="json") | {"run_root": str(blocker / "runs")}
    config = tmp_path / "c.yaml"
    dump_config(config_from_dict(raw), config)
    assert main(["train", str(config)]) == 1
    assert "Not a directory" in _one_line_error(capsys, "train")


def test_foreign_errors_are_one_line_and_traceback_only_with_debug(monkeypatch, capsys):
    def denied(cfg, **kwargs):
        raise PermissionError(13, "Permission denied", "/shared/runs/demo")

    monkeypatch.setattr("anchorctx.training.launch.launch", denied)
    assert main(["train", "configs/demo.yaml"]) == 1
    assert _one_line_error(capsys, "train") == (
        "anchorctx train: Permission denied: /shared/runs/demo"
    )
    monkeypatch.setattr("anchorctx.training.launch.launch", lambda cfg, **kw: {}["x"])
    assert main(["--debug", "train", "configs/demo.yaml"]) == 1
    assert "Traceback" in capsys.readouterr().err


# ----------------------------------------------------------------------- evaluation results
@pytest.fixture
def fake(monkeypatch) -> FakeSuite:
    suite = FakeSuite()
    monkeypatch.setitem(results.SUITES, "fake", Suite(suite))
    results.clear_model_cache()
    yield suite
    results.clear_model_cache()


def _eval_cfg(tmp_path, checkpoint):
    return config_from_dict(
        {
            "name": "t",
            "run_root": str(tmp_path),  # the checkpoint's run lies inside run_root
            "model": {"path": str(checkpoint)},
            "evaluation": {"device": "cpu", "dtype": "float32"},
        }
    )


def test_same_named_checkpoints_in_different_folders_keep_their_results(tmp_path, fake):
    a = save_tiny_checkpoint(tmp_path / "exp" / "left" / "model", seed=0)
    b = save_tiny_checkpoint(tmp_path / "exp" / "right" / "model", seed=1)
    assert eval_dir(a) != eval_dir(b) and eval_dir(a).parent == eval_dir(b).parent
    cfg = _eval_cfg(tmp_path, a)
    ra = json.loads(evaluate_checkpoint(cfg, a, "fake", progress=False).read_text())
    rb = json.loads(evaluate_checkpoint(cfg, b, "fake", progress=False).read_text())
    assert ra["checkpoint_hash"] != rb["checkpoint_hash"]
    assert json.loads(result_path(a, "fake").read_text()) == ra  # not overwritten by b
    run_ckpt = save_tiny_checkpoint(tmp_path / "run" / "checkpoints" / "step-000001", seed=0)
    assert eval_dir(run_ckpt) == (tmp_path / "run" / "eval" / "step-000001").resolve()


def test_hand_edited_result_is_not_served_from_cache(tmp_path, fake):
    ck = save_tiny_checkpoint(tmp_path / "run" / "checkpoints" / "step-000001", seed=0, step=1)
    cfg = _eval_cfg(tmp_path, ck)
    out = evaluate_checkpoint(cfg, ck, "fake", progress=False)
    honest = json.loads(out.read_text())
    assert _mode(out) == file_mode()  # readable per the umask, not 0600
    assert evaluate_checkpoint(cfg, ck, "fake", progress=False) == out and fake.calls == 1
    assert result_is_intact(ck, "fake")
    edited = json.loads(out.read_text())
    edited["scores"]["alpha"]["4096"] = 99.9
    out.write_text(json.dumps(edited))
    assert not result_is_intact(ck, "fake")  # the orchestration refreshes its cached task
    again = json.loads(evaluate_checkpoint(cfg, ck, "fake", progress=False).read_text())
    assert fake.calls == 2 and again["scores"] == honest["scores"]
    assert again["samples"]["resumed"] == NUM_SAMPLES and again["samples"]["new"] == 0


def test_checkpoint_that_cannot_load_is_named(tmp_path, fake):
    ck = save_tiny_checkpoint(tmp_path / "run" / "checkpoints" / "step-000001", seed=0)
    cfg = _eval_cfg(tmp_path, ck)
    _truncate(ck / "model.safetensors", 0.3)
    with pytest.raises(CheckpointLoadError, match=rf"cannot load checkpoint {ck}") as err:
        evaluate_checkpoint(cfg, ck, "fake", progress=False)
    assert err.value.exit_code == 1
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (ck / name).unlink()
    with pytest.raises(EvaluationError, match="no tokenizer"):
        evaluate_checkpoint(cfg, ck, "fake", progress=False)


def test_truncated_weights_in_model_path_name_the_path(tmp_path):
    from anchorctx.models.loading import ModelFileError, load_model
    from anchorctx.models.settings import ModelConfig

    ck = save_tiny_checkpoint(tmp_path / "base", seed=0)
    _truncate(ck / "model.safetensors", 0.3)
    with pytest.raises(ModelFileError, match=rf"model.path {ck} \(SafetensorError") as err:
        load_model(ModelConfig(path=ck), dtype="float32", device="cpu")
    assert err.value.exit_code == 1  # runtime: the file is bad, not the config


def test_evaluation_output_has_one_writer(tmp_path, fake, holder):
    ck = save_tiny_checkpoint(tmp_path / "run" / "checkpoints" / "step-000001", seed=0)
    proc = holder(eval_dir(ck) / ".fake.lock")
    with pytest.raises(LockHeldError, match=f"pid {proc.pid}"):
        evaluate_checkpoint(_eval_cfg(tmp_path, ck), ck, "fake", progress=False)
    assert fake.calls == 0


# ------------------------------------------------------------------------ config loading
def test_variant_override_typo_fails_whenever_the_config_loads(tmp_path, capsys):
    raw = {
        "name": "t",
        "model": {"tiny": {}, "tokenizer": "tok"},
        "variants": [{"name": "x", "attention": "anchor", "overrides": {"data.tagz": 1}}],
    }
    with pytest.raises(ConfigError, match=r"variant 'x'.*unknown key 'data\.tagz'"):
        config_from_dict(raw)
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(raw))
    assert main(["config", str(path)]) == 2  # not only `config --arms`
    assert "data.tagz" in _one_line_error(capsys, "config")


def test_orchestration_passes_resume_or_force():
    from anchorctx.tasks.training import train_command

    # A forced task run moves the earlier run aside itself (under the run lock), so the child
    # needs --resume or nothing; without --resume an existing run is the child's error.
    assert train_command(Path("c.yaml"), resume=True)[-1] == "--resume"
    assert train_command(Path("c.yaml"), resume=False)[-1] == "c.yaml"
