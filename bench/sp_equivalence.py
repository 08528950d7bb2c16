"""Ulysses SP=N vs one GPU: maximum absolute logits difference (the paper's Table 8).

A Llama-2-7B-wide model of reduced depth (hidden 4096, 32 heads, MLP 11008, vocab 32000), bf16,
one synthetic packed row (heavy-tailed document lengths) per attention variant. Rank 0 first
computes the single-GPU reference with the registered attention and no sequence parallelism;
then every rank runs the same weights under DeepSpeed ZeRO-3 with Ulysses SP over all ranks,
the logits shards are gathered to rank 0 and compared. (Loss, gradient norm and parameters
after an optimiser step are checked against one process in the CPU tests, every ZeRO stage.)

``--ring`` adds the paper's baseline: zigzag ring attention over the same ranks (causal full
attention, anchorctx.attention.ring), the same weights without DeepSpeed, compared the same way.

    torchrun --nproc-per-node 2 bench/sp_equivalence.py --seq-len 32768 --out sp2-equiv.json
    torchrun --nproc-per-node 4 bench/sp_equivalence.py --seq-len 32768 --out sp4-equiv.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

for _k, _v in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from anchorctx.attention import build_layout, ring  # noqa: E402
from anchorctx.attention.hf import attention_name, model_inputs, select_attention  # noqa: E402
from anchorctx.demo.synthetic import SMOKE, VOCAB, WIDTH_7B, synthetic_row  # noqa: E402
from anchorctx.experiment import config_from_dict  # noqa: E402
from anchorctx.models.loading import load_model  # noqa: E402
from anchorctx.training.data import shard_rows  # noqa: E402
from anchorctx.training.engine import (  # noqa: E402
    build_engine,
    init_distributed,
    register_sequence_parallel,
    shutdown_distributed,
)
from anchorctx.training.plan import plan_parallelism  # noqa: E402
from anchorctx.training.step import forward_logits  # noqa: E402


def make_config(args, world: int):
    width = SMOKE if args.smoke else WIDTH_7B
    raw = {
        "name": "sp-equivalence",
        "run_root": "/tmp/anchorctx-bench",
        "seed": 0,
        "model": {
            "tiny": {
                "architecture": "llama",
                **width,
                "num_hidden_layers": args.layers,
                "num_key_value_heads": args.kv_heads,
                "vocab_size": VOCAB,
                "init_seed": 0,
            },
            "tokenizer": "unused",
            "dtype": "bfloat16",
            "rope_theta": 1e7,
        },
        "data": {"seq_len": args.seq_len},
        "training": {
            "device": args.device,
            "engine": args.engine,
            "precision": "bf16",
            "zero_stage": 3,
            "activation_checkpointing": True,
            "nproc": world,
            "sequence_parallel": world,
            "micro_batch_size": 1,
            "global_batch_size": 1,
        },
    }
    return config_from_dict(raw)


def reference_logits(model, row, variant: str, engine: str, device: str) -> torch.Tensor:
    """One device, no SP: logits [T, V] on the CPU (bf16, as the model returns them)."""
    layouts = [build_layout(row.seg_lens, variant, row.seg_doc, device=device)]
    with torch.no_grad():
        out = model(
            input_ids=row.input_ids[None].to(device),
            use_cache=False,
            **model_inputs(layouts, engine=engine),
        )
    return out.logits[0].cpu()


def sp_logits(engine, row, variant: str, par, rank: int, device: str) -> torch.Tensor | None:
    mb = shard_rows([row], variant, par.sp, rank % par.sp, device)
    with torch.no_grad():
        local = forward_logits(engine, mb, par.engine)[0].contiguous()  # [T/SP, V]
    shards = [torch.empty_like(local) for _ in range(par.world)]
    dist.all_gather(shards, local)
    return torch.cat(shards).cpu() if rank == 0 else None


def ring_logits(model, row, world: int, rank: int, device: str) -> torch.Tensor | None:
    """Zigzag ring attention over every rank: the whole row's logits [T, V] on rank 0."""
    seq = row.input_ids.shape[0]
    pos = ring.zigzag_positions(seq, world, rank).to(device)
    own = attention_name(model)
    select_attention(model, ring.register())
    try:
        with torch.no_grad():
            local = (
                model(
                    input_ids=row.input_ids.to(device)[pos][None],
                    position_ids=pos[None],
                    use_cache=False,
                    **{ring.POSITIONS_KWARG: pos},
                )
                .logits[0]
                .contiguous()
            )  # [T/N, V], this rank's zigzag shard
    finally:
        select_attention(model, own)
    shards = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(shards, local)
    if rank:
        return None
    order = torch.cat([ring.zigzag_positions(seq, world, r) for r in range(world)])
    whole = torch.empty((seq, local.shape[-1]), dtype=local.dtype)
    whole[order] = torch.cat(shards).cpu()
    return whole


