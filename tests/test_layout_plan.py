"""The layout plan: the DP × SP split, the ZeRO stage and DeepSpeed's communication settings,
chosen with the memory options (anchorctx.training.layout_plan, memory_choice.choose_layout).
Arithmetic only: no GPU, no timing."""

from __future__ import annotations

import pytest

from anchorctx.experiment import load_config
from anchorctx.training import cost_plan, layout_plan, memory, memory_choice
from anchorctx.training.deepspeed_env import deepspeed_config
from anchorctx.training.plan import plan_parallelism

PAPER = "configs/paper/llama2-7b-64k.yaml"
SHAPE = memory.LLAMA2_7B
H200 = cost_plan.GPUS["h200"]


def _cfg(*overrides: str):
    return load_config(PAPER, ["training.device=cpu", *overrides])


def _comm(sp: int, zero: int, gpus: int = 2, nodes: int = 1, tokens: int = 16384):
    links, inter = layout_plan.links_for("h200")
    lay = layout_plan.Layout(gpus, nodes, sp, zero, overlap_comm=True)
    return layout_plan.comm_seconds(SHAPE, tokens, lay, 0, links, inter)


def test_each_stage_and_split_pays_its_own_collectives():
    dp = _comm(sp=1, zero=2)
    assert dp["ulysses"] == 0 and dp["zero3_gather"] == 0
    assert dp["grad_reduce"] > 0 and dp["param_gather"] > 0
    sp = _comm(sp=2, zero=3)
    assert sp["ulysses"] > 0 and sp["zero3_gather"] > 0 and sp["param_gather"] == 0
    # Two nodes: ZeRO's collectives cross the slower link; an SP group inside a node does not.
    two = _comm(sp=2, zero=3, gpus=2, nodes=2)
    assert two["zero3_gather"] > sp["zero3_gather"] and two["ulysses"] == sp["ulysses"]
    wide = _comm(sp=4, zero=3, gpus=2, nodes=2)
    assert wide["ulysses"] > _comm(sp=4, zero=3, gpus=4)["ulysses"]


# Full-depth Llama-2-7B shape on H200s, liger kernels (fused RoPE), flash-attn-4; the rows
# bench/training.py trains on (heavy-tailed documents, seeds 0 to rows - 1). (GPUs, SP, ZeRO,
# overlap_comm, row tokens, kept layers, tiled loss, variant, rows a step, measured s a step,
# attention kernels: cudnn-triton where flash-attn-4 was not installed).
# 2 GPUs: docs/benchmarks/2026-11-28-attention-fa4.md, the 16K rows after the keys' gather got
# its own backward; 4 GPUs: docs/benchmarks/2026-11-28-layout-4gpu.md. The plan must be within
# 10% of each.
MEASURED = (
    (2, 1, 2, True, 16384, 32, False, "anchor", 2, 1.293, "fa4"),
    (2, 1, 2, True, 16384, 32, False, "full", 2, 1.622, "fa4"),
    (2, 1, 2, True, 16384, 32, False, "anchor", 2, 1.389, "cudnn-triton"),
    (2, 1, 2, True, 16384, 32, False, "full", 2, 1.696, "cudnn-triton"),
    (2, 1, 2, True, 32768, 17, True, "anchor", 2, 2.842, "fa4"),
    (2, 1, 2, True, 32768, 17, True, "full", 2, 4.414, "fa4"),
    (4, 1, 2, True, 32768, 23, True, "anchor", 4, 3.150, "fa4"),
    (4, 1, 2, True, 32768, 23, True, "full", 4, 4.199, "fa4"),
    (4, 1, 2, True, 32768, 20, False, "anchor", 4, 3.204, "fa4"),
    (4, 1, 2, False, 32768, 20, False, "anchor", 4, 3.169, "fa4"),
    (4, 1, 3, True, 32768, 23, True, "anchor", 4, 3.229, "fa4"),
    (4, 2, 2, True, 32768, 32, False, "anchor", 4, 3.186, "fa4"),
    (4, 2, 2, True, 32768, 32, False, "full", 2, 2.198, "fa4"),
    # one micro-step of four: the optimizer step fell in every fourth (bench of that day)
    (4, 4, 2, True, 65536, 32, False, "anchor", 1, 1.538, "fa4"),
    (4, 4, 2, True, 65536, 32, False, "full", 1, 3.050, "fa4"),
)


