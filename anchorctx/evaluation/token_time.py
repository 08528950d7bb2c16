"""Training time per billion tokens of each arm on each GPU kind (paper Figure 6), from the
step-time plan (:func:`anchorctx.evaluation.cost_plan.plan_experiment`): ``anchorctx plan CONFIG
--gpus 8 --per-billion-tokens DIR``.

For each GPU kind of :data:`anchorctx.training.cost_plan.GPUS` (A100-80G, H100, H200), the plan
chooses the layout and memory options a launch on ``gpus`` × ``nodes`` of that kind would choose
and predicts each arm's step time; a step trains ``training.global_batch_size`` rows of the
plan's row length. Wall-clock hours per 10⁹ tokens are then ``step_s · 10⁹ / tokens_per_step /
3600`` (days: / 24), GPU-hours that times the GPU count. A kind on which the run does not fit
is a row saying why (the plan's one-line error), not a failure of the whole figure. A100-80G
is an estimate (the H200 fit scaled by peak compute, not measured), and the rows say so.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from anchorctx.evaluation.averaging import markdown_table
from anchorctx.io import atomic_write_json, atomic_write_png, atomic_write_text

if TYPE_CHECKING:
    from anchorctx.experiment import ExperimentConfig

# The paper's Figure 6 order: oldest kind first.
GPU_ORDER = ("a100-80g", "h100", "h200")
BILLION = 1e9
STEM = "time_per_1b_tokens"


def token_times(
    cfg: ExperimentConfig,
    *,
    gpus: int,
    nodes: int = 1,
    host_gib: float | None = None,
    shape_name: str | None = None,
) -> list[dict[str, Any]]:
    """One row per (GPU kind, arm): step seconds, tokens per step, hours and days per 10⁹
    tokens on the whole machine, GPU-hours per 10⁹ tokens; or ``problem`` where it does not
    fit."""
    # Imported here: the plan reads the RULER and LongBench tables, which `--help` skips.
    from anchorctx.evaluation.cost_plan import plan_experiment
    from anchorctx.training.cost_plan import DEFAULT_HOST_GIB, GPUS, PlanError

    rows: list[dict[str, Any]] = []
    for gpu in GPU_ORDER:
        kind = GPUS[gpu]
        try:
            plan = plan_experiment(
                cfg, gpu, gpus, nodes, host_gib or DEFAULT_HOST_GIB, shape_name
            ).training
        except PlanError as err:
            rows += [
                {"gpu": kind.name, "arm": arm.variant_name, "problem": str(err)}
                for arm in cfg.arms()
            ]
            continue
        tokens = cfg.training.global_batch_size * plan.seq_len
        for arm in plan.arms:
            hours = arm.step_s * BILLION / tokens / 3600
            rows.append(
                {
                    "gpu": kind.name,
                    "estimate": kind.estimate,
                    "gpus": gpus * nodes,
                    "arm": arm.name,
                    "variant": arm.variant,
                    "step_s": arm.step_s,
                    "tokens_per_step": tokens,
                    "hours_per_billion": hours,
                    "days_per_billion": hours / 24,
                    "gpu_hours_per_billion": hours * gpus * nodes,
                }
            )
    return rows


def token_time_markdown(rows: list[dict[str, Any]]) -> str:
    """The table: GPU kind, arm, step time, tokens per step, hours and days per 10⁹ tokens."""
    header = ["GPUs", "arm", "step s", "tokens/step", "h / 1B tokens", "days / 1B", "GPU-h / 1B"]
    body = []
    for r in rows:
        if "problem" in r:
            body.append([r["gpu"], r["arm"], "—", "—", f"does not fit: {r['problem']}", "—", "—"])
            continue
        kind = f"{r['gpus']} × {r['gpu']}" + (" (estimate)" if r["estimate"] else "")
        body.append(
            [
                kind,
                r["arm"],
                f"{r['step_s']:.2f}",
                f"{r['tokens_per_step']:,}",
                f"{r['hours_per_billion']:.1f}",
                f"{r['days_per_billion']:.2f}",
                f"{r['gpu_hours_per_billion']:,.0f}",
            ]
        )
    title = "### Figure 6 — training time per 1B tokens (anchorctx plan's step-time model)"
    return f"{title}\n\n{markdown_table(header, body)}\n"


def plot_token_time(rows: list[dict[str, Any]], path: Path) -> Path:
    """Grouped bars: days per 10⁹ tokens, one group per arm, one bar per GPU kind."""
    # Imported here: matplotlib loads only when a figure is drawn.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fitted = [r for r in rows if "problem" not in r]
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    kinds = list(dict.fromkeys(r["gpu"] for r in fitted))
    fig = Figure(figsize=(max(6.4, 1.4 * len(arms) + 2), 4.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(kinds))
    for k, kind in enumerate(kinds):
        by_arm = {r["arm"]: r for r in fitted if r["gpu"] == kind}
        xs = [i + (k - (len(kinds) - 1) / 2) * width for i, a in enumerate(arms) if a in by_arm]
        ys = [by_arm[a]["days_per_billion"] for a in arms if a in by_arm]
        gpus = next(iter(by_arm.values()))["gpus"]
        estimate = " (estimate)" if next(iter(by_arm.values()))["estimate"] else ""
        ax.bar(xs, ys, width, label=f"{gpus} × {kind}{estimate}")
    ax.set_xticks(range(len(arms)), arms, rotation=20 if len(arms) > 4 else 0)
    ax.set_ylabel("days per 1B training tokens")
    ax.set_title("Training time per 1B tokens (plan)")
    ax.grid(True, axis="y", alpha=0.3)
    if kinds:
        ax.legend()
    return atomic_write_png(path, fig)


def write_token_time(rows: list[dict[str, Any]], out_dir: Path) -> dict[str, str]:
    """``<out_dir>/time_per_1b_tokens.{json,md,png}``, each written atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return {
        "json": str(atomic_write_json(out_dir / f"{STEM}.json", {"rows": rows})),
        "markdown": str(atomic_write_text(out_dir / f"{STEM}.md", token_time_markdown(rows))),
        "figure": str(plot_token_time(rows, out_dir / f"{STEM}.png")),
    }
