"""Tracking backends: what training, evaluation and the report log is read back with each
library's own reader (TensorBoard's EventAccumulator, MLflow's client, W&B's offline run file
parsed with wandb's record schema)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from distributed import torch_extensions  # noqa: F401  (fixture)
from wandb_offline import history, run_file, run_info

from anchorctx.config import ConfigError
from anchorctx.evaluation.tracking import log_evaluation, log_report
from anchorctx.experiment import config_from_dict
from anchorctx.io import atomic_write_json, read_jsonl
from anchorctx.tracking import Tracker, TrackingError, check_backends

ALL = ["tensorboard", "mlflow", "wandb"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    # the defaults under test: no tracking server, W&B offline (env unset)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


def _cfg(tiny_config, tmp_path, name="trk", backends=ALL, **raw_updates):
    raw = tiny_config.model_dump(mode="json")
    raw.update(
        name=name,
        run_root=str(tmp_path / "runs"),
        tracking={"backends": backends, "tags": ["unit-test"]},
        **raw_updates,
    )
    return config_from_dict(raw)


def _tb_scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _mlflow_runs(cfg):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{cfg.run_root.resolve() / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(cfg.name)
    return client, client.search_runs([experiment.experiment_id])


# ---------------------------------------------------------------------------------- config
def test_config_list_shorthand_and_errors(tiny_config):
    raw = tiny_config.model_dump(mode="json")
    assert config_from_dict({**raw, "tracking": ["tensorboard", "wandb"]}).tracking.backends == [
        "tensorboard",
        "wandb",
    ]
    with pytest.raises(ConfigError, match="distinct"):
        config_from_dict({**raw, "tracking": ["mlflow", "mlflow"]})
    with pytest.raises(ConfigError, match=r"tracking\.backends"):
        config_from_dict({**raw, "tracking": ["comet"]})
    assert config_from_dict(raw, ["tracking.backends=[mlflow]"]).tracking.backends == ["mlflow"]


def test_missing_package_is_one_clear_line(tiny_config, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    cfg = _cfg(tiny_config, tmp_path)
    with pytest.raises(TrackingError) as err:
        check_backends(cfg)
    message = str(err.value)
    assert "\n" not in message and "'wandb'" in message and "pip install wandb" in message
    assert not Tracker(cfg, "train", enabled=False)  # other ranks never need the package


# -------------------------------------------------------------------------------- training
def test_training_logs_every_step_to_every_backend(
    tiny_config,
    packed_demo,
    tmp_path,
    torch_extensions,  # noqa: F811
):
    from anchorctx.training.loop import train

    cfg = _cfg(tiny_config, tmp_path)
    train(cfg, data_dir=packed_demo)
    rows = read_jsonl(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]

    tb = _tb_scalars(cfg.run_dir / "tensorboard")
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "tflops_per_device", "peak_mem_gib"):
        # float32 event values: compare at float32 resolution
        assert [s for s, _ in tb[f"train/{key}"]] == [1, 2, 3, 4]
        assert [v for _, v in tb[f"train/{key}"]] == pytest.approx([r[key] for r in rows], rel=1e-6)
    assert "train/mfu" not in tb  # no known peak on CPU: left out, never logged as 0

    client, runs = _mlflow_runs(cfg)
    (run,) = runs
    assert run.info.run_name == "trk-anchor-train" and run.info.status == "FINISHED"
    assert run.data.tags["anchorctx.stage"] == "train" and "unit-test" in run.data.tags
    assert run.data.params["training.steps"] == "4"
    history_ = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history_) == [(r["step"], r["loss"]) for r in rows]
    config_yaml = client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))
    assert Path(config_yaml).read_text() == cfg.to_yaml()

    wb = run_file(cfg.run_dir)
    logged = [(h["_step"], h["train/loss"]) for h in history(wb)]
    assert logged == [(r["step"], r["loss"]) for r in rows]
    info = run_info(wb)
    assert info.display_name == "trk-anchor-train" and info.job_type == "train"
    assert "variant:anchor" in info.tags and info.run_group == "trk-anchor"
    config = {i.key: json.loads(i.value_json) for i in info.config.update}
    assert config["training"]["steps"] == 4


# ----------------------------------------------------------------- evaluation and report
def _result(step: int, scores: dict) -> dict:
    return {
        "suite": "ruler",
        "step": step,
        "checkpoint_name": f"step-{step:06d}",
        "scores": scores,
        "evaluation": {"ruler": {"exclude": []}},
    }


def test_evaluation_and_report_scores(tiny_config, tmp_path):
    from anchorctx.evaluation.averaging import summarize_run
    from anchorctx.evaluation.report import write_experiment_report

    cfg = _cfg(tiny_config, tmp_path, name="trk-eval")
    scores = {
        2: {"vt": {"256": 50.0, "512": 25.0}, "fwe": {"256": 100.0, "512": 75.0}},
        4: {"vt": {"256": 70.0, "512": 35.0}, "fwe": {"256": 90.0, "512": 65.0}},
    }
    for step, s in scores.items():
        ckpt_eval = cfg.run_dir / "eval" / f"step-{step:06d}"
        atomic_write_json(ckpt_eval / "ruler.json", _result(step, s))
        mmlu = {"suite": "mmlu", "step": step, "scores": {"mmlu": {"acc": 20.0 + step}}}
        atomic_write_json(ckpt_eval / "mmlu.json", mmlu)
    summarize_run(cfg.run_dir, last_k=2)
    log_evaluation(cfg)

    # W&B keeps only rows in step order: both suites of both checkpoints must be there
    rows = {h["_step"]: h for h in history(run_file(cfg.run_dir))}
    assert sorted(rows) == [2, 4]
    assert rows[2]["eval/ruler/vt/256"] == 50.0 and rows[2]["eval/mmlu/mmlu/acc"] == 22.0
    assert rows[4]["eval/mmlu/mmlu/acc"] == 24.0 and rows[4]["eval_mean/mmlu/mmlu/acc"] == 23.0

    tb = _tb_scalars(cfg.run_dir / "tensorboard")
    assert tb["eval/ruler/vt/256"] == [(2, 50.0), (4, 70.0)]  # per checkpoint, step = its step
    assert tb["eval/ruler/average/512"] == [(2, 50.0), (4, 50.0)]  # mean over tasks
    assert tb["eval_mean/ruler/fwe/512"] == [(4, 70.0)]  # mean over the last 2 checkpoints
    assert tb["eval_std/ruler/vt/256"] == [(4, 10.0)]  # population std of 50 and 70
    assert tb["eval_mean/ruler/average/256"] == [(4, 77.5)]

    report = write_experiment_report(cfg.experiment_dir, ["anchor"])
    log_report(cfg, report)
    tb = _tb_scalars(cfg.experiment_dir / "tensorboard")
    assert tb["report/ruler/anchor/256"] == [(0, 77.5)]
    client, runs = _mlflow_runs(cfg)
    by_stage = {r.data.tags["anchorctx.stage"]: r for r in runs}
    assert set(by_stage) == {"evaluate", "report"}
    evaluate = by_stage["evaluate"]
    assert evaluate.data.metrics["eval_mean/ruler/average/512"] == 50.0
    report_run = by_stage["report"].info.run_id
    files = {f.path for d in ("", "report") for f in client.list_artifacts(report_run, d or None)}
    assert {"report/ruler.json", "ruler_by_length.png", "report/markdown.md"} <= files
    table = json.loads(
        Path(client.download_artifacts(report_run, "report/ruler.json", str(tmp_path))).read_text()
    )
    assert table["columns"] == ["variant", "256", "512"]
    assert table["data"] == [["anchor", "77.50 ± 2.50", "50.00 ± 0.00"]]


def test_cli_refuses_a_missing_tracker_before_any_work(tiny_config, tmp_path, monkeypatch, capsys):
    from anchorctx.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    cfg = _cfg(tiny_config, tmp_path, backends=["mlflow"])
    path = tmp_path / "cfg.yaml"
    path.write_text(cfg.to_yaml())
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("anchorctx train: tracking backend 'mlflow'") and "\n" not in err
    assert not cfg.run_dir.exists()  # nothing was started


def test_a_run_directory_outside_run_root_is_not_logged(tiny_config, tmp_path, caplog):
    """`anchorctx evaluate --run-dir DIR` with DIR outside run_root (its results go under the
    experiment's external/): no event file, W&B folder or anything else is written into DIR
    (read-only or not); one warning line says why."""
    cfg = _cfg(tiny_config, tmp_path, name="trk-out", backends=["tensorboard", "wandb"])
    outside = tmp_path / "elsewhere" / "run"
    atomic_write_json(
        outside / "eval" / "step-000002" / "ruler.json", _result(2, {"vt": {"256": 1.0}})
    )
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "elsewhere").rglob("*"))
    with caplog.at_level("WARNING"):
        log_evaluation(cfg, outside)
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "elsewhere").rglob("*")) == before
    (line,) = [r.getMessage() for r in caplog.records]
    assert f"{outside} is outside run_root {cfg.run_root}" in line and "\n" not in line


def test_an_unwritable_tensorboard_directory_is_one_line(tiny_config, tmp_path):
    """Checked where the tracker opens, not in TensorBoard's writer thread (a traceback after
    the evaluation finished). A file where the directory should be stands in for a read-only
    directory: these tests run as root, which writes anywhere."""
    blocker = tmp_path / "runs" / "trk-ro"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("not a directory")
    cfg = _cfg(tiny_config, tmp_path, name="trk-ro", backends=["tensorboard"])
    with pytest.raises(TrackingError) as err:
        Tracker(cfg, "evaluate")
    msg = str(err.value)
    assert "\n" not in msg and f"cannot write to {cfg.run_dir / 'tensorboard'}" in msg
