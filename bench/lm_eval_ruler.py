"""lm-eval's RULER on one checkpoint: the ``anchorctx`` lm-eval model against lm-eval's ``hf``
model (speed and parity), and lm-eval's RULER against the project's own RULER (scores).

For each task and length (lm-eval task names; ``--limit`` documents each, lm-eval's seeds):

- **speed**: seconds per sample of the model's ``generate_until`` calls (the samples' prefill
  and decode; lm-eval building its synthetic samples is timed apart as ``build_s``; each model
  first answers one untimed batch per length, whose time is ``warmup_s``: compilation and
  graph capture are one-off costs of a process, not of a sample), for
  ``anchorctx`` (:class:`~anchorctx.evaluation.lm_eval.model.AnchorctxLM` on the project's
  engine) and for lm-eval's own ``hf`` model, built as ``simple_evaluate(model="hf",
  model_args="pretrained=DIR,dtype=DTYPE")`` builds it. Next to them the floor of the same
  requests: prefill ``(2·N·T + 2·layers·hidden·T²) / peak`` (N = matmul parameters, T = prompt
  tokens, causal attention) at the GPU's dense bf16 peak (``anchorctx.training.metrics``), plus
  each generated token's HBM read (weights + KV cache, as ``bench/eval_throughput.py``) at the
  copy bandwidth measured in this run; with ``--batch-size`` B each request's share of a decode
  step's weight read is 1/B (the rows of a batch decode together). No floor on CPU.
- **parity**: both models' lm-eval scores side by side (the same documents: same task files,
  limit and seeds; ``same_inputs`` checks the prompts are identical) and the share of documents
  whose generated answers are identical.
- **ours vs lm-eval's RULER**: the project's RULER suite (``anchorctx.evaluation.ruler``, the
  reference NVIDIA/RULER) at the same tasks, lengths and sample count, with a 95% Wilson
  interval on each score (per-sample scores treated as successes out of n), next to lm-eval's
  ``anchorctx`` score with its interval, and their difference with its 95% interval
  (Newcombe's hybrid score method, ``anchorctx.evaluation.paired.unpaired_difference``);
  ``differ`` where that interval excludes 0. The samples differ (each suite draws its own), so
  only the rates are comparable.

Every input is a local file (the GPU host has no network): ``--essays`` (RULER's
``PaulGrahamEssays.json`` or a copy of baber/paul_graham_essays), ``--squad`` (SQuAD v2
dev-v2.0.json), ``--hotpotqa`` (hotpot_dev_distractor_v1.json), ``--nltk-data`` (NLTK's
punkt_tab). ``--assets DIR`` takes the four from an ``anchorctx demo-assets --paper DIR`` tree
(stand-ins: they rehearse the run, the scores mean nothing). Writes ``--out``/lm_eval_ruler.json
and lm_eval_ruler.md.

    python bench/lm_eval_ruler.py --model CKPT --assets ASSETS --out OUT            # GPU, bf16
    python bench/lm_eval_ruler.py --model CKPT --assets ASSETS --out OUT \\
        --device cpu --dtype float32 --lengths 4096 --limit 1 --tasks niah_single_1  # smoke
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from anchorctx.evaluation.paired import unpaired_difference, wilson
from anchorctx.evaluation.ruler.constants import TASKS as RULER_TASKS

# lm-eval task -> the project's RULER task: lm-eval keeps the niah names and prefixes the others
# with ``ruler_``, naming the two QA tasks by their datasets.
_QA = {"qa_1": "ruler_qa_squad", "qa_2": "ruler_qa_hotpot"}
TASK_MAP = {(t if t.startswith("niah") else _QA.get(t, f"ruler_{t}")): t for t in RULER_TASKS}
DEFAULT_TASKS = ["niah_single_1", "niah_single_2", "niah_multikey_1", "ruler_vt", "ruler_fwe"]
DEFAULT_TASKS += ["ruler_qa_squad"]
T0 = time.perf_counter()


def say(text: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {text}", flush=True)


def resolve_inputs(args: argparse.Namespace) -> dict[str, Path | None]:
    """The four local inputs: explicit options win, else the ``--assets`` stand-ins."""
    stand_in: dict[str, Path | None] = dict.fromkeys(("essays", "squad", "hotpotqa", "nltk_data"))
    if args.assets:
        # Imported here: the paper-asset layout is the demo's (it imports nothing heavy).
        from anchorctx.demo.paper_assets import asset_paths

        paths = asset_paths(args.assets)
        stand_in = {
            "essays": paths["evaluation.ruler.essay_path"],
            "squad": paths["evaluation.ruler.squad_path"],
            "hotpotqa": paths["evaluation.ruler.hotpotqa_path"],
            "nltk_data": paths["evaluation.ruler.nltk_data"],
        }
    chosen = {
        "essays": args.essays or stand_in["essays"],
        "squad": args.squad or stand_in["squad"],
        "hotpotqa": args.hotpotqa or stand_in["hotpotqa"],
        "nltk_data": args.nltk_data or stand_in["nltk_data"],
    }
    for key, path in chosen.items():
        origin = "option" if getattr(args, key) else "--assets stand-in" if path else "unset"
        say(f"input {key}: {path} ({origin})")
        if path is not None and not Path(path).exists():
            raise SystemExit(f"{key}: {path} does not exist")
    return chosen


def own_lengths(args: argparse.Namespace) -> list[int]:
    """The lengths the project's RULER runs: it refuses lengths beyond the checkpoint's
    ``max_position_embeddings`` (lm-eval's models take ``--max-length`` instead), so those are
    left to lm-eval's two models and said so."""
    positions = json.loads((Path(args.model) / "config.json").read_text()).get(
        "max_position_embeddings"
    )
    kept = [n for n in args.lengths if positions is None or n <= positions]
    if len(kept) < len(args.lengths):
        dropped = sorted(set(args.lengths) - set(kept))
        say(f"ours: lengths {dropped} exceed the checkpoint's {positions} positions: not run")
    return kept


def build_config(args: argparse.Namespace, inputs: dict[str, Path | None], own: list[int]) -> Any:
    from anchorctx.experiment import config_from_dict

    ruler_files = {
        "essay_path": inputs["essays"],
        "squad_path": inputs["squad"],
        "hotpotqa_path": inputs["hotpotqa"],
        "nltk_data": inputs["nltk_data"],
    }
    ruler_files = {k: str(v) for k, v in ruler_files.items() if v is not None}
    evaluation: dict[str, Any] = {
        "suites": ["ruler"],
        "device": args.device,
        "dtype": args.dtype,
        "ruler": {
            "tasks": [TASK_MAP[t] for t in args.tasks],
            "lengths": own or args.lengths,  # none kept: the pass is skipped (main)
            "num_samples": args.limit,
            **ruler_files,
        },
        "lm_eval": {
            "limit": args.limit,
            "batch_size": args.batch_size,
            **({"max_length": args.max_length} if args.max_length else {}),
            "ruler": {"lengths": args.lengths, **ruler_files},
        },
    }
    if args.engine:
        evaluation["engine"] = args.engine
    raw = {
        "name": "lm-eval-ruler-bench",
        "run_root": str(Path(args.out).resolve() / "runs"),
        "model": {"path": str(Path(args.model).resolve())},
        "evaluation": evaluation,
    }
    return config_from_dict(raw)


# ------------------------------------------------------------------------------- timing
class Timed:
    """Wraps an lm-eval model's ``generate_until``: wall seconds and, per request, the prompt
    and answer token counts and a digest of the prompt (to check both models saw the same)."""

    def __init__(self, lm: Any, tokenizer: Any, device: str) -> None:
        self.lm, self.tokenizer, self.device = lm, tokenizer, device
        self.reset()
        inner = lm.generate_until
        lm.generate_until = lambda requests, *a, **k: self._call(inner, requests, *a, **k)

    def reset(self) -> None:
        self.seconds, self.prompts, self.answers, self.digests = 0.0, [], [], []

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()

    def _call(self, inner, requests, *a, **k):
        self._sync()
        start = time.perf_counter()
        out = inner(requests, *a, **k)
        self._sync()
        self.seconds += time.perf_counter() - start
        for req, text in zip(requests, out, strict=True):
            context, gen_kwargs = req.args[0], req.args[1]
            tokens = self.tokenizer(context, add_special_tokens=False).input_ids
            self.prompts.append(1 + len(tokens))  # + the anchor
            # the answer re-tokenized, at most the task's budget (lm-eval's max_gen_toks)
            answer = len(self.tokenizer(text, add_special_tokens=False).input_ids)
            budget = (gen_kwargs or {}).get("max_gen_toks") or answer
            self.answers.append(min(answer, int(budget)))
            self.digests.append(hashlib.sha256(context.encode()).hexdigest()[:16])
        return out


def floor_seconds(
    prompts: list[int], answers: list[int], hw: dict[str, Any], rows: int = 1
) -> float | None:
    """Sum over requests of the prefill compute floor and the decode HBM floor (module doc).
    ``rows`` requests decode together: a decode step reads the weights once for all of them,
    so each request's share of the weight read is 1/``rows`` (its KV cache it reads alone)."""
    if not hw.get("peak_flops") or not hw.get("bandwidth"):
        return None
    total = 0.0
    for t, g in zip(prompts, answers, strict=True):
        flops = 2.0 * hw["matmul_params"] * t + 2.0 * hw["layers"] * hw["hidden"] * t * t
        read = g * (hw["weight_bytes"] / rows + hw["kv_bytes_per_token"] * (t + g / 2))
        total += flops / hw["peak_flops"] + read / hw["bandwidth"]
    return total


def hardware(model: Any, device: str) -> dict[str, Any]:
    """What the floor needs: model sizes (``anchorctx.training.metrics``, the HBM read of
    ``bench/eval_throughput.py``) and, on a GPU, its bf16 peak and measured copy bandwidth."""
    import torch

    from anchorctx.training.metrics import PEAK_BF16_TFLOPS, matmul_params

    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    elem = next(model.parameters()).element_size()
    out: dict[str, Any] = {
        "matmul_params": matmul_params(model),
        "layers": cfg.num_hidden_layers,
        "hidden": heads * head_dim,
        "kv_bytes_per_token": 2 * cfg.num_hidden_layers * kv_heads * head_dim * elem,
        "device_name": "cpu",
        "peak_flops": None,
        "bandwidth": None,
    }
    if device.startswith("cuda"):
        from eval_throughput import measure_bandwidth, weight_bytes_read

        name = torch.cuda.get_device_name()
        peak = next((p for key, p in PEAK_BF16_TFLOPS if key in name), None)
        out.update(
            device_name=name,
            peak_flops=peak * 1e12 if peak else None,
            bandwidth=measure_bandwidth(),
            weight_bytes=weight_bytes_read(model),
        )
        torch.cuda.empty_cache()
    else:
        emb = model.get_input_embeddings().weight
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        out["weight_bytes"] = total - emb.numel() * emb.element_size()
    return out


# ------------------------------------------------------------------------------- passes
def lm_eval_pass(name: str, lm: Any, tokenizer: Any, cfg: Any, args, hw) -> dict[str, Any]:
    """Every (task, length) through lm-eval with model ``lm``: records, timings, floors."""
    from anchorctx.evaluation.lm_eval import suites as S

    timed = Timed(lm, tokenizer, args.device)
    out: dict[str, Any] = {}
    warmup = warmup_seconds(lm, cfg, args, timed) if args.warmup else {}
    with tempfile.TemporaryDirectory(prefix="lm-eval-ruler-bench-") as tmp:
        for task in args.tasks:
            for length in args.lengths:
                unit = S.Unit(task, length)
                timed.reset()
                start = time.perf_counter()
                try:
                    rec = S.unit_record(unit, S.run_unit(lm, cfg, unit, Path(tmp) / name))
                except Exception as err:  # one task's failure (e.g. vt, cwe: see --help)
                    out[f"{task}/{length}"] = {"error": f"{type(err).__name__}: {err}"}
                    say(f"{name}: {task} @ {length}: FAILED {type(err).__name__}: {err}")
                    continue
                wall = time.perf_counter() - start
                n = max(1, len(timed.prompts))
                rows = max(1, min(args.batch_size, len(timed.prompts)))
                floor = floor_seconds(timed.prompts, timed.answers, hw, rows)
                row = {
                    "score": rec["scores"][str(length)],
                    "n": rec["n"],
                    "predictions": {s["doc_id"]: s["prediction"] for s in rec["samples"]},
                    "sample_scores": [s.get(str(length)) for s in rec["samples"]],
                    "generate_s": timed.seconds,
                    "build_s": wall - timed.seconds,
                    "s_per_sample": timed.seconds / n,
                    "warmup_s": warmup.get(length),
                    "floor_s_per_sample": floor / n if floor is not None else None,
                    "prompt_tokens_mean": sum(timed.prompts) / n,
                    "answer_tokens_mean": sum(timed.answers) / n,
                    "input_digest": hashlib.sha256(
                        "".join(sorted(timed.digests)).encode()
                    ).hexdigest()[:16],
                }
                out[f"{task}/{length}"] = row
                fl = row["floor_s_per_sample"]
                say(
                    f"{name}: {task} @ {length}: score {row['score']:.1f} (n={row['n']}), "
                    f"{row['s_per_sample']:.3f} s/sample"
                    + (f" (floor {fl:.3f} s)" if fl is not None else "")
                    + f", samples built in {row['build_s']:.1f} s"
                )
    return out


def warmup_seconds(lm: Any, cfg: Any, args, timed: Timed) -> dict[int, float]:
    """One untimed batch (``--batch-size`` documents of the first task) per length before the
    timed passes: a model's first batch of a shape pays one-off costs (the static decoder
    compiles its step and captures its graphs per cache size and rows, ~10 s; kernels
    autotune), which would otherwise be spread over the first task's samples. Returns each
    length's warm-up seconds."""
    from anchorctx.evaluation.lm_eval import suites as S

    warm = cfg.model_copy(deep=True)
    warm.evaluation.lm_eval.limit = max(1, args.batch_size)
    seconds: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="lm-eval-ruler-warmup-") as tmp:
        for length in args.lengths:
            timed.reset()
            S.run_unit(lm, warm, S.Unit(args.tasks[0], length), Path(tmp))
            seconds[length] = timed.seconds
            say(f"warm-up at {length}: {timed.seconds:.1f} s (one batch, not timed)")
    return seconds


