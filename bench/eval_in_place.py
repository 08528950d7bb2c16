"""In-place evaluation from several threads: what each later evaluation of a process pays.

On one GPU the flow process evaluates in place, each flow run's tasks on a thread pool of its
own. cuDNN keeps its attention graphs per thread and builds one per prompt length (~68 ms on an
H100), so the static engine runs on one generation thread per process
(:func:`anchorctx.evaluation.generation.on_generation_thread`). This bench evaluates RULER on
``--evaluations`` checkpoints of one architecture (random bf16 weights, the demo tokenizer),
each from a new thread as Prefect would, and prints each evaluation's generation time; with
``--no-generation-thread`` the engine runs in the calling threads instead (the behaviour before).

    python bench/eval_in_place.py --evaluations 3
    python bench/eval_in_place.py --evaluations 3 --no-generation-thread
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from eval_sharding import linked_copy, make_checkpoint, ruler_evaluation

from anchorctx.evaluation import generation, results
from anchorctx.experiment import config_from_dict
from anchorctx.io import atomic_write_json, read_jsonl


def _evaluate(cfg, ckpt: Path, out: dict) -> None:
    start = time.perf_counter()
    results.evaluate_checkpoint(cfg, ckpt, "ruler", progress=False)
    out["wall_s"] = time.perf_counter() - start
    log = read_jsonl(results.time_log_path(results.samples_path(ckpt, "ruler")))
    out.update(load_s=log[-1]["load_s"], generate_s=log[-1]["generate_s"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--evaluations", type=int, default=3)
    p.add_argument("--no-generation-thread", action="store_true")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--lengths", type=int, nargs="+", default=[8192])
    p.add_argument("--tasks", nargs="+", default=["niah_single_1", "niah_single_2", "vt", "fwe"])
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=56)
    p.add_argument("--device", default="cuda")
    p.add_argument("--work", type=Path, default=Path("eval_in_place_work"))
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.no_generation_thread:  # the engine in the calling thread, as before
        generation._on_cuda = lambda model: False

    from anchorctx.demo.corpus import write_demo_corpus
    from anchorctx.demo.fixtures import ensure_eval_fixtures

    work = args.work.resolve()
    corpus = write_demo_corpus(work / "corpus", seed=0, docs_per_domain=12, progress=False)
    fixtures = work / "eval_data"
    raw = {
        "name": "in-place",
        "run_root": str(work / "runs"),
        "model": {"tiny": {}, "tokenizer": str(corpus.tokenizer_dir), "dtype": "bfloat16"},
        "evaluation": ruler_evaluation(fixtures, args, args.device, deterministic=True),
    }
    cfg = config_from_dict(raw)
    ensure_eval_fixtures(cfg)
    ckpts = [cfg.run_dir / "checkpoints" / f"step-{k + 1:06d}" for k in range(args.evaluations)]
    make_checkpoint(ckpts[0], corpus.tokenizer_dir, args)
    for other in ckpts[1:]:
        linked_copy(ckpts[0], other)
    runs: list[dict] = []
    for ckpt in ckpts:  # one after another, each from a new thread
        runs.append({"checkpoint": ckpt.name})
        thread = threading.Thread(target=_evaluate, args=(cfg, ckpt, runs[-1]))
        thread.start()
        thread.join()
        if "generate_s" not in runs[-1]:
            raise SystemExit(f"evaluation of {ckpt} failed (its traceback is above)")
        r = runs[-1]
        print(
            f"{r['checkpoint']}: wall {r['wall_s']:.1f} s, load {r['load_s']:.1f} s, "
            f"generation {r['generate_s']:.1f} s",
            flush=True,
        )
    if args.out:
        import torch

        atomic_write_json(
            args.out,
            {
                "benchmark": "eval_in_place",
                "date": datetime.now(timezone.utc).isoformat(),
                "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "runs": runs,
            },
        )
        print(json.dumps(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
