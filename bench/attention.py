"""Attention engine benchmark: milliseconds and useful TFLOP/s per engine × variant × length.

For each sequence length and document-length distribution (heavy-tailed, SlimPajama-like; and
fixed), times forward and forward+backward of every engine on the anchor/intra-document masks,
beside dense causal SDPA (cuDNN/FlashAttention) in the same run. Useful FLOPs count only
allowed (query, key) pairs: forward 4·d·pairs per head, forward+backward 3.5× forward. Then
checks bf16 accuracy of every engine against a float32 reference at a shorter length.

    python bench/attention.py --lengths 32768 65536 131072 --out attention.json

Per-engine failures are caught and reported in the table; the run keeps going. ``--budget-s``
stops starting new measurements when time runs out (the rest are marked skipped).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from anchorctx.attention import attend, build_layout
from anchorctx.attention.engines import ENGINES
from anchorctx.attention.layout import Layout


@dataclass
class Row:
    length: int
    distribution: str
    variant: str
    engine: str
    docs: int = 0
    fwd_ms: float | None = None
    fwdbwd_ms: float | None = None
    fwd_tflops: float | None = None
    fwdbwd_tflops: float | None = None
    plan_ms: float | None = None  # first build of the engine's mask / plan (once per batch)
    error: str = ""


@dataclass
class Accuracy:
    length: int
    variant: str
    engine: str
    fwd_rel_err: float | None = None
    grad_rel_err: dict[str, float] = field(default_factory=dict)
    error: str = ""


# --------------------------------------------------------------------------------- layouts
def doc_lengths(total: int, distribution: str, seed: int, mean: int) -> list[int]:
    """Document lengths filling ``total`` tokens (the last one truncated)."""
    gen = torch.Generator().manual_seed(seed)
    lens: list[int] = []
    while sum(lens) < total:
        if distribution == "fixed":
            n = mean
        else:
            # Lognormal with sigma 1.6 (mean fixed at ``mean``): mostly short documents and a
            # long tail of book/arXiv-sized ones, the shape of SlimPajama's length histogram.
            sigma = 1.6
            mu = math.log(mean) - sigma**2 / 2
            n = int(math.exp(mu + sigma * torch.randn(1, generator=gen).item()))
        lens.append(max(1, min(n, total - sum(lens))))
    return lens


def make_layout(length: int, distribution: str, variant: str, seed: int, mean: int) -> Layout:
    return build_layout(doc_lengths(length, distribution, seed, mean), variant, device="cuda")


# ---------------------------------------------------------------------------------- timing
def bench_ms(fn, grad_to_none=None) -> float:
    """Median milliseconds (triton's do_bench when available: L2 flushed between runs)."""
    try:
        from triton.testing import do_bench

        return float(
            do_bench(fn, warmup=50, rep=300, grad_to_none=grad_to_none, return_mode="median")
        )
    except ImportError:
        times = []
        for i in range(13):
            for t in grad_to_none or []:
                t.grad = None
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            if i >= 3:
                times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]


