"""The three-panel figure of the RoPE precision study, laid out like the paper's Figure 1."""

from __future__ import annotations

from pathlib import Path
from typing import Any, BinaryIO

STYLE = {
    "bf16": {"color": "tab:red", "marker": "o", "label": "bf16"},
    "bf16_rope_fp32": {"color": "tab:orange", "marker": "s", "label": "bf16, RoPE in fp32"},
    "fp32": {"color": "tab:blue", "marker": "^", "label": "fp32"},
}


def _positive(values: list[float]) -> list[float]:
    """Log axes cannot show 0 (D at Δ1 = Δ2 is exactly 0): plot it as a gap."""
    return [v if v > 0 else float("nan") for v in values]


def _shift_panel(ax, result: dict[str, Any]) -> None:
    settings = result["settings"]
    shifts = settings["shifts"]
    for mode in settings["modes"]:
        ys = [result["shift_curve"][mode][str(d)] for d in shifts]
        ax.plot(range(len(shifts)), _positive(ys), **STYLE[mode])
    if settings["delta2"] in shifts:
        ax.axvline(shifts.index(settings["delta2"]), color="grey", ls=":", lw=1)
    ax.set_xticks(range(len(shifts)), [str(d) for d in shifts], rotation=60, fontsize=7)
    ax.set_yscale("log")
    ax.set_xlabel(f"Δ1 (Δ2 = {settings['delta2']}; D = 0 at Δ1 = Δ2)")
    ax.set_ylabel("attention difference D")
    ax.set_title("Shifted position ids (Eq. 4)")


def _token_panel(ax, result: dict[str, Any]) -> None:
    settings = result["settings"]
    for mode in settings["modes"]:
        ys = result["per_token"][mode]
        share = result["first_token_share"][mode]
        style = {**STYLE[mode], "label": f"{STYLE[mode]['label']} (token 0: {share:.1%})"}
        style.pop("marker")
        ax.plot(range(len(ys)), _positive(ys), lw=0.8, **style)
        ax.plot([0], _positive([ys[0]]), marker="*", ms=10, color=style["color"])
    ax.set_xscale("symlog", linthresh=10)
    ax.set_yscale("log")
    ax.set_xlabel("key token index")
    ax.set_ylabel("contribution to D")
    ax.set_title(f"Per-token, Δ1 = {settings['compare_shift']} vs Δ2 = {settings['delta2']}")


def _length_panel(ax, result: dict[str, Any]) -> None:
    settings = result["settings"]
    lengths = settings["lengths"]
    for mode in settings["modes"]:
        ys = [result["logit_diff_by_length"][mode][str(n)] for n in lengths]
        ax.plot(lengths, _positive(ys), **STYLE[mode])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, [str(n) for n in lengths], rotation=45, fontsize=7)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("first-token logit difference")
    ax.set_title("First-token logits vs length (Eq. 5)")


def plot_study(result: dict[str, Any], path: Path | BinaryIO) -> Path | BinaryIO:
    """Render the figure to ``path`` (PNG) with the non-interactive Agg backend."""
    # Imported here: matplotlib loads only when a figure is drawn, and the Agg backend must be
    # chosen before pyplot is imported.
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    _shift_panel(axes[0], result)
    _token_panel(axes[1], result)
    _length_panel(axes[2], result)
    for ax in axes:
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(fontsize=7)
    settings = result["settings"]
    fig.suptitle(
        f"BF16 RoPE precision — {settings.get('weights', '')}; "
        f"{settings['num_sequences']} sequence(s) × {settings['seq_len']} tokens",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=130, format="png")
    plt.close(fig)
    return path


def _per_sample_panel(ax, record: dict[str, Any], mode: str) -> None:
    settings = record["settings"]
    shifts = settings["shifts"]
    xs = range(len(shifts))
    curves = record["per_sample_shift_curve"][mode]
    for i, curve in enumerate(curves):
        ys = [curve[str(d)] for d in shifts]
        label = "one line per sequence" if i == 0 else None
        ax.plot(xs, _positive(ys), color=STYLE[mode]["color"], lw=0.7, alpha=0.35, label=label)
    mean = [record["shift_curve"][mode][str(d)] for d in shifts]
    ax.plot(xs, _positive(mean), color="black", lw=2, marker=STYLE[mode]["marker"], label="mean")
    if settings["delta2"] in shifts:
        ax.axvline(shifts.index(settings["delta2"]), color="grey", ls=":", lw=1)
    ax.set_xticks(xs, [str(d) for d in shifts], rotation=60, fontsize=7)
    ax.set_yscale("log")  # modes differ by orders of magnitude: each panel has its own axis
    ax.set_xlabel(f"Δ1 (Δ2 = {settings['delta2']})")
    ax.set_ylabel("attention difference D")
    ax.set_title(f"{STYLE[mode]['label']}: {len(curves)} sequence(s)")


