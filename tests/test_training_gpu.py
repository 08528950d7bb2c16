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


@pytest.mark.gpu
def test_two_gpus_train_the_layout_the_plan_chose(tiny_config, packed_demo):
    """`anchorctx train` with the defaults on two GPUs: the launcher's layout plan chooses SP ×
    DP, the ZeRO stage and DeepSpeed's settings, the ranks train with them, and the run records
    the choice and its runners-up (memory_choice.json, the manifest)."""
    import json

    import torch

    from anchorctx.training.launch import launch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    raw = tiny_config.model_dump(mode="json")
    raw["training"].update(
        device="cuda", engine="auto", precision="bf16", nproc=2, steps=2, global_batch_size=2
    )
    raw["training"].pop("sequence_parallel", None)  # the default: auto
    raw["training"].pop("zero_stage", None)
    raw["data"]["output_dir"] = str(packed_demo)
    cfg = config_from_dict(raw)
    assert launch(cfg) == 0  # what `anchorctx train` runs
    run = cfg.run_dir
    chosen = json.loads((run / "memory_choice.json").read_text())
    layout = json.loads((run / "manifest.json").read_text())["layout"]
    assert layout["sp"] * layout["dp"] == 2 and layout["plan"] == chosen
    assert (layout["sp"], layout["zero_stage"]) == (
        chosen["layout"]["sp"],
        chosen["layout"]["zero_stage"],
    )
    assert len(chosen["alternatives"]) == 3  # the other SP × ZeRO layouts on two GPUs
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
