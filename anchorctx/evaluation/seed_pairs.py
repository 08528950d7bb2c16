"""Arm differences over training seeds: the paired RULER difference of two arms, each trained
under the same several seeds from the same base (``VariantSpec.seeds``: runs
``<arm>-s<seed>``), with an interval that holds the seed-to-seed noise.

For a pair of arms ``A - B`` and a length, seed ``s`` gives the paired difference ``d_s`` of
their Table 5 averages on the same RULER samples (:mod:`anchorctx.evaluation.paired`,
stratified over tasks). Over ``S`` seeds:

    mean = (1/S) * sum_s d_s,          sd^2 = sum_s (d_s - mean)^2 / (S - 1)
    se^2 = sd^2 / S + se_samples^2,    95% interval: mean ± t_{0.975, S-1} * se

``sd^2 / S`` is the seed-to-seed spread of the difference (it also holds each seed's own
per-sample noise). ``se_samples`` is the stratified standard error of the per-sample
differences averaged over the seeds: every seed answered the *same* samples, so the spread of
the sample set itself is common to all ``d_s`` and invisible in ``sd``; it is added. The two
terms count the per-sample residual (``sigma_e^2 / (S N)``) twice, and the t quantile uses the
seeds' ``S - 1`` degrees of freedom (the fewer of the two sources'), so the interval errs wide:
a difference reported as excluding 0 does so over training seeds and over the samples alike.
A hierarchical bootstrap would estimate the same two sources, but with three seeds it resamples
three values and gives intervals that are too narrow; this closed form is also exact to test.

When the interval holds 0, its half-width is the smallest mean difference these seeds and
samples could have told from 0. The seeds needed to detect the observed mean difference
``|m|`` with 80% power at a two-sided 5% level are judged by the same interval: ``S`` seeds and
``k`` times the samples per task suffice when

    |m| >= (t_{0.975, S-1} + t_{0.8, S-1}) * se(S, k),    se(S, k)^2 = sd^2 / S + se_samples^2 / k

(``se_samples^2`` scales as one over the samples). This is the usual t approximation of a
t-test's power: with the normal quantiles instead, three seeds whose interval held 0 were
reported as "2 seeds are enough" (run 14, docs/runs/2026-11-27-run-14-seeds-same-samples.md).
Of the combinations up to
:data:`MAX_SEEDS` seeds and :data:`MAX_SAMPLES_FACTOR` times the samples, the one with the
lowest added cost is reported, fewer seeds first on a tie (:func:`plan_cost`: the new seeds
trained and evaluated on ``k`` times the samples, the seeds already run evaluated again on the
larger set; each at an arm's measured training and evaluation times, :func:`with_costs`, or
both 1 where no run measured them). ``t`` quantiles are scipy's (:func:`t_quantile`).
"""

from __future__ import annotations

import functools
import math
from itertools import combinations
from pathlib import Path

from anchorctx.evaluation.averaging import length_label, markdown_table
from anchorctx.evaluation.paired import paired_differences, same_samples, stratified_interval
from anchorctx.evaluation.records import (
    Interval,
    Needed,
    RunSeconds,
    SampleScores,
    SeedCell,
    SeedCost,
    SeedDifference,
    SeedInterval,
)
from anchorctx.experiment import seed_run_of
from anchorctx.io import read_json, read_jsonl

POWER = 0.8  # the power the seeds needed are planned for
MAX_SEEDS = 64  # the largest number of seeds a plan may name
MAX_SAMPLES_FACTOR = 16  # ... and the largest factor on the RULER samples per task


@functools.lru_cache(maxsize=1024)
def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (0.5 < p < 1) of Student's t with ``df`` degrees of freedom: scipy's
    ``stdtrit``, the function ``scipy.stats.t.ppf`` evaluates."""
    if df < 1:
        raise ValueError(f"t quantile: degrees of freedom must be at least 1, not {df}")
    if not 0.5 < p < 1:
        raise ValueError(f"t quantile: p must lie in (0.5, 1), not {p}")
    # Imported here: scipy.special takes most of a second to import (scipy.stats several), and
    # only the seed statistics need it, not every import of the report.
    from scipy.special import stdtrit

    return float(stdtrit(df, p))


def t95(df: int) -> float:
    """Two-sided 95% quantile of Student's t (:func:`t_quantile` at 0.975)."""
    return t_quantile(0.975, df)


