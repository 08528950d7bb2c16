"""The BF16 RoPE precision study on a randomly initialised Llama-2-7B-shaped model (one GPU).

The paper's Figure 1 green line: a Llama-2-7B architecture (hidden 4096, 32 heads, 11008
intermediate, 32 layers, RoPE base 10^4) with random initialisation, shift curve at T = 4096
and the first-token logit difference for lengths 64 … 8192, in bf16, bf16 with RoPE in fp32,
and fp32, on the same (bf16-grid) weights. Inputs are seeded uniform random token ids starting
with BOS: a randomly initialised model has no use for real text.

    python bench/rope_precision_gpu.py --out bench_out/rope_precision          # H100/H200
    python bench/rope_precision_gpu.py --preset tiny --device cpu --out /tmp/rp  # smoke test
    python bench/rope_precision_gpu.py --plot FETCHED/rope_precision.json --out docs/figures

Prints the result table; writes rope_precision.json/.md (and .png when matplotlib is
installed; otherwise render it elsewhere with --plot JSON, which writes rope_precision.png
into --out). ``--out`` is a directory (a path ending in .json means its parent directory).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PRESETS = {
    "llama2-7b": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    ),
}
PAPER_LENGTHS = [64, 128, 256, 512, 1024, 2048, 4096, 8192]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama2-7b")
    p.add_argument("--layers", type=int, default=None, help="Override the number of layers.")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--lengths", type=int, nargs="+", default=PAPER_LENGTHS)
    p.add_argument("--num-sequences", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=["bf16", "bf16_rope_fp32", "fp32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, default=Path("bench_out/rope_precision"))
    p.add_argument("--plot", type=Path, default=None, help="Only render the PNG of this JSON.")
    return p.parse_args(argv)


def build_model(args: argparse.Namespace):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from anchorctx.analysis.probe import register
    from anchorctx.analysis.rope_precision import prepare_model

    shape = dict(PRESETS[args.preset])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    cfg = LlamaConfig(**shape, max_position_embeddings=4096, bos_token_id=1, use_cache=False)
    torch.manual_seed(args.seed)
    with torch.device(args.device):  # initialise on the device: seconds, not minutes, for 7B
        model = AutoModelForCausalLM.from_config(
            cfg, dtype=torch.float32, attn_implementation=register()
        )
    return prepare_model(model), shape


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from anchorctx.analysis.rope_precision import (
        markdown_table,
        measure,
        random_sequences,
        render_figure,
    )

    out_dir = args.out.parent if args.out.suffix == ".json" else args.out
    if args.plot:
        print(f"wrote {render_figure(args.plot, out_dir / 'rope_precision.png')}")
        return 0
    import torch

    from anchorctx.analysis.rope_precision import write_study
    from anchorctx.analysis.settings import RopePrecisionConfig

    spec = RopePrecisionConfig(
        seq_len=args.seq_len,
        lengths=args.lengths,
        precisions=args.modes,
        num_sequences=args.num_sequences,
        device=args.device,
    )
    start = time.perf_counter()
    model, shape = build_model(args)
    init_s = time.perf_counter() - start
    seqs = random_sequences(
        args.num_sequences,
        max(spec.seq_len, *spec.lengths),
        shape["vocab_size"],
        anchor=1,
        seed=args.seed,
    )
    result = measure(model, seqs, spec, progress=True)
    layers = shape["num_hidden_layers"]
    result["settings"].update(
        {
            "inputs": f"uniform random token ids (seed {args.seed}), BOS first",
            "weights": f"random init, Llama-2-7B shape ({layers} layers, preset {args.preset})",
            "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
            "model_shape": shape,
            "init_s": round(init_s, 1),
            "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)
            if args.device == "cuda"
            else None,
        }
    )
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    path = write_study(result, out_dir, figure=has_mpl)
    print(markdown_table(result))
    print(
        f"elapsed {time.perf_counter() - start:.0f}s (init {init_s:.0f}s); wrote {path}"
        + ("" if has_mpl else f"; no matplotlib here: render with --plot {path}")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
