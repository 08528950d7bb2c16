"""What differs among the arms of an experiment, measured: the report's comparison section.

On a model too small to read (the CPU demo), every benchmark score sits at chance for every arm,
so the report also shows the quantities that *do* depend on the arm:

- **training loss** of every arm, read from ``<run_dir>/metrics.jsonl`` (one plot);
- **attention work**: the attended query–key pairs of the rows the arm trained on, relative to
  full causal attention on the same rows. The rows are the ones the training loop drew (the
  same :class:`~anchorctx.training.data.BatchPlan` order, seed and global batch), cut to
  ``data.seq_len`` as training cuts them; the pairs are the attention layer's one count
  (:func:`anchorctx.attention.pairs.row_pairs`, in closed form, never T×T);
- **the BF16-vs-FP32 RoPE discrepancy** (paper Section 2, :mod:`anchorctx.analysis.rope_precision`)
  on the experiment's model, run once per experiment and reused while its settings are unchanged;
- **chance levels**: a score is labelled "at chance" when it lies inside the central 95% region
  of Binomial(n, chance) for its n scored samples (:func:`at_chance`);
- **provenance**: the experiment and every arm (attention, overrides, run dir, dataset).

:func:`write_arm_comparison` writes ``<experiment_dir>/arm_comparison.json`` and the plots;
:mod:`anchorctx.evaluation.report` renders them into ``report.md``.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anchorctx.evaluation.averaging import collect_results, result_step
from anchorctx.evaluation.records import (
    ArmComparison,
    ArmProvenance,
    AttentionWork,
    LossSummary,
    Provenance,
    RopeStudy,
)
from anchorctx.io import atomic_write_json, atomic_write_png, read_json, read_jsonl
from anchorctx.packing.pipeline import load_packed
from anchorctx.training.plan import Parallelism

if TYPE_CHECKING:
    from anchorctx.experiment import ExperimentConfig, VariantSpec

COMPARISON_JSON = "arm_comparison.json"
LOSS_PNG = "training_loss.png"
ROPE_DIR = "rope_precision"

# Chance score of a suite's headline metric, in percent, and why. RULER is scored by exact
# string recall of generated needles/answers: a model that cannot read recalls none, so its
# chance level is 0 (a guess over the vocabulary essentially never spells out a 7-digit value).
# MMLU (acc) and HellaSwag (acc_norm) pick one of 4 options by log-likelihood: 1/4. LongBench
# has no single chance level (F1/ROUGE/edit similarity of free text give nonzero scores to
# any output sharing common words), so its scores are never labelled.
CHANCE = {
    "ruler": (0.0, "exact recall of generated values: 0 without reading"),
    "mmlu": (25.0, "4 answer choices"),
    "hellaswag": (25.0, "4 endings"),
}
# Each tail of the chance region holds at most this probability: a two-sided 95% region.
TAIL = 0.025


# ------------------------------------------------------------------------------ chance
def _binomial_pmf(n: int, p: float) -> list[float]:
    """P(X = k) for k = 0..n, X ~ Binomial(n, p), in log space (n may be in the thousands)."""
    if p <= 0.0 or p >= 1.0:
        return [1.0 if k == (0 if p <= 0.0 else n) else 0.0 for k in range(n + 1)]
    lp, lq, lgn = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    return [
        math.exp(lgn - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * lp + (n - k) * lq)
        for k in range(n + 1)
    ]


def chance_interval(chance_pct: float, n: int) -> tuple[float, float]:
    """Central 95% region (percent) of the accuracy of a chance-level guesser on ``n`` samples.

    Exact binomial, equal tails: the lowest count ``lo`` with P(X ≤ lo) > 2.5% and the highest
    ``hi`` with P(X ≥ hi) > 2.5%, X ~ Binomial(n, chance). Exact rather than the normal
    approximation because the demo scores 8–12 questions, where p ± 1.96·sd is far off (it
    would call 0 of 12 below chance although a 1-in-4 guesser gets 0 of 12 3.2% of the time).
    At chance 0 the region is the single point 0.
    """
    if n <= 0:
        raise ValueError(f"chance interval needs a positive sample count, got {n}")
    pmf = _binomial_pmf(n, chance_pct / 100.0)
    below, lo = 0.0, 0
    for k, mass in enumerate(pmf):
        below += mass
        if below > TAIL:
            lo = k
            break
    above, hi = 0.0, n
    for k in range(n, -1, -1):
        above += pmf[k]
        if above > TAIL:
            hi = k
            break
    return 100.0 * lo / n, 100.0 * hi / n


def at_chance(score_pct: float, chance_pct: float, n: int) -> bool:
    """The score is indistinguishable from chance: inside :func:`chance_interval`.

    The score may be a mean over checkpoints (a fractional count); 1e-9 points of tolerance
    absorb the rounding of stored scores (4 decimals) at the region's edges.
    """
    lo, hi = chance_interval(chance_pct, n)
    return lo - 1e-9 <= score_pct <= hi + 1e-9


def suite_sample_counts(run_dir: str | Path) -> dict[str, dict[str, int]]:
    """Scored samples per suite and key (RULER: per length, over tasks) of the newest result.

    Every checkpoint of a run is evaluated on the same samples, so the newest result's counts
    stand for all of them; the mean over k checkpoints is still one sample set's accuracy.
    """
    out: dict[str, dict[str, int]] = {}
    for suite, results in collect_results(run_dir).items():
        if not results:
            continue
        newest = max(results, key=lambda r: (result_step(r) is not None, result_step(r) or 0))
        counts = newest.get("counts") or {}
        if suite == "ruler":
            by_length: dict[str, int] = {}
            for task_counts in counts.values():
                for length, n in (task_counts or {}).items():
                    by_length[str(length)] = by_length.get(str(length), 0) + int(n)
            out[suite] = by_length
        else:
            out[suite] = {k: int(v) for k, v in counts.items() if isinstance(v, int | float)}
    return out


# ------------------------------------------------------------------------- loss curves
def read_loss_curve(run_dir: str | Path) -> list[tuple[int, float]]:
    """(step, loss) of every logged step, ascending; the last row wins for a repeated step."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    by_step = {int(r["step"]): float(r["loss"]) for r in read_jsonl(path) if "loss" in r}
    return sorted(by_step.items())


