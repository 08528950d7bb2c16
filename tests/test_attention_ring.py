"""Zigzag ring attention, the Table 8 baseline (anchorctx.attention.ring): exact in float32
against one process, off by rounding in bf16 (what the paper's Table 8 shows and Ulysses does
not), and through a transformers model on two gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed

from anchorctx.attention import ring
from anchorctx.attention.errors import AttentionError


def test_zigzag_shards_cover_the_row_once_and_balance_causal_pairs():
    seq, world = 32, 4
    shards = [ring.zigzag_positions(seq, world, r) for r in range(world)]
    assert sorted(torch.cat(shards).tolist()) == list(range(seq))
    pairs = {int((s + 1).sum()) for s in shards}  # causal keys of each query: position + 1
    assert len(pairs) == 1  # every rank the same work
    with pytest.raises(AttentionError, match="2 × 4"):
        ring.zigzag_positions(36, 4, 0)


def _blocks_in_ring_order(q, k, v, world: int, rank: int) -> torch.Tensor:
    """What ring_attention computes on ``rank``, without a process group."""
    seq = q.shape[1]
    shards = [ring.zigzag_positions(seq, world, r) for r in range(world)]
    mine = shards[rank]
    order = [shards[(rank - step) % world] for step in range(world)]
    blocks = [(k[:, src], v[:, src], src) for src in order]
    return ring.attend_blocks(q[:, mine], mine, blocks, 0.125)


def test_blocks_merged_in_ring_order_equal_whole_row_attention_in_float32():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 16, 8) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125)
    for rank in range(4):
        got = _blocks_in_ring_order(q, k, v, 4, rank)
        # float32 throughout: the merge's reassociation only (a few ulps of values ~1)
        torch.testing.assert_close(
            got, ref[:, ring.zigzag_positions(16, 4, rank)], atol=1e-6, rtol=1e-5
        )


def test_in_bf16_the_blocks_round_before_the_merge():
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 256, 32, dtype=torch.bfloat16) for _ in range(3))
    whole = _blocks_in_ring_order(q, k, v, 1, 0)  # one block: one device's numbers
    ringed = _blocks_in_ring_order(q, k, v, 4, 1)
    mine = ring.zigzag_positions(256, 4, 1)
    diff = (ringed.float() - whole[:, mine].float()).abs().max()
    assert 0 < diff < 0.05  # bf16 rounding of partial outputs, not a wrong attention


def _worker(rank: int, world: int, out: Path) -> None:
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from anchorctx.attention.hf import select_attention

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    seq = 32
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=128,
        max_position_embeddings=seq,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).eval()  # the same weights on every rank (same seed)
    ids = torch.randint(0, 128, (1, seq))
    with torch.no_grad():
        ref = model(input_ids=ids).logits[0]  # [T, V], one process, whole row
        select_attention(model, ring.register())
        pos = ring.zigzag_positions(seq, world, rank)
        local = model(
            input_ids=ids[:, pos], position_ids=pos[None], **{ring.POSITIONS_KWARG: pos}
        ).logits[0]  # [T/N, V]
    shards = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(shards, local)
    if rank == 0:
        order = torch.cat([ring.zigzag_positions(seq, world, r) for r in range(world)])
        got = torch.empty_like(ref)
        got[order] = torch.cat(shards)
        out.write_text(json.dumps({"max_abs": float((got - ref).abs().max())}))
    dist.destroy_process_group()


def test_a_model_on_two_ranks_equals_one_process_in_float32(tmp_path):
    out = tmp_path / "ring.json"
    run_distributed(_worker, 2, out)
    # float32 logits of magnitude ~1: the blocks' merge reassociates sums (1e-5 is ~100 ulps)
    assert json.loads(out.read_text())["max_abs"] < 1e-5


def test_the_model_call_must_name_the_positions():
    with pytest.raises(AttentionError, match="row positions"):
        ring.ring_attention_hf(
            torch.nn.Identity(), *(torch.zeros(1, 2, 4, 8) for _ in range(3)), None
        )
