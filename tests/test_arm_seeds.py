"""Arms trained under several training seeds from one base: the config's expansion
(VariantSpec.seeds), the statistics over seeds (evaluation/seed_pairs.py) and the report's
"Arm differences over training seeds"."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_eval_core_results import assert_record_keys

from anchorctx.config import ConfigError
from anchorctx.evaluation.averaging import summarize_run
from anchorctx.evaluation.paired import Z95
from anchorctx.evaluation.records import (
    Interval,
    PairedDifference,
    PairedInterval,
    ReportRecord,
    RulerIntervals,
    SeedCell,
    SeedCost,
    SeedDifference,
    Table,
)
from anchorctx.evaluation.seed_pairs import (
    plan_cost,
    run_seconds,
    seed_differences,
    seed_differences_markdown,
    seed_groups,
    seed_interval,
    seeds_needed,
    t95,
    t_quantile,
)
from anchorctx.experiment import config_from_dict, load_config, seed_run_name, seed_run_of

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "gpu-small.yaml"


# ------------------------------------------------------------------------------ the config
def _raw(variants: list[dict]) -> dict:
    return {"name": "exp", "model": {"path": "m"}, "variants": variants}


def test_seeds_expand_into_one_run_per_seed():
    cfg = config_from_dict(
        _raw(
            [
                {"name": "intra_doc", "attention": "intra_doc", "seeds": [1, 2]},
                {
                    "name": "anchor",
                    "attention": "anchor",
                    "seeds": [1, 2],
                    "overrides": {"training.lr": 1e-5},
                },
                {"name": "full", "attention": "full"},
            ]
        )
    )
    arms = cfg.arms()
    assert [a.variant_name for a in arms] == [
        "intra_doc-s1",
        "intra_doc-s2",
        "anchor-s1",
        "anchor-s2",
        "full",
    ]
    assert [a.seed for a in arms] == [1, 2, 1, 2, 0]
    assert [a.training.attention for a in arms] == ["intra_doc"] * 2 + ["anchor"] * 2 + ["full"]
    assert arms[2].training.lr == 1e-5 and arms[2].run_dir.name == "anchor-s1"
    assert cfg.variants[2].overrides == {"training.lr": 1e-5, "seed": 1}
    # A dumped config loads again as the same runs (the expansion happens once).
    again = config_from_dict(cfg.model_dump(mode="json"))
    assert [a.variant_name for a in again.arms()] == [a.variant_name for a in arms]


def test_seed_arms_read_the_experiments_evaluation_data(tmp_path):
    """A training seed changes training only: every arm's generated evaluation data (demo
    fixtures, held-out sets) is the experiment's. Run 13
    (docs/runs/2026-11-27-run-13-seeds-4x-samples.md) wrote them with each arm's seed into the
    shared directories, so arms of different seeds answered different RULER samples under the same
    keys."""
    from anchorctx.demo.fixtures import data_seed, ensure_eval_fixtures
    from anchorctx.demo.heldout_eval import ensure_heldout_eval

    raw = _raw(
        [
            {"name": "intra_doc", "attention": "intra_doc", "seeds": [1, 2]},
            {"name": "full", "attention": "full"},
        ]
    )
    raw |= {"seed": 7, "evaluation": {"demo_fixtures": str(tmp_path / "fx")}}
    arms = config_from_dict(raw).arms()
    assert [a.seed for a in arms] == [1, 2, 7]
    assert [a.evaluation.data_seed for a in arms] == [7, 7, None]
    assert {data_seed(a) for a in arms} == {7}
    manifest = tmp_path / "fx" / "manifest.json"
    ensure_eval_fixtures(arms[0])
    written = manifest.stat().st_mtime_ns
    for arm in arms[1:]:  # current for every arm: nothing is written again
        ensure_eval_fixtures(arm)
    assert manifest.stat().st_mtime_ns == written
    assert json.loads(manifest.read_text())["seed"] == 7
    # A seed the config names is kept; so is the held-out data's.
    raw["evaluation"] |= {"data_seed": 5, "heldout_data": str(tmp_path / "heldout")}
    arms = config_from_dict(raw).arms()
    assert [a.evaluation.data_seed for a in arms] == [5, 5, 5]
    ensure_heldout_eval(arms[0])
    heldout = tmp_path / "heldout" / "manifest.json"
    written = heldout.stat().st_mtime_ns
    ensure_heldout_eval(arms[1])
    assert heldout.stat().st_mtime_ns == written
    assert json.loads(heldout.read_text())["params"]["seed"] == 5


def test_seed_run_names_round_trip():
    assert seed_run_name("anchor", 3) == "anchor-s3"
    assert seed_run_of("anchor-s3") == ("anchor", 3)
    assert seed_run_of("intra_doc_reset-s0") == ("intra_doc_reset", 0)
    assert seed_run_of("anchor") is None and seed_run_of("anchor-s") is None
    assert seed_run_of("anchor-s01") is None  # not a name seed_run_name writes


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"seeds": []}, "at least one seed"),
        ({"seeds": [1, 1]}, "distinct"),
        ({"seeds": [1], "overrides": {"seed": 2}}, "not both"),
        ({"seeds": [-1]}, "seeds"),
        ({"seedz": [1]}, "seedz"),
    ],
)
def test_bad_seeds_are_errors(spec, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(_raw([{"name": "a", "attention": "anchor", **spec}]))


def test_expanded_names_must_stay_distinct():
    with pytest.raises(ConfigError, match="anchor-s1"):
        config_from_dict(
            _raw(
                [
                    {"name": "anchor", "attention": "anchor", "seeds": [1]},
                    {"name": "anchor-s1", "attention": "anchor"},
                ]
            )
        )


def test_gpu_small_seeds_preset_keeps_gpu_small_base():
    """The preset's arms all start from gpu-small's one pretraining run: its config (and so its
    directory hash) does not change with the seeds, and neither do the arms' other settings."""
    from anchorctx.flows.deployments import GPU_SMALL_SEEDS

    small = load_config(CONFIG)
    seeds = load_config(CONFIG, GPU_SMALL_SEEDS)
    assert seeds.pretraining().run_dir == small.pretraining().run_dir
    assert seeds.pretraining().fingerprint("seed", "model", "data", "training") == (
        small.pretraining().fingerprint("seed", "model", "data", "training")
    )
    arms = seeds.arms()
    assert [a.variant_name for a in arms] == [
        f"{v}-s{s}" for v in ("intra_doc", "anchor") for s in (1, 2, 3)
    ]
    assert {a.model.path for a in arms} == {small.base_model_path}
    assert [a.seed for a in arms] == [1, 2, 3] * 2
    ref = {a.training.attention: a for a in small.arms()}
    for arm in arms:
        same = ref[arm.training.attention]
        assert arm.training == same.training and arm.data == same.data
        assert arm.evaluation.suites == ["ruler"]
        # gpu-small's RULER settings at 8K only, with four times the samples per task.
        assert arm.evaluation.ruler.lengths == [8192]
        assert arm.evaluation.ruler.num_samples == 4 * same.evaluation.ruler.num_samples
        assert (
            arm.evaluation.ruler.model_copy(
                update={"lengths": same.evaluation.ruler.lengths, "num_samples": 56}
            )
            == same.evaluation.ruler
        )
        assert arm.evaluation.data_seed == small.seed  # every arm reads gpu-small's data


