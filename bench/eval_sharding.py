"""Scaling of a sharded RULER evaluation: the same evaluation on 1 GPU and on N GPUs.

A Llama-2-7B-wide checkpoint (random bf16 weights, ``--layers`` deep, the demo tokenizer) is
evaluated on RULER tasks of the demo fixture data, once as one shard on GPU 0 and once split by
:func:`anchorctx.evaluation.sharding.plan_shards` into N shard processes, one per GPU (the
commands the evaluation flow runs, without the Prefect orchestration around them). Wall time
counts everything a shard process does (start, model load, sample construction, generation);
the merge that writes the result is timed apart. The records of both runs are compared.

``--cache`` sets what the compile cache (Inductor's and Triton's on-disk caches) holds when each
run starts: ``shared`` (one cache for the whole bench, as on a machine that evaluated before:
the first run fills it), ``cold`` (an empty one per run, as the first evaluation on a fresh
machine, e.g. full-experiment's first arm) or ``ahead`` (an empty one per run, filled by the
compile-ahead passes of the run's own shard plan before the timed evaluation starts, as
full-experiment does on the evaluation GPUs while its first arm trains; the passes load another
checkpoint of the same architecture, as the flow loads the arms' base model, and are timed apart).

``--workers persistent`` runs the shards in one evaluation worker per GPU
(:mod:`anchorctx.evaluation.worker`, what the flows do), started once (timed apart) and kept for
every run, on one compile cache (``--cache`` sets it as above, ``ahead`` runs the passes in the
workers). The runs are then 1st the N-GPU and 1-GPU evaluations as a first arm sees them, and
again as a later arm (``--repeat`` implied): N, 1, N, 1. The scaling is the later arm's.

    python bench/eval_sharding.py --gpus 2 --out eval_sharding.json
    python bench/eval_sharding.py --gpus 2 --cache cold
    python bench/eval_sharding.py --gpus 2 --cache ahead
    python bench/eval_sharding.py --gpus 2 --cache ahead --workers persistent
    python bench/eval_sharding.py --gpus 1 --cache ahead --workers persistent --release

Shards get the checkpoint's hash from this process, as the flow passes it
(``--checkpoint-hash``); ``--hash-in-shards`` has each shard hash the checkpoint itself, as
before. ``--release`` (with persistent workers) has the workers release their GPU memory before
each timed run, as they do when training takes their GPU between two arms, and reports what a
released worker still holds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from anchorctx.evaluation import results, sharding
from anchorctx.evaluation.worker import EvalWorker
from anchorctx.experiment import config_from_dict
from anchorctx.io import atomic_write_json, read_jsonl
from anchorctx.process import ProcessFailed


def make_checkpoint(
    path: Path, tokenizer_dir: Path, args: argparse.Namespace, seed: int = 0
) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or args.heads,
        max_position_embeddings=max(args.lengths),
        rope_theta=1e7,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(seed)
    with torch.device(args.device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "anchorctx.json").write_text(json.dumps({"step": 1}))


def linked_copy(src: Path, dst: Path) -> None:
    """The same checkpoint in another run directory (hard links: no second copy of weights)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        os.link(f, dst / f.name)


def _run_shard(args: list[str], env: dict[str, str], out: dict, worker=None) -> None:
    """One shard, in a process of its own or in ``worker``: its wall time and the phase times
    it reports."""
    start = time.perf_counter()
    if worker is None:
        cmd = [sys.executable, "-m", "anchorctx.evaluation.sharding", *args]
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
        returncode, lines = proc.returncode, proc.stdout.splitlines()
    else:
        try:
            returncode, lines = 0, worker.run(args)
        except ProcessFailed as err:
            print(err, file=sys.stderr)
            returncode, lines = err.returncode, err.tail
    out.update(wall_s=time.perf_counter() - start, returncode=returncode)
    for line in lines:
        for key in ("shard_timing", "compile_timing"):
            if line.startswith(f'{{"{key}"'):
                out.update(json.loads(line)[key])
    # Interpreter start and imports (in a worker: the request's own overhead): what the
    # shard's own phases do not cover.
    if "generate_s" in out:
        out["start_s"] = out["wall_s"] - out["setup_s"] - out["load_s"] - out["generate_s"]


