"""Reliability of what ``--resume`` and ``prepare-data`` trust: issue #58, rows 6 and 13.

Row 6: resume state that is not this run's (engine files copied from another run of the same
config, another seed) is refused, naming the file. Row 13: a truncated packed dataset is named
with its fix, and ``prepare-data`` no longer calls it complete. Everything runs in this process
on a tiny model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from distributed import torch_extensions  # noqa: F401  (fixture)

from anchorctx.cli import main
from anchorctx.config import dump_config
from anchorctx.experiment import config_from_dict
from anchorctx.io import sha256_file
from anchorctx.training import checkpoints as ckpt
from anchorctx.training.loop import train


def _one_line_error(capsys, command: str = "train") -> str:
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if "real_accelerator.py" not in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"anchorctx {command}: "), err
    return lines[0]


@pytest.fixture(scope="module")
def runs(tiny_config, tmp_path_factory, torch_extensions):  # noqa: F811
    """Two finished 2-step runs of one config but for the seed (0 and 1), each with resume
    state at step 2: {seed: raw config}."""
    tmp = tmp_path_factory.mktemp("reliability-resume")
    out = {}
    for seed in (0, 1):
        raw = tiny_config.model_dump(mode="json")
        raw.update(name=f"seed{seed}", seed=seed, run_root=str(tmp / "runs"))
        raw["data"]["output_dir"] = str(tmp / f"packed-seed{seed}")  # shared by the clones
        raw["training"].update(steps=2, lr=1e-3, warmup_steps=1)
        train(config_from_dict(raw))
        out[seed] = raw
    return out


def _clone(raw: dict, name: str, **training):
    """A copy of ``raw``'s run under ``name``, to continue to more steps with --resume."""
    copy = json.loads(json.dumps(raw))
    copy["name"] = name
    copy["training"].update(training)
    cfg = config_from_dict(copy)
    shutil.rmtree(cfg.experiment_dir, ignore_errors=True)
    shutil.copytree(config_from_dict(raw).run_dir, cfg.run_dir)
    config = cfg.experiment_dir / "config.yaml"
    dump_config(cfg, config)
    return cfg, config


def _engine_from(other: Path, run_dir: Path) -> list[Path]:
    """Replace ``run_dir``'s engine state by ``other``'s (same files, same sizes)."""
    ours, theirs = run_dir / "resume" / "engine", other / "resume" / "engine"
    names = sorted(p.relative_to(theirs) for p in theirs.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(ours) for p in ours.rglob("*") if p.is_file())
    shutil.rmtree(ours)
    shutil.copytree(theirs, ours)
    return [ours / n for n in names]


def _rerecord(run_dir: Path) -> None:
    """Record the files' current hashes in trainer.json (what a hand-made merge would do)."""
    path = run_dir / "resume" / "trainer.json"
    trainer = json.loads(path.read_text())
    for rel, record in trainer["files"].items():
        record["sha256"] = sha256_file(run_dir / "resume" / rel)
    path.write_text(json.dumps(trainer))


# -------------------------------------------------- row 6: resume state of another run
def test_trainer_json_records_content_hashes_and_the_run(runs):
    run_dir = config_from_dict(runs[0]).run_dir
    trainer = json.loads((run_dir / "resume" / "trainer.json").read_text())
    assert trainer["run"] == {"experiment": "seed0", "variant": "anchor", "seed": 0}
    files = trainer["files"]
    assert any(rel.startswith("engine/") for rel in files) and "rng-rank00000.json" in files
    for rel, record in files.items():
        path = run_dir / "resume" / rel
        assert record == {"size": path.stat().st_size, "sha256": sha256_file(path)}, rel
    assert not list((run_dir / "resume").glob(".sha256-rank*"))  # merged, then removed


def test_engine_state_of_another_run_is_refused(runs, capsys):
    cfg, config = _clone(runs[0], "copied-engine", steps=3)
    metrics = (cfg.run_dir / "metrics.jsonl").read_text()
    copied = _engine_from(config_from_dict(runs[1]).run_dir, cfg.run_dir)
    assert main(["train", str(config), "--resume"]) == 1
    err = _one_line_error(capsys)
    assert "corrupt resume state" in err and "copied from another run" in err
    assert any(f"{p}: its content is not what this run wrote" in err for p in copied), err
    assert (cfg.run_dir / "metrics.jsonl").read_text() == metrics  # nothing trained
    assert ckpt.resume_step(cfg.run_dir) == 2


def test_engine_state_with_rerecorded_hashes_is_refused_by_its_client_state(runs, capsys):
    """The engine files carry the step and a hash of the trainer fields (DeepSpeed's client
    state): a trainer.json whose hashes were re-recorded over another run's engine files is
    still refused once DeepSpeed has read them."""
    cfg, config = _clone(runs[0], "rerecorded", steps=3)
    _engine_from(config_from_dict(runs[1]).run_dir, cfg.run_dir)
    _rerecord(cfg.run_dir)
    assert main(["train", str(config), "--resume"]) == 1
    err = _one_line_error(capsys)
    engine = cfg.run_dir / "resume" / "engine"
    assert f"{engine}: DeepSpeed's engine state (step 2) was not saved with this" in err
    assert "another run or step" in err


