"""Each bad training setup fails up front (before any process group or GPU) with a clear error."""

from __future__ import annotations

import sys

import pytest

from anchorctx.experiment import config_from_dict
from anchorctx.training.launch import launch
from anchorctx.training.plan import (
    TrainingError,
    check_dataset,
    default_zero_stage,
    plan_parallelism,
)


def _cfg(tiny_config, **training):
    raw = tiny_config.model_dump(mode="json")
    raw["training"].update(training)
    return config_from_dict(raw)


def test_missing_model_path(tiny_config, tmp_path):
    raw = tiny_config.model_dump(mode="json")
    raw["model"] = {"path": str(tmp_path / "no-such-model"), "tokenizer": raw["model"]["tokenizer"]}
    with pytest.raises(TrainingError, match=r"model\.path does not exist"):
        launch(config_from_dict(raw))


def test_sp_must_divide_query_heads(tiny_config):
    with pytest.raises(TrainingError, match=r"sequence_parallel=3 does not divide .* 4 attention"):
        launch(_cfg(tiny_config, sequence_parallel=3, nproc=3))


def test_sp_and_kv_heads_must_split_or_replicate(tiny_config):
    raw = tiny_config.model_dump(mode="json")
    raw["model"]["tiny"].update(hidden_size=96, num_attention_heads=12, num_key_value_heads=4)
    raw["training"].update(sequence_parallel=6, nproc=6, global_batch_size=1)
    with pytest.raises(TrainingError, match="4 key/value heads"):
        launch(config_from_dict(raw))


def test_kv_heads_replicated_when_sp_exceeds_them(tiny_config):
    from anchorctx.models.loading import build_hf_config
    from anchorctx.training.plan import check_heads

    check_heads(build_hf_config(tiny_config.model, seq_len=512, vocab_size=100), 4)  # 4 q, 2 kv


def test_more_sp_ranks_than_processes(tiny_config):
    with pytest.raises(TrainingError, match=r"sequence_parallel=2 needs at least 2 processes"):
        plan_parallelism(_cfg(tiny_config, sequence_parallel=2, nproc=1))


def test_global_batch_must_divide(tiny_config):
    with pytest.raises(TrainingError, match=r"global_batch_size=3 is not divisible .* 2"):
        plan_parallelism(_cfg(tiny_config, global_batch_size=3, micro_batch_size=2))


def test_cpu_needs_the_sdpa_engine(tiny_config):
    with pytest.raises(TrainingError, match="engine=flex has no CPU backward"):
        plan_parallelism(_cfg(tiny_config, engine="flex"))


def test_parallel_plan_on_cpu_defaults(tiny_config):
    par = plan_parallelism(_cfg(tiny_config, sequence_parallel=2, nproc=None, zero_stage=None))
    assert (par.world, par.sp, par.dp, par.accum, par.zero_stage, par.engine) == (
        2,
        2,
        1,
        2,
        0,
        "sdpa",
    )


def test_zero_stage_default_is_2_for_one_gpu_with_an_offloaded_optimizer(tiny_config):
    """One rank partitions nothing: ZeRO-2 steps an offloaded optimizer faster there (the
    measured 256K row); several GPUs keep ZeRO-3, CPU runs none."""
    from anchorctx.training.loop import resume_fingerprint

    off = _cfg(tiny_config, memory={"offload_optimizer": True}, zero_stage=None)
    plain = _cfg(tiny_config, zero_stage=None)
    assert default_zero_stage(off, "cuda", 1) == 2
    assert default_zero_stage(off, "cuda", 2) == 3
    assert default_zero_stage(plain, "cuda", 1) == 3
    assert default_zero_stage(off, "cpu", 1) == 0
    # A run written under the old default resumes by naming its stage (the recorded parallel
    # layout still refuses any other stage).
    named = _cfg(tiny_config, memory={"offload_optimizer": True}, zero_stage=3)
    assert resume_fingerprint(named) == resume_fingerprint(off)


@pytest.fixture(scope="module")
def tokenizer(tiny_config):
    from anchorctx.models.loading import load_tokenizer

    return load_tokenizer(tiny_config.model)


