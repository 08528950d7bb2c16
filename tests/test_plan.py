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
    cfg = _cfg(
        "training.memory.offload_optimizer=true",
        "training.sequence_parallel=8",
        "training.zero_stage=3",
    )
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

    manual = ["--set", "training.memory.auto=false"]  # auto would choose options that fit
    assert main(["plan", PAPER, "--gpu", "h200", "--gpus", "1", *manual]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("anchorctx plan: ") and "--gpus 2" in lines[0]


def test_a_gpu_count_beyond_the_configs_sp_names_the_sp_it_needs():
    with pytest.raises(
        cost_plan.PlanError, match=r"--gpus (\d+) and training.sequence_parallel=\1\b"
    ):
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
    """The fit (docs/benchmarks/2026-11-24-plan-model.md) stays within 10% of every measured row."""
    h200 = cost_plan.GPUS["h200"]
    for row in cost_plan.STEP_ROWS:
        opt = memory.Options(kernels=row.kernels, keep_activations=row.keep)
        opt = dataclasses.replace(opt, tiled_loss=row.tiled_loss)
        got = cost_plan.row_seconds(cost_plan.BENCH_SHAPE, row.tokens, row.variant, opt, h200)
        assert got == pytest.approx(row.step_s, rel=0.10), row
    # The full-depth 7B row at 256K on one H200 (tiled MLP and loss, optimizer offload stepped by
    # torch's AdamW, as it ran then): 47.4 s.
    opt = memory.Options(tiled_mlp=True, tiled_loss=True, offload_optimizer=True, cpu_adam="torch")
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
    assert data["training"]["sp"] * data["training"]["dp"] == 8  # the layout plan's split
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


# ------------------------------------------------------------------------------ document lengths
ARMS = [
    {"name": "full", "attention": "full"},
    {"name": "intra_doc", "attention": "intra_doc"},
    {"name": "anchor", "attention": "anchor"},
]


def _arms_of(cfg, *overrides: str, **top):
    from anchorctx.experiment import config_from_dict

    raw = {**cfg.model_dump(mode="json"), "variants": ARMS, **top}
    return config_from_dict(raw, list(overrides))


def _run_pairs(arm, dataset, manifest, par) -> float:
    """The mean of build_layout(...).attended_pairs over the rows the run reads (the rows and
    layouts training builds: BatchPlan's order, make_row's cut and padding)."""
    from anchorctx.attention import build_layout
    from anchorctx.training.data import BatchPlan

    t = arm.training
    plan = BatchPlan(
        dataset,
        seed=arm.seed,
        par=par,
        seq_len=arm.data.seq_len,
        variant=t.attention,
        pad_id=int(manifest["anchor_token_id"]),
        rank=0,
    )
    pairs = [
        build_layout(row.seg_lens, t.attention, row.seg_doc).attended_pairs
        for step in range(t.steps)
        for row in (plan._row(i) for i in plan.row_indices(step))
    ]
    return sum(pairs) / len(pairs)


@pytest.mark.parametrize("steps", [4, 100])  # 8 rows of the dataset's 117; more than an epoch
def test_attention_pairs_come_from_the_packed_dataset(tiny_config, packed_demo, steps):
    from anchorctx.packing import load_packed

    cfg = _arms_of(tiny_config, f"training.steps={steps}")
    plan = eval_plan.plan_experiment(cfg, "h200", gpus=1)
    t = plan.training
    dataset, manifest = load_packed(packed_demo)
    par = cost_plan.layout(cfg, t.shape, 1, 1)
    h200 = cost_plan.GPUS["h200"]
    for arm, got in zip(cfg.arms(), t.arms, strict=True):
        if arm.training.attention == "full":
            assert got.document_lengths is None
            continue
        lengths = got.document_lengths
        assert lengths.source == "packed dataset" and lengths.dataset == str(packed_demo)
        assert lengths.rows == steps * arm.training.global_batch_size
        assert lengths.pairs == pytest.approx(_run_pairs(arm, dataset, manifest, par), rel=1e-12)
        assert lengths.detail.startswith(f"packed dataset {packed_demo}, {lengths.rows} rows")
        # The step uses those pairs in place of T·D/2.
        opt = cost_plan.memory_options(arm, t.shape, 1, 1, t.zero_stage)
        ck = arm.training.activation_checkpointing
        step = cost_plan.step_seconds(
            t.shape,
            t.seq_len,
            arm.training.attention,
            opt,
            h200,
            accum=t.accum,
            rows=t.micro,
            checkpointing=ck,
            pairs=lengths.pairs,
        )
        assert got.step_s == pytest.approx(step)
    out = eval_plan.format_plan(plan)
    assert f"\n  document lengths: packed dataset {packed_demo}, {steps * 2} rows (D=" in out
    data = json.loads(json.dumps(plan.to_dict()))
    arms = data["training"]["arms"]
    assert arms[0]["document_lengths"] is None
    assert arms[2]["document_lengths"]["source"] == "packed dataset"
    assert arms[2]["document_lengths"]["pairs"] == t.arms[2].document_lengths.pairs


def test_pairs_follow_the_rows_training_builds(packed_demo):
    """Cut to seq_len and padded to a multiple of SP as make_row does, every row's pairs equal
    build_layout's for each document mask."""
    from anchorctx.attention import build_layout
    from anchorctx.packing import load_packed
    from anchorctx.training.data import make_row, packed_segments, trained_pairs

    dataset, _ = load_packed(packed_demo)
    segments = packed_segments(dataset)
    for seq_len, sp in ((512, 1), (512, 3), (300, 8), (1000, 1)):
        pairs = trained_pairs(*segments, seq_len, sp)
        assert len(pairs.tokens) == len(dataset)
        for i in range(0, len(dataset), 7):
            row = make_row(dataset[i], seq_len, sp, "anchor", pad_id=0)
            assert pairs.tokens[i] == len(row.input_ids), (seq_len, sp, i)
            for variant in ("full", "intra_doc", "anchor"):
                layout = build_layout(row.seg_lens, variant, row.seg_doc)
                assert layout.attended_pairs == pairs.of(variant)[i], (seq_len, sp, i, variant)


def test_without_a_packed_dataset_d_is_assumed_and_said(tmp_path, capsys):
    cfg = _cfg(f"run_root={tmp_path}")
    plan = cost_plan.plan_training(cfg, "h200", gpus=8)
    h200 = cost_plan.GPUS["h200"]
    for arm, got in zip(cfg.arms(), plan.arms, strict=True):
        if arm.training.attention == "full":
            assert got.document_lengths is None
            continue
        lengths = got.document_lengths
        assert lengths.source == "assumed" and lengths.rows == 0
        assert lengths.detail == "assumed D=3.1K (no packed dataset yet)"
        assert lengths.doc_tokens == cost_plan.doc_tokens(65536)
        # The old estimate: T·D/2 pairs.
        opt = cost_plan.memory_options(arm, plan.shape, 8, plan.sp, plan.zero_stage)
        step = cost_plan.step_seconds(
            plan.shape,
            65536,
            arm.training.attention,
            opt,
            h200,
            accum=plan.accum,
            rows=plan.micro,
            overlap_comm=arm.training.zero_stage is None or plan.zero_stage >= 2,
        )
        assert got.step_s == pytest.approx(step)
    assert main(["plan", PAPER, "--gpus", "8", "--set", f"run_root={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "\n  document lengths: assumed D=3.1K (no packed dataset yet)\n" in out
    assert main(["plan", PAPER, "--gpus", "8", "--json", "--set", f"run_root={tmp_path}"]) == 0
    arms = json.loads(capsys.readouterr().out)["training"]["arms"]
    assert arms[3]["document_lengths"]["source"] == "assumed"


def test_a_packed_dataset_of_another_seq_len_is_ignored(tiny_config, packed_demo, tmp_path):
    """The config's dataset, its manifest saying another seq_len: noted, and D assumed."""
    import shutil

    cfg = _arms_of(tiny_config, run_root=str(tmp_path))
    copy = cfg.experiment_dir / "data" / packed_demo.name
    shutil.copytree(packed_demo, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "seq_len": 1024}))
    lengths = cost_plan.plan_training(cfg, "h200", gpus=1).arms[2].document_lengths
    assert lengths.source == "assumed"
    assert f"packed dataset {copy} has seq_len 1024, not data.seq_len 512: ignored" in (
        lengths.detail
    )


def test_lm_eval_suites_are_listed_as_not_estimated():
    """lm-eval's tasks have no cost model: the plan names them and leaves them out of the
    totals rather than dropping them silently."""
    cfg = _cfg("evaluation.suites=[ruler, lm_eval:babilong]")
    plan = eval_plan.plan_evaluation(cfg, memory.LLAMA2_7B, "h200")
    assert plan.unestimated == ("lm_eval:babilong",)
    assert [s.suite for s in plan.suites] == ["ruler"]
    ruler_only = eval_plan.plan_evaluation(_cfg("evaluation.suites=[ruler]"), memory.LLAMA2_7B)
    assert plan.gpu_hours == ruler_only.gpu_hours and ruler_only.unestimated == ()
    text = eval_plan.format_plan(eval_plan.plan_experiment(cfg, "h200", gpus=8))
    assert "not estimated (no cost model; not in the totals): lm_eval:babilong" in text


def test_an_sp_the_heads_do_not_allow_is_refused_as_training_refuses_it():
    """Issue #58 row 10: SP 3 on a 4-head model planned on 3 GPUs was printed as SP 1 × DP 3."""
    four_heads = memory.Shape(
        layers=2, hidden=256, intermediate=512, heads=4, kv_heads=4, vocab=512
    )
    cfg = _cfg("training.sequence_parallel=3", "training.global_batch_size=3")
    with pytest.raises(cost_plan.PlanError, match=r"sequence_parallel=3 does not divide .* 4 "):
        cost_plan.layout(cfg, four_heads, 3, 1)
    # Fewer GPUs than the config names: planned on them (a config written for 8 GPUs).
    assert cost_plan.layout(cfg, four_heads, 2, 1).sp in (1, 2)


def test_host_memory_must_be_a_positive_number(capsys):
    """Issue #58 row 9: `--host-gib -5` (or nan) said the run needs a larger GPU."""
    for bad in ("-5", "nan", "0", "lots"):
        with pytest.raises(SystemExit) as exit_:
            main(["plan", PAPER, "--gpus", "8", "--host-gib", bad])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "--host-gib" in err and "larger GPU" not in err


def test_the_json_plan_is_strict_json():
    """`plan --json` printed `Infinity` where a value was unbounded: strict JSON has None."""
    from anchorctx.evaluation.commands import _finite

    data = {"a": float("inf"), "b": [1.0, float("nan")], "c": {"d": 2}}
    assert json.loads(json.dumps(_finite(data), allow_nan=False)) == {
        "a": None,
        "b": [1.0, None],
        "c": {"d": 2},
    }
