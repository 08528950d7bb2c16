"""Dataset statistics in the shapes of the paper: Table 9 (mixture ratio = share of documents,
token ratio = share of tokens, per domain, for the input corpus and the packed output) and
Figure 8 (document-length histogram), plus tokens by document-length bucket (input vs packed,
the effect of length upsampling) and, for ``mixture: upsampled``, the per-source statistics of
Fu et al.'s rule (budget, tokens, documents kept and dropped)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from anchorctx.io import atomic_write_json, atomic_write_png, atomic_write_text
from anchorctx.packing.mixture import DocumentPlan, bucket_tokens
from anchorctx.packing.pack import PackStats
from anchorctx.packing.tokens import DocIndex


def _shares(docs: dict[str, int], tokens: dict[str, int]) -> dict[str, dict[str, float]]:
    nd, nt = max(sum(docs.values()), 1), max(sum(tokens.values()), 1)
    return {
        d: {
            "documents": docs.get(d, 0),
            "tokens": tokens.get(d, 0),
            "mixture_ratio": docs.get(d, 0) / nd,
            "token_ratio": tokens.get(d, 0) / nt,
        }
        for d in sorted(set(docs) | set(tokens))
    }


def compute(
    index: DocIndex, plan: DocumentPlan, pack: PackStats, emitted: np.ndarray
) -> dict[str, Any]:
    codes = np.arange(len(index.domains))
    in_docs = np.bincount(index.domain, minlength=codes.size)
    in_tok = np.bincount(index.domain, weights=index.length, minlength=codes.size)
    packed_dom = index.domain[plan.doc[emitted]]
    out_docs = np.bincount(packed_dom, minlength=codes.size)
    name = index.domains
    return {
        "input": _shares(
            {name[c]: int(in_docs[c]) for c in codes}, {name[c]: int(in_tok[c]) for c in codes}
        ),
        "packed": _shares(
            {name[c]: int(out_docs[c]) for c in codes if out_docs[c]},
            {d: int(t) for d, t in pack.text_tokens.items()},
        ),
        "target_token_ratio": plan.target_shares,
        "tokens_by_length": {
            "input": bucket_tokens(index.length),
            "packed": bucket_tokens(plan.take[emitted]),
        },
        **({"upsample": plan.upsample} if plan.upsample is not None else {}),
    }


def table9_markdown(stats: dict[str, Any]) -> str:
    lines = [
        "| domain | input mixture ratio | input token ratio | packed mixture ratio "
        "| packed token ratio | target token ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for d in sorted(set(stats["input"]) | set(stats["packed"])):
        i, p = stats["input"].get(d, {}), stats["packed"].get(d, {})
        t = stats["target_token_ratio"].get(d, 0.0)
        lines.append(
            f"| {d} | {i.get('mixture_ratio', 0):.2%} | {i.get('token_ratio', 0):.2%} "
            f"| {p.get('mixture_ratio', 0):.2%} | {p.get('token_ratio', 0):.2%} | {t:.2%} |"
        )
    return "\n".join(lines) + "\n"


def length_histogram(index: DocIndex, plan: DocumentPlan, emitted: np.ndarray, path: Path) -> Path:
    """Figure 8: document lengths (tokens) of the input corpus and of the packed sample (left);
    the share of tokens in each length bucket, input vs packed (right: what upsampling moved)."""
    # Imported here: matplotlib loads only when a figure is drawn, and the Agg backend must be
    # chosen before pyplot is imported.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [index.length, plan.take[emitted]]
    top = max(int(max(x.max() for x in lengths if x.size)), 2)
    bins = np.logspace(0, np.log10(top) + 0.05, 40)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4))
    _bucket_bars(bx, lengths, plan)
    for data, label in zip(lengths, ["input corpus", "packed sample"]):
        ax.hist(
            data, bins=bins, histtype="step", linewidth=1.6, label=f"{label} ({data.size} docs)"
        )
    ax.set_xscale("log")
    ax.set_xlabel("document length (tokens)")
    ax.set_ylabel("documents")
    ax.set_title("Document length distribution")
    ax.legend()
    atomic_write_png(path, fig, dpi=120)
    plt.close(fig)
    return path


def _bucket_bars(ax: Any, lengths: list[np.ndarray], plan: DocumentPlan) -> None:
    names = list(bucket_tokens(lengths[0]))
    x = np.arange(len(names))
    for k, (data, label) in enumerate(zip(lengths, ["input corpus", "packed sample"])):
        tok = np.array(list(bucket_tokens(data).values()), dtype=np.float64)
        ax.bar(x + (k - 0.5) * 0.4, tok / max(tok.sum(), 1.0), width=0.4, label=label)
    ax.set_xticks(x, names, rotation=30)
    ax.set_xlabel("document length (tokens)")
    ax.set_ylabel("share of tokens")
    rule = "Fu et al. per-source upsampling" if plan.upsample is not None else "no upsampling"
    ax.set_title(f"Tokens by document length ({rule})")
    ax.legend()


def upsample_markdown(stats: dict[str, Any]) -> str:
    """The upsampled rule's per-source table (empty for other mixtures)."""
    up = stats.get("upsample")
    if not up:
        return ""
    lines = [
        f"\n## Length upsampling (Fu et al. 2024, per source; short < {up['threshold']} tokens "
        f"kept with p={up['keep_short']}, shares: {up['shares_from']})\n",
        "| source | budget | tokens | met | kept short | kept long | dropped short | unused |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for d, s in up["by_source"].items():
        lines.append(
            f"| {d} | {s['budget']} | {s['tokens']} | {'yes' if s['budget_met'] else 'no'} "
            f"| {s['documents_kept']['short']} | {s['documents_kept']['long']} "
            f"| {s['documents_dropped_short']} | {s['documents_unused']} |"
        )
    return "\n".join(lines) + "\n"


def write(stats: dict[str, Any], out: Path) -> str:
    table = table9_markdown(stats) + upsample_markdown(stats)
    atomic_write_json(out / "stats.json", stats)
    atomic_write_text(out / "stats.md", "# Domain mixture (paper Table 9)\n\n" + table)
    return table
