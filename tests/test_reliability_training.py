"""Reliability of training and model loading: one test per row of issue #33 that these layers own.

Row 1 changed corpus on --resume, 4 weights that do not fit config.json, 5 the anchor token rule,
7 the batch-memory preflight, 8 non-finite loss, 9 tampered engine state, 13 a full disk while
writing the resume state, 15 another parallel layout on --resume, 17 SIGTERM and torchrun's
tracebacks. Everything runs in this process on a tiny model, except torchrun (one subprocess,
with `sleep` as its workers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distributed import torch_extensions  # noqa: F401  (fixture)

from anchorctx.cli import main
from anchorctx.config import dump_config
from anchorctx.experiment import config_from_dict
from anchorctx.io import sha256_file
from anchorctx.models.checkpoints import list_checkpoints
from anchorctx.training import checkpoints as ckpt
from anchorctx.training.loop import train

REPO = Path(__file__).resolve().parents[1]


def _one_line_error(capsys, command: str = "train") -> str:
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if "real_accelerator.py" not in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"anchorctx {command}: "), err
    return lines[0]


def _raw(tiny_config, corpus: Path, tmp: Path, name: str, **training) -> dict:
    raw = tiny_config.model_dump(mode="json")
    raw.update(name=name, run_root=str(tmp / "runs"))
    raw["data"].update(sources=[{"path": str(corpus)}], output_dir=str(tmp / "packed"))
    raw["training"].update(steps=2, lr=1e-3, warmup_steps=1, **training)
    return raw


@pytest.fixture(scope="module")
def base(tiny_config, demo_corpus, tmp_path_factory, torch_extensions):  # noqa: F811
    """A finished 2-step run (checkpoint and resume state at step 2) on a private copy of the
    demo corpus (row 1 edits it in place and restores it)."""
    tmp = tmp_path_factory.mktemp("reliability-training")
    corpus = tmp / "corpus"
    shutil.copytree(demo_corpus.data_dir, corpus)
    raw = _raw(tiny_config, corpus, tmp, "base")
    train(config_from_dict(raw))
    return raw


def _clone(base: dict, name: str, **training):
    raw = json.loads(json.dumps(base))
    raw["name"] = name
    raw["training"].update(training)
    cfg = config_from_dict(raw)
    src = config_from_dict(base).run_dir
    shutil.rmtree(cfg.experiment_dir, ignore_errors=True)
    shutil.copytree(src, cfg.run_dir)
    config = cfg.experiment_dir / "config.yaml"
    dump_config(cfg, config)
    return cfg, config


def _resume_files(run_dir: Path) -> dict[str, bytes]:
    root = run_dir / "resume"
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


# ------------------------------------------------------------------ row 1: data on --resume
def test_resume_refuses_a_corpus_edited_in_place(base, capsys):
    cfg, config = _clone(base, "edited", steps=4)
    trainer = json.loads((cfg.run_dir / "resume" / "trainer.json").read_text())
    manifest = json.loads((Path(base["data"]["output_dir"]) / "manifest.json").read_text())
    assert trainer["data_fingerprint"] == manifest["fingerprint"]  # recorded at save time
    victim = sorted(Path(base["data"]["sources"][0]["path"]).glob("**/*.jsonl"))[0]
    before, st = victim.read_bytes(), victim.stat()
    metrics = (cfg.run_dir / "metrics.jsonl").read_text()
    packed = sorted(p.name for p in Path(base["data"]["output_dir"]).parent.iterdir())
    try:
        lines = before.splitlines(keepends=True)
        victim.write_bytes(b"".join(lines[1:]))  # one document fewer, edited in place
        assert main(["train", str(config), "--resume"]) == 1
        err = _one_line_error(capsys)
    finally:
        victim.write_bytes(before)
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert manifest["fingerprint"] in err and str(victim) in err and "changed size" in err
    assert base["data"]["output_dir"] in err and str(victim.parent.parent) in err
    assert (cfg.run_dir / "metrics.jsonl").read_text() == metrics  # nothing trained
    assert sorted(p.name for p in Path(base["data"]["output_dir"]).parent.iterdir()) == packed


# ----------------------------------------------------- row 4: weights that do not fit config
def test_checkpoint_weights_must_match_config_exactly(tmp_path, base):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from anchorctx.evaluation.generation import load_eval_model
    from anchorctx.models.loading import ModelFileError

    ckpt_dir = tmp_path / "sharded"
    tok = AutoTokenizer.from_pretrained(config_from_dict(base).model.tokenizer_path)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    LlamaForCausalLM(cfg).save_pretrained(ckpt_dir, max_shard_size="100KB")
    tok.save_pretrained(ckpt_dir)
    assert (ckpt_dir / "model.safetensors.index.json").is_file()  # as the Hub publishes
    assert len(list(ckpt_dir.glob("model-*-of-*.safetensors"))) > 1
    load_eval_model(ckpt_dir, device="cpu", dtype="float32")  # consistent: loads
    config = json.loads((ckpt_dir / "config.json").read_text())
    cases = {
        "num_hidden_layers=2": ({"num_hidden_layers": 2}, "model.layers.2.", "dropped"),
        "num_hidden_layers=4": ({"num_hidden_layers": 4}, "model.layers.3.", "random"),
        "intermediate_size=48": ({"intermediate_size": 48}, "model.layers.0.mlp.", "[32, 64]"),
    }
    for change, key, words in cases.values():
        (ckpt_dir / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ModelFileError) as err:
            load_eval_model(ckpt_dir, device="cpu", dtype="float32")
        msg = str(err.value)
        assert "\n" not in msg and str(ckpt_dir) in msg and key in msg and words in msg, msg


# -------------------------------------------------------------------- row 5: the anchor rule
def test_anchor_is_a_real_bos_consistent_with_the_model(base, tmp_path, caplog):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from anchorctx.evaluation.generation import load_eval_model
    from anchorctx.models.loading import AnchorTokenError, anchor_token_id

    run = config_from_dict(base)
    tok = AutoTokenizer.from_pretrained(run.model.tokenizer_path)
    # The demo's own checkpoints: config.json ids are the tokenizer's; the anchor is recorded.
    step = list_checkpoints(run.run_dir)[-1]
    saved = json.loads((step / "config.json").read_text())
    assert (saved["bos_token_id"], saved["eos_token_id"]) == (tok.bos_token_id, tok.eos_token_id)
    meta = json.loads((step / "anchorctx.json").read_text())
    assert meta["anchor_token_id"] == tok.bos_token_id == anchor_token_id(tok)

    # BOS = <unk>: not a real token.
    unk_bos = AutoTokenizer.from_pretrained(run.model.tokenizer_path)
    unk_bos.bos_token = unk_bos.unk_token
    with pytest.raises(AnchorTokenError, match=r"BOS token '<unk>' is not a real token"):
        anchor_token_id(unk_bos)

    # The checkpoint's tokenizer lost its BOS: training's anchor (BOS) != evaluation's (EOS).
    lost = tmp_path / "lost-bos"
    shutil.copytree(step, lost)
    config = json.loads((lost / "tokenizer_config.json").read_text())
    config["bos_token"] = None
    (lost / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(AnchorTokenError, match=r"has no BOS token, but the model .*declares"):
        load_eval_model(lost, device="cpu", dtype="float32")
    # Another BOS than the one trained with (recorded in anchorctx.json) is refused too.
    config["bos_token"] = tok.eos_token
    (lost / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(AnchorTokenError, match=r"trained with anchor token id 0"):
        load_eval_model(lost, device="cpu", dtype="float32")

    # A foreign model whose config.json names another bos_token_id: the tokenizer wins, and
    # the decision is logged and applied to the loaded config.
    foreign = tmp_path / "foreign"
    small = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )  # transformers' defaults: bos 1, eos 2 (another tokenizer's ids)
    LlamaForCausalLM(small).save_pretrained(foreign)
    tok.save_pretrained(foreign)
    with caplog.at_level(logging.WARNING, logger="anchorctx.models"):
        model, _ = load_eval_model(foreign, device="cpu", dtype="float32")
    assert model.config.bos_token_id == tok.bos_token_id == 0
    assert any("the tokenizer's BOS is the anchor" in r.message for r in caplog.records)


# ---------------------------------------------------------------- row 7: batch-memory preflight
def test_batch_memory_preflight_names_global_batch_size(base, monkeypatch):
    from anchorctx.training import loop, plan
    from anchorctx.training.plan import TrainingError, plan_parallelism, step_memory

    raw = json.loads(json.dumps(base))
    raw["training"]["global_batch_size"] = 1 << 16
    cfg = config_from_dict(raw)
    par = plan_parallelism(cfg)
    assert step_memory(par, cfg.data.seq_len).host > 1 << 29
    monkeypatch.setattr(plan, "host_available_bytes", lambda: 1 << 30)  # a 1 GiB host

    def never(*args, **kwargs):
        raise AssertionError("data prepared before the memory check")

    monkeypatch.setattr(loop, "prepare_data", never)
    with pytest.raises(TrainingError, match=r"^training\.global_batch_size=65536: .* GiB of host"):
        loop.preflight(cfg, par)
    # The base run's batch plan (2 rows) fits the same host.
    monkeypatch.undo()
    monkeypatch.setattr(plan, "host_available_bytes", lambda: 1 << 30)
    small = config_from_dict(base)
    loop.preflight(small, plan_parallelism(small), data_dir=Path(base["data"]["output_dir"]))
    # On a GPU the micro-batches of a step live on the device: a 1 GiB GPU refuses them too.
    gpu = dataclasses.replace(par, device="cuda")
    monkeypatch.setattr(plan, "host_available_bytes", lambda: 1 << 40)
    monkeypatch.setattr(plan, "device_total_bytes", lambda: 1 << 30)
    with pytest.raises(TrainingError, match=r"^training\.global_batch_size=65536: .* on each GPU"):
        plan.check_batch_memory(cfg, gpu)


# --------------------------------------------------------------- row 8: a non-finite loss stops
def test_non_finite_loss_stops_naming_step_and_checkpoint(base, monkeypatch, capsys):
    from anchorctx.training import loop
    from anchorctx.training.step import StepStats

    cfg, config = _clone(base, "nan", steps=4)
    real = loop.train_step

    def poisoned(*args, **kwargs):
        stats = real(*args, **kwargs)
        return StepStats(loss=math.nan, grad_norm=math.inf, lr=stats.lr)

    monkeypatch.setattr(loop, "train_step", poisoned)
    resume = _resume_files(cfg.run_dir)
    assert main(["train", str(config), "--resume"]) == 1
    err = _one_line_error(capsys)
    assert "step 3: the loss is nan and the gradient norm inf" in err
    assert str(cfg.run_dir / "checkpoints" / "step-000002") in err
    assert "resume state is at step 2" in err
    assert [p.name for p in list_checkpoints(cfg.run_dir)] == ["step-000002"]
    assert _resume_files(cfg.run_dir) == resume
    rows = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2]  # no row of the bad step


# ------------------------------------------------------------ row 9: tampered engine state
def _evil_file(path: Path, size: int, marker: Path) -> None:
    """A torch.save file whose unpickling writes ``marker``, padded to exactly ``size`` bytes."""
    import torch

    class Payload:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').write('ran')",))

    pad = 0
    for _ in range(5):  # torch's legacy (plain pickle) format: sizes move byte by byte
        obj = {"module": Payload(), "pad": b"x" * pad}
        torch.save(obj, path, _use_new_zipfile_serialization=False)
        got = path.stat().st_size
        if got == size:
            return
        pad += size - got
    raise AssertionError("could not pad the payload to the recorded size")


def test_tampered_engine_state_is_refused_not_run(base, tmp_path, capsys):
    cfg, config = _clone(base, "tampered", steps=3)
    target = max((cfg.run_dir / "resume" / "engine").rglob("*.pt"), key=lambda p: p.stat().st_size)
    marker = tmp_path / "payload-ran"
    _evil_file(target, target.stat().st_size, marker)
    # An attacker who can write the engine files can record their hashes in trainer.json too:
    # then only the weights-only load stands between the payload and its running.
    trainer_path = cfg.run_dir / "resume" / "trainer.json"
    trainer = json.loads(trainer_path.read_text())
    trainer["files"][target.relative_to(cfg.run_dir / "resume").as_posix()]["sha256"] = sha256_file(
        target
    )
    trainer_path.write_text(json.dumps(trainer))
    assert main(["train", str(config), "--resume"]) == 1
    err = _one_line_error(capsys)
    assert not marker.exists(), "the pickle payload ran"
    assert "corrupt resume state" in err and str(target) in err
    assert "refused" in err and "the global exec" in err and "add_safe_globals" not in err
    assert ckpt.resume_step(cfg.run_dir) == 2


# ------------------------------------------------------------------------ row 13: disk full
def test_disk_full_while_writing_resume_state(base, monkeypatch, capsys):
    import torch

    # Step 3 writes only resume state (save.resume_every=1), step 4 a checkpoint too.
    save = {**base["training"]["save"], "resume_every": 1}
    cfg, config = _clone(base, "diskfull", steps=4, save=save)
    resume = _resume_files(cfg.run_dir)

    def full(*args, **kwargs):
        raise RuntimeError(
            "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing "
            "file data/3: file write failed"
        )

    monkeypatch.setattr(torch, "save", full)  # DeepSpeed's engine files go through torch.save
    assert main(["train", str(config), "--resume"]) == 1
    err = _one_line_error(capsys)
    assert "cannot write the resume state" in err and "the disk is full" in err
    assert str(cfg.run_dir / "resume" / "engine") in err and ".pt" in err
    assert "resume state of step 2" in err and "is intact" in err
    assert _resume_files(cfg.run_dir) == resume  # the previous state, byte for byte
    assert not (cfg.run_dir / ".resume.partial").exists()
    assert ckpt.read_trainer_state(cfg.run_dir).step == 2


# ------------------------------------------------------- row 15: another layout on --resume
def test_resume_with_another_sp_names_the_layout(base, capsys):
    from anchorctx.training.loop import restart_state
    from anchorctx.training.plan import TrainingError, plan_parallelism

    cfg, _ = _clone(base, "layout")
    raw = json.loads(json.dumps(base))
    raw.update(name="layout")
    raw["training"]["sequence_parallel"] = 2
    sp2 = config_from_dict(raw)
    with pytest.raises(TrainingError, match=r"another parallel layout") as err:
        restart_state(sp2, plan_parallelism(sp2), resume=True)
    msg = str(err.value)
    assert "training.sequence_parallel 1 -> 2" in msg and "processes 1 -> 2" in msg
    assert "rng-rank" not in msg and "corrupt" not in msg
    config = cfg.experiment_dir / "sp2.yaml"
    dump_config(sp2, config)
    assert main(["train", str(config), "--resume"]) == 2  # a command-line choice: usage
    assert "another parallel layout" in _one_line_error(capsys)


# ------------------------------------------------- row 17: SIGTERM, and torchrun's tracebacks
class _Killed(Exception):
    pass


def test_sigterm_is_handled_like_ctrl_c(base, monkeypatch, capsys):
    from anchorctx.training import launch as launch_mod

    _, config = _clone(base, "sigterm")
    seen: list[str] = []

    def launch(cfg, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)  # the handler interrupts this
        finally:
            seen.append("cleanup ran")
        return 0

    def fallback(signum, frame):  # only reached if `anchorctx train` does not handle SIGTERM
        raise _Killed

    monkeypatch.setattr(launch_mod, "launch", launch)
    previous = signal.signal(signal.SIGTERM, fallback)
    try:
        started = time.monotonic()
        assert main(["train", str(config)]) == 130  # as for Ctrl-C
        assert time.monotonic() - started < 5
        assert signal.getsignal(signal.SIGTERM) is fallback  # restored afterwards
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert _one_line_error(capsys) == "anchorctx train: interrupted"
    assert seen == ["cleanup ran"]


def test_torchrun_stopped_by_a_signal_is_one_line(tmp_path):
    import psutil

    from anchorctx.process import free_port, kill_group
    from anchorctx.training.launch import TORCHRUN

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        TORCHRUN,
        "--nnodes=1",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        "--no-python",
    ]
    proc = subprocess.Popen(
        [*cmd, "sleep", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # as run_process_group starts the launcher
        cwd=REPO,
        env=env,
    )

    def sleeping() -> int:
        """Workers that are running ``sleep`` already: a worker still being started when the
        signal comes can outlive torchrun holding its pipes (seen on a loaded 2-core machine:
        `communicate` then waited out its 30 s)."""
        names = []
        for child in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                names.append(child.name())
        return names.count("sleep")

    try:
        deadline = time.monotonic() + 60
        while sleeping() < 2:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        tree = psutil.Process(proc.pid).children(recursive=True)
        kill_group(proc)  # what `anchorctx train` does on Ctrl-C or SIGTERM
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # say who still holds the pipes (a flake seen once)
            alive = [p for p in tree if p.is_running()]
            described = [(p.pid, p.name(), os.getsid(p.pid)) for p in alive]
            pytest.fail(f"torchrun {proc.pid} (exit {proc.poll()}) left {described} running")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    assert err.strip() == "anchorctx train: torchrun stopped its workers (SIGTERM)", err
    # A failed worker: one line naming the rank, and its exit status passed on.
    failed = subprocess.run(
        [*cmd, "sh", "-c", "exit 2"], capture_output=True, text=True, cwd=REPO, env=env
    )
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr
    assert failed.stderr.strip().splitlines()[-1].startswith("anchorctx train: rank ")