def ours_pass(cfg: Any, args) -> dict[str, Any]:
    """The project's RULER suite at the same tasks, lengths and sample count."""
    from anchorctx.evaluation.results import evaluate_checkpoint, load_result

    start = time.perf_counter()
    path = evaluate_checkpoint(cfg, Path(args.model).resolve(), "ruler", progress=False)
    result = load_result(path) or {}
    say(f"ours: the project's RULER in {time.perf_counter() - start:.1f} s -> {path}")
    return {
        "path": str(path),
        "scores": result["scores"],
        "counts": result["counts"],
        "prompt_tokens": prompt_tokens(path.parent / result["samples"]["file"]),
    }


def prompt_tokens(samples: Path) -> dict[str, dict[str, float]]:
    """Mean prompt tokens per task and length of the project's RULER records: its haystack
    rule (``evaluation.ruler.fit``) and lm-eval's can fill one target length differently."""
    from anchorctx.io import read_jsonl

    by_cell: dict[tuple[str, str], list[int]] = {}
    for r in read_jsonl(samples)[1:]:  # the first line is the header
        by_cell.setdefault((r["task"], str(r["length"])), []).append(r["prompt_tokens"])
    out: dict[str, dict[str, float]] = {}
    for (task, length), tokens in by_cell.items():
        out.setdefault(task, {})[length] = sum(tokens) / len(tokens)
    return out


