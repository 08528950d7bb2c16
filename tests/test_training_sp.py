"""Ulysses sequence parallelism is exact: SP=2 on two gloo processes equals one process
(and so does DP=2, which checks the data-parallel half of the gradient normalisation).

Anchor variant, GQA (4 q heads, 2 KV heads), fp32, one global batch of 2 rows with gradient
accumulation, for every ZeRO stage: the logits, the global loss, the gradient norm and every
parameter tensor after one AdamW step agree to 1e-6 relative (parameters: per-tensor norm of the
difference over the norm; elementwise is not meaningful after Adam's first step, which divides
each gradient element by its own magnitude and so amplifies fp32 summation-order noise in
near-zero gradients). Grad norm catches a gradient scaled by the SP size; the parameters catch
a wrong direction. A first implementation that ignored ZeRO-3's different averaging failed
both (grad norm off by 2×, parameters by 5e-3 relative).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from distributed import run_distributed, torch_extensions  # noqa: F401  (fixture)

STAGES = (0, 1, 2, 3)
RTOL = 1e-6


def _config(tiny_config, sp: int, world: int):
    return tiny_config.model_copy(
        update={"training": tiny_config.training.model_copy(update={
            "attention": "anchor", "sequence_parallel": sp, "nproc": world, "lr": 1e-3,
        })},
    )  # fmt: skip


def _step_outputs(rank: int, world: int, cfg_yaml: str, data_dir: str, out: str) -> None:
    """One rank: for each ZeRO stage, logits of the first micro-batch, then one step."""
    import deepspeed
    import torch.distributed as dist
    import yaml

    from anchorctx.config import config_from_dict
    from anchorctx.packing import load_packed
    from anchorctx.training.data import BatchPlan
    from anchorctx.training.engine import (
        build_engine,
        init_distributed,
        loss_scale,
        register_sequence_parallel,
        shutdown_distributed,
    )  # fmt: skip
    from anchorctx.training.loop import preflight
    from anchorctx.training.model import load_model
    from anchorctx.training.plan import plan_parallelism
    from anchorctx.training.step import forward_logits, train_step

    cfg = config_from_dict(yaml.safe_load(cfg_yaml))
    init_distributed("cpu")
    base = plan_parallelism(cfg, world=world)
    pre = preflight(cfg, base, data_dir=Path(data_dir))
    dataset, _ = load_packed(pre.data_dir)
    # Load every stage's model before the Ulysses wrapper replaces the registered attention
    # (one registration per process; loading registers the plain attention again).
    models = {z: load_model(cfg.model, seq_len=cfg.data.seq_len, dtype="float32",
                            tokenizer=pre.tokenizer) for z in STAGES}  # fmt: skip
    mpu = register_sequence_parallel(models[0], base, cfg.data.seq_len)
    results = {}
    for stage in STAGES:
        par = replace(base, zero_stage=stage)
        engine = build_engine(models[stage], cfg, par, mpu)
        plan = BatchPlan(dataset, seed=cfg.seed, par=par, seq_len=cfg.data.seq_len,
                         variant="anchor", pad_id=0, rank=rank)  # fmt: skip
        data = plan.step_data(0, "cpu")
        with torch.no_grad():
            local = forward_logits(engine, data.micro_batches[0], "sdpa")  # [B, T/SP, V]
        shards = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(shards, local.contiguous())
        stats = train_step(engine, data, "sdpa", loss_scale(engine, par))
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        results[stage] = {"logits": torch.cat(shards, dim=1), "loss": stats.loss,
                          "grad_norm": stats.grad_norm, "params": params}  # fmt: skip
    if rank == 0:
        torch.save(results, out)
    shutdown_distributed()


def _run(tiny_config, packed_demo, sp: int, world: int, out: Path) -> dict:
    cfg = _config(tiny_config, sp, world)
    run_distributed(_step_outputs, world, cfg.to_yaml(), str(packed_demo), str(out))
    return torch.load(out, weights_only=False)


def _close(a, b) -> bool:
    return torch.allclose(torch.as_tensor(a), torch.as_tensor(b), rtol=RTOL, atol=0)


@pytest.mark.distributed
def test_sp2_and_dp2_equal_one_process(tiny_config, packed_demo, tmp_path, torch_extensions):  # noqa: F811
    single = _run(tiny_config, packed_demo, sp=1, world=1, out=tmp_path / "one.pt")
    _compare(single, _run(tiny_config, packed_demo, sp=2, world=2, out=tmp_path / "sp2.pt"))
    # Two data-parallel ranks (each one row of the batch, no accumulation): same update.
    _compare(single, _run(tiny_config, packed_demo, sp=1, world=2, out=tmp_path / "dp2.pt"))
    # The stages agree with each other (same objective; fp32 reduction order differs).
    for stage in STAGES[1:]:
        assert single[stage]["grad_norm"] == pytest.approx(single[0]["grad_norm"], rel=1e-5)


def _compare(single: dict, sharded: dict) -> None:
    for stage in STAGES:
        ref, got = single[stage], sharded[stage]
        # Gathered over all ranks: SP shards make up the reference's first row; under DP,
        # rank 0's row (the first T positions) is the reference's first row.
        t = ref["logits"].shape[1]
        assert _close(got["logits"][:, :t], ref["logits"]), f"ZeRO-{stage}: logits differ"
        assert _close(got["loss"], ref["loss"]), f"ZeRO-{stage}: loss"
        assert ref["grad_norm"] is not None and got["grad_norm"] is not None
        assert _close(got["grad_norm"], ref["grad_norm"]), f"ZeRO-{stage}: grad norm"
        for name, value in ref["params"].items():
            diff = torch.linalg.vector_norm(got["params"][name] - value)
            rel = float(diff / torch.linalg.vector_norm(value))
            assert rel <= RTOL, f"ZeRO-{stage}: {name} after one step: {rel:.2e} relative"
