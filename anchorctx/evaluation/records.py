"""The evaluation's result records, typed: what one module writes and another reads.

Each record is JSON written and read as it is (``<suite>.json``, ``eval/summary.json``,
``report.json``), so each is a ``TypedDict``: the type checker knows its keys and their values,
and the file on disk keeps its exact format (a dict, its keys in the order they are written).
A key marked ``NotRequired`` is absent from some files: a suite's own extras, or a file written
before the key was recorded (the readers say which).

Types only: nothing here computes a score or reads a file (``results.SCORE_NEUTRAL_SOURCES``).
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict, TypeGuard

# {task: {length or split or metric: score}}: a suite's scores, RULER's keyed by length.
Scores = dict[str, dict[str, float]]


# ------------------------------------------------------------- <run_dir>/eval/<key>/<suite>.json
class Identity(TypedDict):
    """What a cached result must match to be reused (``results.identity``); also the header
    of its samples file."""

    checkpoint_hash: str
    evaluation_fingerprint: str
    code_version: str
    model_overrides: NotRequired[str]  # only where evaluation changes the model's config (JSON)


class SamplesInfo(TypedDict):
    """The per-sample records a result was computed from."""

    resumed: int
    new: int
    file: str
    sha256: str


class ResultRecord(TypedDict):
    """One checkpoint's result on one suite (the evaluation results contract,
    docs/ARCHITECTURE.md), as ``results.evaluate_checkpoint`` writes it."""

    schema: int
    suite: str
    checkpoint: str
    checkpoint_name: str
    step: int | None
    checkpoint_hash: str
    evaluation_fingerprint: str
    code_version: str
    model_overrides: NotRequired[str]
    evaluation: dict[str, Any]  # results.suite_config: the settings that can change a score
    inputs: dict[str, str]  # data file or directory -> content hash
    scores: Scores
    counts: dict[str, Any]  # task -> samples, or {length or split: samples}
    not_run: dict[str, str]  # task -> why
    versions: dict[str, str | None]
    git: dict[str, Any]
    time: str
    duration_s: float
    process_s: NotRequired[float]  # every process that generated its records; older: absent
    processes: NotRequired[int]
    samples: SamplesInfo
    result_sha256: str
    # A suite's extras: LongBench's category means, the reference a suite follows, whether
    # MMLU found every subject.
    categories: NotRequired[dict[str, float]]
    reference: NotRequired[dict[str, Any]]
    complete: NotRequired[bool]
    # Set by averaging.collect_results when it reads the file, never written: the folder
    # under eval/ that holds it and its samples.
    eval_key: NotRequired[str]


def is_result_record(value: object) -> TypeGuard[ResultRecord]:
    """Whether a JSON value read from ``eval/`` is a result (a dict naming its suite, with
    scores); a foreign file there is not."""
    return isinstance(value, dict) and "suite" in value and "scores" in value


# -------------------------------------------------------------------- <run_dir>/eval/summary.json
class Stat(TypedDict):
    """Mean, population std (ddof=0) and count of values (``averaging.stats``)."""

    mean: float
    std: float
    n: int


class SuiteSummary(TypedDict):
    """One suite averaged over a run's last k checkpoints (``averaging.summarize_results``)."""

    checkpoints: list[str]
    eval_keys: NotRequired[list[str]]  # older summaries: absent (their checkpoint names)
    steps: list[int | None]
    n: int
    scores: dict[str, dict[str, Stat]]
    not_run: dict[str, str]
    settings: NotRequired[dict[str, str]]  # older summaries: absent (averaging.result_settings)
    # RULER only: the per-length mean over tasks, the tasks it is over, those left out.
    average: NotRequired[dict[str, Stat]]
    average_tasks: NotRequired[list[str]]  # older summaries: absent
    excluded: NotRequired[list[str]]
    categories: NotRequired[dict[str, Stat]]  # LongBench's categories


class RunSummary(TypedDict):
    """``eval/summary.json`` of one run (``averaging.summarize_run``)."""

    run_dir: str
    last_k: int
    std: str
    suites: dict[str, SuiteSummary]
    other_checkpoints: dict[str, dict[str, SuiteSummary]]  # checkpoints without a step


# ------------------------------------------------------------- report.json: ruler_intervals
class Interval(TypedDict):
    """A stratified mean with its standard error and 95% interval (``paired.stratified_interval``)."""

    mean: float
    se: float
    lo: float
    hi: float
    n: int


class PairedInterval(Interval):
    """An interval of the difference between two arms on the same samples."""

    excludes_zero: bool


class PairedDifference(TypedDict):
    """``arm - minus`` per length (``paired.ruler_intervals``)."""

    arm: str
    minus: str
    lengths: dict[str, PairedInterval]


# A RULER per-sample score table: {length: {task: {sample key: score}}} (paired.ruler_sample_scores).
SampleScores = dict[str, dict[str, dict[str, float]]]


class Needed(TypedDict):
    """The seeds and the factor on the samples that detect a difference (None: no plan within
    the bounds; ``seed_pairs.seeds_needed``)."""

    seeds: int | None
    samples_factor: int | None


class SeedInterval(TypedDict):
    """The mean of per-seed differences and its 95% interval (``seed_pairs.seed_interval``)."""

    mean: float
    sd: float
    se_samples: float
    se: float
    seeds: int
    half_width: float
    lo: float
    hi: float
    excludes_zero: bool


class SeedCell(SeedInterval):
    """One length of a seed difference: the interval, each seed's difference, the seeds needed."""

    per_seed: dict[str, float]
    needed: Needed | None