def test_resume_state_without_content_hashes_is_refused(runs):
    from anchorctx.training.plan import ResumeStateError

    cfg, _ = _clone(runs[0], "sizes-only", steps=3)
    path = cfg.run_dir / "resume" / "trainer.json"
    trainer = json.loads(path.read_text())
    trainer["files"] = {rel: r["size"] for rel, r in trainer["files"].items()}  # older format
    path.write_text(json.dumps(trainer))
    with pytest.raises(ResumeStateError, match=r"trainer\.json: records no content hash for"):
        ckpt.read_trainer_state(cfg.run_dir)


# --------------------------------------------------- row 13: a truncated packed dataset
def _truncated_copy(raw: dict, tmp: Path) -> tuple[Path, Path, Path]:
    """A config on a copy of ``raw``'s packed dataset whose Arrow file is then cut in half (a
    copy cut short, a full disk): (config path, dataset, Arrow file)."""
    data = tmp / "packed"
    shutil.copytree(raw["data"]["output_dir"], data)
    copy = json.loads(json.dumps(raw))
    copy["data"]["output_dir"] = str(data)
    config = tmp / "config.yaml"
    dump_config(config_from_dict(copy), config)
    (arrow,) = data.glob("*.arrow")
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    return config, data, arrow


def test_manifest_records_the_arrow_files(runs):
    data = Path(runs[0]["data"]["output_dir"])
    files = json.loads((data / "manifest.json").read_text())["files"]
    arrows = sorted(data.glob("*.arrow"))
    assert arrows and sorted(files) == [p.name for p in arrows]
    for p in arrows:
        assert files[p.name] == {"size": p.stat().st_size, "sha256": sha256_file(p)}


@pytest.mark.parametrize("recorded", [True, False], ids=["sizes", "older-manifest"])
def test_truncated_packed_dataset_is_named_and_packed_again(runs, tmp_path, recorded, capsys):
    from anchorctx.packing import load_packed
    from anchorctx.packing.sources import DataError

    config, data, arrow = _truncated_copy(runs[0], tmp_path)
    manifest = json.loads((data / "manifest.json").read_text())
    if not recorded:  # packed before the sizes were recorded: the stream is read instead
        from anchorctx.io import record_owner
        from anchorctx.packing.pipeline import PACKED_OWNER

        del manifest["files"]
        (data / "manifest.json").write_text(json.dumps(manifest))
        # The edited manifest stands for prepare-data's own (its owner marker lists it as is);
        # the truncated Arrow file stays recorded as written, so only its damage differs.
        marker = json.loads((data / ".anchorctx-owner.json").read_text())
        arrow_record = marker["files"][arrow.name]
        record_owner(data, PACKED_OWNER)
        marker = json.loads((data / ".anchorctx-owner.json").read_text())
        marker["files"][arrow.name] = arrow_record
        (data / ".anchorctx-owner.json").write_text(json.dumps(marker))
    with pytest.raises(DataError) as err:
        load_packed(data)
    msg = str(err.value)
    assert f"packed dataset {data} is damaged: {arrow}" in msg and "\n" not in msg
    assert "anchorctx prepare-data CONFIG" in msg
    # prepare-data no longer calls it complete: it packs the dataset again, the same one.
    assert main(["prepare-data", str(config), "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(data)
    ds, again = load_packed(data)
    assert again["fingerprint"] == manifest["fingerprint"] and len(ds) > 0


def test_resume_on_a_truncated_packed_dataset_packs_it_again(runs, tmp_path, caplog):
    raw = json.loads(json.dumps(runs[0]))
    raw.update(name="cut-resume", run_root=str(tmp_path / "runs"))
    raw["data"]["output_dir"] = str(tmp_path / "packed")  # its own: it is cut below
    cfg = config_from_dict(raw)
    train(cfg)
    config = cfg.experiment_dir / "config.yaml"
    raw["training"]["steps"] = 3
    dump_config(config_from_dict(raw), config)
    data = Path(raw["data"]["output_dir"])
    (arrow,) = data.glob("*.arrow")
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    fingerprint = json.loads((data / "manifest.json").read_text())["fingerprint"]
    assert main(["train", str(config), "--resume"]) == 0
    assert f"packed dataset {data} is damaged ({arrow}: " in caplog.text
    steps = [
        json.loads(r)["step"] for r in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2, 3]  # resumed at step 2 on the dataset it was trained on
    assert json.loads((data / "manifest.json").read_text())["fingerprint"] == fingerprint