def test_dataset_tokenizer_mismatch(tiny_config, packed_demo, tokenizer):
    from anchorctx.packing import load_packed

    _, manifest = load_packed(packed_demo)
    check_dataset(tiny_config, manifest, tokenizer)  # the real pair is accepted
    other = {**manifest, "tokenizer": {**manifest["tokenizer"], "fingerprint": "0123abcd"}}
    with pytest.raises(TrainingError, match="different tokenizer"):
        check_dataset(tiny_config, other, tokenizer)
    with pytest.raises(TrainingError, match="anchor token id"):
        check_dataset(tiny_config, {**manifest, "anchor_token_id": -1}, tokenizer)


def test_seq_len_beyond_the_dataset(tiny_config, packed_demo, tokenizer):
    from anchorctx.packing import load_packed

    _, manifest = load_packed(packed_demo)
    longer = tiny_config.model_copy(deep=True)
    longer.data.seq_len = 2 * int(manifest["seq_len"])
    with pytest.raises(TrainingError, match="longer than the packed rows"):
        check_dataset(longer, manifest, tokenizer)


def test_deepspeed_import_failure_is_explained(monkeypatch):
    from anchorctx.training.deepspeed_env import import_deepspeed

    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(RuntimeError, match="DeepSpeed is required for training"):
        import_deepspeed()


@pytest.mark.parametrize("on", ["all", "matrices"])
def test_weight_decay_groups(tiny_config, on):
    """AnchorContext decays every parameter by 0.1 (the default); 'matrices' spares 1-D ones."""
    import torch

    from anchorctx.training.engine import build_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    cfg = tiny_config.model_copy(deep=True)
    cfg.training.weight_decay_on = on
    opt = build_optimizer(model, cfg, "cpu")
    decay = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert len(decay) == 4  # every parameter is in exactly one group
    expected = [0.1, 0.1, 0.1, 0.1] if on == "all" else [0.1, 0.0, 0.0, 0.0]
    assert [decay[id(p)] for p in model.parameters()] == expected
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-8


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_lr_schedule(tiny_config, schedule):
    """A linear warmup, then constant (the paper's code, the default) or a cosine from lr down
    to a tenth of it at the last step; the engine's scheduler steps through exactly these."""
    import itertools
    import math

    import torch

    from anchorctx.training.engine import COSINE_FLOOR, build_optimizer, build_scheduler

    assert tiny_config.training.schedule == "constant"
    cfg = _cfg(tiny_config, lr=1e-3, warmup_steps=4, steps=24, schedule=schedule)
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model, cfg, "cpu")
    sched = build_scheduler(opt, cfg.training)
    lrs = []
    for _ in range(24):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    if schedule == "constant":
        assert lrs[4:] == pytest.approx([1e-3] * 20)
        return
    decay = lrs[4:]
    assert decay[0] == pytest.approx(1e-3) and decay[-1] == pytest.approx(COSINE_FLOOR * 1e-3)
    assert all(a > b for a, b in itertools.pairwise(decay))
    # Step 10 of the 20-step decay (19 intervals): the cosine at 10/19 of its half period.
    assert decay[len(decay) // 2] == pytest.approx(
        1e-3 * (COSINE_FLOOR + (1 - COSINE_FLOOR) * 0.5 * (1 + math.cos(math.pi * 10 / 19)))
    )


@pytest.mark.parametrize(
    ("heads", "kv", "sp"), [(4, 2, 3), (12, 4, 6), (4, 2, 4), (8, 8, 2), (4, 2, 1)]
)
def test_the_planner_checks_heads_as_training_does(heads, kv, sp):
    """cost_plan.heads_problem (the planner, from a Shape) gives training's own check_heads
    verdict (from a transformers config), message included."""
    from transformers import LlamaConfig

    from anchorctx.training.cost_plan import heads_problem
    from anchorctx.training.memory import Shape
    from anchorctx.training.plan import check_heads

    config = LlamaConfig(hidden_size=heads * 8, num_attention_heads=heads, num_key_value_heads=kv)
    try:
        check_heads(config, sp)
        expected = None
    except TrainingError as err:
        expected = str(err)
    assert heads_problem(Shape(2, heads * 8, 64, heads, kv, 100), sp) == expected