class SeedDifference(TypedDict):
    """Two arms' difference over training seeds (``seed_pairs.seed_differences``)."""

    arm: str
    minus: str
    seeds: list[int]
    runs: list[str]
    lengths: dict[str, SeedCell]


class RunSeconds(TypedDict):
    """What a run measured of its own time (``seed_pairs.run_seconds``)."""

    train_s: float
    eval_s: float


class SeedCost(RunSeconds):
    """GPU seconds of one more seed of a pair (``seed_pairs.seed_cost``)."""

    per_seed_s: float


class RulerIntervals(TypedDict):
    """``report.json``'s ``ruler_intervals``: each arm's interval per length, every pair's
    paired difference, and the differences over training seeds."""

    confidence: float
    arms: dict[str, dict[str, Interval]]
    differences: list[PairedDifference]
    other_samples: NotRequired[dict[str, str | None]]  # each arm's identity, when they differ
    # Added by the report (report.write_experiment_report).
    seed_differences: NotRequired[list[SeedDifference]]
    seed_costs: NotRequired[dict[str, SeedCost | None]]


# ------------------------------------------------------------ <experiment_dir>/arm_comparison.json
class ArmProvenance(TypedDict):
    """One arm of the experiment (``arm_comparison.arm_provenance``)."""

    variant: str
    attention: str
    overrides: dict[str, Any]
    run_dir: str
    dataset: str | None
    config_fingerprint: str
    deterministic: bool | None  # None: no manifest, or one that did not record it


class Provenance(TypedDict):
    experiment: str
    experiment_dir: str
    config_fingerprint: str
    seed: int
    arms: list[ArmProvenance]


class LossSummary(TypedDict):
    steps: int
    first: float
    last: float


class AttentionWork(TypedDict):
    """Attended pairs of the rows an arm trained on (``arm_comparison.attention_work``)."""

    variant: str
    rows: int
    distinct_rows: int
    pairs: int
    full_pairs: int
    fraction: float
    mean_documents_per_row: float


class RopeStudy(TypedDict):
    """The RoPE precision study's headline numbers (``arm_comparison.ensure_rope_study``)."""

    json: str
    png: str
    table: str
    seconds: float | None  # None: an earlier result with equal inputs was reused
    weights: Any
    sequences: int
    seq_len: int
    compare_shift: int
    delta2: int
    # mode -> {"D": float or None (no value at the shift), "first_token_share": float,
    # "D_logit_<length>": float}; a key named by a length, so not a TypedDict
    modes: dict[str, dict[str, Any]]


class ArmComparison(TypedDict):
    """``arm_comparison.json`` (``arm_comparison.write_arm_comparison``): what differs among
    the arms besides their scores."""

    provenance: Provenance
    paths: dict[str, str]
    loss: dict[str, LossSummary | None]
    attention_work: dict[str, AttentionWork]
    rope_precision: NotRequired[RopeStudy]
    # Added by the report, not written to arm_comparison.json: the study on learned weights.
    rope_weights: NotRequired[dict[str, Any]]


# ------------------------------------------------------------------------ report.json: tables
class ChanceFlag(TypedDict):
    """A cell's chance level, sample count, 95% interval of a guesser and the verdict."""

    chance: float
    n: int
    interval: list[float]
    at_chance: bool


class Table(TypedDict):
    """A report table: columns, one row of cells per variant, the cells' chance flags."""

    columns: list[str]
    rows: dict[str, dict[str, Stat]]
    chance: NotRequired[dict[str, dict[str, ChanceFlag]]]  # RULER and the general table


# The report's tables by name: ruler, longbench, general (MMLU, HellaSwag), lm_eval.
Tables = dict[str, Table]


class BaseCheck(TypedDict):
    """The base model's retrieval check (``report.base_retrieval_check``)."""

    passed: bool
    bar: float
    scores: dict[str, dict[str, float]]


class SuiteRun(TypedDict):
    n: int
    steps: list[int | None]


class RunInfo(TypedDict):
    """A variant's summary in ``report.json``'s ``runs``."""

    run_dir: str | None
    last_k: int | None
    suites: dict[str, SuiteRun]


class PaperCell(TypedDict):
    """One published number in a report table's cell (``paper_numbers.paper_cells``)."""

    value: float
    table: str  # the paper's table number
    tasks: list[str] | None  # a RULER cell's task set; None: not RULER


class BesidePaper(TypedDict):
    """Ours beside the paper's in one cell (``paper_numbers.beside``): ``ours`` and the rest
    only where the run has the cell; ``why`` where it is not compared, else ``difference``."""

    paper: float
    table: str
    ours: NotRequired[float]
    interval: NotRequired[list[float]]  # our 95% interval, where the run has one
    compared: NotRequired[bool]
    why: NotRequired[str]
    difference: NotRequired[float]


# report.json's ``paper``: {report table: {arm: {column: BesidePaper}}}; {} for no paper preset.
PaperComparison = dict[str, dict[str, dict[str, BesidePaper]]]


class ReportRecord(TypedDict):
    """``report.json`` (``report.write_experiment_report``)."""

    experiment_dir: str
    variants: list[str]
    base: str | None
    base_check: BaseCheck | None
    ruler_intervals: RulerIntervals
    runs: dict[str, RunInfo | None]
    settings_differences: dict[str, str]
    paper: PaperComparison
    tables: Tables
    curves: dict[str, Any]  # Figure 4's points (evaluation/curves.py)
    paths: dict[str, str]
    comparison: ArmComparison | None  # with the RoPE study on learned weights, if measured


class Report(TypedDict):
    """What ``report.write_experiment_report`` returns."""

    markdown: str
    tables: Tables
    paths: dict[str, str]