def ruler_evaluation(fixtures: Path, args: argparse.Namespace, device: str, deterministic: bool):
    """The config's ``evaluation`` section: RULER alone, on the demo fixtures in ``fixtures``."""
    return {
        "suites": ["ruler"],
        "demo_fixtures": str(fixtures),
        "device": device,
        "dtype": "bfloat16",
        "batch_size": args.batch_size,
        "deterministic_decode": deterministic,
        "ruler": {
            "tasks": args.tasks,
            "lengths": args.lengths,
            "num_samples": args.samples,
            "squad_path": str(fixtures / "squad.json"),
            # The demo's essays and sentence splitter: without them RULER's essay-haystack NIAH
            # tasks do not run (reported as not run, no records).
            "essay_path": str(fixtures / "essays.json"),
            "nltk_data": str(fixtures / "nltk_data"),
        },
    }


def _start_workers(workers: list) -> dict:
    """Start every worker (a request that only prints the command's help); the seconds until
    all answered: interpreter start and the sharding module's imports, not torch's (the first
    shard request imports it)."""
    start = time.perf_counter()
    threads = [threading.Thread(target=w.run, args=(["--help"],)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"workers_start_s": time.perf_counter() - start}


def compile_cache(work: Path, mode: str, k: int) -> dict[str, str]:
    """The environment giving run ``k`` the ``--cache`` mode's compile cache."""
    if mode == "shared":
        return {}  # "cold" and "ahead": an empty cache per run
    cache = work / f"compile-cache-{k}"
    return {"TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton")}


def _run_shards(
    cfg_json: Path,
    ckpt: Path,
    plan: list[list[str]],
    gpus: list[str],
    env: dict,
    extra=(),
    workers: list | None = None,
) -> tuple[float, list[dict]]:
    """Every shard of ``plan`` in its own process (or in ``workers[i]``), shard i on GPU i;
    wall s and each one's times. ``extra``: more arguments (``--compile-only``)."""
    start = time.perf_counter()
    shards: list[dict] = [{"units": owned} for owned in plan]
    threads = []
    for i, owned in enumerate(plan):
        args = ["--config", str(cfg_json), "--checkpoint", str(ckpt), "--suite", "ruler"]
        args += ["--shard", str(i), str(len(plan)), *extra, "--units", *owned]
        shard_env = {**os.environ, **env, "CUDA_VISIBLE_DEVICES": gpus[i]}
        worker = workers[i] if workers else None
        threads.append(
            threading.Thread(target=_run_shard, args=(args, shard_env, shards[i], worker))
        )
        threads[-1].start()
    for t in threads:
        t.join()
    if any(s.get("returncode") for s in shards):
        sys.exit(f"shard processes failed: exit codes {[s.get('returncode') for s in shards]}")
    return time.perf_counter() - start, shards


def run_sharded(
    cfg_json: Path,
    cfg,
    ckpt: Path,
    n: int,
    gpus: list[str],
    cache_env: dict[str, str],
    ahead: Path | None = None,
    workers: list | None = None,
    release: bool = False,
    hash_in_shards: bool = False,
) -> dict:
    """The evaluation over ``n`` GPUs (in ``workers``, if given); ``ahead``: first the
    compile-ahead passes of its shard plan with that checkpoint (timed apart, ``ahead_s``);
    ``release``: the workers release their memory before the timed run; ``hash_in_shards``:
    the shards hash the checkpoint themselves."""
    assert sharding.prepare(cfg, ckpt, "ruler", force=True)
    plan = sharding.plan_shards(cfg, "ruler", n)
    cost = sharding.units(cfg, "ruler")
    passes: dict = {}
    if ahead is not None:
        ahead_s, times = _run_shards(
            cfg_json, ahead, plan, gpus, cache_env, ["--compile-only"], workers
        )
        passes = {"ahead_s": ahead_s, "ahead_times": times}
    if release and workers:  # as before an arm's training; the timed run comes after it
        passes["released"] = [line for w in workers for line in w.release()]
        print("\n".join(passes["released"]), flush=True)
    # prepare() hashed the checkpoint here; the flow passes the hash on the same way.
    token = [] if hash_in_shards else ["--checkpoint-hash", results.checkpoint_hash_token(ckpt)]
    wall, shards = _run_shards(cfg_json, ckpt, plan, gpus, cache_env, token, workers)
    for s in shards:
        s["estimated_s"] = sum(cost[u] for u in s["units"])
    start = time.perf_counter()
    out = sharding.finalize(cfg, ckpt, "ruler")
    merge = time.perf_counter() - start
    records = sorted(read_jsonl(results.samples_path(ckpt, "ruler"))[1:], key=lambda r: r["key"])
    return {
        "gpus": n,
        "shards": plan,
        "shard_times": shards,
        "wall_s": wall,
        "merge_s": merge,
        **passes,
        "scores": results.load_result(out)["scores"],
        "records": records,
    }


