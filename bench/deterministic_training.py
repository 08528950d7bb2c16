"""Bit-identical reruns and what they cost: ``training.deterministic`` on a config's pretraining.

Runs the pretraining stage of an experiment config (default ``configs/gpu-small.yaml``) several
times from the same config and seed, each in a run root of its own through ``anchorctx train``:
twice with ``training.deterministic: true`` and twice without. Compares the sha256 of the
checkpoints' weight files and the median step time of each run (the first steps, compilation
and autotuning, are left out), and writes a JSON record.

    python bench/deterministic_training.py --steps 200 --out det.json
    python bench/deterministic_training.py --set training.device=cpu --set model.tiny... (smoke)

The demo corpus (tokenizer, domain text) is written where the config puts it when missing; the
pretraining corpus, shrunk by ``--corpus-scale`` for a short run, under ``--work``, shared by
every run (the token budget must stay within it: an error names ``data.token_budget``
otherwise).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from anchorctx.config import dump_config
from anchorctx.demo.corpus import ensure_demo_corpus
from anchorctx.demo.pretrain_corpus import ensure_pretrain_corpus
from anchorctx.experiment import load_config


def weight_hashes(run_dir: Path) -> dict[str, str]:
    """sha256 of every checkpoint weight file, by path under ``checkpoints/``."""
    root = run_dir / "checkpoints"
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*.safetensors"))
    }


def step_times(run_dir: Path, skip: int) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in rows if "step_time_s" in r and r["step"] > skip]


def pretraining_config(args) -> Path:
    """The pretraining stage's config of ``args.config``, shortened to ``args.steps``."""
    cfg = load_config(args.config, args.set)
    corpus = cfg.pretrain.corpus
    scale = args.corpus_scale
    new_dir = args.work / f"pretrain-corpus-{scale}"  # not the full-size corpus' place
    cfg.data.sources = [  # the arms' sources name the corpus too (gpu-small)
        s.model_copy(update={"path": new_dir / "data"}) if s.path == corpus.dir / "data" else s
        for s in cfg.data.sources
    ]
    cfg.pretrain.corpus = corpus.model_copy(
        update={
            "dir": new_dir,
            "documents": max(1, int(corpus.documents * scale)),
            "task_format_documents": int(corpus.task_format_documents * scale),
        }
    )
    ensure_demo_corpus(cfg)  # the tokenizer and domain text, where the config puts them
    ensure_pretrain_corpus(cfg)
    pre = cfg.pretraining()
    t = pre.training
    budget = args.steps * t.global_batch_size * pre.data.seq_len
    pre = pre.model_copy(
        update={
            # One packed dataset for every run (packed by the first).
            "data": pre.data.model_copy(
                update={"token_budget": budget, "output_dir": args.work / "packed"}
            ),
            "training": t.model_copy(
                update={
                    "steps": args.steps,
                    "save": t.save.model_copy(
                        update={"every": args.steps, "last": None, "resume": False}
                    ),
                }
            ),
        }
    )
    path = args.work / "pretraining.yaml"
    args.work.mkdir(parents=True, exist_ok=True)
    dump_config(pre, path)
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="configs/gpu-small.yaml")
    p.add_argument("--set", action="append", default=[], help="override of the experiment config")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--corpus-scale", type=float, default=0.2)
    p.add_argument("--runs", default="det,det,nondet,nondet", help="modes, in order")
    p.add_argument("--skip", type=int, default=5, help="first steps left out of the step time")
    p.add_argument("--work", type=Path, default=Path("/tmp/anchorctx-determinism"))
    p.add_argument("--out", type=Path, default=Path("determinism.json"))
    args = p.parse_args()
    cfg_path = pretraining_config(args)
    runs = []
    for i, mode in enumerate(args.runs.split(",")):
        root = args.work / f"run{i}-{mode}"
        cmd = [
            sys.executable,
            "-m",
            "anchorctx",
            "train",
            str(cfg_path),
            "--set",
            f"run_root={root}",
            "--set",
            f"training.deterministic={'true' if mode == 'det' else 'false'}",
        ]
        start = time.perf_counter()
        subprocess.run(cmd, check=True)
        wall = time.perf_counter() - start
        (run_dir,) = [d for d in root.glob("*/*") if (d / "checkpoints").is_dir()]
        times = step_times(run_dir, args.skip)
        runs.append(
            {
                "mode": mode,
                "run_dir": str(run_dir),
                "wall_s": round(wall, 1),
                "median_step_s": round(statistics.median(times), 4),
                "hashes": weight_hashes(run_dir),
                "manifest_deterministic": json.loads((run_dir / "manifest.json").read_text())[
                    "deterministic"
                ],
            }
        )
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "hashes"}), flush=True)
    by_mode: dict[str, list[dict]] = {}
    for r in runs:
        by_mode.setdefault(r["mode"], []).append(r)
    summary = {
        mode: {
            "identical": all(r["hashes"] == rs[0]["hashes"] for r in rs),
            "median_step_s": [r["median_step_s"] for r in rs],
        }
        for mode, rs in by_mode.items()
    }
    if "det" in summary and "nondet" in summary:
        det = statistics.mean(summary["det"]["median_step_s"])
        nondet = statistics.mean(summary["nondet"]["median_step_s"])
        summary["slowdown"] = round(det / nondet, 4)
    record = {"steps": args.steps, "config": args.config, "summary": summary, "runs": runs}
    args.out.write_text(json.dumps(record, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
