"""Where one RULER pass spends its time: sample generation, prompt encoding, prefill, graph
capture, decode, per (task, length).

Runs the evaluation's own code (``evaluation.ruler.runner.run_suite`` through the static engine)
on the config's model: ``model.path`` when it names a checkpoint, else ``model.tiny`` built with
random weights (a random model never stops early, so its decode time is the answer budget's
upper bound). The phases are timed by wrapping the library's functions here, with a device
synchronisation on each side of the GPU phases, so the times add up to the wall time.

    python bench/ruler_phases.py configs/gpu-small.yaml --out ruler_phases.json
    python bench/ruler_phases.py configs/gpu-small.yaml --set evaluation.ruler.num_samples=8

A second pass over the same samples (``--passes 2``) shows what an experiment's later
checkpoints pay: the in-process sample cache and the compiled decode step are warm then.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

from anchorctx.evaluation import generation
from anchorctx.evaluation.ruler import runner
from anchorctx.experiment import load_config
from anchorctx.models import decoding
from anchorctx.models.loading import load_model, load_tokenizer

PHASES = ("samples", "encode", "prefill", "capture", "decode", "other")


class Clock:
    """Seconds per (task, length, phase); ``current`` is the (task, length) being run."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.current = ("?", 0)
        self.seconds: dict[tuple[str, int], dict[str, float]] = defaultdict(
            lambda: dict.fromkeys(PHASES, 0.0)
        )

    @contextmanager
    def phase(self, name: str):
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.seconds[self.current][name] += time.perf_counter() - t0


def instrument(clock: Clock) -> None:
    """Wrap the library's phase functions with the clock (this process only)."""
    cache_samples = runner.SampleCache.samples

    def samples(self, task, length, *args, **kwargs):
        clock.current = (task, length)
        with clock.phase("samples"):
            return cache_samples(self, task, length, *args, **kwargs)

    runner.SampleCache.samples = samples

    encode = generation.encode_prompt

    def encode_prompt(tokenizer, text):
        with clock.phase("encode"):
            return encode(tokenizer, text)

    generation.encode_prompt = encode_prompt

    def timed(cls, name: str, phase: str):
        original = getattr(cls, name)

        def wrapper(*args, **kwargs):
            with clock.phase(phase):
                return original(*args, **kwargs)

        setattr(cls, name, wrapper)

    timed(decoding.GreedyDecoder, "_prefill", "prefill")
    timed(decoding.GreedyDecoder, "_capture", "capture")
    # decode = generate minus its prefill and capture (computed below from the totals)
    timed(decoding.GreedyDecoder, "generate", "decode")


def build(cfg):
    tokenizer = load_tokenizer(cfg.model)
    dtype = cfg.evaluation.dtype
    model = load_model(
        cfg.model,
        dtype=dtype,
        device=cfg.evaluation.device,
        attn_implementation="sdpa",
        tokenizer=tokenizer,
    )
    if cfg.model.tiny is not None:
        # Evaluation lengths beyond the tiny config's default position limit.
        model.config.max_position_embeddings = max(cfg.evaluation.ruler.lengths) + 256
    return model.eval(), tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", type=Path)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Dotted config overrides, as for every anchorctx command.",
    )
    p.add_argument("--passes", type=int, default=2)
    p.add_argument(
        "--profile-top",
        type=int,
        default=40,
        help="cProfile's top functions by cumulative time, last pass (0: none).",
    )
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    cfg = load_config(args.config, args.set)
    cuda = cfg.evaluation.device.startswith("cuda")
    t0 = time.perf_counter()
    model, tokenizer = build(cfg)
    load_s = time.perf_counter() - t0
    clock = Clock(cuda)
    instrument(clock)
    passes = []
    profile_text = ""
    for n in range(args.passes):
        clock.seconds.clear()
        prof = cProfile.Profile() if args.profile_top and n == args.passes - 1 else None
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        summary = runner.run_suite(
            model, tokenizer, cfg, done={}, on_sample=lambda rec: None, progress=False
        )
        if prof is not None:
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(args.profile_top)
            profile_text = buf.getvalue()
        wall = time.perf_counter() - t0
        rows = []
        for (task, length), s in sorted(clock.seconds.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            s = dict(s)
            s["decode"] -= s["prefill"] + s["capture"]  # generate's own share
            rows.append({"task": task, "length": length, **{k: round(v, 3) for k, v in s.items()}})
        total = {ph: round(sum(r[ph] for r in rows), 2) for ph in PHASES}
        total["other"] = round(wall - sum(total.values()), 2)
        passes.append(
            {
                "pass": n + 1,
                "wall_s": round(wall, 2),
                "phases_s": total,
                "rows": rows,
                "scores": summary["scores"],
            }
        )
        print(
            f"pass {n + 1}: {wall:.1f} s  " + "  ".join(f"{k} {v:.1f}" for k, v in total.items()),
            flush=True,
        )
    per_length: dict[int, dict[str, float]] = defaultdict(lambda: dict.fromkeys(PHASES[:-1], 0.0))
    for r in passes[0]["rows"]:
        for ph in PHASES[:-1]:
            per_length[r["length"]][ph] += r[ph]
    print(
        f"\nfirst pass per length (s), model load {load_s:.1f} s, "
        f"{cfg.evaluation.ruler.num_samples} samples x {len(passes[0]['rows']) // max(1, len(per_length))} tasks"
    )
    print("length  " + "  ".join(f"{ph:>8}" for ph in PHASES[:-1]))
    for length, s in sorted(per_length.items()):
        print(f"{length:>6}  " + "  ".join(f"{s[ph]:8.2f}" for ph in PHASES[:-1]))
    if profile_text:
        print("\n" + "\n".join(profile_text.splitlines()[: args.profile_top + 12]))
    if args.out:
        device = torch.cuda.get_device_name() if cuda else "cpu"
        args.out.write_text(
            json.dumps(
                {
                    "device": device,
                    "config": str(args.config),
                    "overrides": args.set,
                    "model_load_s": load_s,
                    "passes": passes,
                    "profile": profile_text,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