def _bench_pairs(tokens: int, variant: str, sp: int, rows: int) -> float | None:
    """Mean attended pairs of the bench's rows (what its printed plan used), None for full."""
    if variant == "full":
        return None
    from anchorctx.attention import build_layout
    from anchorctx.demo.synthetic import VOCAB, synthetic_row

    made = [synthetic_row(tokens, variant, seed=i, vocab=VOCAB, sp=sp) for i in range(rows)]
    return sum(build_layout(r.seg_lens, variant, r.seg_doc).attended_pairs for r in made) / rows


@pytest.mark.parametrize(
    "row",
    MEASURED,
    ids=lambda r: f"{r[0]}gpu-sp{r[1]}-z{r[2]}-{r[4]}-{r[7]}-keep{r[5]}-ov{r[3]:d}-{r[10]}",
)
def test_the_step_model_is_within_10_percent_of_the_measured_steps(row):
    gpus, sp, zero, overlap, tokens, keep, tiled_loss, variant, rows, measured, kernels = row
    opt = memory.Options(
        gpus=gpus, sp=sp, zero=zero, keep_activations=keep, tiled_loss=tiled_loss, kernels="liger"
    )
    dp = gpus // sp
    step = cost_plan.step_seconds(
        SHAPE,
        tokens,
        variant,
        opt,
        H200,
        overlap_comm=overlap,
        attention=kernels,
        accum=max(rows // dp, 1),
        pairs=_bench_pairs(tokens, variant, sp, rows),
    )
    assert step == pytest.approx(measured, rel=0.10)


def test_the_plan_assumes_fa4_only_where_it_runs(monkeypatch):
    cost_plan.fa4_installed.cache_clear()  # looked up once per process otherwise
    monkeypatch.setattr(cost_plan, "fa4_installed", cost_plan.fa4_installed.__wrapped__)
    a100 = cost_plan.GPUS["a100-80g"]
    assert cost_plan.attention_kernels(a100) == "cudnn-triton"
    monkeypatch.setattr(cost_plan.importlib.util, "find_spec", lambda name: object())
    assert cost_plan.attention_kernels(H200) == "fa4"
    assert cost_plan.attention_kernels(a100) == "cudnn-triton"  # no sm80 kernels

    def missing(name):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(cost_plan.importlib.util, "find_spec", missing)
    assert cost_plan.attention_kernels(H200) == "cudnn-triton"


def test_the_choice_is_the_fastest_layout_and_names_the_others():
    cfg = _cfg("training.nproc=2")
    choice = memory_choice.choose_layout(cfg, SHAPE, 2, 1, H200, 256, liger=True)
    assert choice is not None
    layouts = {(a.sp, a.zero) for a in choice.alternatives}
    assert (choice.options.sp, choice.options.zero) not in layouts
    assert layouts | {(choice.options.sp, choice.options.zero)} == {(1, 2), (1, 3), (2, 2), (2, 3)}
    assert all(choice.step_s <= a.step_s for a in choice.alternatives if a.step_s is not None)
    line = choice.line()
    assert line.startswith("layout auto: SP ") and "runners-up: " in line
    record = choice.record()
    assert record["layout"] == {"sp": choice.options.sp, "dp": choice.dp, "zero_stage": 2}
    assert len(record["alternatives"]) == 3


def test_explicit_values_win():
    cfg = _cfg("training.nproc=2", "training.sequence_parallel=2", "training.zero_stage=3")
    choice = memory_choice.choose_layout(cfg, SHAPE, 2, 1, H200, 256, liger=True)
    assert (choice.options.sp, choice.options.zero, choice.alternatives) == (2, 3, ())
    # A communication setting the config names stays; the others are the plan's.
    cfg = _cfg("training.nproc=2", "training.zero_stage=2", "training.comm.overlap_comm=false")
    run, choice = memory_choice.resolve(cfg, H200, 2, host_gib=256, liger=True)
    assert run.training.comm.overlap_comm is False and choice.overlap_comm is False
    assert run.training.zero_stage == 2 and run.training.sequence_parallel == choice.options.sp


def test_the_chosen_settings_reach_deepspeed():
    cfg = _cfg("training.nproc=2")
    run, choice = memory_choice.resolve(cfg, H200, 2, host_gib=256, liger=True)
    assert run.training.memory.auto is False and run.training.sequence_parallel != "auto"
    par = plan_parallelism(run, world=2)
    zero = deepspeed_config(run, par)["zero_optimization"]
    assert zero["stage"] == choice.options.zero == 2
    assert zero["overlap_comm"] is True
    assert "stage3_prefetch_bucket_size" not in zero  # stage-3 keys only at stage 3
    z3 = _cfg("training.nproc=2", "training.comm.prefetch_bucket_size=200000000")
    par3 = plan_parallelism(z3.model_copy(update={}), world=2)
    par3 = par3.__class__(**{**par3.to_dict(), "zero_stage": 3})
    assert deepspeed_config(z3, par3)["zero_optimization"]["stage3_prefetch_bucket_size"] == 2e8


def test_auto_sp_on_cpu_is_one_row_a_rank_and_config_checks_accept_it():
    cfg = _cfg("training.nproc=2")
    assert cfg.training.sequence_parallel == "auto"
    assert cfg.training.layout_problem() is None
    par = plan_parallelism(cfg, world=2)
    assert (par.sp, par.dp) == (1, 2)
    with pytest.raises(ValueError, match="sequence_parallel"):
        _cfg("training.sequence_parallel=0")


def test_one_gpu_keeps_the_long_standing_stages():
    cfg = _cfg("training.nproc=1")
    assert memory_choice.zero_candidates(cfg, 1) == [3]
    off = _cfg("training.nproc=1", "training.memory.offload_optimizer=true")
    assert memory_choice.zero_candidates(off, 1) == [2]
    assert memory_choice.zero_candidates(cfg, 8) == list(layout_plan.STAGES)


def test_sp_candidates_follow_heads_and_the_batch():
    cfg = _cfg("training.global_batch_size=4")
    # 8 GPUs: DP 8 does not divide a batch of 4 rows, so SP 1 is out.
    assert memory_choice.sp_candidates(cfg, SHAPE, 8) == [2, 4, 8]
    fixed = _cfg("training.sequence_parallel=4")
    assert memory_choice.sp_candidates(fixed, SHAPE, 8) == [4]


def test_the_step_parts_name_what_is_exposed_and_sum_to_the_step():
    sp4 = memory.Options(gpus=4, sp=4, zero=2, keep_activations=32, kernels="liger")
    parts = cost_plan.step_parts(SHAPE, 65536, "anchor", sp4, H200, overlap_comm=True)
    assert set(parts) == set(cost_plan.STEP_PARTS)
    assert sum(parts.values()) == cost_plan.step_seconds(
        SHAPE, 65536, "anchor", sp4, H200, overlap_comm=True
    )
    assert parts["ulysses"] > 0 and parts["zero3_gather"] == 0
    assert parts["grad_reduce"] == 0  # overlapped behind backward
    dp = memory.Options(gpus=4, sp=1, zero=2, keep_activations=23, kernels="liger")
    serial = cost_plan.step_parts(SHAPE, 32768, "anchor", dp, H200, overlap_comm=False)
    assert serial["ulysses"] == 0 and serial["grad_reduce"] > 0


def test_the_plan_prints_where_a_step_goes_once_per_split():
    from anchorctx.evaluation.cost_plan import format_plan, plan_experiment

    text = format_plan(plan_experiment(_cfg("training.kernels=liger"), "h200", gpus=4))
    lines = [x for x in text.splitlines() if x.startswith("  where a step goes (")]
    # full attention alone; the document-masked arms (same attention work) share one line
    assert len(lines) == 2 and lines[0].startswith("  where a step goes (full): compute ")
    assert "intra_doc, intra_doc_reset, anchor" in lines[1]
    assert all("per-layer hooks and launches" in x for x in lines)  # never 0 at full depth
