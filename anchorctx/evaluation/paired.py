"""Sampling intervals of the RULER averages and paired differences between arms.

Every arm of an experiment is evaluated on the same RULER samples (one generator seed, one
sample set per task and length), so two arms differ on each sample by ``d = a - b``. The
difference of their Table 5 averages is then estimated from those per-sample differences, which
cancels the variance that the samples' own difficulty puts into each arm's average: what is left
is how differently the two arms answer the same prompts.

Table 5's average at a length is the unweighted mean over tasks of each task's mean score, so the
estimate here is stratified the same way: with ``T`` tasks and ``n_t`` samples in task ``t``,

    mean = (1/T) * sum_t mean_t(x),      se^2 = (1/T^2) * sum_t var_t(x) / n_t

with ``var_t`` the sample variance (ddof=1) of the task's per-sample values ``x`` (one arm's
scores, or two arms' differences). The 95% interval is ``mean ± 1.96 se``: the normal
approximation of a mean of hundreds of bounded per-sample values (scores lie in [0, 100]); with
equal ``n_t`` (the experiment's configs) the mean equals the plain mean over all samples.

Per-sample scores are averaged over the arm's last k evaluated checkpoints first (the same
checkpoints as its summary), so the interval is that of the number Table 5 shows.
"""

from __future__ import annotations

import json
import math
from itertools import combinations
from pathlib import Path

from anchorctx.evaluation.averaging import length_label, markdown_table
from anchorctx.evaluation.records import (
    Interval,
    PairedDifference,
    PairedInterval,
    RulerIntervals,
    SampleScores,
    SuiteSummary,
)
from anchorctx.io import read_jsonl

Z95 = 1.959963984540054  # two-sided 95% quantile of the standard normal


def _eval_keys(ruler_summary: SuiteSummary) -> list[str]:
    """The eval sub-directories of the summary's checkpoints (older summaries: their names)."""
    return list(ruler_summary.get("eval_keys") or ruler_summary.get("checkpoints") or [])


def ruler_sample_scores(run_dir: str | Path, ruler_summary: SuiteSummary) -> SampleScores | None:
    """``{length: {task: {sample key: score}}}`` of the checkpoints ``ruler_summary`` averages,
    each sample's score averaged over them; only the tasks of its Table 5 average.

    None when a checkpoint's samples file is missing (nothing is filled in)."""
    tasks = set(ruler_summary.get("average_tasks") or [])
    keys = _eval_keys(ruler_summary)
    if not keys:
        return None
    sums: dict[tuple[str, str, str], list[float]] = {}
    for key in keys:
        path = Path(run_dir) / "eval" / key / "ruler.samples.jsonl"
        if not path.is_file():
            return None
        for row in read_jsonl(path):
            if "key" not in row or not isinstance(row.get("score"), int | float):
                continue  # the header line
            if tasks and row["task"] not in tasks:
                continue
            sums.setdefault((str(row["length"]), row["task"], row["key"]), []).append(
                float(row["score"])
            )
    out: SampleScores = {}
    for (length, task, key), values in sums.items():
        if len(values) == len(keys):  # a sample every averaged checkpoint scored
            out.setdefault(length, {}).setdefault(task, {})[key] = sum(values) / len(values)
    return out


def ruler_sample_identity(run_dir: str | Path, ruler_summary: SuiteSummary) -> str | None:
    """The evaluation fingerprint under which the averaged checkpoints' RULER samples were
    answered (their samples files' headers; several are ``|``-joined). It covers the settings
    and the input files' content, so two arms with equal identities answered the same samples
    under the same keys. None when a samples file or its header is missing."""
    found = set()
    for key in _eval_keys(ruler_summary):
        path = Path(run_dir) / "eval" / key / "ruler.samples.jsonl"
        try:
            with path.open() as f:  # the header is the first line; the records need no reading
                header = json.loads(f.readline() or "{}").get("__header__")
        except (OSError, ValueError, AttributeError):
            return None
        if not isinstance(header, dict) or not header.get("evaluation_fingerprint"):
            return None
        found.add(str(header["evaluation_fingerprint"]))
    return "|".join(sorted(found)) or None


def same_samples(identity: dict[str, str | None] | None, a: str, b: str) -> bool:
    """Whether runs ``a`` and ``b`` may be paired sample by sample: no identities given, or
    equal ones. Different ones (other input files or settings) reuse keys for other samples."""
    return identity is None or identity.get(a) == identity.get(b)


def stratified_interval(by_task: dict[str, list[float]]) -> Interval | None:
    """Mean over tasks of the task means, its standard error and 95% interval (module doc).

    None when a task has fewer than two values (no variance to estimate)."""
    if not by_task or any(len(v) < 2 for v in by_task.values()):
        return None
    t = len(by_task)
    mean = sum(sum(v) / len(v) for v in by_task.values()) / t
    var = 0.0
    for values in by_task.values():
        m = sum(values) / len(values)
        var += sum((x - m) ** 2 for x in values) / (len(values) - 1) / len(values)
    se = math.sqrt(var) / t
    n = sum(len(v) for v in by_task.values())
    return {"mean": mean, "se": se, "lo": mean - Z95 * se, "hi": mean + Z95 * se, "n": n}


