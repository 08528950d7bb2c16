"""``anchorctx prepare-data CONFIG`` and ``anchorctx demo-corpus OUT``."""

from __future__ import annotations

import argparse
import sys

from anchorctx.demo import ensure_demo_corpus, write_demo_corpus
from anchorctx.packing.pipeline import prepare_data as run
from anchorctx.packing.sources import DataError


def prepare_data_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--force", action="store_true", help="Rebuild even when a matching dataset exists."
    )
    parser.add_argument("--quiet", action="store_true", help="No progress bars or summary.")


def prepare_data(args: argparse.Namespace) -> int:
    try:
        ensure_demo_corpus(args.cfg, progress=not args.quiet)  # demo configs: data + tokenizer
        out = run(args.cfg, force=args.force, progress=not args.quiet)
    except DataError as err:
        print(f"anchorctx prepare-data: {err}", file=sys.stderr)
        return 1
    print(out)
    return 0


def demo_corpus_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", metavar="OUT", help="Directory to write (new or empty).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--docs-per-domain", type=int, default=40)
    parser.add_argument("--quiet", action="store_true")


def demo_corpus(args: argparse.Namespace) -> int:
    try:
        corpus = write_demo_corpus(
            args.out,
            seed=args.seed,
            docs_per_domain=args.docs_per_domain,
            progress=not args.quiet,
        )
    except (FileExistsError, ValueError) as err:
        print(f"anchorctx demo-corpus: {err}", file=sys.stderr)
        return 1
    print(f"data: {corpus.data_dir}\ntokenizer: {corpus.tokenizer_dir}")
    return 0