# ---------------------------------------------------------------------------- the statistics
def test_t_quantiles_are_scipys():
    # Published two-sided 95% points, and the 80% point at 2 degrees of freedom in closed form:
    # t_p = (2p - 1) sqrt(2 / (4 p (1 - p))) = 0.6 sqrt(3.125); at 1, tan(pi (p - 1/2)).
    assert t95(1) == pytest.approx(12.706204736174694, rel=1e-12)
    assert t95(2) == pytest.approx(4.302652729749462, rel=1e-12)
    assert t95(30) == pytest.approx(2.0422724563012378, rel=1e-12)
    assert t95(60) == pytest.approx(2.000297822014, abs=1e-9)
    assert t_quantile(0.8, 2) == pytest.approx(0.6 * math.sqrt(3.125), rel=1e-12)
    assert t_quantile(0.8, 1) == pytest.approx(math.tan(math.pi * 0.3), rel=1e-12)
    # scipy.stats.t's quantile function, whatever the degrees of freedom; the published
    # t_.975 at 200 is 1.971896.
    from scipy.stats import t

    for df in (*range(1, 40), 100, 200, 201, 5000):
        for p in (0.8, 0.975):
            assert t_quantile(p, df) == t.ppf(p, df), (p, df)
    assert t95(200) == pytest.approx(1.971896, abs=1e-6)
    assert t95(10**6) == pytest.approx(Z95, abs=1e-5)
    for bad in ((0.975, 0), (0.4, 5), (1.0, 5)):
        with pytest.raises(ValueError):
            t_quantile(*bad)


