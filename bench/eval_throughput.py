"""Evaluation generation throughput on one GPU: Hugging Face ``generate`` vs the static engine.

A Llama-2-7B-shaped model (32 layers, hidden 4096, 32 heads MHA, MLP 11008, vocab 32000) with
random bf16 weights, on random token ids, at each length (prompt = length - 128 tokens, RULER's
largest answer budget). Per length:

- ``hf``: prefill = one ``model(...)`` forward over the prompt (``logits_to_keep=1``); decode
  ms/token = (``generate`` of ``--hf-new`` tokens - prefill) / (tokens - 1), batch 1 (the path
  evaluation used before the static engine);
- ``static`` (:mod:`anchorctx.models.decoding`): prefill of one row; decode ms/token = mean of
  timed CUDA-graph replays of the decode step at batch 1 and at the largest batch the memory
  budget gives for that length (the same rule generation uses: 60% of free memory for the KV cache,
  at most ``--max-rows`` rows);
- ``--step``: the static engine's decode-step layers (``decoding.DECODE_STEPS``: "hf" = the
  checkpoint's modules, "fused" = :mod:`anchorctx.models.decoder`); the first one listed fills
  the main table, every further one gets its batch-1 decode timed on the same prompt (a second
  table: ms/token, HBM floor, token agreement with the first);
- token agreement: greedy tokens of both engines on the same prompt (bf16 rounding differs
  between the paths, so a random model's near-tied logits may diverge after a while);
- HBM floor of one decode step: (weights read + KV cache bytes of the batch) / bandwidth, at
  4.3 TB/s (H200 spec) and at the bandwidth measured here with a device-to-device copy.

Projection: GPU-hours of the paper's RULER protocol for one arm (13 tasks × 6 lengths 4K-128K ×
500 samples × the last 5 checkpoints), each sample costing its prefill plus its task's full
answer budget of decode steps (an upper bound: models often stop earlier at EOS), at the batch
size measured; for ``hf`` at batch 1.

    python bench/eval_throughput.py --out eval_throughput.json   # ~5 minutes on one H200
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from anchorctx.models.decoding import DECODE_ATTENTIONS, DECODE_STEPS

# RULER max new tokens per task (scripts/data/synthetic/constants.py), 13 tasks.
TASK_NEW_TOKENS = [128] * 8 + [30, 120, 50, 32, 32]
RULER_LENGTHS = [4096, 8192, 16384, 32768, 65536, 131072]
RULER_SAMPLES = 500
LAST_CHECKPOINTS = 5
SPEC_BANDWIDTH = 4.3e12  # H200 HBM3e, bytes/s (H100 SXM: 3.35e12)


def build_model(args: argparse.Namespace):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=args.layers,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=max(args.lengths),
        rope_theta=1e7,
        use_cache=True,
    )
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    return model.eval()


def _sync() -> None:
    torch.cuda.synchronize()


def _timed(fn) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def measure_bandwidth() -> float:
    """Bytes/s of a 4 GiB device-to-device copy (read + write), best of 3."""
    src = torch.empty(2**31, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(4))
    return 2 * 2**32 / best


def weight_bytes_read(model) -> int:
    """Bytes a decode step reads: every parameter but the input embedding (a few rows)."""
    emb = model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - emb.numel() * emb.element_size()


def measure_hf(model, ids: torch.Tensor, new: int) -> dict:
    from transformers import GenerationConfig

    gen = GenerationConfig(
        max_new_tokens=new,
        do_sample=False,
        num_beams=1,
        temperature=None,
        top_p=None,
        top_k=None,
        eos_token_id=None,
        pad_token_id=0,
        use_cache=True,
    )
    with torch.inference_mode():
        prefill = _timed(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1))
        torch.cuda.empty_cache()
        out = {}
        total = _timed(
            lambda: out.setdefault("seq", model.generate(input_ids=ids, generation_config=gen))
        )
    tokens = out["seq"][0, ids.shape[1] :].tolist()
    torch.cuda.empty_cache()
    return {
        "prefill_s": prefill,
        "decode_ms": 1e3 * (total - prefill) / (new - 1),
        "generate_s": total,
        "tokens": tokens,
    }


def time_replays(decoder, batch, width: int, lengths: list[int], steps: int) -> float:
    """ms per decode step: ``steps`` graph replays from the state right after prefill."""
    b = batch
    b.mask.zero_()
    for r, n in enumerate(lengths):
        b.mask[r, 0, 0, width - n : width] = True
    b.done.zero_()
    b.pos.copy_(torch.tensor(lengths, device=b.pos.device)[:, None])
    b.slot.fill_(width)
    b.step.fill_(1)
    if b.graph is None:
        decoder._capture(b)
    b.graph.replay()  # warm
    b.slot.fill_(width)
    b.step.fill_(1)
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        b.graph.replay()
    _sync()
    return 1e3 * (time.perf_counter() - start) / steps


def measure_static(
    model, decoder, ids: list[int], rows: int, steps: int, prefill: bool = True
) -> dict:
    from anchorctx.models.decoding import SLOT_ROUND, StopRules, _round_up

    n = len(ids)
    new = steps + 1
    with torch.inference_mode():
        start = time.perf_counter()
        tokens = decoder.generate([ids], max_new_tokens=new, pad_id=0, stop=StopRules())[0]
        _sync()
        first_call = time.perf_counter() - start  # prefill + capture + decode
        b = decoder._batch
        prefill = _timed(lambda: decoder._prefill(b.cache, 0, 0, ids, ())) if prefill else None
        ms1 = time_replays(decoder, b, n, [n], steps)
        msb = None
        if rows > 1:
            decoder.release()
            slots = _round_up(n + new - 1, SLOT_ROUND)
            bb = decoder._buffers(rows, slots, new, [], 0)
            msb = time_replays(decoder, bb, n, [n] * rows, steps)
        decoder.release()
    return {
        "prefill_s": prefill,
        "decode_ms_b1": ms1,
        "decode_ms_batch": msb,
        "first_call_s": first_call,
        "tokens": tokens,
    }


def agreement(a: list[int], b: list[int]) -> dict:
    n = min(len(a), len(b))
    same = sum(x == y for x, y in zip(a[:n], b[:n]))
    prefix = next((i for i in range(n) if a[i] != b[i]), n)
    return {"compared": n, "equal": same, "equal_prefix": prefix}


def project(rows: list[dict], engine: str) -> dict:
    """Seconds per RULER sample at each length and GPU-hours of the protocol for one arm."""
    by_len = {r["length"]: r for r in rows}
    per_len = {}
    for n in RULER_LENGTHS:
        r = by_len.get(n)
        if r is None or r[engine] is None:
            return {"error": f"length {n} not measured for {engine}"}
        m = r[engine]
        if engine == "hf":
            pre, step, batch = m["prefill_s"], m["decode_ms"] / 1e3, 1
        else:
            batch = r["rows"]
            step = (m["decode_ms_batch"] if batch > 1 else m["decode_ms_b1"]) / 1e3
            pre = m["prefill_s"]
        per_len[n] = sum(pre + k * step / batch for k in TASK_NEW_TOKENS) / len(TASK_NEW_TOKENS)
    samples = len(TASK_NEW_TOKENS) * RULER_SAMPLES * LAST_CHECKPOINTS
    return {
        "seconds_per_sample": per_len,
        "gpu_hours_per_arm": sum(per_len.values()) * samples / 3600,
        "gpu_hours_per_checkpoint": sum(per_len.values()) * samples / LAST_CHECKPOINTS / 3600,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=RULER_LENGTHS)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hf-new", type=int, default=32, help="Tokens hf generate makes per length.")
    p.add_argument("--steps", type=int, default=64, help="Timed static decode steps.")
    p.add_argument("--max-rows", type=int, default=16)
    p.add_argument("--skip-hf-above", type=int, default=131072)
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--attention",
        default="sdpa",
        choices=DECODE_ATTENTIONS,
        help="The static engine's decode attention kernel.",
    )
    p.add_argument(
        "--step",
        nargs="+",
        choices=DECODE_STEPS,
        default=["fused", "hf"],
        help="Decode-step layers; the first fills the main table.",
    )
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    from anchorctx.models.decoding import GreedyDecoder, kv_bytes_per_token, plan_batches

    name = torch.cuda.get_device_name()
    bandwidth = measure_bandwidth()
    torch.cuda.empty_cache()  # the copy's 8 GiB
    model = build_model(args)
    decoders = {s: GreedyDecoder(model, attention=args.attention, step=s) for s in args.step}
    decoder = decoders[args.step[0]]
    wbytes, kvtok = weight_bytes_read(model), kv_bytes_per_token(model)
    budget = int(0.6 * decoder.free_bytes()) // kvtok  # the rule generate_greedy uses
    print(
        f"{name}: copy bandwidth {bandwidth / 1e12:.2f} TB/s, weights read {wbytes / 1e9:.2f} GB, "
        f"KV {kvtok / 2**10:.0f} KiB/token, KV budget {budget} tokens",
        flush=True,
    )
    g = torch.Generator().manual_seed(0)
    warm = [1, *torch.randint(3, 32000, (1023,), generator=g).tolist()]
    if min(args.lengths) <= args.skip_hf_above:
        measure_hf(model, torch.tensor([warm], device=args.device), 4)
    warmup = {}
    for s, d in decoders.items():  # compiles the fused step; each later shape compiles its own
        start = time.perf_counter()
        measure_static(model, d, warm, 2, 4)
        warmup[s] = time.perf_counter() - start
    print(f"warm-up (compile, capture) s: {warmup}", flush=True)
    rows = []
    for length in sorted(args.lengths):
        prompt = [1, *torch.randint(3, 32000, (length - 129,), generator=g).tolist()]
        batch = len(
            plan_batches([length] * args.max_rows, max_rows=args.max_rows, max_tokens=budget)[0]
        )
        row = {"length": length, "prompt_tokens": len(prompt), "rows": batch, "hf": None}
        if length <= args.skip_hf_above:
            row["hf"] = measure_hf(model, torch.tensor([prompt], device=args.device), args.hf_new)
        row["static"] = measure_static(model, decoder, prompt, batch, args.steps)
        row["steps"] = {
            s: measure_static(model, d, prompt, 1, args.steps, prefill=False)
            for s, d in decoders.items()
            if s != args.step[0]
        }
        for v in row["steps"].values():
            v["agreement"] = agreement(row["static"]["tokens"], v["tokens"])
        if row["hf"] is not None:
            row["agreement"] = agreement(row["hf"]["tokens"], row["static"]["tokens"])
        ctx = length  # cache slots read per row at the end of the answer
        row["floor_ms_b1"] = 1e3 * (wbytes + kvtok * ctx) / SPEC_BANDWIDTH
        row["floor_ms_b1_measured_bw"] = 1e3 * (wbytes + kvtok * ctx) / bandwidth
        row["floor_ms_batch"] = 1e3 * (wbytes + batch * kvtok * ctx) / SPEC_BANDWIDTH
        rows.append(row)
        s, h = row["static"], row["hf"]
        print(
            f"{length}: hf {h and round(h['decode_ms'], 2)} ms/tok, static "
            f"{s['decode_ms_b1']:.2f} ms/tok (floor {row['floor_ms_b1']:.2f}), "
            f"agreement {row.get('agreement')}",
            flush=True,
        )

    print(
        f"\nEvaluation generation, Llama-7B shape ({args.layers} layers, MHA), bf16, {name}, "
        f"static decode attention {args.attention}"
    )
    print(
        "| length | hf prefill s | static prefill s | hf decode ms/tok (b=1) | "
        "static decode ms/tok (b=1) | HBM floor ms (4.3 TB/s / measured) | static/floor | "
        "rows | static ms/step (rows) | floor ms (rows) | ms/tok/sample | static samples/s |"
        " hf samples/s | agree (equal/compared) |"
    )
    print("|---:" * 14 + "|")
    for r in rows:
        s, h = r["static"], r["hf"]
        step_b = s["decode_ms_batch"] if r["rows"] > 1 else s["decode_ms_b1"]
        sps = r["rows"] / (r["rows"] * s["prefill_s"] + 128 * step_b / 1e3)
        hsps = 1 / (h["prefill_s"] + 128 * h["decode_ms"] / 1e3) if h else None
        ag = r.get("agreement")
        print(
            f"| {r['length']} | {h['prefill_s']:.3f} | {s['prefill_s']:.3f} | "
            f"{h['decode_ms']:.1f} | {s['decode_ms_b1']:.2f} | "
            f"{r['floor_ms_b1']:.2f} / {r['floor_ms_b1_measured_bw']:.2f} | "
            f"{s['decode_ms_b1'] / r['floor_ms_b1']:.2f}× | {r['rows']} | {step_b:.2f} | "
            f"{r['floor_ms_batch']:.2f} | {step_b / r['rows']:.2f} | {sps:.3f} | "
            f"{hsps:.3f} | {ag['equal']}/{ag['compared']} (prefix {ag['equal_prefix']}) |"
            if h
            else f"| {r['length']} | – | {s['prefill_s']:.3f} | – | "
            f"{s['decode_ms_b1']:.2f} | {r['floor_ms_b1']:.2f} | – | {r['rows']} | {step_b:.2f}"
            f" | {r['floor_ms_batch']:.2f} | {step_b / r['rows']:.2f} | {sps:.3f} | – | – |"
        )
    if len(args.step) > 1:
        print(f"\nDecode step variants, batch 1 (agreement: greedy tokens against {args.step[0]})")
        print("| length | step | decode ms/tok | HBM floor ms | / floor | agree |")
        print("|---:|---|---:|---:|---:|---|")
        for r in rows:
            variants = {args.step[0]: r["static"], **r["steps"]}
            for s, v in variants.items():
                ag = v.get("agreement")
                print(
                    f"| {r['length']} | {s} | {v['decode_ms_b1']:.2f} | {r['floor_ms_b1']:.2f} | "
                    f"{v['decode_ms_b1'] / r['floor_ms_b1']:.2f}× | "
                    f"{ag and str(ag['equal']) + '/' + str(ag['compared'])} |"
                )
    proj = {e: project(rows, e) for e in ("hf", "static")}
    for e, v in proj.items():
        if "error" in v:
            print(f"{e}: {v['error']}")
        else:
            print(
                f"{e}: RULER protocol (13 tasks × 6 lengths × 500 × 5 checkpoints): "
                f"{v['gpu_hours_per_arm']:.1f} GPU-hours per arm, "
                f"{v['gpu_hours_per_checkpoint']:.1f} per checkpoint"
            )
    if args.out:
        import transformers

        from anchorctx.io import atomic_write_json

        atomic_write_json(
            args.out,
            {
                "benchmark": "eval_throughput",
                "date": datetime.now(timezone.utc).isoformat(),
                "device": name,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "bandwidth_Bps": bandwidth,
                "weight_bytes": wbytes,
                "kv_bytes_per_token": kvtok,
                "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "rows": rows,
                "projection": proj,
                "warmup_s": warmup,
            },
        )
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
