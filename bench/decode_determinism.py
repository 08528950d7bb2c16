"""Run-to-run determinism and speed of the static engine's decode attention kernels on one GPU.

The decode step attends one query per row over the whole static KV buffer through a boolean
mask. SDPA then picks cuDNN's kernel (fast, not deterministic); the decoder can instead use
SDPA's memory-efficient kernel or compiled FlexAttention (``GreedyDecoder(attention=...)``). For
each (length, rows) and kernel: three runs of the same batch through
:class:`anchorctx.models.decoding.GreedyDecoder` (96 greedy tokens), how many rows of runs 2 and
3 equal run 1, how many rows of run 1 equal the memory-efficient kernel's run 1 (the bf16
agreement between kernels), and ms per decode step (64 timed graph replays). A 7B-wide model
(hidden 4096, 32 heads, MLP 11008) of ``--layers`` layers, random bf16 weights.

    python bench/decode_determinism.py --layers 8 --out decode_determinism.json
"""

from __future__ import annotations

import argparse
from datetime import datetime, timezone
from pathlib import Path

import torch

from anchorctx.models.decoding import DECODE_ATTENTIONS, GreedyDecoder, StopRules

LABELS = {
    "sdpa": "PyTorch's pick (cuDNN)",
    "efficient": "SDPA memory-efficient",
    "flex": "FlexAttention (compiled)",
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument(
        "--shapes", nargs="+", default=["4096x16", "32768x4", "32768x1"], help="LENGTHxROWS"
    )
    p.add_argument(
        "--attentions", nargs="+", default=list(DECODE_ATTENTIONS), choices=DECODE_ATTENTIONS
    )
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.eval_throughput import time_replays

    cfg = LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=args.layers,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=131072,
        rope_theta=1e7,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    # The reference of the cross-kernel column: the memory-efficient kernel, measured first.
    order = sorted(args.attentions, key=lambda a: a != "efficient")
    results = []
    for shape in args.shapes:
        length, rows_n = (int(x) for x in shape.split("x"))
        # Rows 7 tokens apart: a padded batch, as RULER's samples of one task and length are.
        rows = [
            [1, *torch.randint(3, 32000, (length - 1 - 7 * i,), generator=g).tolist()]
            for i in range(rows_n)
        ]
        reference = None
        for attention in order:
            outs, ms = [], 0.0
            for run in range(3):
                decoder = GreedyDecoder(model, attention=attention)
                outs.append(decoder.generate(rows, max_new_tokens=96, pad_id=0, stop=StopRules()))
                if run == 2:
                    with torch.inference_mode():
                        ms = time_replays(
                            decoder, decoder._batch, length, [len(r) for r in rows], 64
                        )
                decoder.release()
            reference = outs[0] if attention == "efficient" else reference
            same = [sum(a == b for a, b in zip(outs[0], o)) for o in outs[1:]]
            vs_ref = None if reference is None else sum(a == b for a, b in zip(reference, outs[0]))
            results.append(
                {
                    "length": length,
                    "rows": rows_n,
                    "attention": attention,
                    "runs_equal_run1": same,
                    "rows_equal_efficient": vs_ref,
                    "ms_per_step": ms,
                    "tokens": outs,
                }
            )
            print(
                f"{shape} {attention}: runs equal {same}, vs efficient {vs_ref}, {ms:.2f} ms/step",
                flush=True,
            )
    name = torch.cuda.get_device_name()
    print(f"\n{name}, {args.layers} layers, bf16, torch {torch.__version__}")
    print(
        "| length × rows | decode kernel | rows equal to run 1 (runs 2, 3) | "
        "rows equal to memory-efficient | ms/step |"
    )
    print("|---|---|---|---|---:|")
    for r in results:
        print(
            f"| {r['length']} × {r['rows']} | {LABELS[r['attention']]} | "
            f"{r['runs_equal_run1'][0]}, {r['runs_equal_run1'][1]} of {r['rows']} | "
            f"{r['rows_equal_efficient']} of {r['rows']} | {r['ms_per_step']:.2f} |"
        )
    if args.out:
        from anchorctx.io import atomic_write_json

        atomic_write_json(
            args.out,
            {
                "benchmark": "decode_determinism",
                "date": datetime.now(timezone.utc).isoformat(),
                "device": name,
                "torch": torch.__version__,
                "layers": args.layers,
                "results": results,
            },
        )
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
