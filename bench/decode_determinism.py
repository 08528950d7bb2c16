"""Run-to-run determinism and speed of the static engine's decode attention on one GPU.

The decode step attends one query per row over the whole static KV buffer through a boolean
mask. SDPA then picks cuDNN's kernel (fast, not deterministic) unless the decoder is
``deterministic`` (memory-efficient kernel). For each (length, rows): three runs of the same batch
through :class:`anchorctx.models.decoding.GreedyDecoder` (96 greedy tokens), how many rows of
runs 2 and 3 equal run 1, and ms per decode step (64 timed graph replays). A 7B-wide model
(hidden 4096, 32 heads, MLP 11008) of ``--layers`` layers, random bf16 weights.

    python bench/decode_determinism.py --layers 8
"""

from __future__ import annotations

import argparse

import torch

from anchorctx.models.decoding import GreedyDecoder, StopRules


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--shapes", nargs="+", default=["4096x16", "32768x4", "32768x1"],
                   help="LENGTHxROWS")  # fmt: skip
    args = p.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.eval_throughput import time_replays

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=args.layers,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                      max_position_embeddings=131072, rope_theta=1e7)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    print("| length × rows | decode kernel | rows equal to run 1 (runs 2, 3) | ms/step |")
    print("|---|---|---|---:|")
    for shape in args.shapes:
        length, rows_n = (int(x) for x in shape.split("x"))
        # Rows 7 tokens apart: a padded batch, as RULER's samples of one task and length are.
        rows = [[1, *torch.randint(3, 32000, (length - 1 - 7 * i,), generator=g).tolist()]
                for i in range(rows_n)]  # fmt: skip
        for deterministic in (False, True):
            outs, ms = [], 0.0
            for run in range(3):
                decoder = GreedyDecoder(model, deterministic=deterministic)
                outs.append(decoder.generate(rows, max_new_tokens=96, pad_id=0, stop=StopRules()))
                if run == 2:
                    with torch.inference_mode():
                        ms = time_replays(decoder, decoder._batch, length,
                                          [len(r) for r in rows], 64)  # fmt: skip
                decoder.release()
            same = [sum(a == b for a, b in zip(outs[0], o)) for o in outs[1:]]
            kernel = "memory-efficient (deterministic)" if deterministic else "PyTorch's pick"
            print(f"| {length} × {rows_n} | {kernel} | {same[0]}, {same[1]} of {rows_n} | "
                  f"{ms:.2f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
