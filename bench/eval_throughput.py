"""RULER evaluation throughput on one GPU: prefill and generation at 32K/64K/128K.

A Llama-2-7B-shaped model (hidden 4096, 32 heads, MLP 11008, vocab 32000) with fewer layers and
random weights, run through the same path as evaluation (transformers' stock SDPA attention,
KV-cached greedy ``generate``), on random token ids. Measures per sample: prefill time, full
generation time with RULER's NIAH budget of 128 new tokens, peak GPU memory; then extrapolates
to the 32-layer model and prices a full evaluation (13 tasks × 6 lengths × 500 samples × 5
checkpoints) in GPU-hours.

    python bench/eval_throughput.py --out eval_throughput.json        # about 1-2 minutes on H100/H200

Assumptions of the extrapolation (also written to the JSON):
- time per sample scales linearly with depth (every layer is the same; embedding and the
  last-position LM head are negligible next to 32 layers of 32K-128K prefill);
- prefill time at 4K-16K comes from a fit t(L) = a·L + b·L² to the measured lengths, decode
  time per token from a fit c + d·L (KV-cache reads grow with L);
- batch size 1 and every task generating its full max new tokens (upper bound: base models
  often stop earlier at EOS, and short lengths can batch);
- sample construction (tokenisation, on CPU) overlaps with GPU work and is not counted.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

# RULER max new tokens per task (scripts/data/synthetic/constants.py), 13 tasks.
TASK_NEW_TOKENS = [128] * 8 + [30, 120, 50, 32, 32]
RULER_LENGTHS = [4096, 8192, 16384, 32768, 65536, 131072]


def build_model(args: argparse.Namespace):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        max_position_embeddings=max(args.lengths), rope_theta=1e7, use_cache=True,
    )  # fmt: skip
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.to(args.device).eval()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def measure(model, length: int, args: argparse.Namespace) -> dict:
    """One RULER-sized sample: prompt of length - new_tokens tokens, then new_tokens greedy."""
    from transformers import GenerationConfig

    prompt_len = length - args.new_tokens
    ids = torch.randint(3, args.vocab, (1, prompt_len), device=args.device)  # [1, T]
    ids[0, 0] = 1  # the anchor / BOS
    gen = GenerationConfig(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                           do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=2)  # fmt: skip
    with torch.inference_mode():
        prefill = min(_timed(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1),
                             args.device) for _ in range(args.repeats))  # fmt: skip
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        total = _timed(lambda: model.generate(input_ids=ids, generation_config=gen), args.device)
    peak = torch.cuda.max_memory_allocated() if args.device.startswith("cuda") else 0
    decode = max(total - prefill, 0.0)
    return {"length": length, "prompt_tokens": prompt_len, "prefill_s": prefill,
            "generate_s": total, "decode_ms_per_token": 1e3 * decode / args.new_tokens,
            "prefill_samples_per_s": 1 / prefill, "samples_per_s": 1 / total,
            "peak_gib": peak / 2**30}  # fmt: skip


def _fit(xs: list[float], ys: list[float], basis) -> list[float]:
    """Least squares on a two-term basis with non-negative coefficients (time never shrinks with
    length): when the joint fit gives a negative term, refit with the other term alone."""

    def solve(cols: list[int]) -> list[float]:
        a = torch.tensor([[basis(x)[c] for c in cols] for x in xs], dtype=torch.float64)
        b = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
        sol = torch.linalg.lstsq(a, b).solution.squeeze(1).tolist()
        out = [0.0, 0.0]
        for c, v in zip(cols, sol):
            out[c] = v
        return out

    coef = solve([0, 1])
    if min(coef) >= 0:
        return coef
    return solve([0]) if coef[1] < 0 else solve([1])


def extrapolate(rows: list[dict], args: argparse.Namespace) -> dict:
    """Per-sample seconds of the full-depth model at every RULER length, and the GPU-hours."""
    scale = args.full_layers / args.layers
    xs = [r["prompt_tokens"] for r in rows]
    pa, pb = _fit(xs, [r["prefill_s"] * scale for r in rows], lambda x: [x, x * x])
    dc, dd = _fit(xs, [r["decode_ms_per_token"] * scale / 1e3 for r in rows], lambda x: [1.0, x])
    per_length = {}
    for n in RULER_LENGTHS:
        seconds = sum(pa * (n - k) + pb * (n - k) ** 2 + k * (dc + dd * n) for k in TASK_NEW_TOKENS)
        per_length[str(n)] = seconds / len(TASK_NEW_TOKENS)  # mean seconds per sample
    samples = args.samples * args.checkpoints * len(TASK_NEW_TOKENS)
    hours = sum(per_length.values()) * samples / 3600
    return {"seconds_per_sample_7b": per_length, "gpu_hours_full_eval": hours,
            "full_eval": f"{len(TASK_NEW_TOKENS)} tasks x {len(RULER_LENGTHS)} lengths x "
                         f"{args.samples} samples x {args.checkpoints} checkpoints",
            "assumptions": __doc__.split("Assumptions of the extrapolation")[1].strip()}  # fmt: skip


def kv_cache_gib(args: argparse.Namespace, layers: int, length: int) -> float:
    head_dim = args.hidden // args.heads
    bytes_per = torch.finfo(getattr(torch, args.dtype)).bits // 8
    return 2 * layers * length * args.kv_heads * head_dim * bytes_per / 2**30


def print_table(rows: list[dict], est: dict, args: argparse.Namespace) -> None:
    print(f"\nRULER evaluation throughput, {args.layers}-layer Llama-7B shape, {args.dtype}, "
          f"{args.device_name}")  # fmt: skip
    head = f"{'length':>8} {'prefill s':>10} {'prefill smp/s':>13} {'gen s (+128)':>12} " \
           f"{'decode ms/tok':>13} {'samples/s':>9} {'peak GiB':>9} {'7B KV GiB':>9}"  # fmt: skip
    print(head)
    for r in rows:
        print(f"{r['length']:>8} {r['prefill_s']:>10.3f} {r['prefill_samples_per_s']:>13.2f} "
              f"{r['generate_s']:>12.3f} {r['decode_ms_per_token']:>13.2f} "
              f"{r['samples_per_s']:>9.2f} {r['peak_gib']:>9.1f} "
              f"{kv_cache_gib(args, args.full_layers, r['length']):>9.1f}")  # fmt: skip
    print(f"\n{args.full_layers}-layer (7B) seconds per sample, mean over the 13 tasks:")
    print("  " + "  ".join(f"{k}: {v:.2f}" for k, v in est["seconds_per_sample_7b"].items()))
    print(f"Full evaluation ({est['full_eval']}): {est['gpu_hours_full_eval']:.0f} GPU-hours")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    p.add_argument("--layers", type=int, default=4, help="Depth measured (7B has 32).")
    p.add_argument("--full-layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=32, help="Llama-2-7B: 32 (no GQA).")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--new-tokens", type=int, default=128, help="RULER NIAH max new tokens.")
    p.add_argument("--repeats", type=int, default=2, help="Prefill repeats (best is kept).")
    p.add_argument("--samples", type=int, default=500)
    p.add_argument("--checkpoints", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, help="Write the results as JSON here.")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if len(args.lengths) < 2:
        sys.exit("--lengths: give at least two lengths (the extrapolation fits a curve)")
    args.device_name = (torch.cuda.get_device_name() if args.device.startswith("cuda")
                        else "cpu")  # fmt: skip
    model = build_model(args)
    measure(model, min(args.lengths) // 8, args)  # warm-up: kernels, allocator, cuBLAS handles
    rows = []
    for n in sorted(args.lengths):
        rows.append(measure(model, n, args))
        print(f"measured {n}: {rows[-1]['generate_s']:.2f} s", flush=True)
    est = extrapolate(rows, args)
    print_table(rows, est, args)
    if args.out:
        import transformers

        from anchorctx.io import atomic_write_json

        atomic_write_json(args.out, {
            "benchmark": "eval_throughput", "date": datetime.now(timezone.utc).isoformat(),
            "device": args.device_name, "torch": torch.__version__,
            "transformers": transformers.__version__,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "rows": rows, "estimate": est,
        })  # fmt: skip
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
