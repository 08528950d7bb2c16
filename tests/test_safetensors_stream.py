"""Checkpoint weights written one tensor at a time equal what save_pretrained writes."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from anchorctx.models import safetensors_stream as ST
from anchorctx.training.checkpoints import _finish_streamed


def _tiny(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


def test_write_safetensors_round_trips_every_dtype_exactly(tmp_path):
    tensors = {
        "a": torch.randn(3, 5).to(torch.bfloat16),
        "b": torch.randn(7).to(torch.float16),
        "c": torch.randn(2, 2, 2),
        "d": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    }
    entries = [
        (k, ST.DTYPE_CODES[t.dtype], tuple(t.shape), t.numel() * t.element_size())
        for k, t in tensors.items()
    ]
    # each tensor in two pieces: the writer takes any split of the bytes
    pieces = []
    for t in tensors.values():
        raw = bytes(t.contiguous().view(torch.uint8).numpy())
        pieces += [raw[: len(raw) // 2], raw[len(raw) // 2 :]]
    ST.write_safetensors(tmp_path / "x.safetensors", entries, pieces)
    back = load_file(tmp_path / "x.safetensors")
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t)


def test_byte_count_that_disagrees_with_the_header_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="header says 8"):
        ST.write_safetensors(tmp_path / "x.safetensors", [("a", "F32", (2,), 8)], [b"1234"])


def test_shard_plan_keeps_order_and_bound():
    assert ST.plan_shards([4, 4, 4, 9, 1], 8) == [[0, 1], [2], [3], [4]]
    assert ST.plan_shards([1, 2, 3], 100) == [[0, 1, 2]]
    assert ST.shard_names(1) == ["model.safetensors"]
    assert ST.shard_names(2)[1] == "model-00002-of-00002.safetensors"


@pytest.mark.parametrize("tied", [False, True])
def test_streamed_checkpoint_equals_save_pretrained(tmp_path, tied):
    model = _tiny(tied)
    ref, out = tmp_path / "ref", tmp_path / "out"
    model.save_pretrained(ref, safe_serialization=True)
    staged = tmp_path / "staged"
    staged.mkdir()
    # 20 KB shards: the 2-layer model spans several, so the index is written and read too
    ST.save_weights_streamed(model, staged, max_shard_bytes=20_000)
    out.mkdir()
    _finish_streamed(model, staged, out)
    index = json.loads((out / ST.INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1
    written = {}
    for shard in sorted(set(index["weight_map"].values())):
        written.update(load_file(out / shard))
    expected = load_file(ref / "model.safetensors")
    assert written.keys() == expected.keys()  # tied weights stored once, under the same name
    assert all(torch.equal(written[k], expected[k]) for k in expected)
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (ref / "config.json").read_text()
    )
    assert (out / "generation_config.json").read_text() == (
        ref / "generation_config.json"
    ).read_text()
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    for (name, a), (_, b) in zip(
        model.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_a_failed_write_still_joins_every_gather(tmp_path, monkeypatch):
    """Under ZeRO-3 each parameter's gather is a collective: the writing rank must take part in
    all of them even after its disk fails, or the other ranks wait forever."""
    from deepspeed.runtime.zero import partition_parameters

    gathered = []

    @contextlib.contextmanager
    def counting(params, modifier_rank=None):
        gathered.extend(params)
        yield

    monkeypatch.setattr(partition_parameters, "GatheredParameters", counting)
    real = ST.write_safetensors
    calls = []

    def failing(path, entries, pieces):
        calls.append(path)
        if len(calls) == 2:
            next(iter(pieces))
            raise OSError(28, "No space left on device")
        return real(path, entries, pieces)

    monkeypatch.setattr(ST, "write_safetensors", failing)
    model = _tiny(False)
    with pytest.raises(OSError, match="No space left"):
        ST.save_weights_streamed(model, tmp_path, max_shard_bytes=20_000)
    assert len(gathered) == len(list(model.parameters()))
    assert len(calls) == 2  # no shard is written after the failure


class _Engine:
    """What checkpoints._stage_weights asks of a DeepSpeed engine."""

    def __init__(self, module, stage: int, offload: bool) -> None:
        self.module, self._stage, self._offload = module, stage, offload

    def zero_optimization_stage(self) -> int:
        return self._stage

    def zero_cpu_offload(self) -> bool:
        return self._offload


@pytest.mark.parametrize(
    ("stage", "offload", "streamed"),
    [(3, False, True), (2, True, True), (2, False, False), (0, False, False)],
)
def test_weights_stream_under_zero3_or_an_offloaded_optimizer(
    tmp_path, monkeypatch, stage, offload, streamed
):
    """An offloaded optimizer fills the host (one GPU steps it under ZeRO-2 by default), so its
    checkpoints stream one tensor at a time as ZeRO-3's do, instead of save_pretrained's
    whole-shard buffers."""
    from anchorctx.training import checkpoints

    monkeypatch.setattr(checkpoints.dist, "get_rank", lambda: 0)
    final = tmp_path / "checkpoints" / "step-000001"
    final.parent.mkdir()
    staged, failure = checkpoints._stage_weights(_Engine(_tiny(False), stage, offload), final)
    assert failure is None
    assert (staged is not None) == streamed
    if streamed:
        assert (staged / "model.safetensors").is_file()