def plot_loss_curves(curves: dict[str, list[tuple[int, float]]], path: Path) -> Path:
    """Training loss against step, one line per arm; below it, each arm minus the reference arm
    (``full`` when present), where differences too small to see in the top panel show."""
    # Imported here: matplotlib loads only when a figure is drawn.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    drawn = {v: c for v, c in curves.items() if c}
    ref_name = "full" if "full" in drawn else next(iter(drawn), None)
    fig = Figure(figsize=(6.4, 6.0), dpi=120)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    ref = dict(drawn.get(ref_name, [])) if ref_name is not None else {}
    for variant, curve in drawn.items():
        line = top.plot([s for s, _ in curve], [v for _, v in curve], marker=".", label=variant)
        common = [(s, v - ref[s]) for s, v in curve if s in ref]
        if variant != ref_name and common:
            bottom.plot(
                [s for s, _ in common],
                [d for _, d in common],
                marker=".",
                color=line[0].get_color(),
                label=variant,
            )
    top.set_ylabel("training loss (mean per target token)")
    top.set_title("Training loss by arm")
    top.legend()
    bottom.axhline(0.0, color="grey", lw=1)
    bottom.set_ylabel(f"loss − {ref_name} loss")
    bottom.set_xlabel("training step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    return atomic_write_png(path, fig)


# ---------------------------------------------------------------------- attention work
def trained_row_indices(dataset: Any, *, seed: int, global_batch: int, steps: int) -> list[int]:
    """Dataset rows the training loop draws over ``steps`` steps (with repeats across epochs).

    Uses the loop's own :class:`BatchPlan` order: it depends on the seed and the global batch
    only, not on how the batch is split over ranks, micro-batches or sequence parallelism.
    """
    # Imported here: the training data module imports torch, which the report path otherwise skips.
    from anchorctx.training.data import BatchPlan

    par = Parallelism(
        world=1, sp=1, dp=1, micro=global_batch, accum=1, device="cpu", zero_stage=0, engine="sdpa"
    )
    plan = BatchPlan(dataset, seed=seed, par=par, seq_len=1, variant="full", pad_id=0, rank=0)
    return [i for step in range(steps) for i in plan.row_indices(step)]


def attention_work(
    ds: Any, *, variant: str, seed: int, global_batch: int, steps: int, seq_len: int
) -> AttentionWork:
    """Attended query–key pairs of the rows an arm trained on, relative to full attention.

    ``ds``: the packed dataset (a ``datasets.Dataset`` with ``seg_lens`` and ``seg_doc``).
    """
    # Imported here: the training data module imports torch (see trained_row_indices).
    import numpy as np

    from anchorctx.training.data import packed_segments, trained_pairs

    indices = trained_row_indices(ds, seed=seed, global_batch=global_batch, steps=steps)
    rows = np.asarray(indices, dtype=np.int64)
    # sp 1: the useful pairs, without the padding a sequence-parallel run adds.
    per_row = trained_pairs(*packed_segments(ds), seq_len, 1)
    pairs = int(per_row.of(variant)[rows].sum())
    full = int(per_row.of("full")[rows].sum())
    return {
        "variant": variant,
        "rows": len(indices),
        "distinct_rows": len(set(indices)),
        "pairs": pairs,
        "full_pairs": full,
        "fraction": pairs / full if full else float("nan"),
        "mean_documents_per_row": float(per_row.documents[rows].sum()) / max(1, len(indices)),
    }


# ------------------------------------------------------------------------ RoPE study
def _rope_inputs(cfg: ExperimentConfig) -> dict[str, Any]:
    """What the study's result depends on: model, study settings, data and seed."""
    raw = cfg.model_dump(mode="json")
    return {
        "model": raw["model"],
        "analysis": raw["analysis"],
        "data": raw["data"],
        "seed": raw["seed"],
    }


def ensure_rope_study(cfg: ExperimentConfig, out_dir: Path) -> RopeStudy:
    """Run the RoPE precision study into ``out_dir`` unless a result with equal inputs is there."""
    # Imported here: the study imports torch and transformers, needed only when it runs.
    from anchorctx.analysis.rope_precision import JSON_NAME, MD_NAME, PNG_NAME, run_study

    json_path = out_dir / JSON_NAME
    inputs = _rope_inputs(cfg)
    stamp = out_dir / "inputs.json"
    seconds = None
    if not (
        json_path.is_file()
        and (out_dir / PNG_NAME).is_file()
        and stamp.is_file()
        and read_json(stamp) == inputs
    ):
        start = time.perf_counter()
        run_study(cfg, out_dir=out_dir, progress=False)
        seconds = round(time.perf_counter() - start, 1)
        atomic_write_json(stamp, inputs)
    result = read_json(json_path)
    settings = result["settings"]
    last = str(settings["lengths"][-1])
    return {
        "json": str(json_path),
        "png": str(out_dir / PNG_NAME),
        "table": str(out_dir / MD_NAME),
        "seconds": seconds,
        "weights": settings.get("weights"),
        "sequences": settings["num_sequences"],
        "seq_len": settings["seq_len"],
        "compare_shift": settings["compare_shift"],
        "delta2": settings["delta2"],
        "modes": {
            m: {
                "D": result["shift_curve"][m].get(str(settings["compare_shift"])),
                "first_token_share": result["first_token_share"][m],
                f"D_logit_{last}": result["logit_diff_by_length"][m][last],
            }
            for m in settings["modes"]
        },
    }


# --------------------------------------------------------------------------- provenance
def arm_provenance(cfg: ExperimentConfig, datasets: dict[str, str]) -> Provenance:
    """The experiment and every arm: attention, overrides, run dir and packed dataset."""
    arms: list[ArmProvenance] = []
    specs: list[VariantSpec | None] = [*cfg.variants] if cfg.variants else [None]
    for spec, arm in zip(specs, cfg.arms()):
        arms.append(
            {
                "variant": arm.variant_name,
                "attention": arm.training.attention,
                "overrides": dict(spec.overrides) if spec is not None else {},
                "run_dir": str(arm.run_dir),
                "dataset": datasets.get(arm.variant_name),
                "config_fingerprint": arm.fingerprint(),
                "deterministic": trained_deterministic(arm.run_dir),
            }
        )
    return {
        "experiment": cfg.name,
        "experiment_dir": str(cfg.experiment_dir),
        "config_fingerprint": cfg.fingerprint(),
        "seed": cfg.seed,
        "arms": arms,
    }


def trained_deterministic(run_dir: Path) -> bool | None:
    """Whether the run in ``run_dir`` trained under torch's deterministic mode
    (``training.deterministic``, as its manifest recorded it); None: no manifest, or one
    written before the mode was recorded."""
    path = Path(run_dir) / "manifest.json"
    if not path.is_file():
        return None
    entry = read_json(path).get("deterministic")
    return None if entry is None else bool(entry.get("torch_deterministic_algorithms"))


# ------------------------------------------------------------------------------ driver
def write_arm_comparison(
    cfg: ExperimentConfig, datasets: dict[str, str], *, rope_study: bool | None = None
) -> ArmComparison:
    """Measure what differs among the arms of ``cfg``; write ``arm_comparison.json`` + plots.

    ``datasets``: the packed dataset each arm trained on, by variant name. ``rope_study``:
    run the RoPE precision study too (default: ``analysis.rope_precision.in_report``).
    """
    if rope_study is None:
        rope_study = cfg.analysis.rope_precision.in_report
    out_dir = cfg.experiment_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    arms = cfg.arms()
    curves = {a.variant_name: read_loss_curve(a.run_dir) for a in arms}
    paths: dict[str, str] = {}
    loss: dict[str, LossSummary | None] = {
        v: {"steps": len(c), "first": c[0][1], "last": c[-1][1]} if c else None
        for v, c in curves.items()
    }
    if any(curves.values()):
        paths["loss_plot"] = str(plot_loss_curves(curves, out_dir / LOSS_PNG))
    work: dict[str, AttentionWork] = {}
    for a in arms:
        dataset = datasets.get(a.variant_name)
        if dataset is None:
            continue
        t = a.training
        work[a.variant_name] = attention_work(
            load_packed(dataset)[0],
            variant=t.attention,
            seed=a.seed,
            global_batch=t.global_batch_size,
            steps=t.steps,
            seq_len=a.data.seq_len,
        )
    comparison: ArmComparison = {
        "provenance": arm_provenance(cfg, datasets),
        "paths": paths,
        "loss": loss,
        "attention_work": work,
    }
    if rope_study:
        comparison["rope_precision"] = ensure_rope_study(cfg, out_dir / ROPE_DIR)
        comparison["paths"]["rope_plot"] = comparison["rope_precision"]["png"]
    atomic_write_json(out_dir / COMPARISON_JSON, comparison)
    return comparison
