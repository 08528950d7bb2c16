"""A run survives interruption: 4 steps straight == 2 steps, stop, ``--resume`` to 4.

Also: checkpoints are plain Hugging Face checkpoints, the run directory holds what the contract
lists, and unsafe restarts are refused.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from distributed import torch_extensions  # noqa: F401  (fixture)
from safetensors.torch import load_file

from anchorctx.experiment import config_from_dict
from anchorctx.io import read_jsonl
from anchorctx.models.checkpoints import list_checkpoints
from anchorctx.training.loop import train
from anchorctx.training.plan import TrainingError


def _cfg(tiny_config, name: str, steps: int, **training):
    raw = tiny_config.model_dump(mode="json")
    raw["name"] = name
    raw["data"]["seq_len"] = 256  # shorter than the packed rows: exercises truncation
    raw["training"].update(steps=steps, lr=1e-3, warmup_steps=2, **training)
    return config_from_dict(raw)


def _weights(run_dir, step: int) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step-{step:06d}" / "model.safetensors")


@pytest.fixture(scope="module")
def runs(tiny_config, packed_demo, torch_extensions):  # noqa: F811
    straight = _cfg(tiny_config, "straight", 4)
    train(straight, data_dir=packed_demo)
    first = _cfg(tiny_config, "resumed", 2)
    train(first, data_dir=packed_demo)
    resumed = _cfg(tiny_config, "resumed", 4)
    return straight, first, resumed, packed_demo


def test_resume_continues_identically(runs):
    straight, _, resumed, data = runs
    summary = train(resumed, resume=True, data_dir=data)
    assert summary["resumed_from"] == 2 and summary["steps"] == 4
    a, b = _weights(straight.run_dir, 4), _weights(resumed.run_dir, 4)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "weights after resume differ"
    rows_a, rows_b = (
        read_jsonl(straight.run_dir / "metrics.jsonl"),
        read_jsonl(resumed.run_dir / "metrics.jsonl"),
    )
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]
    assert [r["loss"] for r in rows_a] == [r["loss"] for r in rows_b]
    assert [r["lr"] for r in rows_a] == [r["lr"] for r in rows_b]  # warmup state restored
    # Resuming a finished run returns at once.
    assert train(resumed, resume=True, data_dir=data)["resumed_from"] == 4


def test_unsafe_restarts_are_refused(runs):
    straight, _, _, data = runs
    with pytest.raises(TrainingError, match=r"holds an earlier run.*--resume.*--force"):
        train(straight, data_dir=data)
    changed = straight.model_copy(deep=True)
    changed.training.lr = 5e-4
    with pytest.raises(TrainingError, match="different config"):
        train(changed, resume=True, data_dir=data)


def test_run_directory_and_checkpoint_contract(runs):
    from transformers import AutoModelForCausalLM

    straight, _, _, _ = runs
    run_dir = straight.run_dir
    for name in ("config.yaml", "manifest.json", "metrics.jsonl", "train.log", "resume"):
        assert (run_dir / name).exists(), name
    # The log says where a run's time outside its steps went: start-up, saves.
    log_text = (run_dir / "train.log").read_text()
    assert re.search(
        r"ready for the first step \d+\.\d s after the process started \(model "
        r"and DeepSpeed engine \d+\.\d s",
        log_text,
    )
    assert re.search(r"checkpoint \S+step-000004 \(\d+\.\d s\)", log_text)
    assert re.search(r"resume state at step 4 \(\d+\.\d s\)", log_text)
    row = read_jsonl(run_dir / "metrics.jsonl")[-1]
    for key in ("step", "loss", "grad_norm", "lr", "tokens_per_s", "mfu", "peak_mem_gib"):
        assert key in row
    ckpts = list_checkpoints(run_dir)
    assert [p.name for p in ckpts] == ["step-000002", "step-000004"]
    meta = json.loads((ckpts[-1] / "anchorctx.json").read_text())
    assert meta["step"] == 4 and meta["variant"] == "anchor" and meta["tokens_seen"] == 4 * 2 * 256
    assert meta["config_hash"] == straight.fingerprint() and len(meta["data_manifest_hash"]) == 64
    # Plain transformers, no anchorctx attention: the default causal attention loads it.
    model = AutoModelForCausalLM.from_pretrained(ckpts[-1])
    assert model.config._attn_implementation != "anchorctx"
    saved = _weights(run_dir, 4)
    assert torch.equal(model.lm_head.weight, saved["lm_head.weight"])
    logits = model(input_ids=torch.tensor([[1, 5, 6, 7]])).logits
    assert torch.isfinite(logits).all()