def compare(got: torch.Tensor, ref: torch.Tensor, **fields) -> dict:
    diff = (got.float() - ref.float()).abs()
    return {
        **fields,
        "dtype": "bfloat16",
        "max_abs_logits_diff": float(diff.max()),
        "mean_abs_logits_diff": float(diff.mean()),
        "bit_identical": bool(torch.equal(got, ref)),
    }


def run(args) -> list[dict]:
    rank, world, local_rank = init_distributed(args.device)
    device = f"cuda:{local_rank}" if args.device == "cuda" else "cpu"
    cfg = make_config(args, world)
    par = plan_parallelism(cfg, world=world)
    model = load_model(cfg.model, seq_len=args.seq_len, dtype="bfloat16", device=device)
    model.eval()  # logits only: no dropout in Llama anyway, no checkpointing needed
    rows = {
        v: synthetic_row(args.seq_len, v, seed=args.seed, vocab=VOCAB, sp=world)
        for v in args.variants
    }
    refs = {}
    if rank == 0:  # the single-device reference, before the Ulysses wrapper exists
        single = replace(par, sp=1)
        refs = {v: reference_logits(model, rows[v], v, single.engine, device) for v in rows}
    dist.barrier()
    results = []
    if args.ring and "full" in rows:  # before Ulysses wraps the attention: the plain model
        got = ring_logits(model, rows["full"], world, rank, device)
        if rank == 0:
            results.append(
                compare(
                    got,
                    refs["full"],
                    variant="full",
                    method="ring (zigzag)",
                    sp=world,
                    seq_len=args.seq_len,
                    layers=args.layers,
                    documents=len(rows["full"].seg_lens),
                    zero_stage=None,
                )
            )
            print(json.dumps(results[-1]), flush=True)
    mpu = register_sequence_parallel(model, par, args.seq_len)
    engine = build_engine(model, cfg, par, mpu)
    for variant, row in rows.items():
        got = sp_logits(engine, row, variant, par, rank, device)
        if rank == 0:
            results.append(
                compare(
                    got,
                    refs[variant],
                    variant=variant,
                    method="Ulysses",
                    sp=world,
                    seq_len=args.seq_len,
                    layers=args.layers,
                    documents=len(row.seg_lens),
                    zero_stage=3,
                )
            )
            print(json.dumps(results[-1]), flush=True)
    shutdown_distributed()
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=32)
    p.add_argument("--variants", nargs="+", default=["anchor", "full"])
    p.add_argument("--engine", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument(
        "--ring",
        action="store_true",
        help="Also zigzag ring attention over the same ranks (full attention; the paper's "
        "Table 8 baseline).",
    )
    p.add_argument("--smoke", action="store_true", help="Tiny width on CPU (checks the script).")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.smoke:
        args.device, args.engine, args.kv_heads = "cpu", "sdpa", min(args.kv_heads, 4)
    results = run(args)
    if not results:
        return 0
    print(
        "\n| method | variant | SP | seq_len | layers | docs | max abs logits diff | bit-identical |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for r in results:
        print(
            f"| {r['method']} | {r['variant']} | {r['sp']} | {r['seq_len']} | {r['layers']} | "
            f"{r['documents']} | {r['max_abs_logits_diff']:.3g} | {r['bit_identical']} |"
        )
    if args.out:
        args.out.write_text(json.dumps({"results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