def seed_groups(runs: list[str]) -> dict[str, dict[int, str]]:
    """``{arm: {seed: run}}`` of the runs named ``<arm>-s<seed>``, arms in order of first
    appearance; only arms with two seeds or more (one seed has no seed-to-seed spread)."""
    groups: dict[str, dict[int, str]] = {}
    for run in runs:
        if (found := seed_run_of(run)) is not None:
            groups.setdefault(found[0], {})[found[1]] = run
    return {arm: by_seed for arm, by_seed in groups.items() if len(by_seed) >= 2}


def seed_interval(per_seed: list[float], se_samples: float) -> SeedInterval:
    """Mean of the per-seed differences and its 95% interval (module doc)."""
    n = len(per_seed)
    if n < 2:
        raise ValueError("seed_interval needs the differences of two seeds or more")
    mean = sum(per_seed) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in per_seed) / (n - 1))
    se = math.sqrt(sd**2 / n + se_samples**2)
    half = t95(n - 1) * se
    return {
        "mean": mean,
        "sd": sd,
        "se_samples": se_samples,
        "se": se,
        "seeds": n,
        "half_width": half,
        "lo": mean - half,
        "hi": mean + half,
        "excludes_zero": mean - half > 0 or mean + half < 0,
    }


def plan_cost(seeds: int, k: int, have: int, train_s: float = 1.0, eval_s: float = 1.0) -> float:
    """Seconds one arm adds for ``seeds`` seeds at ``k`` times the samples when ``have`` seeds
    ran at the current sample size: the new seeds trained and evaluated on the larger set, and
    the seeds already run evaluated again on it (evaluation time taken as linear in samples)."""
    return max(0, seeds - have) * (train_s + k * eval_s) + min(seeds, have) * (k - 1) * eval_s


def seeds_needed(
    mean: float,
    sd: float,
    se_samples: float,
    have: int = 0,
    train_s: float = 1.0,
    eval_s: float = 1.0,
) -> Needed | None:
    """Seeds and a factor on the samples per task that detect ``mean`` with 80% power at a
    two-sided 5% level, the cheapest by :func:`plan_cost` (``have`` seeds run already);
    ``seeds`` None when no combination within :data:`MAX_SEEDS` and :data:`MAX_SAMPLES_FACTOR`
    does. None when the mean is 0 (nothing to detect)."""
    if mean == 0:
        return None
    best: tuple[float, int, int] | None = None  # (cost, seeds, samples factor)
    for k in range(1, MAX_SAMPLES_FACTOR + 1):
        for seeds in range(2, MAX_SEEDS + 1):
            t = t95(seeds - 1) + t_quantile(POWER, seeds - 1)
            if abs(mean) >= t * math.sqrt(sd**2 / seeds + se_samples**2 / k):
                plan = (plan_cost(seeds, k, have, train_s, eval_s), seeds, k)
                best = min(best or plan, plan)
                break  # more seeds at this k only cost more
    if best is None:
        return {"seeds": None, "samples_factor": None}
    return {"seeds": best[1], "samples_factor": best[2]}


def _seed_averaged(per_seed: list[dict[str, list[float]]]) -> dict[str, list[float]] | None:
    """Per task, each sample's difference averaged over the seeds (the same samples each)."""
    tasks = per_seed[0].keys()
    if any(
        d.keys() != tasks or any(len(d[t]) != len(per_seed[0][t]) for t in tasks) for d in per_seed
    ):
        return None  # the seeds scored different samples: no common sample set
    return {t: [sum(vals) / len(vals) for vals in zip(*(d[t] for d in per_seed))] for t in tasks}


def seed_differences(
    samples: dict[str, SampleScores | None],
    runs: list[str],
    identity: dict[str, str | None] | None = None,
) -> list[SeedDifference]:
    """Every pair of arms trained under two seeds or more: per length, each seed's paired
    difference, their mean and the interval of :func:`seed_interval`, and the seeds needed.

    ``samples``: :func:`anchorctx.evaluation.paired.ruler_sample_scores` per run. Pairs are
    ``later - earlier`` in ``runs`` order (the experiment's variant order), over the seeds both
    arms have samples for, answered under the same identity
    (:func:`anchorctx.evaluation.paired.same_samples`)."""
    groups = seed_groups(runs)
    out: list[SeedDifference] = []
    for first, second in combinations(groups, 2):
        # Per seed both arms have samples for, answered under one identity: (second, first).
        pairs = {
            s: (x, y)
            for s in sorted(set(groups[first]) & set(groups[second]))
            if (x := samples.get(groups[second][s]))
            and (y := samples.get(groups[first][s]))
            and same_samples(identity, groups[first][s], groups[second][s])
        }
        if len(pairs) < 2:
            continue
        seeds = list(pairs)
        common = set.intersection(*(set(x) & set(y) for x, y in pairs.values()))
        cells: dict[str, SeedCell] = {}
        for length in sorted(common, key=float):
            diffs = [paired_differences(x[length], y[length]) for x, y in pairs.values()]
            per_seed = [iv for d in diffs if (iv := stratified_interval(d)) is not None]
            averaged = _seed_averaged(diffs)
            pooled = stratified_interval(averaged) if averaged else None
            if pooled is None or len(per_seed) < len(diffs):
                continue
            cells[length] = _seed_cell(seeds, per_seed, pooled)
        if cells:
            out.append(
                {
                    "arm": second,
                    "minus": first,
                    "seeds": seeds,
                    "runs": [groups[arm][s] for arm in (second, first) for s in seeds],
                    "lengths": cells,
                }
            )
    return out


