"""GPU smoke test of the training loop (run with ``pytest -m gpu`` on a CUDA machine)."""

from __future__ import annotations

import math

import pytest

from anchorctx.experiment import config_from_dict
from anchorctx.io import read_jsonl
from anchorctx.models.checkpoints import list_checkpoints
from anchorctx.training.loop import train
from anchorctx.training.plan import plan_parallelism


def _one_gpu(tiny_config, name: str, **training):
    """Two bf16 steps of the tiny model on one GPU, checkpointed activations."""
    raw = tiny_config.model_dump(mode="json")
    raw["name"] = name
    raw["training"].update(
        device="cuda",
        engine="auto",
        precision="bf16",
        activation_checkpointing=True,
        nproc=1,
        steps=2,
        **training,
    )
    return config_from_dict(raw)


@pytest.mark.gpu
@pytest.mark.parametrize("zero_stage", [0, 3])
def test_bf16_anchor_training_on_one_gpu(tiny_config, packed_demo, zero_stage):
    cfg = _one_gpu(tiny_config, f"gpu-z{zero_stage}", zero_stage=zero_stage)
    summary = train(cfg, data_dir=packed_demo)
    rows = read_jsonl(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] is not None for r in rows)
    assert rows[-1]["mfu"] is None or 0 < rows[-1]["mfu"] < 1
    assert [p.name for p in list_checkpoints(cfg.run_dir)] == ["step-000002"]
    assert summary["steps"] == 2


@pytest.mark.gpu
def test_one_gpu_with_an_offloaded_optimizer_trains_under_zero2_and_streams_its_checkpoint(
    tiny_config, packed_demo
):
    """The one-GPU default for an offloaded optimizer (plan.default_zero_stage): DeepSpeed's
    CPU Adam steps it under ZeRO-2, and the checkpoint is streamed (the host may be full) and
    loads in plain transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    memory = {"auto": False, "offload_optimizer": True}
    cfg = _one_gpu(tiny_config, "gpu-offload-z2", zero_stage=None, memory=memory)
    assert plan_parallelism(cfg).zero_stage == 2
    train(cfg, data_dir=packed_demo)
    rows = read_jsonl(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in rows)
    (ckpt,) = list_checkpoints(cfg.run_dir)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    assert all(torch.isfinite(p).all() for p in model.parameters())
