"""The decode step's attention alone at 7B shapes: cuDNN, SDPA memory-efficient and compiled
FlexAttention under several Triton kernel options, then the 7B decode with the best option.

One query per row (32 heads, head dim 128, bf16) over a static buffer of S slots, a boolean slot
mask with rows 7 tokens apart (as the decoder builds it). Per kernel: relative error against
SDPA's memory-efficient kernel, whether three calls give bit-identical outputs, median time
(``triton.testing.do_bench``) and the K/V bytes read over that time. The deterministic option
with the least total time is then set as ``decoding.FLEX_KERNEL_OPTIONS`` and
``bench/eval_throughput.py --attention flex`` runs with it (``--throughput-lengths``). The
variant ``{}`` is FlexAttention's own choice of options.

    python bench/decode_attention_sweep.py --out decode_attention_sweep.json
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from anchorctx.models import decoding

VARIANTS = [
    {},
    {"BLOCK_N": 128},
    {"SPLIT_KV": 32},
    {"SPLIT_KV": 64},
    {"SPLIT_KV": 32, "BLOCK_N": 128},
    {"SPLIT_KV": 64, "BLOCK_N": 128, "num_warps": 8},
    {"num_stages": 3},
    {"SPLIT_KV": 32, "num_stages": 3},
]


def sweep_shape(rows: int, slots: int, results: list[dict]) -> None:
    """Every kernel at one (rows, slots); appends one result per kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    heads, dim, scale = 32, 128, 128**-0.5
    shape = f"{rows}x{slots}"
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(rows, heads, 1, dim, device="cuda", generator=g).bfloat16()
    k = torch.randn(rows, heads, slots, dim, device="cuda", generator=g).bfloat16()
    v = torch.randn(rows, heads, slots, dim, device="cuda", generator=g).bfloat16()
    visible = torch.zeros(rows, slots, dtype=torch.bool, device="cuda")
    for r in range(rows):
        visible[r, 7 * r : slots - 100] = True
    mask = visible[:, None, None]  # [B, 1, 1, S]
    blocks = slots // decoding.SLOT_ROUND
    kv_blocks = torch.full((1, 1, 1), blocks, dtype=torch.int32, device="cuda")
    kv_index = torch.arange(blocks, dtype=torch.int32, device="cuda").view(1, 1, 1, -1)
    nbytes = 2 * k.numel() * k.element_size()
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).float()

    def record(name, fn):
        try:
            outs = [fn() for _ in range(3)]
        except Exception as e:  # an option the kernel rejects: reported, not fatal
            results.append(
                {
                    "rows": rows,
                    "slots": slots,
                    "kernel": name,
                    "error": f"{type(e).__name__}: {str(e)[:200]}",
                }
            )
            print(f"{shape} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            return
        err = float((outs[0].float() - ref).norm() / ref.norm())
        same = all(torch.equal(outs[0], o) for o in outs[1:])
        ms = do_bench(fn, warmup=50, rep=300, return_mode="median")
        results.append(
            {
                "rows": rows,
                "slots": slots,
                "kernel": name,
                "rel_err": err,
                "bit_identical_3_calls": same,
                "ms": ms,
                "TBps": nbytes / ms / 1e9,
            }
        )
        print(
            f"{shape} {name}: err {err:.1e} identical {same} {ms:.3f} ms "
            f"{nbytes / ms / 1e9:.2f} TB/s",
            flush=True,
        )

    record(
        "cudnn (SDPA pick)",
        lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale),
    )

    def efficient():
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    record("efficient", efficient)
    saved = dict(decoding.FLEX_KERNEL_OPTIONS)
    for opts in VARIANTS:
        decoding.FLEX_KERNEL_OPTIONS.clear()
        decoding.FLEX_KERNEL_OPTIONS.update(opts)
        fn = torch.compile(decoding._flex_decode, fullgraph=True, dynamic=False)
        record(
            f"flex {json.dumps(opts)}",
            lambda fn=fn: fn(q, k, v, visible, kv_blocks, kv_index, scale),
        )
    decoding.FLEX_KERNEL_OPTIONS.clear()
    decoding.FLEX_KERNEL_OPTIONS.update(saved)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--shapes", nargs="+", default=["1x131072", "4x32768", "16x4096"], help="ROWSxSLOTS"
    )
    p.add_argument("--throughput-lengths", type=int, nargs="*", default=[32768, 131072])
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    torch._dynamo.config.recompile_limit = 256  # one compile per (variant, shape)
    torch._dynamo.config.accumulated_recompile_limit = 4096
    results: list[dict] = []
    for shape in args.shapes:
        rows, slots = (int(x) for x in shape.split("x"))
        sweep_shape(rows, slots, results)
        torch.cuda.empty_cache()
    totals: dict[str, float] = {}
    for r in results:
        if (
            r["kernel"].startswith("flex")
            and r.get("bit_identical_3_calls")
            and r["rel_err"] < 2e-2  # bf16 output rounding is ~4e-3; a wrong mask is O(1)
        ):
            totals[r["kernel"]] = totals.get(r["kernel"], 0.0) + r["ms"]
    complete = {
        n: t
        for n, t in totals.items()
        if sum(r["kernel"] == n and "ms" in r for r in results) == len(args.shapes)
    }
    best = min(complete, key=complete.get) if complete else None
    name = torch.cuda.get_device_name()
    print(f"\n{name}, torch {torch.__version__}; best flex option: {best}")
    print("| rows × slots | kernel | rel. err vs efficient | bit-identical (3 calls) | ms | TB/s |")
    print("|---|---|---:|---|---:|---:|")
    for r in results:
        if "error" in r:
            print(f"| {r['rows']} × {r['slots']} | {r['kernel']} | {r['error'][:60]} | | | |")
        else:
            print(
                f"| {r['rows']} × {r['slots']} | {r['kernel']} | {r['rel_err']:.1e} | "
                f"{r['bit_identical_3_calls']} | {r['ms']:.3f} | {r['TBps']:.2f} |"
            )
    if args.out:
        from anchorctx.io import atomic_write_json

        atomic_write_json(
            args.out,
            {
                "benchmark": "decode_attention_sweep",
                "date": datetime.now(timezone.utc).isoformat(),
                "device": name,
                "torch": torch.__version__,
                "results": results,
                "best": best,
            },
        )
    if best is not None and args.throughput_lengths:
        from bench.eval_throughput import main as throughput

        decoding.FLEX_KERNEL_OPTIONS.clear()
        decoding.FLEX_KERNEL_OPTIONS.update(json.loads(best.removeprefix("flex ")))
        torch._dynamo.reset()
        out = None if args.out is None else args.out.with_name(args.out.stem + "_e2e.json")
        throughput(
            [
                "--lengths",
                *map(str, args.throughput_lengths),
                "--skip-hf-above",
                "0",
                "--attention",
                "flex",
                *(["--out", str(out)] if out else []),
            ]
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