# ------------------------------------------------------------------------------- report
def compare(args, anchor, hf, ours) -> list[dict[str, Any]]:
    rows = []
    for task in args.tasks:
        for length in args.lengths:
            key = f"{task}/{length}"
            a, h = anchor[key], hf.get(key) if hf else None
            row: dict[str, Any] = {"task": task, "length": length, "anchorctx": a}
            if h is not None:
                row["hf"] = h
            if "error" in a or (h is not None and "error" in h):
                rows.append(row)
                continue
            if h is not None:
                common = sorted(set(a["predictions"]) & set(h["predictions"]))
                same = sum(
                    (a["predictions"][d] or "").strip() == (h["predictions"][d] or "").strip()
                    for d in common
                )
                row["hf"] = h
                row["agreement"] = same / len(common) if common else None
                row["same_inputs"] = a["input_digest"] == h["input_digest"]
            lo, hi = wilson(a["score"] / 100, a["n"])
            row["lm_eval_interval"] = [lo, hi]
            ours_task = TASK_MAP[task]
            o_score = ours["scores"].get(ours_task, {}).get(str(length)) if ours else None
            if o_score is not None:
                n = ours["counts"][ours_task][str(length)]
                olo, ohi = wilson(o_score / 100, n)
                row["ours"] = {
                    "task": ours_task,
                    "score": o_score,
                    "n": n,
                    "interval": [olo, ohi],
                    "prompt_tokens_mean": ours.get("prompt_tokens", {})
                    .get(ours_task, {})
                    .get(str(length)),
                }
                d, dlo, dhi = unpaired_difference(a["score"] / 100, a["n"], o_score / 100, n)
                row["difference"] = {"value": d, "interval": [dlo, dhi]}
                row["differ"] = dlo > 0 or dhi < 0
            rows.append(row)
    return rows


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "–" if x is None else format(x, fmt)


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    hw = meta["hardware"]
    failed = [r for r in rows if "error" in r["anchorctx"] or "error" in (r.get("hf") or {})]
    rows = [r for r in rows if r not in failed]
    lines = [
        "# lm-eval RULER: anchorctx vs hf, and lm-eval's RULER vs the project's",
        "",
        f"Checkpoint `{meta['model']}`, {hw['device_name']}, {meta['dtype']}, "
        f"{meta['limit']} document(s) per task and length, lm-eval {meta['lm_eval']}; "
        f"hf model_args `{meta['hf_model_args']}`.",
        "",
        "## Speed (seconds per sample of generate_until; floor: prefill at the bf16 peak + "
        "decode HBM reads at the measured bandwidth)",
        "",
        "| task | length | prompt tok | anchorctx s | hf s | floor s | hf / anchorctx | "
        "anchorctx / floor | warm-up s (anchorctx, hf) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, h = r["anchorctx"], r.get("hf")
        fl = a["floor_s_per_sample"]
        lines.append(
            f"| {r['task']} | {r['length']} | {a['prompt_tokens_mean']:.0f} | "
            f"{a['s_per_sample']:.3f} | {_f(h and h['s_per_sample'], '.3f')} | "
            f"{_f(fl, '.3f')} | {_f(h and h['s_per_sample'] / a['s_per_sample'], '.2f')} | "
            f"{_f(fl and a['s_per_sample'] / fl, '.2f')} | "
            f"{_f(a.get('warmup_s'))}, {_f(h and h.get('warmup_s'))} |"
        )
    lines += [
        "",
        "## Parity (lm-eval scores, same documents)",
        "",
        "| task | length | n | anchorctx | hf | answers identical | same prompts |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        h = r.get("hf")
        agree = r.get("agreement")
        lines.append(
            f"| {r['task']} | {r['length']} | {r['anchorctx']['n']} | "
            f"{r['anchorctx']['score']:.1f} | {_f(h and h['score'])} | "
            f"{_f(agree * 100 if agree is not None else None)}% | "
            f"{r.get('same_inputs', '–')} |"
        )
    lines += [
        "",
        "## lm-eval's RULER vs the project's RULER (anchorctx model, 95% Wilson intervals)",
        "",
        "| task | length | lm-eval score [95%] | ours | ours score [95%] | lm-eval − ours [95%] "
        "| differ | prompt tok (lm-eval, ours) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lo, hi = r["lm_eval_interval"]
        o = r.get("ours")
        ours = (
            o and f"{o['score']:.1f} [{o['interval'][0]:.1f}, {o['interval'][1]:.1f}] (n={o['n']})"
        )
        d = r.get("difference")
        diff = d and f"{d['value']:+.1f} [{d['interval'][0]:+.1f}, {d['interval'][1]:+.1f}]"
        lines.append(
            f"| {r['task']} | {r['length']} | {r['anchorctx']['score']:.1f} [{lo:.1f}, {hi:.1f}] "
            f"(n={r['anchorctx']['n']}) | {o['task'] if o else '–'} | {ours if o else '–'} | "
            f"{diff or '–'} | {'**yes**' if r.get('differ') else 'no' if o else '–'} | "
            f"{r['anchorctx']['prompt_tokens_mean']:.0f}, "
            f"{_f(o and o.get('prompt_tokens_mean'), '.0f')} |"
        )
    if failed:
        lines += ["", "## Failed (no score)", ""]
        for r in failed:
            for model in ("anchorctx", "hf"):
                if "error" in (r.get(model) or {}):
                    lines.append(f"- {r['task']} @ {r['length']}, {model}: {r[model]['error']}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------- main
def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__,
        epilog="Tasks: " + ", ".join(TASK_MAP) + ". Inputs from --assets are the stand-ins "
        "`anchorctx demo-assets --paper DIR` writes (data/ruler/PaulGrahamEssays.json, "
        "squad_v2_dev.json, hotpotqa_dev_distractor.json, data/nltk_data).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="Checkpoint directory (Hugging Face layout).")
    p.add_argument("--out", required=True, help="Output directory (JSON, markdown, runs/).")
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768], help="%(default)s")
    p.add_argument(
        "--tasks",
        nargs="+",
        default=DEFAULT_TASKS,
        choices=list(TASK_MAP),
        metavar="TASK",
        help="lm-eval RULER tasks (default: %(default)s).",
    )
    p.add_argument("--limit", type=int, default=20, help="Documents per task and length.")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--engine", choices=["auto", "hf", "static"], help="anchorctx's engine.")
    p.add_argument("--batch-size", type=int, default=1, help="Rows per batch (both models).")
    p.add_argument(
        "--max-length",
        type=int,
        help="Token budget of both models (prompt + answer; longer prompts are cut). Default: "
        "the checkpoint's max_position_embeddings, as lm-eval does (set it for a checkpoint that "
        "declares less than the lengths, e.g. the Llama-2 stand-in's 4096).",
    )
    p.add_argument("--assets", help="An `anchorctx demo-assets --paper` directory: stand-ins.")
    p.add_argument("--essays", help="PaulGrahamEssays.json or a copy of baber/paul_graham_essays")
    p.add_argument("--squad", help="SQuAD v2 dev-v2.0.json")
    p.add_argument("--hotpotqa", help="HotpotQA hotpot_dev_distractor_v1.json")
    p.add_argument("--nltk-data", help="Directory holding tokenizers/punkt_tab")
    p.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="Time each model's first request at a length too (compilation, graph capture) "
        "instead of one untimed batch per length first.",
    )
    p.add_argument("--skip-hf", action="store_true", help="No lm-eval hf pass.")
    p.add_argument("--skip-ours", action="store_true", help="No project RULER pass.")
    p.add_argument(
        "--only-hf",
        action="store_true",
        help="The lm-eval hf pass alone (its partial.json; run beside a --skip-hf run on another "
        "GPU, then --combine both output directories).",
    )
    p.add_argument(
        "--combine",
        nargs="+",
        metavar="DIR",
        help="Run nothing: the tables from these runs' output directories (their partial.json), "
        "with the same --model, --tasks and --lengths.",
    )
    args = p.parse_args(argv)
    if args.only_hf and args.skip_hf:
        p.error("--only-hf and --skip-hf exclude each other")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    inputs = resolve_inputs(args)
    own = own_lengths(args)
    cfg = build_config(args, inputs, own)
    ckpt = Path(args.model).resolve()
    hf_args = f"pretrained={ckpt},dtype={args.dtype}"
    if args.max_length:
        hf_args += f",max_length={args.max_length}"
    if args.combine:
        found = combine(args.combine)
    else:
        found = run_passes(args, cfg, own, ckpt, hf_args, out_dir / "partial.json")
    if found.get("anchorctx") is None:  # --only-hf: its partial.json is the result
        say(f"wrote {out_dir / 'partial.json'} (combine it with an anchorctx pass: --combine)")
        return 0

    import lm_eval

    from anchorctx.evaluation.lm_eval import call as lm_eval_call

    rows = compare(args, found["anchorctx"], found.get("hf"), found.get("ours"))
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": str(ckpt),
        "device": args.device,
        "dtype": args.dtype,
        "engine": cfg.evaluation.engine,
        "limit": args.limit,
        "lengths": args.lengths,
        "tasks": args.tasks,
        "inputs": {k: str(v) if v else None for k, v in inputs.items()},
        "lm_eval": getattr(lm_eval, "__version__", None) or lm_eval_call.installed_version(),
        "hf_model_args": hf_args,
        "hardware": found["hardware"],
        "argv": sys.argv[1:],
    }
    (out_dir / "lm_eval_ruler.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    md = markdown(meta, rows)
    (out_dir / "lm_eval_ruler.md").write_text(md)
    print(md)
    say(f"wrote {out_dir / 'lm_eval_ruler.json'} and {out_dir / 'lm_eval_ruler.md'}")
    return 0


def combine(dirs: list[str]) -> dict[str, Any]:
    """The passes of several runs of this script (their ``partial.json``; e.g. ``--only-hf`` on
    one GPU beside a ``--skip-hf`` run on another), later ones filling what earlier ones lack."""
    found: dict[str, Any] = {}
    for d in dirs:
        path = Path(d) / "partial.json"
        if not path.is_file():
            raise SystemExit(f"--combine: {path} not found (not an output directory of a run)")
        for name, value in json.loads(path.read_text()).items():
            found.setdefault(name, value)
    if "anchorctx" not in found:
        raise SystemExit(f"--combine: no anchorctx pass in {', '.join(dirs)}")
    return found


def run_passes(args, cfg: Any, own: list[int], ckpt: Path, hf_args: str, partial: Path) -> dict:
    """The project's RULER, lm-eval with the anchorctx model, lm-eval with hf (each as asked),
    each pass kept in ``partial`` as soon as it ends: a run cut short keeps them."""
    import torch

    from anchorctx.evaluation import results
    from anchorctx.evaluation.lm_eval import call as lm_eval_call
    from anchorctx.evaluation.lm_eval import suites as S
    from anchorctx.evaluation.lm_eval.model import make_lm

    for task in args.tasks:  # the files each task reads, before any model loads
        S.check_data(cfg, f"lm_eval:{task}")
    lm_eval_call.quiet()
    S._punkt(cfg.evaluation.lm_eval.ruler.nltk_data)
    found: dict[str, Any] = {}

    def keep(name: str, value: Any) -> Any:
        found[name] = value
        partial.write_text(json.dumps(found, indent=1))
        return value

    if not (args.skip_ours or args.only_hf) and own:
        keep("ours", ours_pass(cfg, args))
    if not args.only_hf:
        say(f"loading {ckpt} ({args.device}, {args.dtype})")
        model, tokenizer = results.cached_model(ckpt, cfg, results.checkpoint_hash(ckpt))
        hw = keep("hardware", hardware(model, args.device))
        lm = make_lm(model, tokenizer, **S.lm_options(cfg))
        keep("anchorctx", lm_eval_pass("anchorctx", lm, tokenizer, cfg, args, hw))
        del model, lm
        results.clear_model_cache()
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if not args.skip_hf:
        from lm_eval.api.registry import get_model

        say(f"loading lm-eval hf: model_args {hf_args}")
        hf_lm = get_model("hf").create_from_arg_string(
            hf_args, {"batch_size": args.batch_size, "device": args.device}
        )
        hw = found.get("hardware") or keep("hardware", hardware(hf_lm.model, args.device))
        keep("hf", lm_eval_pass("hf", hf_lm, hf_lm.tokenizer, cfg, args, hw))
        del hf_lm
        gc.collect()
    return found


if __name__ == "__main__":
    raise SystemExit(main())