def wilson(p: float, n: int) -> tuple[float, float]:
    """95% Wilson score interval (percent) of a rate ``p`` (0-1) over ``n`` samples: exact
    enough at 0 and 100%, where the normal approximation collapses to a point."""
    if n <= 0:
        return (0.0, 100.0)
    z2 = Z95 * Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return (100 * max(0.0, centre - half), 100 * min(1.0, centre + half))


def unpaired_difference(p1: float, n1: int, p2: float, n2: int) -> tuple[float, float, float]:
    """``p1 - p2`` (percent) of two rates (0-1) over independent samples, with its 95% interval
    by Newcombe's hybrid score method (1998, method 10: each rate's Wilson interval combined).
    For two suites that draw their own samples (nothing to pair); two overlapping intervals can
    still differ significantly, so this, not the overlap, says whether they do."""
    l1, u1 = (x / 100 for x in wilson(p1, n1))
    l2, u2 = (x / 100 for x in wilson(p2, n2))
    d = p1 - p2
    lo = d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2)
    hi = d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)
    return (100 * d, 100 * lo, 100 * hi)


def paired_differences(
    a: dict[str, dict[str, float]], b: dict[str, dict[str, float]]
) -> dict[str, list[float]]:
    """Per task, ``a - b`` on the samples both arms scored."""
    out: dict[str, list[float]] = {}
    for task in sorted(set(a) & set(b)):
        common = sorted(set(a[task]) & set(b[task]))
        out[task] = [a[task][k] - b[task][k] for k in common]
    return out


def ruler_intervals(
    samples: dict[str, SampleScores | None],
    arms: list[str],
    identity: dict[str, str | None] | None = None,
) -> RulerIntervals:
    """Each arm's 95% interval per length, and every pair's paired difference per length.

    ``samples``: :func:`ruler_sample_scores` per arm (None: not available; such an arm is left
    out). Pairs are ``later - earlier`` in ``arms`` order (the experiment's variant order).
    ``identity``: :func:`ruler_sample_identity` per arm; arms whose identities differ are not
    paired, and the result lists them under ``other_samples``."""
    have = {a: found for a in arms if (found := samples.get(a))}
    intervals = {
        arm: {
            length: iv
            for length, by_task in scores.items()
            if (iv := stratified_interval({t: list(s.values()) for t, s in by_task.items()}))
        }
        for arm, scores in have.items()
    }
    differences: list[PairedDifference] = []
    for first, second in combinations(have, 2):
        if not same_samples(identity, first, second):
            continue
        cells: dict[str, PairedInterval] = {}
        for length in sorted(set(have[first]) & set(have[second]), key=float):
            iv = stratified_interval(paired_differences(have[second][length], have[first][length]))
            if iv is not None:
                cells[length] = PairedInterval(**iv, excludes_zero=iv["lo"] > 0 or iv["hi"] < 0)
        if cells:
            differences.append({"arm": second, "minus": first, "lengths": cells})
    out: RulerIntervals = {"confidence": 0.95, "arms": intervals, "differences": differences}
    ids = {a: (identity or {}).get(a) for a in have}
    if len(set(ids.values())) > 1:
        out["other_samples"] = ids  # each arm's identity, when they are not all one
    return out


def intervals_markdown(result: RulerIntervals, arms: list[str]) -> str:
    """The two tables of :func:`ruler_intervals`, with how they were computed."""
    lengths = sorted({k for iv in result["arms"].values() for k in iv}, key=float)
    other = result.get("other_samples") or {}
    same = (
        "Every arm answered the same RULER samples."
        if not other
        else "**Not every arm answered the same RULER samples**: their evaluation fingerprints "
        "(settings and input files) differ ("
        + ", ".join(f"`{arm}` {fp or 'unknown'}" for arm, fp in other.items())
        + "), so only arms with equal fingerprints are paired."
    )
    lines = [
        "### RULER: 95% intervals and paired differences",
        "",
        same + " The first table gives each arm's Table 5 "
        "average with its 95% sampling interval (stratified over tasks, normal approximation); "
        "the second, the difference between two arms on the same samples with its 95% "
        "interval, **bold** where the interval excludes 0. Each interval holds on its own: "
        "among many cells, about one in twenty excludes 0 by chance alone.",
        "",
    ]
    rows = [
        [arm]
        + [
            f"{iv['mean']:.1f} [{iv['lo']:.1f}, {iv['hi']:.1f}]"
            if (iv := result["arms"][arm].get(k))
            else "—"
            for k in lengths
        ]
        for arm in arms
        if arm in result["arms"]
    ]
    ns = sorted({iv["n"] for by_len in result["arms"].values() for iv in by_len.values()})
    lines += [markdown_table(["arm"] + [length_label(k) for k in lengths], rows), ""]
    rows = []
    for diff in result["differences"]:
        row = [f"{diff['arm']} − {diff['minus']}"]
        for k in lengths:
            iv = diff["lengths"].get(k)
            text = f"{iv['mean']:+.1f} [{iv['lo']:+.1f}, {iv['hi']:+.1f}]" if iv else "—"
            row.append(f"**{text}**" if iv and iv["excludes_zero"] else text)
        rows.append(row)
    if rows:
        lines += [markdown_table(["difference"] + [length_label(k) for k in lengths], rows), ""]
    lines.append(f"n per length: {', '.join(str(n) for n in ns)}.")
    return "\n".join(lines)