def test_seed_interval_by_hand():
    """d = 1, 2, 6: mean 3, sd^2 = (4 + 1 + 9) / 2 = 7; se^2 = 7/3 + se_samples^2."""
    iv = seed_interval([1.0, 2.0, 6.0], 0.0)
    assert iv["mean"] == 3.0 and iv["sd"] == pytest.approx(math.sqrt(7))
    assert iv["half_width"] == pytest.approx(4.302652729749462 * math.sqrt(7 / 3))
    assert (iv["lo"], iv["hi"]) == pytest.approx((3 - 6.5724, 3 + 6.5724), abs=1e-4)
    assert not iv["excludes_zero"] and iv["seeds"] == 3
    iv = seed_interval([1.0, 2.0, 6.0], 1.0)
    assert iv["se"] == pytest.approx(math.sqrt(10 / 3))
    iv = seed_interval([2.0, 2.0], 0.5)
    assert iv["half_width"] == pytest.approx(12.706204736174694 * 0.5) and not iv["excludes_zero"]
    assert seed_interval([2.0, 2.0], 0.1)["excludes_zero"]  # 2 ± 1.27
    with pytest.raises(ValueError):
        seed_interval([1.0], 0.0)


def test_seeds_needed_by_hand():
    """S seeds and k x the samples are enough when |m| >= (t.975 + t.8)(S - 1) se(S, k),
    se(S, k)^2 = sd^2 / S + se_samples^2 / k; the cheapest by S (1 + k)."""
    a = t95(9) + t_quantile(0.8, 9)  # 3.1456
    b = t95(10) + t_quantile(0.8, 10)  # 3.1072
    # m = 3, sd^2 = 7, se_samples^2 = 0.25: 10 seeds give 3.1456 * sqrt(0.95) = 3.07 > 3, 11
    # give 3.1072 * sqrt(7/11 + 0.25) = 2.92; 10 seeds with 2x samples (30) cost more than 22.
    assert a * math.sqrt(0.95) > 3 > b * math.sqrt(7 / 11 + 0.25)
    assert seeds_needed(3.0, math.sqrt(7), 0.5) == {"seeds": 11, "samples_factor": 1}
    # se_samples^2 = 4: no number of seeds is enough at 1x (3 < (t.975 + t.8)_inf * 2 = 5.6).
    assert seeds_needed(-3.0, math.sqrt(7), 2.0) == {"seeds": 15, "samples_factor": 8}
    assert seeds_needed(3.0, 0.0, 0.0) == {"seeds": 2, "samples_factor": 1}
    assert seeds_needed(0.0, 1.0, 1.0) is None
    # Run 14's anchor − intra_doc at 8K (docs/runs/2026-11-27-run-14-seeds-same-samples.md): three
    # seeds whose interval held
    # 0. The normal formula said 2 seeds; with t, 5 (3 seeds: 5.36 x 0.326 = 1.75 > 1.23).
    assert seeds_needed(1.23, 0.32, 0.27) == {"seeds": 5, "samples_factor": 1}
    assert seeds_needed(0.01, 1.0, 1.0) == {"seeds": None, "samples_factor": None}
    # What a plan adds: the new seeds at k x the samples, the seeds run already evaluated again.
    assert plan_cost(5, 1, 3, 52.0, 112.0) == 2 * 164.0
    assert plan_cost(2, 1, 3) == 0.0  # fewer seeds than run, same samples: nothing to add
    assert plan_cost(2, 3, 3, 10.0, 1.0) == 2 * 2 * 1.0  # two of the run seeds, 3x the samples


