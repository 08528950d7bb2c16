"""``anchorctx rope-precision CONFIG [--out DIR]``: the BF16 RoPE precision study."""

from __future__ import annotations

import argparse
import sys

from anchorctx.demo import ensure_demo_corpus
from anchorctx.io import read_json


def rope_precision_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="Output directory (default: <run_dir>/analysis/): rope_precision.json (means "
        "over sequences), .md and .png (Figure 1), rope_precision_per_sample.json (the shift "
        "curve of every sequence) and .png (Figure 7: one line per sequence and the mean).",
    )
    parser.add_argument("--no-progress", action="store_true", help="Hide the progress bar.")


def rope_precision(args: argparse.Namespace) -> int:
    # Imported here: the study imports torch and transformers, which `anchorctx --help` skips.
    from anchorctx.analysis.rope_precision import StudyInputError, run_study
    from anchorctx.models.loading import ModelLoadError

    try:
        # Demo configs: the corpus provides the tokenizer and the input text.
        ensure_demo_corpus(args.cfg, progress=not args.no_progress)
        path = run_study(args.cfg, out_dir=args.out, progress=not args.no_progress)
    except (StudyInputError, ModelLoadError) as err:
        print(f"anchorctx rope-precision: {err}", file=sys.stderr)
        return 2
    result = read_json(path)
    for mode in result["settings"]["modes"]:
        curve = result["shift_curve"][mode]
        print(
            f"{mode:>15}: D(Δ1=0)={curve.get('0', float('nan')):.3e}  "
            f"first-token share={result['first_token_share'][mode]:.1%}  "
            f"D_logit(T={result['settings']['lengths'][-1]})="
            f"{result['logit_diff_by_length'][mode][str(result['settings']['lengths'][-1])]:.3e}"
        )
    print(f"wrote {path} (figure, table and per-sequence curves beside it)")
    return 0
