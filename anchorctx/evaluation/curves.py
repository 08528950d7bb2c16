"""Scores over training (paper Figure 4): each arm's RULER score and perplexity at every
evaluated checkpoint, against its training step.

Read from the results ``anchorctx evaluate CONFIG`` writes for every saved checkpoint of a run
(no ``--last-k``: all of them), each checked as the report checks the results it averages
(:func:`anchorctx.evaluation.averaging.collect_results` with ``verify``). A checkpoint without a
step (a weight-averaged one, a base model) has no place on the axis and is left out.

- RULER: the mean over the averaged tasks (``evaluation.ruler.exclude`` honoured) and over the
  evaluated lengths, one number per checkpoint (Table 5's "Avg." column);
- perplexity: per evaluated length, exp(mean NLL) of the held-out rows
  (:mod:`anchorctx.evaluation.perplexity`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from anchorctx.evaluation.averaging import (
    collect_results,
    length_label,
    markdown_table,
    result_step,
    ruler_average,
    sorted_keys,
)
from anchorctx.evaluation.integrity import ResultIntegrityError
from anchorctx.io import atomic_write_png

PNG_NAME = "training_curves.png"


def run_curves(run_dir: str | Path) -> dict[str, Any]:
    """``{"ruler": {step: mean}, "perplexity": {length: {step: ppl}}}`` of one run (steps as
    strings, ascending)."""
    grouped = collect_results(run_dir, verify=True)
    ruler: dict[int, float] = {}
    for result in grouped.get("ruler", []):
        step = result_step(result)
        by_length, _ = ruler_average(result)
        if step is not None and by_length:
            ruler[step] = sum(by_length.values()) / len(by_length)
    ppl: dict[str, dict[int, float]] = {}
    for result in grouped.get("perplexity", []):
        step = result_step(result)
        for length, value in (result["scores"].get("perplexity") or {}).items():
            if step is not None and isinstance(value, int | float):
                ppl.setdefault(str(length), {})[step] = float(value)
    return {
        "ruler": {str(s): ruler[s] for s in sorted(ruler)},
        "perplexity": {
            n: {str(s): by_step[s] for s in sorted(by_step)}
            for n, by_step in ((n, ppl[n]) for n in sorted_keys(ppl))
        },
    }


def experiment_curves(
    experiment_dir: str | Path, arms: list[str]
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """(:func:`run_curves` of every arm that has evaluation results over two or more steps,
    one line per arm left out because a result file fails its integrity check: the report
    prints them, the other arms' curves are still drawn)."""
    out, problems = {}, []
    for arm in arms:
        if not (Path(experiment_dir) / arm / "eval").is_dir():
            continue
        try:
            curves = run_curves(Path(experiment_dir) / arm)
        except ResultIntegrityError as err:
            problems.append(f"{arm}: not drawn: {err}")
            continue
        steps = set(curves["ruler"]) | {s for c in curves["perplexity"].values() for s in c}
        if len(steps) >= 2:
            out[arm] = curves
    return out, problems


def plot_curves(curves: dict[str, dict[str, Any]], path: Path) -> Path:
    """RULER (left) and perplexity at each length (right, log scale) against training step,
    one colour per arm."""
    # Imported here: matplotlib loads only when a figure is drawn.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), dpi=120)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    for i, (arm, c) in enumerate(curves.items()):
        colour = f"C{i}"  # one colour per arm in both panels
        if c["ruler"]:
            xs = [int(s) for s in c["ruler"]]
            left.plot(xs, list(c["ruler"].values()), marker="o", color=colour, label=arm)
        styles = ["-", "--", ":", "-."]
        for j, (length, by_step) in enumerate(c["perplexity"].items()):
            xs = [int(s) for s in by_step]
            right.plot(
                xs,
                list(by_step.values()),
                marker="o",
                linestyle=styles[j % len(styles)],
                color=colour,
                label=f"{arm} @ {length_label(length)}",
            )
    left.set(xlabel="training step", ylabel="RULER score (mean over tasks and lengths)")
    left.set_title("RULER over training")
    right.set(xlabel="training step", ylabel="perplexity (held-out rows)")
    right.set_yscale("log")
    right.set_title("Perplexity over training")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    return atomic_write_png(path, fig)


def curves_markdown(
    curves: dict[str, dict[str, Any]],
    figure: str | None,
    problems: tuple[str, ...] | list[str] = (),
) -> str:
    """The arms side by side by step: one table of the RULER mean, one of perplexity per
    length; then the arms left out."""
    lines = ["### Figure 4 — RULER and perplexity over training", ""]
    lines += [f"- {line}" for line in problems] + ([""] if problems else [])
    lines += [
        "Every evaluated checkpoint of each arm (`anchorctx evaluate CONFIG --all-arms` "
        "evaluates them all)."
    ]
    if figure:
        lines += ["", f"![RULER and perplexity over training]({figure})"]
    if not curves:
        return "\n".join(lines)
    arms = list(curves)
    series = {"RULER mean": {arm: c["ruler"] for arm, c in curves.items()}}
    lengths = sorted_keys(n for c in curves.values() for n in c["perplexity"])
    for n in lengths:
        by_arm = {arm: c["perplexity"].get(n, {}) for arm, c in curves.items()}
        series[f"perplexity at {length_label(n)}"] = by_arm
    for title, by_arm in series.items():
        steps = sorted({s for points in by_arm.values() for s in points}, key=int)
        rows = [[s] + [_num(by_arm[arm].get(s)) for arm in arms] for s in steps]
        lines += ["", f"**{title}** by step", "", markdown_table(["step", *arms], rows)]
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"