def qkv(length: int, heads: int, kv_heads: int, dim: int, *, grad: bool, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape_q, shape_kv = (1, heads, length, dim), (1, kv_heads, length, dim)
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, generator=gen)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def measure(row: Row, layout: Layout, args) -> None:
    """Fill ``row`` with forward and forward+backward timings of ``row.engine``."""
    h, hk, d = args.heads, args.kv_heads, args.head_dim
    q, k, v = qkv(row.length, h, hk, d, grad=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        attend(q, k, v, layout, engine=row.engine)  # builds the plan; compiles flex once
    torch.cuda.synchronize()
    row.plan_ms = (time.perf_counter() - t0) * 1e3
    flops = layout.attention_flops(h, d)
    with torch.no_grad():
        row.fwd_ms = bench_ms(lambda: attend(q, k, v, layout, engine=row.engine))
    grad = torch.randn(1, h, row.length, d, device="cuda", dtype=torch.bfloat16)

    def fwd_bwd():
        attend(q, k, v, layout, engine=row.engine).backward(grad)

    row.fwdbwd_ms = bench_ms(fwd_bwd, grad_to_none=[q, k, v])
    row.fwd_tflops = flops / row.fwd_ms / 1e9
    row.fwdbwd_tflops = 3.5 * flops / row.fwdbwd_ms / 1e9


def run_timings(args, deadline: float) -> list[Row]:
    rows: list[Row] = []
    for length in args.lengths:
        for dist in args.distributions:
            plan = [("full", "sdpa")]  # dense causal baseline (cuDNN / FlashAttention)
            plan += [(var, eng) for var in args.variants for eng in args.engines]
            for variant, engine in plan:
                layout = make_layout(length, dist, variant, args.seed, args.mean_doc_len)
                row = Row(length, dist, variant, engine, docs=layout.num_segments)
                rows.append(row)
                if variant != "full" and engine == "sdpa" and length > args.sdpa_mask_max:
                    row.error = (
                        f"skipped: dense T×T mask above --sdpa-mask-max={args.sdpa_mask_max}"
                    )
                elif time.monotonic() > deadline:
                    row.error = "skipped: --budget-s exhausted"
                else:
                    _guarded(row, measure, row, layout, args)
                print(_row_line(row), flush=True)
    return rows


def _guarded(record, fn, *args) -> None:
    try:
        fn(*args)
    except Exception as err:  # report the engine's failure in the table and keep going
        record.error = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
        if os.environ.get("BENCH_TRACEBACK"):
            traceback.print_exc()
    finally:
        torch.cuda.empty_cache()


# -------------------------------------------------------------------------------- accuracy
def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def accuracy(args, deadline: float) -> list[Accuracy]:
    """bf16 engines vs a float32 dense-mask reference (sdpa) at ``--check-len`` tokens."""
    out: list[Accuracy] = []
    t = args.check_len
    for variant in ["full", *args.variants]:
        layout = make_layout(t, "heavy_tailed", variant, args.seed + 1, args.mean_doc_len // 4)
        q, k, v = qkv(t, args.heads, args.kv_heads, args.head_dim, grad=False, seed=1)
        grad = torch.randn_like(q)
        ref32 = [x.float().requires_grad_() for x in (q, k, v)]
        ref = attend(*ref32, layout, engine="sdpa")
        reference = (ref.detach(), torch.autograd.grad(ref, ref32, grad.float()))
        for engine in ["sdpa", *[e for e in args.engines if e != "sdpa"]]:
            rec = Accuracy(t, variant, engine)
            out.append(rec)
            if time.monotonic() > deadline:
                rec.error = "skipped: --budget-s exhausted"
                continue
            _guarded(rec, _check_engine, rec, (q, k, v), grad, layout, reference)
            print(_acc_line(rec), flush=True)
    return out


def _check_engine(rec: Accuracy, inputs, grad, layout, reference) -> None:
    ref, ref_grads = reference
    x = [y.detach().clone().requires_grad_() for y in inputs]
    got = attend(*x, layout, engine=rec.engine)
    rec.fwd_rel_err = rel_err(got, ref)
    grads = torch.autograd.grad(got, x, grad)
    rec.grad_rel_err = {n: rel_err(g, r) for n, g, r in zip("qkv", grads, ref_grads)}


# ---------------------------------------------------------------------------------- tables
def _fmt(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _row_line(r: Row) -> str:
    base = f"{r.length:>7} {r.distribution:<12} {r.variant:<15} {r.engine:<10}"
    if r.error:
        return f"{base} {r.error}"
    return (
        f"{base} fwd {_fmt(r.fwd_ms, 2)} ms ({_fmt(r.fwd_tflops)} TF/s)  "
        f"fwd+bwd {_fmt(r.fwdbwd_ms, 2)} ms ({_fmt(r.fwdbwd_tflops)} TF/s)  plan {_fmt(r.plan_ms)} ms"
    )


def _acc_line(a: Accuracy) -> str:
    if a.error:
        return f"accuracy {a.length} {a.variant:<15} {a.engine:<10} {a.error}"
    grads = " ".join(f"d{n} {e:.2e}" for n, e in a.grad_rel_err.items())
    return f"accuracy {a.length} {a.variant:<15} {a.engine:<10} out {a.fwd_rel_err:.2e} {grads}"


def markdown(rows: list[Row], acc: list[Accuracy]) -> str:
    dense = {
        (r.length, r.distribution): r for r in rows if r.variant == "full" and r.engine == "sdpa"
    }
    lines = [
        "| T | docs | variant | engine | fwd ms | fwd+bwd ms | fwd TF/s | fwd+bwd TF/s "
        "| × dense causal time | plan ms | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = dense.get((r.length, r.distribution))
        speed = (
            f"{base.fwdbwd_ms / r.fwdbwd_ms:.1f}×"
            if base and base.fwdbwd_ms and r.fwdbwd_ms and r is not base
            else "—"
        )
        lines.append(
            f"| {r.length} | {r.distribution} ({r.docs}) | {r.variant} | {r.engine} "
            f"| {_fmt(r.fwd_ms, 2)} | {_fmt(r.fwdbwd_ms, 2)} | {_fmt(r.fwd_tflops)} "
            f"| {_fmt(r.fwdbwd_tflops)} | {speed} | {_fmt(r.plan_ms)} | {r.error} |"
        )
    lines += [
        "",
        "| T | variant | engine (bf16) | out rel err | dq | dk | dv | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for a in acc:
        g = a.grad_rel_err
        cells = [_fmt(a.fwd_rel_err and a.fwd_rel_err * 1e3, 2)] + [
            _fmt(g[n] * 1e3, 2) if n in g else "—" for n in "qkv"
        ]
        lines.append(
            f"| {a.length} | {a.variant} | {a.engine} | " + " | ".join(cells) + f" | {a.error} |"
        )
    lines.append("\nRelative errors ×1e-3 against a float32 dense-mask reference.")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    p.add_argument(
        "--engines",
        nargs="+",
        default=["flex", "varlen", "flash_attn"],
        choices=list(ENGINES),
        help="Engines on the document masks.",
    )
    p.add_argument(
        "--variants",
        nargs="+",
        default=["anchor", "intra_doc"],
        choices=["full", "intra_doc", "intra_doc_reset", "anchor"],
        help="intra_doc_reset has intra_doc's mask (only positions differ).",
    )
    p.add_argument(
        "--distributions",
        nargs="+",
        default=["heavy_tailed", "fixed"],
        choices=["heavy_tailed", "fixed"],
    )
    p.add_argument("--mean-doc-len", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--check-len", type=int, default=4096, help="Length of the accuracy check.")
    p.add_argument(
        "--sdpa-mask-max",
        type=int,
        default=16384,
        help="Longest T for the dense-mask sdpa engine (its mask is T×T bytes).",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--budget-s", type=float, default=330.0, help="Stop starting new runs after this."
    )
    p.add_argument("--out", type=Path, help="Write rows, accuracy and environment as JSON.")
    return p.parse_args(argv)  # fmt: skip


def environment() -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "argv": sys.argv,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.budget_s
    acc = accuracy(args, deadline)
    rows = run_timings(args, deadline)
    table = markdown(rows, acc)
    print(f"\n## Attention engines — {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print(table)
    if args.out:
        payload = {
            "environment": environment(),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "timings": [asdict(r) for r in rows],
            "accuracy": [asdict(a) for a in acc],
            "markdown": table,
        }
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text(json.dumps(payload, indent=2))
        tmp.replace(args.out)  # atomic: a reader never sees a half-written file
    return 0


if __name__ == "__main__":
    sys.exit(main())