def _seed_cell(seeds: list[int], per_seed: list[Interval], pooled: Interval) -> SeedCell:
    """One length of a seed difference: :func:`seed_interval` over the seeds' paired
    differences (``per_seed``, in ``seeds`` order) with the seed-averaged samples' error."""
    iv = seed_interval([p["mean"] for p in per_seed], pooled["se"])
    return SeedCell(
        **iv,
        per_seed={str(s): p["mean"] for s, p in zip(seeds, per_seed)},
        needed=seeds_needed(iv["mean"], iv["sd"], iv["se_samples"], len(seeds)),
    )


# ------------------------------------------------------------------------------- cost
def run_seconds(run_dir: str | Path) -> RunSeconds | None:
    """What a run measured of its own time: training (``elapsed_s`` of the last row of
    ``metrics.jsonl``: the step loop, without process start and model load) and evaluation
    (every suite result under ``eval/``: the seconds of all the processes that generated its
    records, ``process_s``; a result written before that was recorded gives its own
    ``duration_s``). None when neither is there."""
    run_dir = Path(run_dir)
    train = None
    if (metrics := run_dir / "metrics.jsonl").is_file():
        rows = [r for r in read_jsonl(metrics) if isinstance(r.get("elapsed_s"), int | float)]
        train = float(rows[-1]["elapsed_s"]) if rows else None
    evaluate = 0.0
    found = False
    for path in sorted((run_dir / "eval").glob("*/*.json")):
        try:
            record = read_json(path)
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict):
            continue
        seconds = record.get("process_s", record.get("duration_s"))
        if isinstance(seconds, int | float):
            evaluate += float(seconds)
            found = True
    if train is None and not found:
        return None
    return {"train_s": train or 0.0, "eval_s": evaluate if found else 0.0}


def seed_cost(experiment_dir: str | Path, diff: SeedDifference) -> SeedCost | None:
    """GPU seconds of one more seed of a pair (both arms trained and evaluated), from the mean
    of what the pair's runs measured; None when no run measured its time."""
    times = [t for run in diff["runs"] if (t := run_seconds(Path(experiment_dir) / run))]
    if not times:
        return None
    train = sum(t["train_s"] for t in times) / len(times)
    evaluate = sum(t["eval_s"] for t in times) / len(times)
    return {"train_s": train, "eval_s": evaluate, "per_seed_s": 2 * (train + evaluate)}


def with_costs(diff: SeedDifference, cost: SeedCost | None) -> SeedDifference:
    """``diff`` with each length's seeds needed planned at the training and evaluation times
    its runs measured (:func:`seed_cost`); unchanged without a cost."""
    if not cost:
        return diff
    have = len(diff["seeds"])
    lengths: dict[str, SeedCell] = {
        length: cell
        | {
            "needed": seeds_needed(
                cell["mean"], cell["sd"], cell["se_samples"], have, cost["train_s"], cost["eval_s"]
            )
        }
        for length, cell in diff["lengths"].items()
    }
    return diff | {"lengths": lengths}


# --------------------------------------------------------------------------- markdown
def _needed_text(needed: Needed | None) -> str:
    if needed is None:
        return "—"
    if needed["seeds"] is None:
        return f"more than {MAX_SEEDS}, or {MAX_SAMPLES_FACTOR}× samples"
    if needed["samples_factor"] == 1:
        return f"{needed['seeds']}"
    return f"{needed['seeds']}, and {needed['samples_factor']}× samples"


