"""Ulysses sequence parallelism is exact: SP=2 on two gloo processes equals one process
(and so does DP=2, which checks the data-parallel half of the gradient normalisation).

Anchor variant, GQA (4 q heads, 2 KV heads), fp32, one global batch of 2 rows with gradient
accumulation, for every ZeRO stage. Compared against one process:

- the logits of the first micro-batch, the global loss and the gradient norm;
- every gradient, through one plain SGD step: the update ``p1 - p0 = -lr · clip · g`` is the
  gradient itself (the clip factor depends only on the grad norm, checked above). AdamW would
  hide exactly the bugs this test exists for: its first step ``lr · g / (|g| + eps)`` does not
  depend on the gradient's scale (a gradient SP× too large passes) and turns fp32 summation-order
  noise in near-zero gradients into full ``±lr`` steps (an ill-conditioned comparison).

Tolerances. Every run computes the same fp32 function; only the order of reductions differs
(all-to-all, all-reduce and reduce-scatter sum partial results in another order than one
process does), which moves results by a few ulps of the accumulated sums: ~1e-7 relative is
what is observed on the logits, loss and grad norm, so 1e-5 leaves a 100× margin. A gradient is
compared by the norm of the difference of the two steps, which may be RTOL of the step taken
plus what fp32 rounds away when the step is recovered as ``p1 - p0`` (one ulp of each element of
``p``; the largest difference observed, 3.8e-6 of the step on q_proj, is such rounding: those
steps are 1e-4 per element on weights of 2e-2, whose ulp is 2e-9). Not relative to the
parameter, whose size has nothing to do with the gradient. :func:`test_comparison_catches_one_dropped_token` shows the check is
tight enough to see ONE target of the ~1,000 in the batch go missing.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from distributed import run_distributed, torch_extensions  # noqa: F401  (fixture)

STAGES = (0, 1, 2, 3)
RTOL = 1e-5  # fp32 reduction-order noise is ~1e-7 relative (see the module docstring)
SGD_LR = 1.0  # large, so the step p1 - p0 stays well above the fp32 rounding of p
EPS32 = torch.finfo(torch.float32).eps


def _config(tiny_config, sp: int, world: int):
    return tiny_config.model_copy(
        update={
            "training": tiny_config.training.model_copy(
                update={
                    "attention": "anchor",
                    "sequence_parallel": sp,
                    "nproc": world,
                    "warmup_steps": 0,
                }
            )
        },
    )


def _step_outputs(
    rank: int,
    world: int,
    cfg_yaml: str,
    data_dir: str,
    out: str,
    drops: tuple[bool, ...],
    ulysses_first: bool,
) -> None:
    """One rank: for each ZeRO stage, logits of the first micro-batch, then one SGD step; once
    per entry of ``drops`` (True: with one target dropped), each on freshly loaded models.
    ``ulysses_first``: before anything else loads a model in this fresh interpreter, the check
    of :func:`_wrapped_then_loaded` (its failure is recorded, not raised)."""
    import traceback

    import torch.distributed as dist
    import yaml

    from anchorctx.experiment import config_from_dict
    from anchorctx.models.loading import load_model
    from anchorctx.packing import load_packed
    from anchorctx.training.data import BatchPlan
    from anchorctx.training.deepspeed_env import import_deepspeed
    from anchorctx.training.engine import (
        build_engine,
        init_distributed,
        loss_scale,
        register_sequence_parallel,
        shutdown_distributed,
    )
    from anchorctx.training.loop import preflight
    from anchorctx.training.loss import IGNORE_INDEX
    from anchorctx.training.plan import plan_parallelism
    from anchorctx.training.step import forward_logits, train_step

    cfg = config_from_dict(yaml.safe_load(cfg_yaml))
    init_distributed("cpu")
    # DeepSpeed as training loads it: imported by init_distributed, after its accelerator was
    # chosen and without MLflow (a plain `import deepspeed` first also imported MLflow, ~1.5 s
    # of CPU a rank, for its autotuner).
    deepspeed = import_deepspeed()
    base = plan_parallelism(cfg, world=world)
    pre = preflight(cfg, base, data_dir=Path(data_dir))
    dataset, _ = load_packed(pre.data_dir)
    wrapper = None
    if ulysses_first:
        try:
            _wrapped_then_loaded(rank, world, cfg, base, pre, dataset)
        except AssertionError:
            wrapper = f"rank {rank}: {traceback.format_exc(limit=-1)}"
    runs = []
    for drop_target in drops:
        # Every stage's model runs inside the Ulysses wrapper (one wrapper and mpu per layout).
        models = {
            z: load_model(
                cfg.model, seq_len=cfg.data.seq_len, dtype="float32", tokenizer=pre.tokenizer
            )
            for z in STAGES
        }
        for model in models.values():
            mpu = register_sequence_parallel(model, base, cfg.data.seq_len)
        results = {}
        for stage in STAGES:
            par = replace(base, zero_stage=stage)
            model = models[stage]
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            sgd = torch.optim.SGD(model.parameters(), lr=SGD_LR)
            engine = build_engine(model, cfg, par, mpu, optimizer=sgd)
            plan = BatchPlan(
                dataset,
                seed=cfg.seed,
                par=par,
                seq_len=cfg.data.seq_len,
                variant="anchor",
                pad_id=0,
                rank=rank,
            )
            data = plan.step_data(0, "cpu")
            if drop_target and rank == 0:  # the bug a broken shard would cause: one target lost
                targets = data.micro_batches[0].targets
                first = int((targets[0] != IGNORE_INDEX).nonzero()[0])
                targets[0, first] = IGNORE_INDEX
            with torch.no_grad():
                local = forward_logits(engine, data.micro_batches[0], "sdpa")  # [B, T/SP, V]
            shards = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(shards, local.contiguous())
            stats = train_step(engine, data, "sdpa", loss_scale(engine, par))
            with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                step = {n: p.detach() - before[n] for n, p in engine.module.named_parameters()}
            # What storing p1 and subtracting p0 may round away: one fp32 ulp of each element.
            ulp = {n: float(torch.linalg.vector_norm(EPS32 * p.abs())) for n, p in before.items()}
            results[stage] = {
                "logits": torch.cat(shards, dim=1),
                "loss": stats.loss,
                "grad_norm": stats.grad_norm,
                "step": step,
                "ulp": ulp,
            }
        runs.append(results)
    if rank == 0:
        torch.save({"runs": runs, "wrapper": wrapper}, out)
    shutdown_distributed()


def _run(
    tiny_config,
    packed_demo,
    sp: int,
    world: int,
    out: Path,
    drops: tuple[bool, ...] = (False,),
    ulysses_first: bool = False,
) -> dict:
    """``_step_outputs`` on ``world`` ranks: ``runs``, one result per entry of ``drops``, and
    ``wrapper``, what failed of the Ulysses check (None: passed or not run)."""
    cfg = _config(tiny_config, sp, world)
    args = (cfg.to_yaml(), str(packed_demo), str(out), drops, ulysses_first)
    run_distributed(_step_outputs, world, *args)
    return torch.load(out, weights_only=True)


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def _compare(single: dict, sharded: dict) -> None:
    for stage in STAGES:
        ref, got = single[stage], sharded[stage]
        # Gathered over all ranks: SP shards make up the reference's first row; under DP,
        # rank 0's row (the first T positions) is the reference's first row.
        t = ref["logits"].shape[1]
        assert _rel(got["logits"][:, :t], ref["logits"]) <= RTOL, f"ZeRO-{stage}: logits differ"
        assert _rel(got["loss"], ref["loss"]) <= RTOL, f"ZeRO-{stage}: loss"
        assert ref["grad_norm"] is not None and got["grad_norm"] is not None
        assert _rel(got["grad_norm"], ref["grad_norm"]) <= RTOL, f"ZeRO-{stage}: grad norm"
        _compare_gradients(stage, ref, got)


def _compare_gradients(stage: int, ref: dict, got: dict) -> None:
    for name, step in ref["step"].items():
        diff = float(torch.linalg.vector_norm(got["step"][name] - step))
        bound = RTOL * float(torch.linalg.vector_norm(step)) + ref["ulp"][name]
        assert diff <= bound, f"ZeRO-{stage}: gradient of {name}: |diff| {diff:.2e} > {bound:.2e}"


@pytest.fixture(scope="module")
def one_process(tiny_config, packed_demo, tmp_path_factory, torch_extensions):  # noqa: F811
    """One process, computed once: the reference both tests below compare with, then the same
    step with one target dropped (on freshly loaded models, in the same process: one
    interpreter start and DeepSpeed set-up less than a process of its own)."""
    out = tmp_path_factory.mktemp("sp_reference") / "one.pt"
    return _run(tiny_config, packed_demo, sp=1, world=1, out=out, drops=(False, True))["runs"]


@pytest.fixture(scope="module")
def single(one_process) -> dict:
    return one_process[0]


@pytest.fixture(scope="module")
def sp2(tiny_config, packed_demo, tmp_path_factory, torch_extensions) -> dict:  # noqa: F811
    """SP=2 on two processes, computed once: first the Ulysses wrapper check of
    test_ulysses_wrapper_survives_a_later_model_load (the first model loads of the fresh
    interpreters), then the step outputs test_sp2_and_dp2_equal_one_process compares (the same
    config and process group: one process start and DeepSpeed set-up less than one each)."""
    out = tmp_path_factory.mktemp("sp2") / "sp2.pt"
    return _run(tiny_config, packed_demo, sp=2, world=2, out=out, ulysses_first=True)


@pytest.mark.distributed
def test_sp2_and_dp2_equal_one_process(single, sp2, tiny_config, packed_demo, tmp_path):
    _compare(single, sp2["runs"][0])
    # Two data-parallel ranks (each one row of the batch, no accumulation): same update.
    dp2 = _run(tiny_config, packed_demo, sp=1, world=2, out=tmp_path / "dp2.pt")["runs"][0]
    _compare(single, dp2)
    # The stages agree with each other (same objective; fp32 reduction order differs).
    for stage in STAGES[1:]:
        assert _rel(single[stage]["grad_norm"], single[0]["grad_norm"]) <= RTOL


@pytest.mark.distributed
def test_comparison_catches_one_dropped_token(one_process):
    """The criterion above is not vacuous: losing one target of the batch (what a shard that
    drops or duplicates a token boundary does) fails it, on the gradients and not only the loss."""
    single, broken = one_process
    for stage in STAGES:
        # The same weights and inputs (the logits come before the step): only the target differs.
        assert torch.equal(broken[stage]["logits"], single[stage]["logits"]), stage
        with pytest.raises(AssertionError, match="gradient of"):
            _compare_gradients(stage, single[stage], broken[stage])
    with pytest.raises(AssertionError, match="loss"):
        _compare(single, broken)


def _wrapped_then_loaded(rank: int, world: int, cfg, par, pre, dataset) -> None:
    """One rank: wrap a model for Ulysses, THEN load another (the order that used to undo the
    wrapper: loading registers the plain attention again); the first must still run SP."""
    import torch.distributed as dist
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from anchorctx.attention.hf import anchorctx_attention, attention_name, model_inputs
    from anchorctx.models.loading import load_model
    from anchorctx.training.data import BatchPlan
    from anchorctx.training.engine import register_sequence_parallel
    from anchorctx.training.step import forward_logits

    def load():
        return load_model(
            cfg.model, seq_len=cfg.data.seq_len, dtype="float32", tokenizer=pre.tokenizer
        )

    wrapped = load()
    mpu = register_sequence_parallel(wrapped, par, cfg.data.seq_len)
    later = load()  # the "wrong" order
    assert register_sequence_parallel(wrapped, par, cfg.data.seq_len) is mpu  # idempotent
    assert attention_name(wrapped) == "anchorctx+ulysses" and attention_name(later) == "anchorctx"
    assert ALL_ATTENTION_FUNCTIONS["anchorctx"] is anchorctx_attention
    assert ALL_ATTENTION_FUNCTIONS["anchorctx+ulysses"] is not anchorctx_attention

    mb = (
        BatchPlan(
            dataset,
            seed=cfg.seed,
            par=par,
            seq_len=cfg.data.seq_len,
            variant="anchor",
            pad_id=0,
            rank=rank,
        )
        .step_data(0, "cpu")
        .micro_batches[0]
    )
    with torch.no_grad():
        local = forward_logits(wrapped, mb, "sdpa")  # [B, T/SP, V]: this rank's shard
        shards = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(shards, local.contiguous())
        ids = [torch.empty_like(mb.input_ids) for _ in range(world)]
        dist.all_gather(ids, mb.input_ids.contiguous())
        # The reference: the plain model on the whole row (no SP involved).
        full = later(
            input_ids=torch.cat(ids, dim=1),
            use_cache=False,
            **model_inputs(mb.layouts, engine="sdpa"),
        ).logits
    assert _rel(torch.cat(shards, dim=1), full) <= RTOL, "the Ulysses wrapper was undone"


@pytest.mark.distributed
def test_ulysses_wrapper_survives_a_later_model_load(sp2):
    """Checked on the two SP ranks of ``sp2``, before their step outputs (_wrapped_then_loaded)."""
    failure = sp2["wrapper"]
    assert failure is None, failure
