"""``anchorctx plan``: memory from the memory model, refusal with a fix, GPU-hours arithmetic."""

from __future__ import annotations

import dataclasses
import json

import pytest

from anchorctx.cli import main
from anchorctx.evaluation import cost_plan as eval_plan
from anchorctx.experiment import load_config
from anchorctx.training import cost_plan, memory

PAPER = "configs/paper/llama2-7b-64k.yaml"


def _cfg(*overrides: str):
    return load_config(PAPER, list(overrides))


def test_memory_prediction_is_the_memory_models():
    cfg = _cfg("training.memory.offload_optimizer=true")
    plan = cost_plan.plan_training(cfg, "h200", gpus=1)
    opt = memory.Options.of_run(cfg.training, gpus=1, sp=1)
    assert plan.options == opt
    assert plan.memory_gib == memory.summary(memory.predict(memory.LLAMA2_7B, 65536, opt))
    eight = cost_plan.plan_training(cfg, "h200", gpus=8)
    assert eight.sp == 8 and eight.dp == 1
    opt8 = memory.Options.of_run(cfg.training, gpus=8, sp=8)
    assert eight.memory_gib == memory.summary(memory.predict(memory.LLAMA2_7B, 65536, opt8))


def test_a_run_that_does_not_fit_is_refused_with_the_fix(capsys):
    with pytest.raises(cost_plan.PlanError) as err:
        cost_plan.plan_training(_cfg(), "h200", gpus=1)
    msg = str(err.value)
    assert "needs training.memory.offload_optimizer=true or --gpus 2" in msg
    # The option it names makes the run fit.
    cost_plan.plan_training(_cfg("training.memory.offload_optimizer=true"), "h200", gpus=1)

    assert main(["plan", PAPER, "--gpu", "h200", "--gpus", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("anchorctx plan: ") and "--gpus 2" in lines[0]


def test_a_gpu_count_beyond_the_configs_sp_names_the_sp_it_needs():
    with pytest.raises(cost_plan.PlanError, match=r"--gpus 2 and training.sequence_parallel=2"):
        cost_plan.plan_training(_cfg("training.sequence_parallel=1"), "h100", gpus=1)


def test_gpu_hours_scale_linearly_with_steps_and_arms():
    base = eval_plan.plan_experiment(_cfg(), "h200", gpus=8)
    double = eval_plan.plan_experiment(_cfg("training.steps=4000"), "h200", gpus=8)
    for a, b in zip(base.training.arms, double.training.arms, strict=True):
        assert b.step_s == pytest.approx(a.step_s)
        assert b.gpu_hours == pytest.approx(2 * a.gpu_hours)
        assert a.gpu_hours == pytest.approx(a.steps * a.step_s * 8 / 3600)
    cfg = _cfg()
    anchors = [v for v in cfg.variants if v.attention == "anchor"]
    two = cfg.model_copy(update={"variants": anchors})
    four = cfg.model_copy(update={"variants": anchors * 2})
    p2, p4 = (eval_plan.plan_experiment(c, "h200", gpus=8) for c in (two, four))
    assert p4.training.gpu_hours == pytest.approx(2 * p2.training.gpu_hours)
    assert p4.evaluation.gpu_hours == pytest.approx(2 * p2.evaluation.gpu_hours)
    # Evaluation: checkpoints × per-checkpoint cost, the last_k the report averages.
    e = base.evaluation
    assert e.checkpoints_per_arm == 5 and e.arms == 5
    assert e.gpu_hours == pytest.approx(25 * e.per_checkpoint_hours)
    assert base.gpu_hours == pytest.approx(base.training.gpu_hours + e.gpu_hours)


def test_ruler_cost_is_the_shard_cost_model():
    """On an H200 the RULER term is evaluation.sharding's own estimate of its units."""
    from anchorctx.evaluation.sharding import units

    cfg = _cfg()
    plan = eval_plan.plan_evaluation(cfg, memory.LLAMA2_7B, "h200")
    ruler = next(s for s in plan.suites if s.suite == "ruler")
    assert ruler.hours == pytest.approx(sum(units(cfg, "ruler").values()) / 3600)


def test_step_time_model_reproduces_the_measured_steps():
    """The fit (docs/PERFORMANCE.md, "Plan model") stays within 10% of every measured row."""
    h200 = cost_plan.GPUS["h200"]
    for row in cost_plan.STEP_ROWS:
        opt = memory.Options(kernels=row.kernels, keep_activations=row.keep)
        opt = dataclasses.replace(opt, tiled_loss=row.tiled_loss)
        got = cost_plan.row_seconds(cost_plan.BENCH_SHAPE, row.tokens, row.variant, opt, h200)
        assert got == pytest.approx(row.step_s, rel=0.10), row
    # The full-depth 7B row at 256K on one H200 (tiled MLP and loss, optimizer offload): 47.4 s.
    opt = memory.Options(tiled_mlp=True, tiled_loss=True, offload_optimizer=True)
    shape = memory.LLAMA2_7B
    got = cost_plan.row_seconds(shape, 262144, "anchor", opt, h200)
    got += cost_plan.optimizer_seconds(shape, opt)
    assert got == pytest.approx(47.4, rel=0.10)


def test_the_paper_setup_prints(capsys):
    assert main(["plan", PAPER, "--gpu", "a100-80g", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "8 × A100-80G" in out and "an estimate" in out
    for arm in ("full", "intra_doc", "intra_doc_reset", "anchor", "anchor_tags"):
        assert f"\n  {arm} " in out
    for suite in ("ruler", "longbench", "mmlu", "hellaswag"):
        assert f"\n  {suite} " in out
    assert "GPU-hours (training" in out and "SP 8 × DP 1" in out


def test_json_parses(capsys):
    assert main(["plan", PAPER, "--gpus", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["training"]["sp"] == 8
    assert len(data["training"]["arms"]) == 5
    assert data["gpu_hours"] == pytest.approx(
        data["training"]["gpu_hours"] + data["evaluation"]["gpu_hours"]
    )
    assert data["training"]["memory_gib"]["peak"] <= data["training"]["usable_gib"]


def test_shape_comes_from_config_json(tmp_path):
    model = tmp_path / "my-model"
    model.mkdir()
    hf = {
        "num_hidden_layers": 2,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
    }
    (model / "config.json").write_text(json.dumps(hf))
    shape, source = cost_plan.model_shape(_cfg(f"model.path={model}"))
    assert shape == memory.Shape(2, 256, 512, 8, 2, 1000) and source.endswith("config.json")
    with pytest.raises(cost_plan.PlanError, match="--shape"):
        cost_plan.model_shape(_cfg(f"model.path={tmp_path / 'unknown'}"))