def seed_differences_markdown(
    diffs: list[SeedDifference], costs: dict[str, SeedCost | None] | None = None
) -> str:
    """The section "Arm differences over training seeds": one table and one verdict per pair.

    ``costs``: :func:`seed_cost` per pair label (``"<arm> − <minus>"``), for what more seeds
    would cost."""
    lines = [
        "### Arm differences over training seeds",
        "",
        "Each arm below was trained under several seeds from the same base model, and every "
        "run answered the same RULER samples. Per length: each seed's paired difference of the "
        "Table 5 averages, their mean, and a 95% interval that holds the seed-to-seed spread "
        "and the sample set's own noise (t over the seeds, S − 1 degrees of freedom; "
        "`anchorctx/evaluation/seed_pairs.py`), **bold** where it excludes 0. "
        '"Seeds for 80% power": how many seeds would detect the observed mean difference '
        "(two-sided 5% level; with “k× samples”, k times the samples per task too).",
        "",
    ]
    for diff in diffs:
        label = f"{diff['arm']} − {diff['minus']}"
        lengths = list(diff["lengths"])
        cells = diff["lengths"]
        rows = [
            [f"seed {s}"] + [f"{cells[k]['per_seed'][str(s)]:+.1f}" for k in lengths]
            for s in diff["seeds"]
        ]
        rows.append(["mean"] + [f"{cells[k]['mean']:+.1f}" for k in lengths])
        interval = []
        for k in lengths:
            text = f"[{cells[k]['lo']:+.1f}, {cells[k]['hi']:+.1f}]"
            interval.append(f"**{text}**" if cells[k]["excludes_zero"] else text)
        rows.append(["95% interval", *interval])
        rows.append(
            ["± (smallest difference that excludes 0)"]
            + [f"{cells[k]['half_width']:.1f}" for k in lengths]
        )
        rows.append(["seeds for 80% power"] + [_needed_text(cells[k]["needed"]) for k in lengths])
        lines += [
            f"#### {label} ({len(diff['seeds'])} seeds)",
            "",
            markdown_table([label] + [length_label(k) for k in lengths], rows),
            "",
        ]
        excluding = [k for k in lengths if cells[k]["excludes_zero"]]
        if excluding:
            where = ", ".join(f"{length_label(k)} ({cells[k]['mean']:+.1f})" for k in excluding)
            lines.append(f"**{label}: the difference excludes 0 at {where}.**")
        else:
            lines.append(
                f"**{label}: the difference does not exclude 0 at any length** over "
                f"{len(diff['seeds'])} seeds. At this scale a mean difference smaller than "
                f"{min(cells[k]['half_width'] for k in lengths):.1f} points cannot be told "
                "from 0 at any length."
            )
            lines += ["", _cost_sentence(label, diff, (costs or {}).get(label))]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _cost_sentence(label: str, diff: SeedDifference, cost: SeedCost | None) -> str:
    """What the cheapest plan that could detect the observed difference would cost."""
    have = len(diff["seeds"])
    cells = [(k, c["needed"]) for k, c in diff["lengths"].items() if c["needed"] is not None]
    if not cells:
        return f"{label}: the mean difference is 0 at every length; there is nothing to detect."
    # (length, seeds, samples factor) of each length with a plan
    options = [
        (k, seeds, factor)
        for k, n in cells
        if (seeds := n["seeds"]) is not None and (factor := n["samples_factor"]) is not None
    ]
    if not options:
        return (
            f"{label}: no plan of up to {MAX_SEEDS} seeds and {MAX_SAMPLES_FACTOR}× the RULER "
            "samples per task detects the observed mean with 80% power at any length."
        )
    times = (cost["train_s"], cost["eval_s"]) if cost else (1.0, 1.0)
    length, seeds, factor = min(options, key=lambda o: (plan_cost(o[1], o[2], have, *times), o[1]))
    more = max(0, seeds - have)
    what = f"{seeds} seeds"
    if factor > 1:
        what += f" and {factor}× the RULER samples per task"
    text = f"{label}: the cheapest plan that detects the observed mean with 80% power is at " + (
        f"{length_label(length)}: {what} ({more} more seeds of both arms"
    )
    if cost is None:
        return text + "; no run measured its time, see `anchorctx plan`)."
    # Both arms: their new seeds, and the seeds run already evaluated again on a larger set.
    seconds = 2 * plan_cost(seeds, factor, have, *times)
    return text + (
        f", {seconds / 60:.0f} GPU-minutes: one seed of the pair cost "
        f"{cost['per_seed_s'] / 60:.1f} GPU-minutes here, {cost['train_s']:.0f} s training "
        f"and {cost['eval_s']:.0f} s evaluation per arm, measured; the base is shared)."
    )
