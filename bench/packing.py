"""Data-pipeline throughput and memory on CPU.

Measures, on a generated demo corpus at 1x and at 10x (the same files repeated):
- tokens/s of tokenisation alone (read + parse + tokenise, nothing kept),
- tokens/s of the whole ``prepare_data`` (read, tokenise, plan, pack, write),
- peak RSS of each run (separate subprocesses, so the numbers do not mix).

    python bench/packing.py [--docs-per-domain 12] [--workers 1] [--out packing.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _cfg(corpus: Path, tokenizer: Path, workers: int, run_root: Path):
    from anchorctx.experiment import config_from_dict

    return config_from_dict(
        {
            "name": "bench",
            "run_root": str(run_root),
            "model": {"tiny": {}, "tokenizer": str(tokenizer), "dtype": "float32"},
            "data": {"sources": [{"path": str(corpus)}], "seq_len": 8192, "num_workers": workers},
        }
    )


def _tokenize_only(cfg) -> int:
    from anchorctx.models.loading import load_tokenizer
    from anchorctx.packing.pipeline import _records, _resolve_inputs
    from anchorctx.packing.sources import BadInput
    from anchorctx.packing.tokens import encode_batches

    tok = load_tokenizer(cfg.model)
    bad = BadInput(skip=False)
    files = _resolve_inputs(cfg.data, bad)
    batches = encode_batches(
        _records(files, bad, None),
        tok,
        str(cfg.model.tokenizer_path),
        batch_size=cfg.data.tokenize_batch_size,
        num_workers=cfg.data.num_workers,
    )
    return sum(int(flat.shape[0]) for _, flat, _ in batches)


def child(mode: str, corpus: Path, tokenizer: Path, workers: int) -> None:
    from anchorctx.packing import load_packed, prepare_data

    with tempfile.TemporaryDirectory() as tmp:
        cfg = _cfg(corpus, tokenizer, workers, Path(tmp))
        start = time.perf_counter()
        if mode == "tokenize":
            tokens = _tokenize_only(cfg)
        else:
            _, manifest = load_packed(prepare_data(cfg, force=True, progress=False))
            tokens = manifest["counts"]["input_tokens"]
        seconds = time.perf_counter() - start
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"tokens": tokens, "seconds": seconds, "peak_rss_mib": peak_mib}))


def _run_child(mode: str, corpus: Path, tokenizer: Path, workers: int) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        mode,
        "--corpus",
        str(corpus),
        "--tokenizer",
        str(tokenizer),
        "--workers",
        str(workers),
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    res["tokens_per_s"] = res["tokens"] / res["seconds"]
    return res


def _replicate(src: Path, dst: Path, times: int) -> Path:
    for i in range(times):
        shutil.copytree(src, dst / f"copy{i}")
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--docs-per-domain", type=int, default=12)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--scale", type=int, default=10, help="Corpus growth for the memory check.")
    ap.add_argument("--out", type=Path, help="Write the results as JSON.")
    ap.add_argument("--child", choices=["tokenize", "full"], help=argparse.SUPPRESS)
    ap.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.corpus, args.tokenizer, args.workers)
        return
    from anchorctx.demo.corpus import write_demo_corpus

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        demo = write_demo_corpus(
            Path(tmp) / "demo", docs_per_domain=args.docs_per_domain, progress=False
        )
        corpora = {
            1: demo.data_dir,
            args.scale: _replicate(demo.data_dir, Path(tmp) / "big", args.scale),
        }
        for scale, corpus in corpora.items():
            for mode in ("tokenize", "full"):
                res = _run_child(mode, corpus, demo.tokenizer_dir, args.workers)
                rows.append({"scale": scale, "mode": mode, "workers": args.workers, **res})
    _print(rows)
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "cpus": _cpus()}, indent=2) + "\n")


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


def _print(rows: list[dict]) -> None:
    print(
        f"{'corpus':>7} {'stage':<18} {'tokens':>10} {'seconds':>8} {'tok/s':>10} {'peak RSS MiB':>13}"
    )
    for r in rows:
        stage = "tokenise only" if r["mode"] == "tokenize" else "tokenise + pack"
        print(
            f"{r['scale']:>6}x {stage:<18} {r['tokens']:>10} {r['seconds']:>8.1f} "
            f"{r['tokens_per_s']:>10.0f} {r['peak_rss_mib']:>13.0f}"
        )
    for scale in sorted({r["scale"] for r in rows}):
        t = {r["mode"]: r for r in rows if r["scale"] == scale}
        overhead = t["tokenize"]["tokens_per_s"] / t["full"]["tokens_per_s"] - 1
        print(f"{scale}x: packing adds {overhead:.1%} to tokenisation time")


if __name__ == "__main__":
    main()