def _phases(run: dict) -> str:
    return "; ".join(
        f"shard {i}: start {s['start_s']:.1f} + setup {s['setup_s']:.1f} + load {s['load_s']:.1f} "
        f"+ generate {s['generate_s']:.1f} s (estimated {s['estimated_s']:.1f})"
        for i, s in enumerate(run["shard_times"])
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument(
        "--repeat",
        action="store_true",
        help="Also run the 1-GPU evaluation a second time (run-to-run determinism).",
    )
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, help="Default: --heads (no GQA).")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--tasks", nargs="+", default=["niah_single_1", "niah_multikey_2", "vt", "qa_1"])
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="evaluation.deterministic_decode (FlexAttention decode, compiled), as gpu-small.",
    )
    p.add_argument("--cache", choices=["shared", "cold", "ahead"], default="shared")
    p.add_argument(
        "--workers",
        choices=["process", "persistent"],
        default="process",
        help="process: a process per shard; persistent: one evaluation worker per GPU for "
        "every run (runs N, 1, N, 1 GPUs).",
    )
    p.add_argument(
        "--release",
        action="store_true",
        help="With --workers persistent: the workers release their GPU memory before each timed "
        "run, as before an arm's training (what a released worker holds is printed).",
    )
    p.add_argument(
        "--hash-in-shards",
        action="store_true",
        help="Each shard hashes the checkpoint itself (the behaviour before the flow passed "
        "its hash on).",
    )
    p.add_argument("--work", type=Path, default=Path("eval_sharding_work"))
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.release and args.workers != "persistent":
        p.error("--release needs --workers persistent")

    from anchorctx.demo.corpus import write_demo_corpus
    from anchorctx.demo.fixtures import ensure_eval_fixtures

    work = args.work.resolve()
    corpus = write_demo_corpus(work / "corpus", seed=0, docs_per_domain=12, progress=False)
    fixtures = work / "eval_data"
    device = "cuda" if args.device == "cuda" else "cpu"
    cfgs, ckpts = [], []
    persistent = args.workers == "persistent"
    if persistent:  # first-arm runs, then later-arm runs, on the same workers
        counts = [args.gpus, 1, args.gpus, 1]
    else:
        counts = [1, args.gpus, 1] if args.repeat else [1, args.gpus]
    for k, n in enumerate(counts):
        raw = {
            "name": f"shard{n}",
            "run_root": str(work / f"runs-{k}-{n}"),
            "model": {"tiny": {}, "tokenizer": str(corpus.tokenizer_dir), "dtype": "bfloat16"},
            "evaluation": ruler_evaluation(fixtures, args, device, args.deterministic),
        }
        cfgs.append(config_from_dict(raw))
        ckpts.append(cfgs[-1].run_dir / "checkpoints" / "step-000001")
    ensure_eval_fixtures(cfgs[0])
    make_checkpoint(ckpts[0], corpus.tokenizer_dir, args)
    for other in ckpts[1:]:
        linked_copy(ckpts[0], other)
    # The compile-ahead passes' model: the architecture, other weights (the flow's base model).
    base = work / "base" if args.cache == "ahead" else None
    if base is not None:
        make_checkpoint(base, corpus.tokenizer_dir, args, seed=1)
    gpus = [str(i) for i in range(args.gpus)]
    workers, started = None, {}
    if persistent:  # one cache for the workers' life: the first run's
        workers = [EvalWorker(g, compile_cache(work, args.cache, 0)) for g in gpus]
        started = _start_workers(workers)
        print(f"workers started in {started['workers_start_s']:.1f} s", flush=True)
    runs = []
    for k, (n, cfg, ckpt) in enumerate(zip(counts, cfgs, ckpts)):
        cfg_json = work / f"config-{k}-{n}.json"
        cfg_json.write_text(cfg.model_dump_json())
        cache_env = compile_cache(work, args.cache, 0 if persistent else k)
        ahead = base if not persistent or k == 0 else None  # workers: compiled once, ahead
        runs.append(
            run_sharded(
                cfg_json,
                cfg,
                ckpt,
                n,
                gpus,
                cache_env,
                ahead,
                workers,
                release=args.release,
                hash_in_shards=args.hash_in_shards,
            )
            | started
        )
        before = f"compiled ahead in {runs[-1]['ahead_s']:.1f} s, then " if ahead else ""
        print(
            f"{n} GPU(s), {args.cache} compile cache: {before}{runs[-1]['wall_s']:.1f} s "
            f"(+ merge {runs[-1]['merge_s']:.1f} s); "
            f"{_phases(runs[-1])}",
            flush=True,
        )
        if args.out:  # what has run so far survives a run cut short
            atomic_write_json(
                args.out,
                {
                    "benchmark": "eval_sharding",
                    "partial": True,
                    "runs": [{k: v for k, v in r.items() if k != "records"} for r in runs],
                },
            )
    if workers:
        for w in workers:
            w.close()
    # The scaling: with workers, the later arm's runs (on warm workers); else the first two.
    one, many = (runs[3], runs[2]) if persistent else (runs[0], runs[1])
    first = runs[0]["records"]
    same = sum(a == b for a, b in zip(one["records"], many["records"]))
    if persistent:
        every = all(r["records"] == first for r in runs)
        print(f"records of all {len(runs)} runs identical to the first's: {every}")
    if args.repeat and not persistent:
        again = sum(a == b for a, b in zip(one["records"], runs[2]["records"]))
        print(f"1 GPU run twice: {again}/{len(one['records'])} records identical")
    speedup = one["wall_s"] / many["wall_s"]
    # The protocol's shards run for hours, so per-process start and load vanish there: the
    # generation phases alone (the slowest shard's) are what its scaling tends to.
    gen_speedup = max(s["generate_s"] for s in one["shard_times"]) / max(
        s["generate_s"] for s in many["shard_times"]
    )
    print(
        f"\nRULER {args.tasks} × {args.lengths} × {args.samples} samples, "
        f"{args.layers}-layer 7B-wide model, batch ≤ {args.batch_size}"
    )
    print("| GPUs | shards (units) | wall s | merge s | speedup |")
    print("|---:|---|---:|---:|---:|")
    for r in runs:
        sizes = "/".join(str(len(s)) for s in r["shards"])
        print(
            f"| {r['gpus']} | {sizes} | {r['wall_s']:.1f} | {r['merge_s']:.1f} | "
            f"{one['wall_s'] / r['wall_s']:.2f}× |"
        )
    print(
        f"records identical: {same}/{len(one['records'])}; scores identical: "
        f"{one['scores'] == many['scores']}; speedup {speedup:.2f}× "
        f"(generation phases alone {gen_speedup:.2f}×)"
    )
    if args.out:
        import torch

        atomic_write_json(
            args.out,
            {
                "benchmark": "eval_sharding",
                "date": datetime.now(timezone.utc).isoformat(),
                "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "runs": [{k: v for k, v in r.items() if k != "records"} for r in runs],
                "records": len(one["records"]),
                "records_identical": same,
                "speedup": speedup,
                "generation_speedup": gen_speedup,
            },
        )
        for k, r in enumerate(runs):
            path = args.out.with_name(f"{args.out.stem}.records-{k}-{r['gpus']}.jsonl")
            path.write_text("".join(json.dumps(x) + "\n" for x in r["records"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
