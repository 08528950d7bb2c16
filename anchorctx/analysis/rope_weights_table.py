"""The Section 2 study on learned weights, as files and tables (no torch: the report reads it).

:mod:`anchorctx.analysis.rope_weights` measures one set of weights (random init, the pretrained
base model, or an arm's final checkpoint) with and without the anchor token and writes one
file per weights. :func:`write_weights_study` gathers those into one result with a ``weights``
axis, ``<experiment_dir>/rope_precision/rope_weights.json``, beside its table and figure:

    {"schema_version": 1, "study": "rope_precision_weights",
     "settings": {delta2, compare_shift, seq_len, num_sequences, modes, inputs, device},
     "weights": [{"key", "name", "kind", "label", "checkpoint", "step", "elapsed_s",
                  "results": {"with_anchor" | "without_anchor":
                              {mode: {"D", "D_std", "first_token_share", "D_logit",
                                      "per_token"}}}}, ...]}

``kind`` is ``random_init``, ``base`` or ``arm``; ``D`` is Eq. 4 at Δ1 = ``compare_shift``
against Δ2 = ``delta2``, ``first_token_share`` the share of D contributed by key token 0,
``D_logit`` Eq. 5 at T = ``seq_len`` (means over the sequences; ``D_std`` their std).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from anchorctx.io import atomic_write_bytes, atomic_write_json, atomic_write_text, read_json

STUDY = "rope_precision_weights"
SCHEMA_VERSION = 1
STUDY_DIR = "rope_precision"  # under the experiment directory (the random-init study's too)
WEIGHTS_DIR = "weights"  # one file per weights, and the shared inputs, under STUDY_DIR
JSON_NAME = "rope_weights.json"
PNG_NAME = "rope_weights.png"
MD_NAME = "rope_weights.md"
INPUTS = ("with_anchor", "without_anchor")
INPUT_LABELS = {"with_anchor": "anchor (BOS) at 0", "without_anchor": "no anchor"}
MODE_LABELS = {"bf16": "bf16", "bf16_rope_fp32": "bf16, RoPE fp32", "fp32": "fp32"}


def study_dir(experiment_dir: str | Path) -> Path:
    return Path(experiment_dir) / STUDY_DIR


def combine(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result with a ``weights`` axis from per-weights results (in the order given)."""
    if not results:
        raise ValueError("no per-weights results to combine")
    settings = results[0]["settings"]
    for r in results[1:]:
        if r["settings"] != settings:
            raise ValueError(
                f"per-weights results measured with different settings: {r['weights']['key']} "
                f"has {r['settings']}, {results[0]['weights']['key']} has {settings}"
            )
    return {
        "schema_version": SCHEMA_VERSION,
        "study": STUDY,
        "settings": settings,
        "weights": [
            {**r["weights"], "elapsed_s": r.get("elapsed_s"), "results": r["results"]}
            for r in results
        ],
    }


def read_weights_study(path: str | Path) -> dict[str, Any] | None:
    """The combined result at ``path`` (a per-weights file reads as a one-entry result), or
    None when there is none."""
    path = Path(path)
    if not path.is_file():
        return None
    data = read_json(path)
    if data.get("study") != STUDY:
        return None
    if isinstance(data.get("weights"), dict):  # one set of weights
        return combine([data])
    return data


def without_curves(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` without the per-key contributions (what a report embeds: the table's numbers;
    the curves stay in ``rope_weights.json`` and its figure)."""
    return {
        **result,
        "weights": [
            {
                **w,
                "results": {
                    inp: {
                        m: {k: v for k, v in stats.items() if k != "per_token"}
                        for m, stats in by_mode.items()
                    }
                    for inp, by_mode in w["results"].items()
                },
            }
            for w in result["weights"]
        ],
    }


def write_weights_study(
    result_paths: Sequence[str | Path], out_dir: str | Path, *, figure: bool = True
) -> Path:
    """Gather per-weights results into ``rope_weights.json`` (+ Markdown table and figure)."""
    out_dir = Path(out_dir)
    result = combine([read_json(p) for p in result_paths])
    atomic_write_text(out_dir / MD_NAME, markdown(result))
    path = atomic_write_json(out_dir / JSON_NAME, result)
    if figure:
        # Imported here: matplotlib loads only when the figure is drawn.
        from anchorctx.analysis.plot import plot_weights

        png = io.BytesIO()
        plot_weights(result, png)
        atomic_write_bytes(out_dir / PNG_NAME, png.getvalue())
    return path


# ---------------------------------------------------------------------------------- tables
def table_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (weights, input): D, first-token share and D_logit per precision mode."""
    modes = result["settings"]["modes"]
    rows = []
    for w in result["weights"]:
        for inp in INPUTS:
            by_mode = w["results"].get(inp)
            if not by_mode:
                continue
            row: dict[str, Any] = {"weights": w["name"], "kind": w["kind"], "input": inp}
            for m in modes:
                row[f"D {m}"] = by_mode[m]["D"]
                row[f"first-token share {m}"] = by_mode[m]["first_token_share"]
                row[f"D_logit {m}"] = by_mode[m]["D_logit"]
            rows.append(row)
    return rows


def _cells(row: dict[str, Any], modes: list[str]) -> list[str]:
    return [f"{row[f'D {m}']:.3e}" for m in modes] + [
        f"{100 * row[f'first-token share {m}']:.1f}%" for m in modes
    ]


def markdown_rows(result: dict[str, Any]) -> str:
    """The side-by-side table: weights × with/without anchor, D and first-token share per mode."""
    modes = result["settings"]["modes"]
    header = (
        ["weights", "first token"]
        + [f"D ({MODE_LABELS.get(m, m)})" for m in modes]
        + [f"first-token share ({MODE_LABELS.get(m, m)})" for m in modes]
    )
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (2 * len(modes))]
    for row in table_rows(result):
        cells = [row["weights"], INPUT_LABELS[row["input"]], *_cells(row, modes)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(result: dict[str, Any]) -> str:
    """One sentence: what was measured, on which inputs."""
    s = result["settings"]
    return (
        f"D: Eq. 4 at Δ1 = {s['compare_shift']} against Δ2 = {s['delta2']}, first-token share: "
        f"key token 0's share of D, on {s['num_sequences']} sequence(s) × {s['seq_len']} "
        f"tokens of {s.get('inputs', '?')}: each with the anchor token (BOS) at position 0 as "
        "the project packs rows, and the same text without it"
    )


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# BF16 RoPE precision on learned weights",
        "",
        describe(result) + ".",
        "",
        *(f"- **{w['name']}** ({w['kind']}): {w['label']}" for w in result["weights"]),
        "",
        markdown_rows(result),
    ]
    return "\n".join(lines) + "\n"
