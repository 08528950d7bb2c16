"""average_weights on tiny real HF checkpoints: exact arithmetic, sharding, bf16 accumulation,
copied tokenizer/config, provenance, layout mismatches, and the average-weights command."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from anchorctx.evaluation.weights import WeightAveragingError, average_weights


def save_checkpoint(
    path: Path,
    *,
    seed: int,
    step: int,
    hidden: int = 16,
    dtype=torch.float32,
    shard: str | None = None,
) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<s>", "</s>", "<unk>", "x", "y", "z"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # random norms too, so every tensor differs between seeds
        for p in model.parameters():
            p.normal_()
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, **kwargs)
    tok.save_pretrained(path)
    (path / "anchorctx.json").write_text(json.dumps({"step": step}))
    return path


def weights(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_average_of_two_is_exact_mean(tmp_path: Path):
    ckpts = [save_checkpoint(tmp_path / f"step-{s:06d}", seed=s, step=s) for s in (1, 2)]
    out = average_weights(ckpts, tmp_path / "avg", progress=False)
    a, b, avg = weights(ckpts[0]), weights(ckpts[1]), weights(out)
    assert avg.keys() == a.keys()
    for name in a:
        torch.testing.assert_close(avg[name], (a[name] + b[name]) / 2, rtol=0, atol=0)
    meta = json.loads((out / "anchorctx.json").read_text())
    assert [s["step"] for s in meta["averaged_from"]] == [1, 2] and meta["step"] is None
    assert all(len(s["checkpoint_hash"]) == 64 for s in meta["averaged_from"])
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (ckpts[1] / name).read_bytes()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).bos_token == "<s>"
    ids = torch.tensor([[0, 3, 4, 5]])
    assert model(input_ids=ids).logits.shape == (1, 4, 6)


def test_sharded_bf16_accumulates_in_fp32(tmp_path: Path):
    ckpts = [
        save_checkpoint(tmp_path / f"c{s}", seed=s, step=s, dtype=torch.bfloat16, shard="4KB")
        for s in (1, 2, 3)
    ]
    assert (ckpts[0] / "model.safetensors.index.json").is_file()
    assert len(list(ckpts[0].glob("*.safetensors"))) > 1
    out = average_weights(ckpts, tmp_path / "avg", progress=False)
    assert (out / "model.safetensors.index.json").is_file()
    ws = [weights(c) for c in ckpts]
    avg = weights(out)
    for name, t in avg.items():
        assert t.dtype == torch.bfloat16
        expected = (sum(w[name].float() for w in ws) / 3).to(torch.bfloat16)
        torch.testing.assert_close(t, expected, rtol=0, atol=0)


def test_mismatched_models_rejected(tmp_path: Path):
    a = save_checkpoint(tmp_path / "a", seed=1, step=1)
    b = save_checkpoint(tmp_path / "b", seed=2, step=2, hidden=32)
    with pytest.raises(WeightAveragingError, match="shape"):
        average_weights([a, b], tmp_path / "avg", progress=False)
    assert not (tmp_path / "avg").exists()  # nothing half-written
    with pytest.raises(WeightAveragingError, match="one of the inputs"):
        average_weights([a], a, progress=False)


def test_average_weights_command(tmp_path: Path, monkeypatch, capsys):
    from anchorctx.evaluation import commands
    from anchorctx.experiment import config_from_dict

    run = tmp_path / "runs" / "exp" / "anchor"
    ckpts = [
        save_checkpoint(run / "checkpoints" / f"step-{s:06d}", seed=s, step=s) for s in (10, 20, 30)
    ]
    monkeypatch.setattr(commands, "_run_checkpoints", lambda run_dir: ckpts)
    cfg = config_from_dict(
        {"name": "exp", "run_root": str(tmp_path / "runs"), "model": {"path": str(ckpts[0])}}
    )
    args = argparse.Namespace(cfg=cfg, run_dir=None, last_k=2, out=None)
    assert commands.average_weights(args) == 0
    out = run / "averaged" / "averaged-last-2"
    meta = json.loads((out / "anchorctx.json").read_text())
    assert [s["step"] for s in meta["averaged_from"]] == [20, 30]
    assert "step-000020, step-000030" in capsys.readouterr().out