def plot_per_sample(record: dict[str, Any], path: Path | BinaryIO) -> Path | BinaryIO:
    """The paper's Figure 7 from ``rope_precision_per_sample.json``: per mode, the attention
    difference D against Δ1 of every sequence, and their mean. PNG, non-interactive Agg."""
    # Imported here: matplotlib loads only when a figure is drawn.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    modes = record["settings"]["modes"]
    fig = Figure(figsize=(5.4 * len(modes), 4.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(modes), squeeze=False)[0]
    for ax, mode in zip(axes, modes, strict=True):
        _per_sample_panel(ax, record, mode)
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(fontsize=7)
    settings = record["settings"]
    fig.suptitle(
        f"BF16 RoPE precision per sequence — {settings.get('weights', '')}; "
        f"{settings['num_sequences']} sequence(s) × {settings['seq_len']} tokens",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=130, format="png")
    return path


# ------------------------------------------------------------------------ on learned weights
INPUT_STYLE = {
    "with_anchor": {"ls": "-", "fillstyle": "full", "label": "anchor at 0"},
    "without_anchor": {"ls": "--", "fillstyle": "none", "label": "no anchor"},
}


def _weights_d_panel(ax, result: dict[str, Any]) -> None:
    settings = result["settings"]
    names = [w["name"] for w in result["weights"]]
    for mode in settings["modes"]:
        for inp, style in INPUT_STYLE.items():
            ys = [w["results"][inp][mode]["D"] for w in result["weights"]]
            ax.plot(
                range(len(names)),
                _positive(ys),
                color=STYLE[mode]["color"],
                marker=STYLE[mode]["marker"],
                ls=style["ls"],
                fillstyle=style["fillstyle"],
                label=f"{STYLE[mode]['label']}, {style['label']}",
            )
    ax.set_xticks(range(len(names)), names, rotation=30, fontsize=7, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("attention difference D")
    ax.set_title(f"D (Eq. 4), Δ1 = {settings['compare_shift']} vs Δ2 = {settings['delta2']}")


def _weights_token_panel(ax, result: dict[str, Any], inp: str, mode: str) -> None:
    for w in result["weights"]:
        by_mode = w["results"][inp][mode]
        ys = by_mode["per_token"]
        label = f"{w['name']} (token 0: {by_mode['first_token_share']:.1%})"
        line = ax.plot(range(len(ys)), _positive(ys), lw=0.8, label=label)
        ax.plot([0], _positive([ys[0]]), marker="*", ms=9, color=line[0].get_color())
    ax.set_xscale("symlog", linthresh=10)
    ax.set_yscale("log")
    ax.set_xlabel("key token index")
    ax.set_ylabel("contribution to D")
    ax.set_title(f"Per-token, {STYLE[mode]['label']}, {INPUT_STYLE[inp]['label']}")


def plot_weights(result: dict[str, Any], path: Path | BinaryIO) -> Path | BinaryIO:
    """The study on learned weights (``rope_weights.json``): D per weights and input, and the
    per-key contributions (Figure 1 middle) of every weights, random init among them, with and
    without the anchor token, in bf16. PNG with the non-interactive Agg backend."""
    # Imported here: matplotlib loads only when a figure is drawn.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    settings = result["settings"]
    mode = "bf16" if "bf16" in settings["modes"] else settings["modes"][0]
    fig = Figure(figsize=(16, 4.8))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    _weights_d_panel(axes[0], result)
    _weights_token_panel(axes[1], result, "with_anchor", mode)
    _weights_token_panel(axes[2], result, "without_anchor", mode)
    for ax in axes:
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(fontsize=6)
    fig.suptitle(
        f"BF16 RoPE precision on learned weights — {settings['num_sequences']} sequence(s) × "
        f"{settings['seq_len']} tokens, with and without the anchor token",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=130, format="png")
    return path