def _by_length(per_length: dict[str, list[float]]) -> dict:
    """``{length: {"vt": {sample key: score}}}``: one task, samples keyed by index."""
    return {k: {"vt": {str(i): v for i, v in enumerate(s)}} for k, s in per_length.items()}


# intra_doc scores [0, 100, 0, 100] under every seed at 2K and 0 at 4K; anchor's per-sample
# differences at 2K are [100,0,0,0], [0,0,100,0], [100,0,100,0] (d_s = 25, 25, 50), and 100 on
# every sample at 4K.
INTRA = {"2048": [0.0, 100.0, 0.0, 100.0], "4096": [0.0] * 4}
ANCHOR = {
    1: {"2048": [100.0, 100.0, 0.0, 100.0], "4096": [100.0] * 4},
    2: {"2048": [0.0, 100.0, 100.0, 100.0], "4096": [100.0] * 4},
    3: {"2048": [100.0, 100.0, 100.0, 100.0], "4096": [100.0] * 4},
}
RUNS = [f"intra_doc-s{s}" for s in (1, 2, 3)] + [f"anchor-s{s}" for s in (1, 2, 3)]
# By hand at 2K: mean 100/3; sd^2 = ((25 - 100/3)^2 * 2 + (50 - 100/3)^2) / 2 = 625/3; the
# seed-averaged differences [200/3, 0, 200/3, 0] have variance (4 * (100/3)^2) / 3 = 40000/27,
# so se_samples^2 = 40000/27 / 4 = 10000/27; se^2 = 625/9 + 10000/27 = 11875/27.
MEAN_2K, SD2_2K, SE_SAMPLES2_2K = 100 / 3, 625 / 3, 10000 / 27


def _samples() -> dict:
    out = {f"intra_doc-s{s}": _by_length(INTRA) for s in (1, 2, 3)}
    out |= {f"anchor-s{s}": _by_length(ANCHOR[s]) for s in (1, 2, 3)}
    return out


def test_seed_differences_by_hand():
    assert seed_groups([*RUNS, "full", "x-s1"]) == {
        "intra_doc": {1: "intra_doc-s1", 2: "intra_doc-s2", 3: "intra_doc-s3"},
        "anchor": {1: "anchor-s1", 2: "anchor-s2", 3: "anchor-s3"},
    }  # "x" has one seed: no spread, no pair
    (diff,) = seed_differences(_samples(), RUNS)
    assert (diff["arm"], diff["minus"], diff["seeds"]) == ("anchor", "intra_doc", [1, 2, 3])
    two = diff["lengths"]["2048"]
    assert two["per_seed"] == pytest.approx({"1": 25.0, "2": 25.0, "3": 50.0})
    assert two["mean"] == pytest.approx(MEAN_2K)
    assert two["sd"] ** 2 == pytest.approx(SD2_2K)
    assert two["se_samples"] ** 2 == pytest.approx(SE_SAMPLES2_2K)
    assert two["se"] ** 2 == pytest.approx(11875 / 27)
    assert two["half_width"] == pytest.approx(4.302652729749462 * math.sqrt(11875 / 27))
    assert not two["excludes_zero"]
    # sd^2 = 208.3, se_samples^2 = 370.4: 6 seeds and 7x the samples give (2.5706 + 0.9195) x
    # sqrt(208.3/6 + 370.4/7) = 32.7 <= 33.3 (5 seeds: 36.2); 8 seeds and 5x tie at 48 seed-
    # evaluations, and fewer seeds win the tie.
    assert two["needed"] == {"seeds": 6, "samples_factor": 7}
    four = diff["lengths"]["4096"]
    assert four["mean"] == 100.0 and four["half_width"] == 0.0 and four["excludes_zero"]
    # A seed one arm lacks is left out; one seed left is no pair.
    partial = _samples() | {"anchor-s2": None, "anchor-s3": None}
    assert seed_differences(partial, RUNS) == []


