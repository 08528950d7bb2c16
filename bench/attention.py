"""Attention engine benchmark: milliseconds and useful TFLOP/s per engine × variant × length.

For each sequence length and document-length distribution (heavy-tailed, SlimPajama-like;
fixed 2K; web pages around one long book; one very long book plus short pages; many tiny
documents), times forward and forward+backward of every engine (and ``auto``) on the
anchor/intra-document masks, beside dense causal SDPA (cuDNN/FlashAttention) in the same run. Useful FLOPs count only
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
    picked: str = ""  # the engine ``auto`` chose
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
DISTRIBUTIONS = ("heavy_tailed", "fixed", "web_books", "one_book", "tiny")


def _lognormal(gen: torch.Generator, mean: float, sigma: float) -> int:
    mu = math.log(mean) - sigma**2 / 2  # the distribution's mean is ``mean``
    return int(math.exp(mu + sigma * torch.randn(1, generator=gen).item()))


def doc_lengths(total: int, distribution: str, seed: int, mean: int) -> list[int]:
    """Document lengths filling ``total`` tokens (the last one truncated).

    heavy_tailed: log-normal, sigma 1.6, mean ``mean`` (SlimPajama's shape: mostly short
    documents, a long tail of book/arXiv-sized ones); fixed: ``mean`` each; web_books: one book
    of 54% of the row (71K of 128K) among log-normal web pages of mean 1.2K (≈ 48 documents at
    128K); one_book: one book of 73% of the row (96K of 128K) among pages of mean 600; tiny:
    log-normal of mean 300 capped at 1.5K (≈ 430 documents at 128K).
    """
    gen = torch.Generator().manual_seed(seed)
    book = {"web_books": 0.54, "one_book": 0.73}.get(distribution)
    budget = total - (int(book * total) if book else 0)
    lens: list[int] = []
    while sum(lens) < budget:
        if distribution == "fixed":
            n = mean
        elif distribution == "heavy_tailed":
            n = _lognormal(gen, mean, 1.6)
        elif distribution == "web_books":
            n = _lognormal(gen, 1200, 1.0)
        elif distribution == "one_book":
            n = _lognormal(gen, 600, 1.0)
        else:  # tiny
            n = min(_lognormal(gen, 300, 0.8), 1536)
        lens.append(max(1, min(n, budget - sum(lens))))
    if book:  # the book at a seeded place among the pages
        at = int(torch.randint(0, len(lens) + 1, (1,), generator=gen))
        lens.insert(at, total - budget)
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
    if row.engine == "auto":
        row.picked = auto_choice(q, k, v, layout)
    flops = layout.attention_flops(h, d)
    with torch.no_grad():
        row.fwd_ms = bench_ms(lambda: attend(q, k, v, layout, engine=row.engine))
    grad = torch.randn(1, h, row.length, d, device="cuda", dtype=torch.bfloat16)

    def fwd_bwd():
        attend(q, k, v, layout, engine=row.engine).backward(grad)

    row.fwdbwd_ms = bench_ms(fwd_bwd, grad_to_none=[q, k, v])
    row.fwd_tflops = flops / row.fwd_ms / 1e9
    row.fwdbwd_tflops = 3.5 * flops / row.fwdbwd_ms / 1e9


def auto_choice(q, k, v, layout: Layout) -> str:
    from anchorctx.attention.api import _as_batch
    from anchorctx.attention.engines import AttentionCall, select_engine

    batch, cache = _as_batch(layout, q.shape[0])
    call = AttentionCall(q=q, k=k, v=v, batch=batch, cache=cache, scale=q.shape[-1] ** -0.5)
    return select_engine(call, "auto").name


def run_timings(args, deadline: float) -> list[Row]:
    rows: list[Row] = []
    for length in args.lengths:
        for dist in args.distributions:
            # dense causal baseline (cuDNN / FlashAttention); it depends on T only
            plan = [] if args.skip_dense else [("full", "sdpa")]
            plan += [
                (var, eng)
                for var in args.variants
                for eng in args.engines
                if not (var == "intra_doc" and eng in args.anchor_only)
            ]
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
                elif engine == "auto" and _reuse_pick(row, rows, layout, args):
                    pass  # auto dispatched to an engine already timed on this row
                else:
                    _guarded(row, measure, row, layout, args)
                print(_row_line(row), flush=True)
    return rows


def _reuse_pick(row: Row, rows: list[Row], layout: Layout, args) -> bool:
    """Fill an ``auto`` row from the timed row of the engine it picks (the same kernels)."""
    q, k, v = qkv(row.length, args.heads, args.kv_heads, args.head_dim, grad=False)
    row.picked = auto_choice(q, k, v, layout)
    for other in rows:
        if (other.length, other.distribution, other.variant, other.engine) == (
            row.length,
            row.distribution,
            row.variant,
            row.picked,
        ) and not other.error:
            for name in ("fwd_ms", "fwdbwd_ms", "fwd_tflops", "fwdbwd_tflops", "plan_ms"):
                setattr(row, name, getattr(other, name))
            return True
    return False


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
    engine = f"{r.engine}={r.picked}" if r.picked else r.engine
    base = f"{r.length:>7} {r.distribution:<12} {r.variant:<15} {engine:<10}"
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
            f"| {r.length} | {r.distribution} ({r.docs}) | {r.variant} "
            f"| {r.engine}{f' ({r.picked})' if r.picked else ''} "
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


ISSUE_COLUMNS = (  # (header, variant, engine) of the summary table
    ("dense causal cuDNN", "full", "sdpa"),
    ("anchor flex", "anchor", "flex"),
    ("anchor varlen", "anchor", "varlen"),
    ("intra_doc flex", "intra_doc", "flex"),
    ("anchor flex_merge", "anchor", "flex_merge"),
    ("anchor flex_copy", "anchor", "flex_copy"),
    ("anchor triton", "anchor", "triton"),
    ("anchor auto", "anchor", "auto"),
)
RATIO_ENGINES = ("flex_merge", "flex_copy", "triton")  # anchor engines over intra_doc flex
SINGLE_ENGINES = ("flex", "varlen", "flash_attn", "flex_merge", "flex_copy", "triton")


def summary(rows: list[Row]) -> str:
    """Forward+backward useful TFLOP/s, one line per (T, distribution), the engines side by side;
    the last columns: flex_merge, flex_copy and triton (anchor) over intra_doc flex (TFLOP/s
    ratios), and auto over the best single anchor engine (time ratio)."""
    by_key = {(r.length, r.distribution, r.variant, r.engine): r for r in rows}
    heads = [h for h, _, _ in ISSUE_COLUMNS]
    lines = [
        "| T | documents | "
        + " | ".join(heads)
        + " | merge / intra_doc | copy / intra_doc | triton / intra_doc | auto / best |",
        "|---|---|" + "---:|" * (len(heads) + 4),
    ]
    for length, dist in dict.fromkeys((r.length, r.distribution) for r in rows):
        cells, docs = [], ""
        for _, variant, engine in ISSUE_COLUMNS:
            r = by_key.get((length, dist, variant, engine))
            if r and variant == "anchor":
                docs = str(r.docs)
            tf = r.fwdbwd_tflops if r and not r.error else None
            cells.append(_fmt(tf, 0) + (f" (= {r.picked})" if r and r.picked and tf else ""))

        def ms(variant, engine, key=(length, dist)):
            r = by_key.get((*key, variant, engine))
            return r.fwdbwd_ms if r and not r.error else None

        # useful FLOPs differ by the anchor column only (< 1%): compare TFLOP/s, as the issue
        ratios = []
        for engine in RATIO_ENGINES:
            ratio = "—"
            if ms("anchor", engine) and ms("intra_doc", "flex"):
                r_a = by_key[(length, dist, "anchor", engine)].fwdbwd_tflops
                r_i = by_key[(length, dist, "intra_doc", "flex")].fwdbwd_tflops
                ratio = f"{r_a / r_i:.3f}"
            ratios.append(ratio)
        singles = [t for t in (ms("anchor", e) for e in SINGLE_ENGINES) if t]
        auto = ms("anchor", "auto")
        vs_best = f"{auto / min(singles):.3f}" if auto and singles else "—"
        lines.append(
            f"| {_k(length)} | {dist} ({docs}) | "
            + " | ".join(cells)
            + f" | {' | '.join(ratios)} | {vs_best} |"
        )
    return "\n".join(lines)


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    p.add_argument(
        "--engines",
        nargs="+",
        default=[
            *("flex", "varlen", "flash_attn", "flex_merge", "flex_copy", "triton"),
            *("fa4", "flex_flash", "auto"),
        ],
        choices=[*ENGINES, "auto"],
        help="Engines on the document masks.",
    )
    p.add_argument(
        "--anchor-only",
        nargs="*",
        default=["flex_merge", "flex_copy", "triton", "auto", "varlen"],
        help="Engines timed on the anchor variant only (flex_merge, flex_copy and auto equal flex on "
        "intra_doc; varlen and triton there are not in the summary).",
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
        default=list(DISTRIBUTIONS),
        choices=list(DISTRIBUTIONS),
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
    p.add_argument(
        "--skip-dense", action="store_true", help="Leave out the dense causal SDPA baseline."
    )
    p.add_argument(
        "--skip-accuracy", action="store_true", help="Leave out the bf16 accuracy check."
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--budget-s", type=float, default=330.0, help="Stop starting new runs after this."
    )
    p.add_argument("--out", type=Path, help="Write rows, accuracy and environment as JSON.")
    return p.parse_args(argv)


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
    acc = [] if args.skip_accuracy else accuracy(args, deadline)
    rows = run_timings(args, deadline)
    table = markdown(rows, acc) + "\n\n" + summary(rows)
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
