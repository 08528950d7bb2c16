"""``anchorctx demo-assets``: stand-ins, in the published formats, for the paper configs' inputs."""

from __future__ import annotations

import argparse


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def demo_assets_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Write seeded, offline stand-ins for every input configs/paper/*.yaml names, each in its "
        "published layout: a Llama-2-7B-shaped Hugging Face checkpoint (sharded fp16 "
        "safetensors with their index, random weights) with a Llama-style SentencePiece "
        "tokenizer; small random stand-ins of Table 6's Llama-3-8B, Mistral-7B-v0.3 and "
        "Qwen-1.5-1.8B with their config.json fields and tokenizer conventions; SlimPajama chunks (chunkN/example_train_K.jsonl.zst), RULER's essay, SQuAD "
        "v2, HotpotQA and english_words.json files, LongBench v1, MMLU and HellaSwag. Then print the --set "
        "overrides that point a paper config at them (also saved as DIR/paper-assets.yaml). "
        "The content is synthetic: it rehearses the pipeline, not the paper's numbers. "
        "Every path key of the paper configs is covered (model, tokenizer, data sources, "
        "evaluation files)."
    )
    parser.add_argument(
        "--paper",
        required=True,
        metavar="DIR",
        help="Directory to write (new, empty, or an earlier demo-assets directory).",
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of every file (default 0).")
    parser.add_argument(
        "--layers",
        type=_positive,
        metavar="N",
        help="Decoder layers of the checkpoint (default: Llama-2-7B's 32, about 13 GB of fp16; "
        "fewer for a quicker rehearsal).",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="Same files and fields, tiny sizes (64-wide 2-layer model, 1000-piece tokenizer, a "
        "few documents and samples): for CPU tests.",
    )
    parser.add_argument(
        "--force", action="store_true", help="Rewrite even when a matching set is there."
    )
    parser.add_argument("--quiet", action="store_true", help="No progress lines.")


def demo_assets(args: argparse.Namespace) -> int:
    # Imported here: the generators (numpy, zstandard, safetensors) load only when this
    # command runs, not for every ``anchorctx --help``.
    from anchorctx.demo.paper_assets import TABLE6_PRESETS, paper_overrides, write_paper_assets

    write_paper_assets(
        args.paper,
        seed=args.seed,
        tiny=args.tiny,
        layers=args.layers,
        force=args.force,
        progress=not args.quiet,
    )
    for preset in ("llama2-7b-64k", *TABLE6_PRESETS):
        print(f"anchorctx config configs/paper/{preset}.yaml \\")
        print(" \\\n".join(f"  --set {o}" for o in paper_overrides(args.paper, preset)))
    return 0
