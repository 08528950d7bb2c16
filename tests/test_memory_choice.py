"""training.memory.auto: the fastest predicted combination of memory options that fits."""

from __future__ import annotations

import dataclasses

import pytest

from anchorctx.cli import main
from anchorctx.evaluation import cost_plan as eval_plan
from anchorctx.experiment import load_config
from anchorctx.training import cost_plan, memory, memory_choice

PAPER = "configs/paper/llama2-7b-64k.yaml"
ONE_GPU = ["training.nproc=1", "training.sequence_parallel=1", "training.global_batch_size=1"]


def _cfg(*overrides: str):
    return load_config(PAPER, [*ONE_GPU, *overrides])


def _brute_force(cfg, kind, host_gib):
    """Every combination, by the same two models, independently of the search's order."""
    shape, _ = cost_plan.model_shape(cfg)
    base = cost_plan.memory_options(cfg, shape, 1, 1, zero=3)
    t = cfg.training
    best = None
    for tl in (False, True):
        for tm in (False, True):
            for off in (False, True):
                for keep in range(shape.layers + 1):
                    opt = dataclasses.replace(
                        base,
                        tiled_loss=tl,
                        tiled_mlp=tm,
                        offload_optimizer=off,
                        keep_activations=keep,
                    )
                    est = memory.predict(shape, 65536, opt)
                    use = cost_plan.usable_gib(kind) * memory.GIB
                    if est["peak"] > use or est["cpu"] > host_gib * memory.GIB:
                        continue
                    step = cost_plan.step_seconds(
                        shape,
                        65536,
                        t.attention,
                        opt,
                        kind,
                        accum=t.global_batch_size // t.micro_batch_size,
                    )
                    if best is None or step < best[0] - 1e-9:
                        best = (step, opt)
    return best


@pytest.mark.parametrize("gpu", ["h200", "h100"])
def test_auto_is_the_fastest_combination_that_fits(gpu):
    cfg = _cfg()
    kind = cost_plan.GPUS[gpu]
    choice = memory_choice.choose(
        cfg, memory.LLAMA2_7B, 1, 1, kind, host_gib=128, liger=False, zero=3
    )
    assert choice is not None
    assert choice.peak_gib <= cost_plan.usable_gib(kind)
    step, _ = _brute_force(cfg, kind, 128)
    # every kept-layer count is searched (and checkpoint offload besides): no slower than the
    # best combination here
    assert choice.step_s <= step + 1e-9
    assert memory_choice.choose(cfg, memory.LLAMA2_7B, 1, 1, kind, 128, False, 3) == choice


def test_auto_keeps_what_the_config_turned_on_and_off_means_as_written():
    on = _cfg("training.memory.offload_optimizer=true")
    choice = memory_choice.choose(on, memory.LLAMA2_7B, 1, 1, cost_plan.GPUS["h200"], 128, False)
    assert choice is not None and choice.options.offload_optimizer is True
    off = _cfg(
        "training.memory.auto=false", "training.sequence_parallel=8", "training.zero_stage=3"
    )
    assert memory_choice.resolve(off, cost_plan.GPUS["h200"], 1)[1] is None


def test_nothing_fits_is_none_and_the_plan_still_names_the_fix():
    cfg = _cfg("data.seq_len=1048576", "model.max_position_embeddings=1048576")
    kind = cost_plan.GPUS["h100"]
    assert memory_choice.choose(cfg, memory.LLAMA2_7B, 1, 1, kind, 128, False) is None
    with pytest.raises(cost_plan.PlanError, match="needs"):
        eval_plan.plan_experiment(cfg, "h100", gpus=1)


def test_plan_prints_the_choice_and_the_run_gets_it(capsys):
    sets = [arg for o in ONE_GPU for arg in ("--set", o)]
    assert main(["plan", PAPER, *sets, "--gpus", "1"]) == 0
    out = capsys.readouterr().out
    assert "layout auto: " in out and "fitting combinations" in out
    cfg = _cfg()
    run, choice = memory_choice.resolve(cfg, cost_plan.GPUS["h200"], 1, liger=False)
    assert choice is not None and run.training.memory.auto is False
    assert memory.Options.of_run(run.training, 1, 1) == choice.options
    assert run.training.sequence_parallel == choice.options.sp == 1
    # the written config reloads to the same options (ranks read it from a YAML dump)
    chosen = [f"{k}={str(v).lower()}" for k, v in choice.settings().items()]
    again = load_config(PAPER, [*ONE_GPU, *chosen, "training.memory.auto=false"])
    assert memory.Options.of_run(again.training, 1, 1) == choice.options


def test_training_memory_auto_as_a_value():
    cfg = _cfg("training.memory=auto")
    assert cfg.training.memory.auto is True and cfg.training.memory.tiled_mlp is False


def test_gpu_kind_from_the_device_name():
    assert memory_choice.gpu_kind("NVIDIA H100 80GB HBM3", 79.6).train == (
        cost_plan.GPUS["h100"].train
    )
    h200 = memory_choice.gpu_kind("NVIDIA H200", 139.8)
    assert h200.name == "H200" and not h200.estimate
    other = memory_choice.gpu_kind("NVIDIA L40S", 44.5)
    assert other.estimate and other.memory_gib == 44.5


def test_launch_chooses_for_this_hosts_gpu(monkeypatch):
    cfg = _cfg()
    monkeypatch.setattr(memory_choice, "liger_installed", lambda: False)
    monkeypatch.setattr(memory_choice, "local_gpu", lambda: ("NVIDIA H100 80GB HBM3", 79.6))
    monkeypatch.setattr(memory_choice, "host_memory_gib", lambda: 125.0)
    run, choice, line = memory_choice.for_launch(cfg, 1, 1)
    assert choice is not None and line.startswith("layout auto: ")
    assert choice.usable_gib == pytest.approx(79.6 * (1 - memory.RESERVED_FRACTION))
    assert run.training.memory.auto is False
    assert choice.record()["settings"] == choice.settings()
    monkeypatch.setattr(memory_choice, "local_gpu", lambda: None)
    same, none, why = memory_choice.for_launch(cfg, 1, 1)
    assert same is cfg and none is None and "nvidia-smi" in why


def test_auto_takes_the_fused_kernels_only_at_the_width_they_were_measured_on():
    """Liger's kernels where they were measured to help (the 7B width); a narrower model keeps
    transformers' kernels unless its config names liger."""
    kind = cost_plan.GPUS["h100"]
    wide = memory_choice.choose(_cfg(), memory.LLAMA2_7B, 1, 1, kind, 128, liger=True)
    assert wide is not None and wide.options.kernels == "liger"
    narrow_shape = dataclasses.replace(memory.LLAMA2_7B, hidden=1024, intermediate=2816)
    narrow = memory_choice.choose(_cfg(), narrow_shape, 1, 1, kind, 128, liger=True)
    assert narrow is not None and narrow.options.kernels == "torch"
    named = memory_choice.choose(
        _cfg("training.kernels=liger"), narrow_shape, 1, 1, kind, 128, liger=True
    )
    assert named is not None and named.options.kernels == "liger"