def test_markdown_says_where_the_difference_excludes_zero():
    md = seed_differences_markdown(seed_differences(_samples(), RUNS))
    assert "### Arm differences over training seeds" in md
    assert "#### anchor − intra_doc (3 seeds)" in md
    assert "| seed 3 | +50.0 | +100.0 |" in md
    assert "| mean | +33.3 | +100.0 |" in md
    assert "| 95% interval | [-56.9, +123.6] | **[+100.0, +100.0]** |" in md
    assert "**anchor − intra_doc: the difference excludes 0 at 4K (+100.0).**" in md


def _write_run(
    run_dir: Path,
    per_length: dict[str, list[float]],
    train_s: float,
    eval_s: float,
    fingerprint: str | None = None,
):
    """A run at step 50: its RULER result and samples (task vt), and its measured times."""
    folder = run_dir / "eval" / "step-000050"
    folder.mkdir(parents=True)
    header = {"checkpoint_hash": "x"}
    if fingerprint:
        header["evaluation_fingerprint"] = fingerprint
    lines = [json.dumps({"__header__": header})]
    for length, values in per_length.items():
        lines += [
            json.dumps(
                {
                    "key": f"vt/{length}/{i}",
                    "task": "vt",
                    "length": int(length),
                    "index": i,
                    "prediction": "",
                    "references": [],
                    "score": v,
                }
            )
            for i, v in enumerate(values)
        ]
    (folder / "ruler.samples.jsonl").write_text("\n".join(lines) + "\n")
    scores = {"vt": {k: sum(v) / len(v) for k, v in per_length.items()}}
    counts = {"vt": {k: len(v) for k, v in per_length.items()}}
    result = {
        "suite": "ruler",
        "step": 50,
        "checkpoint_name": "step-000050",
        "scores": scores,
        "counts": counts,
        "duration_s": eval_s,
    }
    (folder / "ruler.json").write_text(json.dumps(result))
    rows = [
        {"step": 49, "loss": 2.0, "elapsed_s": train_s - 2},
        {"step": 50, "loss": 1.9, "elapsed_s": train_s},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summarize_run(run_dir, 1)


def test_report_section_from_result_files(tmp_path):
    """2 arms x 3 seeds on disk, 2K only (the difference holds 0 there): the per-arm sections
    still compare every run, and the new section gives the verdict, the smallest difference that
    could exclude 0 and what the seeds that could detect the observed one would cost."""
    from anchorctx.evaluation.report import write_experiment_report

    exp = tmp_path / "exp"
    for s in (1, 2, 3):
        _write_run(exp / f"intra_doc-s{s}", {"2048": INTRA["2048"]}, 80.0, 100.0)
        _write_run(exp / f"anchor-s{s}", {"2048": ANCHOR[s]["2048"]}, 80.0, 100.0)
    assert run_seconds(exp / "anchor-s1") == {"train_s": 80.0, "eval_s": 100.0}
    # A sharded evaluation's result: its own duration_s is the merge's; process_s, every
    # process's seconds, is what it cost.
    sharded = exp / "anchor-s1" / "eval" / "step-000050" / "ruler.json"
    sharded.write_text(
        json.dumps(json.loads(sharded.read_text()) | {"duration_s": 0.01, "process_s": 140.0})
    )
    assert run_seconds(exp / "anchor-s1") == {"train_s": 80.0, "eval_s": 140.0}
    sharded.write_text(json.dumps(json.loads(sharded.read_text()) | {"process_s": 100.0}))
    assert run_seconds(exp / "nothing") is None
    md = write_experiment_report(exp, RUNS)["markdown"]
    assert "### RULER: 95% intervals and paired differences" in md  # every run an arm there
    assert "| anchor-s3 − intra_doc-s3 | +50.0 [-6.6, +106.6] |" in md
    assert "#### anchor − intra_doc (3 seeds)" in md
    assert "| ± (smallest difference that excludes 0) | 90.2 |" in md
    # Planned at the measured 80 s training and 100 s evaluation, with 3 seeds run: 8 seeds and
    # 5x the samples add 5 * (80 + 5 * 100) + 3 * (5 - 1) * 100 = 4100 s an arm, less than 6
    # and 7x (3 * 780 + 3 * 600 = 4140) or 7 and 6x (4 * 680 + 3 * 500 = 4220), which tie
    # with it at equal times (seed_differences' plan: 6 and 7x, above).
    assert plan_cost(8, 5, 3, 80.0, 100.0) == 4100.0
    assert "| seeds for 80% power | 8, and 5× samples |" in md
    assert "**anchor − intra_doc: the difference does not exclude 0 at any length** over 3 " in md
    assert "smaller than 90.2 points" in md
    # Both arms: 2 * 4100 s = 137 GPU-minutes; one seed of the pair, 2 * 180 s = 6.0.
    assert "2K: 8 seeds and 5× the RULER samples per task (5 more seeds of both arms, 137 " in md
    assert "one seed of the pair cost 6.0 GPU-minutes here, 80 s training and 100 s " in md
    report = json.loads((exp / "report.json").read_text())
    (diff,) = report["ruler_intervals"]["seed_differences"]
    assert diff["lengths"]["2048"]["mean"] == pytest.approx(MEAN_2K)
    assert report["ruler_intervals"]["seed_costs"]["anchor − intra_doc"]["per_seed_s"] == 360.0
    # records.py types what report.json holds.
    intervals = report["ruler_intervals"]
    assert_record_keys(ReportRecord, report)
    assert_record_keys(RulerIntervals, intervals)
    assert_record_keys(SeedDifference, diff)
    assert_record_keys(SeedCell, diff["lengths"]["2048"])
    assert_record_keys(SeedCost, intervals["seed_costs"]["anchor − intra_doc"])
    assert intervals["differences"] and all(intervals["arms"].values())
    for iv in (iv for by_len in intervals["arms"].values() for iv in by_len.values()):
        assert_record_keys(Interval, iv)
    for pair in intervals["differences"]:
        assert_record_keys(PairedDifference, pair)
        for iv in pair["lengths"].values():
            assert_record_keys(PairedInterval, iv)
    for table in report["tables"].values():
        assert_record_keys(Table, table)


def test_report_without_seeds_has_no_section(tmp_path):
    from anchorctx.evaluation.report import write_experiment_report

    exp = tmp_path / "exp"
    _write_run(exp / "intra_doc", {"2048": INTRA["2048"]}, 80.0, 100.0)
    _write_run(exp / "anchor", {"2048": ANCHOR[1]["2048"]}, 80.0, 100.0)
    md = write_experiment_report(exp, ["intra_doc", "anchor"])["markdown"]
    assert "paired differences" in md and "over training seeds" not in md


def test_runs_that_answered_other_samples_are_not_paired(tmp_path):
    """intra_doc-s2 was evaluated on other input files (another evaluation fingerprint): its
    samples reuse the keys of the others' but are not the same prompts. The report says so,
    pairs none of its cells and computes the seed section over seeds 1 and 3."""
    from anchorctx.evaluation.report import write_experiment_report

    exp = tmp_path / "exp"
    for s in (1, 2, 3):
        fp = "other" if s == 2 else "same"
        _write_run(exp / f"intra_doc-s{s}", {"2048": INTRA["2048"]}, 80.0, 100.0, fp)
        _write_run(exp / f"anchor-s{s}", {"2048": ANCHOR[s]["2048"]}, 80.0, 100.0, "same")
    md = write_experiment_report(exp, RUNS)["markdown"]
    assert "**Not every arm answered the same RULER samples**" in md
    assert "`intra_doc-s2` other" in md
    assert "| anchor-s3 − intra_doc-s3 | +50.0 [-6.6, +106.6] |" in md
    assert "− intra_doc-s2 |" not in md and "| intra_doc-s2 − " not in md
    assert "#### anchor − intra_doc (2 seeds)" in md
    report = json.loads((exp / "report.json").read_text())
    (diff,) = report["ruler_intervals"]["seed_differences"]
    assert diff["seeds"] == [1, 3]
