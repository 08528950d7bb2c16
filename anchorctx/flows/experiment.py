"""The Prefect flows: full-experiment and its stages, each a flow of its own.

``full-experiment`` calls the stage flows as subflows, so every stage is its own run in the UI
(with its own logs, artifacts and provenance summary) and can be re-run alone:

    full-experiment
      ├─ pretrain            only with a ``pretrain`` section: the arms' base model, trained
      │                      from scratch by the same train flow (cached like any run)
      ├─ prepare-data        once per distinct data config + tokenizer (tagged arms get their own)
      ├─ compile-ahead       on GPUs: the first arm's decode steps compiled while the arms'
      │                      data is packed, or with overlap on the evaluation GPUs while it
      │                      trains (a task, not a flow)
      ├─ train               per arm: a child process group (torchrun for several GPUs)
      ├─ evaluate            per arm: every checkpoint × suite as mapped, content-cached tasks
      └─ report              variants side by side; tables, plot and summary as artifacts

What runs where and when (RULER sample prefetch, the base model's evaluation beside data
packing, overlap of evaluation with training, compile-ahead) is decided once, before anything
runs, by :func:`anchorctx.evaluation.schedule.decide_schedule`; this module only carries it out.

Every flow takes the validated :class:`~anchorctx.config.ExperimentConfig` as its ``cfg``
parameter (the UI renders it as a form) and a ``force`` flag that recomputes instead of
reusing cached results. A cache record only proves that a result *was* computed: it is reused
only while its files are intact, else the task recomputes (:func:`anchorctx.tasks.reuse.submission`,
the one place where Prefect's cache and the library's own reuse meet).

Every flow body is wrapped in :func:`anchorctx.tasks.api.api_errors`: a lost Prefect server is
one line naming it and how to resume, and a cancel still stops the run (and kills its training
process group) after the server restarted (:class:`anchorctx.tasks.api.CancelWatch`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger
from prefect import task as prefect_task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture, as_completed
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from anchorctx.evaluation.records import Report
from anchorctx.evaluation.schedule import (
    CompileAhead,
    Machine,
    Overlap,
    Prefetch,
    Schedule,
    decide_schedule,
    evaluated_suites,
)
from anchorctx.evaluation.settings import suite_name
from anchorctx.evaluation.tracking import log_evaluation, log_report
from anchorctx.experiment import ExperimentConfig
from anchorctx.flows.sharded import compile_sharded, evaluate_sharded, wait_all
from anchorctx.tasks.api import api_errors
from anchorctx.tasks.artifacts import (
    Progress,
    artifact_key,
    png_data_uri,
    publish_plot,
    publish_summary,
    publish_table,
    run_summary_markdown,
)
from anchorctx.tasks.caching import code_version, data_key
from anchorctx.tasks.data import (
    dataset_exists,
    ensure_demo_corpus_task,
    ensure_eval_fixtures_task,
    ensure_heldout_eval_task,
    ensure_pretrain_corpus_task,
    prepare_data_task,
)
from anchorctx.tasks.evaluation import (
    arm_comparison_task,
    evaluate_task,
    prefetch_ruler_task,
    report_task,
    result_exists,
    summarize_task,
)
from anchorctx.tasks.reporting import report_tables, summary_tables
from anchorctx.tasks.reuse import submission, tag_flow_run_cached, was_cached
from anchorctx.tasks.sharding import (
    TrainingGpus,
    evaluation_workers,
    hold_training_gpus,
    release_workers,
    visible_gpus,
)
from anchorctx.tasks.training import checkpoints_exist, list_checkpoint_paths, train_task

# Evaluation tasks running at once in one flow run, for evaluation on CPU (on GPUs the shards run
# in the GPUs' workers, as many at once as GPUs). One by default: on two CPU cores parallel
# evaluations only compete for them.
EVAL_WORKERS = int(os.environ.get("ANCHORCTX_EVAL_WORKERS", "1"))

# Tracker runs (W&B, MLflow) are process-global state: opened from one thread at a time.
_TRACKING_LOCK = threading.Lock()

# Image artifacts of the experiment report, by report path key: (artifact key suffix, title).
REPORT_PLOTS = {
    "ruler_plot": ("ruler-by-length-plot", "RULER score by context length"),
    "loss_plot": ("training-loss-plot", "Training loss by arm"),
    "rope_plot": ("rope-precision-plot", "RoPE BF16 vs FP32 discrepancy on the experiment's model"),
    "rope_weights_plot": (
        "rope-precision-weights-plot",
        "RoPE BF16 vs FP32 discrepancy on the base model and every arm's final checkpoint",
    ),
}


def _run_name(stage: str, per_arm: bool = True) -> str:
    cfg = flow_run.parameters.get("cfg")
    if isinstance(cfg, ExperimentConfig):
        # evaluate's ``variant`` parameter picks the arm; the name must say which one
        arm = flow_run.parameters.get("variant") or cfg.variant_name
        return f"{stage}-{cfg.name}-{arm}" if per_arm else f"{stage}-{cfg.name}"
    if isinstance(cfg, dict):  # parameters before validation
        return f"{stage}-{cfg.get('name', 'experiment')}"
    return stage


Stage = Literal["pretrain", "data", "train", "evaluate", "report"]
STAGES: tuple[str, ...] = ("pretrain", "data", "train", "evaluate", "report")


# --------------------------------------------------------------------------- prepare-data
@flow(name="prepare-data", flow_run_name=lambda: _run_name("prepare-data", per_arm=False))
@api_errors
def prepare_data_flow(cfg: ExperimentConfig, force: bool = False) -> str:
    """Pack the training data of ``cfg`` (cached by inputs, data config and tokenizer)."""
    ensure_demo_corpus_task(cfg)
    task = submission(prepare_data_task, {"cfg": cfg}, force=force, intact=dataset_exists).task
    state = task(cfg, force=force, return_state=True)
    dataset = state.result()
    if was_cached(state):
        tag_flow_run_cached()
    publish_summary(
        f"{cfg.name}-data-{Path(dataset).name}",
        run_summary_markdown(
            "prepare-data",
            cfg,
            dataset=dataset,
            code_version=code_version(),
            outputs={"packed dataset": dataset},
        ),
        "Packed dataset: provenance and resolved config",
    )
    return dataset


# ---------------------------------------------------------------------------------- train
@flow(name="train", flow_run_name=lambda: _run_name("train"))
@api_errors
def train_flow(
    cfg: ExperimentConfig,
    force: bool = False,
    resume: bool = True,
    timeout_s: float | None = None,
    dataset: str | None = None,
    gpus: list[str] | None = None,
) -> list[str]:
    """Train one arm (``cfg.variant``) and return its checkpoints.

    ``dataset``: an already packed dataset (full-experiment passes it); by default the data is
    prepared first (a cache hit when it exists). ``timeout_s`` kills the training process group
    after that many seconds. ``resume`` continues an interrupted run (a finished one returns at
    once); ``force`` trains from scratch, keeping the earlier run until the new one finishes
    (a cancelled or failed forced run puts it back). ``gpus``: the device ids training may
    use (default: every visible GPU).
    """
    if dataset is None or not dataset_exists(dataset):
        dataset = prepare_data_flow(cfg, force=force)
    params = {"cfg": cfg, "dataset": dataset}
    task = submission(train_task, params, force=force, intact=checkpoints_exist).task
    state = task(
        cfg, dataset, resume=resume, timeout_s=timeout_s, fresh=force, gpus=gpus, return_state=True
    )
    checkpoints = state.result()
    if was_cached(state):
        tag_flow_run_cached()
    publish_summary(
        f"{cfg.name}-{cfg.variant_name}-train",
        run_summary_markdown(
            f"train {cfg.name}/{cfg.variant_name}",
            cfg,
            dataset=dataset,
            code_version=code_version(),
            outputs={
                "run dir": cfg.run_dir,
                "checkpoints": len(checkpoints),
                "last checkpoint": checkpoints[-1] if checkpoints else None,
            },
        ),
        "Training run: provenance, resolved config, outputs",
    )
    return checkpoints


# ------------------------------------------------------------------------------- pretrain
@flow(name="pretrain", flow_run_name=lambda: _run_name("pretrain", per_arm=False))
@api_errors
def pretrain_flow(
    cfg: ExperimentConfig,
    force: bool = False,
    timeout_s: float | None = None,
    evaluate: bool = False,
) -> str:
    """Pretrain the experiment's base model (its ``pretrain`` section) and return its last
    checkpoint, the arms' ``model.path``: the generated corpus is written, then the
    pretraining config is packed and trained by the prepare-data and train flows (both
    cached, so a second run reuses the model). ``evaluate``: also evaluate the base model on
    the experiment's suites, RULER at the lengths it was pretrained for (the report's base
    row)."""
    pre = cfg.pretraining()
    ensure_pretrain_corpus_task(pre)
    checkpoints = train_flow(pre, force=force, timeout_s=timeout_s)
    base = str(cfg.base_model_path)
    if not checkpoints or checkpoints[-1] != base:
        raise RuntimeError(f"pretraining {pre.run_dir} ended without its last checkpoint {base}")
    if evaluate and pre.evaluation.suites:
        evaluate_flow(pre, force=force)
    return base


def _check_base_model(cfg: ExperimentConfig) -> None:
    """Arms that start from a pretrained model need it on disk."""
    if cfg.pretrain is not None and not (cfg.base_model_path / "config.json").is_file():
        raise FileNotFoundError(
            f"{cfg.name}: no pretrained base model at {cfg.base_model_path}: "
            "run the pretrain stage first"
        )


# ------------------------------------------------------------------------------- evaluate
def _arm(cfg: ExperimentConfig, variant: str | None) -> ExperimentConfig:
    if variant is None:
        return cfg
    arms = {a.variant_name: a for a in cfg.arms()}
    if variant not in arms:
        raise ValueError(f"variant {variant!r} is not an arm of {cfg.name}: {sorted(arms)}")
    return arms[variant]


@flow(
    name="evaluate",
    flow_run_name=lambda: _run_name("evaluate"),
    # Prefect's flow() wants TaskRunner[PrefectFuture], which no runner is (its type parameter
    # is invariant): its own stub, wrong for every runner it ships.
    task_runner=ThreadPoolTaskRunner(max_workers=EVAL_WORKERS),  # type: ignore[arg-type]
)
@api_errors
def evaluate_flow(
    cfg: ExperimentConfig,
    variant: str | None = None,
    run_dir: str | None = None,
    suites: list[str] | None = None,
    force: bool = False,
    gpus: list[str] | None = None,
) -> dict[str, Any]:
    """Evaluate every existing checkpoint of a run on each suite, then average the last k.

    The run is ``run_dir`` if given, else the arm named ``variant``, else ``cfg.run_dir``.
    Unchanged checkpoints with unchanged evaluation settings and code are cache hits.
    ``gpus``: the device ids to shard over (default: every visible GPU).
    """
    cfg = _arm(cfg, variant)
    run = Path(run_dir) if run_dir else cfg.run_dir
    checkpoints = list_checkpoint_paths(run)
    if not checkpoints:
        raise FileNotFoundError(f"no checkpoints under {run / 'checkpoints'}: run `train` first")
    suites = list(check_suites(suites, "suites") or cfg.evaluation.suites)
    ensure_eval_fixtures_task(cfg)
    ensure_heldout_eval_task(cfg)
    results = _evaluate_all(cfg, checkpoints, suites, force, gpus)
    summary = summarize_task(str(run), cfg.evaluation.last_k)
    with _TRACKING_LOCK:  # arms evaluated side by side (overlap) open one tracker run at a time
        log_evaluation(cfg, run)  # every score per checkpoint and the averages, to the trackers
    for name, rows in summary_tables(summary).items():
        publish_table(
            f"{cfg.name}-{run.name}-{name}",
            rows,
            f"{run}: {name}, mean ± std over the last {cfg.evaluation.last_k} checkpoints",
        )
    summary_md = run / "eval" / "summary.md"
    publish_summary(
        f"{cfg.name}-{run.name}-evaluation",
        run_summary_markdown(
            f"evaluate {run}",
            cfg,
            code_version=code_version(),
            outputs={"results": len(results), "summary": summary_md},
        )
        + "\n\n"
        + (summary_md.read_text() if summary_md.is_file() else ""),
        "Evaluation: averaged scores and provenance",
    )
    return {"run_dir": str(run), "results": results, "summary": str(summary_md)}


def _evaluate_all(
    cfg: ExperimentConfig,
    checkpoints: list[str],
    suites: list[str],
    force: bool,
    gpus: list[str] | None = None,
) -> list[str]:
    """One evaluation task per (checkpoint, suite) pair, cached by content: a cache record is
    reused only while its result file is intact (all recomputed with ``force``), for evaluation
    on CPU. On GPUs the pairs are sharded over all of them and run in their evaluation workers
    (flows/sharded.py; one GPU too: its worker keeps what it compiled from arm to arm, through
    training), on a work pool over its workers (flows/pool.py): both reuse results through the
    library alone."""
    if cfg.evaluation.work_pool:  # workers on any number of nodes (flows/pool.py)
        from anchorctx.flows.pool import evaluate_on_pool

        return evaluate_on_pool(cfg, checkpoints, suites, force)
    if cfg.evaluation.device == "cpu":
        gpus = []
    elif gpus is None:
        gpus = visible_gpus()
    if gpus:
        return evaluate_sharded(cfg, checkpoints, suites, force, gpus)
    pairs = [(c, s) for c in checkpoints for s in suites]
    futures = _submit_evaluations(cfg, pairs, force)
    progress = Progress(
        artifact_key("evaluate", cfg.name, cfg.variant_name),
        f"Evaluating {cfg.name}/{cfg.variant_name}: {len(pairs)} checkpoint × suite pairs",
    )
    failed = []
    cached = 0
    for done, future in enumerate(as_completed(futures), start=1):
        progress.update(done / len(futures), force=done == len(futures))
        # wait() keeps the final state the task returned: without it `state` asks the server,
        # which may not have the task run's events yet and then answers Pending (so a cache
        # hit was not marked and a failure could be missed).
        future.wait()
        if future.state.is_failed():
            failed.append(future.state.message or str(future.task_run_id))
        cached += was_cached(future.state)
    if futures and cached == len(futures):
        tag_flow_run_cached()
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(futures)} evaluations failed: {failed[:3]}")
    return [f.result() for f in futures]


def _submit_evaluations(
    cfg: ExperimentConfig, pairs: list[tuple[str, str]], force: bool
) -> list[PrefectFuture]:
    """Submit one evaluation task per pair: the reused ones first (they finish at once), then
    new work, then results computed again."""
    planned = []
    for c, s in pairs:
        params = {"cfg": cfg, "checkpoint": c, "suite": s}
        sub = submission(evaluate_task, params, force=force, intact=_result_intact(cfg, c, s))
        planned.append((0 if sub.reused else 2 if sub.refresh else 1, c, s, sub.task))
    planned.sort(key=lambda p: p[0])
    return [task.submit(cfg=cfg, checkpoint=c, suite=s, force=force) for _, c, s, task in planned]


def _result_intact(cfg: ExperimentConfig, checkpoint: str, suite: str) -> Callable[[Any], bool]:
    """Whether a cached evaluation's result file (the recorded value) is still as written."""
    return lambda _path: result_exists(checkpoint, suite, cfg)


# Never a cache hit of its own: the evaluate flow inside decides what is cached (by content).
@prefect_task(
    name="evaluate-arm",
    task_run_name="evaluate-arm-{cfg.variant_name}",
    cache_policy=NO_CACHE,
    persist_result=False,
)
def evaluate_arm_task(
    cfg: ExperimentConfig, suites: list[str], force: bool, gpus: list[str] | None
) -> dict[str, Any]:
    """The evaluate flow of one arm as a task, so full-experiment can run it beside training
    (it still shows as its own flow run, a child of this task run)."""
    return evaluate_flow(cfg, suites=suites, force=force, gpus=gpus)


# ------------------------------------------------------------------------ full-experiment
@flow(name="full-experiment", flow_run_name=lambda: _run_name("full-experiment", per_arm=False))
@api_errors
def full_experiment(
    cfg: ExperimentConfig,
    force: bool = False,
    train_timeout_s: float | None = None,
    arms: list[str] | None = None,
    stages: list[Stage] | None = None,
    suites: list[str] | None = None,
    force_stages: list[Stage] | None = None,
) -> dict[str, Any]:
    """Prepare data, train every arm, evaluate every checkpoint, compare the variants.

    Scope (everything outside it is left as it is, cached results included):
    ``arms`` runs only these arms (default: all; the report still compares every arm);
    ``stages`` runs only these stages (default: pretrain, which runs only with a ``pretrain``
    section, then data, train, evaluate, report; training still
    resolves its packed dataset, a cache hit when it exists); ``suites`` evaluates only these
    of each arm's ``evaluation.suites`` (default: all of them; any suite of the registry,
    ``lm_eval:<task>`` included). ``force`` recomputes instead of
    reusing, within that scope, in ``force_stages`` (default: every stage that runs). A forced
    run that is cancelled or fails leaves the previous results in place.
    """
    scope = Scope.of(cfg, arms, stages, suites, force, force_stages, train_timeout_s)
    ensure_demo_corpus_task(cfg)  # before data keys: they fingerprint the corpus files
    ensure_pretrain_corpus_task(cfg)  # the arms' sources may list it too
    # Decided once the demo inputs exist (prefetch needs the tokenizer); the rest only runs it.
    schedule = decide_schedule(cfg, scope.arms, scope.stages, scope.suites, Machine(visible_gpus))
    stop_prefetch = threading.Event()
    prefetch = _prefetch_samples(schedule.prefetch, stop_prefetch)
    try:
        with evaluation_workers():  # one per GPU, kept from arm to arm (tasks/sharding.py)
            return _run_experiment(scope, schedule)
    finally:
        stop_prefetch.set()  # a failed or cancelled run does not wait for samples it won't use
        if prefetch is not None:
            prefetch.wait()


@dataclass(frozen=True)
class Scope:
    """What one full-experiment run does: which arms, stages and suites, what it forces."""

    cfg: ExperimentConfig
    all_arms: list[ExperimentConfig]  # every arm: the report compares them all
    arms: list[ExperimentConfig]  # the arms this run trains and evaluates
    stages: frozenset[str]
    forced: frozenset[str]
    suites: list[str] | None  # None: each arm's ``evaluation.suites``
    train_timeout_s: float | None = None

    @classmethod
    def of(
        cls,
        cfg: ExperimentConfig,
        arms: list[str] | None,
        stages: Sequence[str] | None,
        suites: list[str] | None,
        force: bool,
        force_stages: Sequence[str] | None,
        train_timeout_s: float | None,
    ) -> Scope:
        """full-experiment's parameters, checked (an unknown arm or stage is an error)."""
        all_arms = cfg.arms()
        selected = select_arms(all_arms, arms)
        run_stages = frozenset(check_stages(stages, "stages") or STAGES)
        forced = (check_stages(force_stages, "force_stages") or run_stages) if force else ()
        only = check_suites(suites, "suites")
        return cls(cfg, all_arms, selected, run_stages, frozenset(forced), only, train_timeout_s)

    def runs(self, *stages: str) -> bool:
        """Whether any of ``stages`` runs."""
        return not self.stages.isdisjoint(stages)

    def forces(self, stage: str) -> bool:
        return stage in self.forced

    def suites_of(self, arm: ExperimentConfig) -> list[str]:
        """The suites this run evaluates ``arm`` on."""
        return evaluated_suites(arm, self.suites)


def _prefetch_samples(prefetch: Prefetch | None, stop: threading.Event) -> PrefectFuture | None:
    """Start generating the arms' RULER samples in this process while the GPU trains (a
    future), as the schedule says, or None (:class:`anchorctx.evaluation.schedule.Prefetch`)."""
    if prefetch is None:
        return None
    ensure_eval_fixtures_task(prefetch.arm)
    # transformers' lazy module is not thread-safe: two threads resolving it at once fail with
    # "cannot import name 'AutoTokenizer'". Resolve what both import before the second starts.
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    return prefetch_ruler_task.submit(prefetch.arm, prefetch.tokenizer, stop)


def _run_experiment(scope: Scope, schedule: Schedule) -> dict[str, Any]:
    """The stages in order: pretrain, data, train and evaluate per arm, report; run as
    ``schedule`` says (:mod:`anchorctx.evaluation.schedule`)."""
    base_eval = _pretrain(scope, schedule.evaluate_base)
    if scope.runs("data", "train"):
        _check_base_model(scope.cfg)  # the arms' tokenizer and weights are the pretrained model's
    # After the base model's evaluation, which would compete for the GPUs' memory.
    ahead = _compile_ahead(schedule.compile_ahead, beside_training=False, after=base_eval)
    try:
        datasets = _prepare_datasets(scope)
    finally:
        if base_eval is not None:  # before the arms train: they would share the GPU with it
            wait_all([base_eval], "base model evaluations")
        _settle(ahead)  # before the arms train too: its passes hold GPUs and memory
    _train_and_evaluate(scope, schedule, datasets)
    out: dict[str, Any] = {"experiment_dir": str(scope.cfg.experiment_dir)}
    if scope.runs("report"):
        out["report"] = _report(scope, datasets)
    return out


def _pretrain(scope: Scope, evaluate: bool) -> PrefectFuture | None:
    """Pretrain the arms' base model (a ``pretrain`` section only); returns the base model's
    evaluation (with ``evaluate``), running beside the arms' data packing (GPU beside CPU), or
    None."""
    cfg = scope.cfg
    if cfg.pretrain is None or not scope.runs("pretrain"):
        return None
    pretrain_flow(cfg, force=scope.forces("pretrain"), timeout_s=scope.train_timeout_s)
    if not evaluate:
        return None
    pre = cfg.pretraining()
    return evaluate_arm_task.submit(pre, pre.evaluation.suites, scope.forces("pretrain"), None)


def _prepare_datasets(scope: Scope) -> dict[str, str]:
    """The packed dataset of every arm in scope, by data key (arms with equal keys share one);
    empty when neither the data nor the train stage runs."""
    datasets: dict[str, str] = {}
    if not scope.runs("data", "train"):
        return datasets
    for arm in scope.arms:
        key = data_key(arm)
        if key not in datasets:
            datasets[key] = prepare_data_flow(arm, force=scope.forces("data"))
        get_run_logger().info("arm %s: dataset %s", arm.variant_name, datasets[key])
    return datasets


def _train_and_evaluate(scope: Scope, schedule: Schedule, datasets: dict[str, str]) -> None:
    """Train each arm, then evaluate it: in this flow, or, with overlap (:func:`_overlap`), as
    a task beside the next arm's training on the GPUs training does not hold."""
    evaluations: list[PrefectFuture] = []
    with _overlap(schedule.overlap) as split:
        # Submitted once training holds its GPUs: the passes take the evaluation GPUs' slots.
        ahead = _compile_ahead(schedule.compile_ahead, beside_training=True)
        for arm in scope.arms:
            if scope.runs("train"):
                _train_arm(scope, arm, datasets[data_key(arm)], split)
            suites = scope.suites_of(arm)
            if not (scope.runs("evaluate") and suites):
                continue
            force = scope.forces("evaluate")
            if split is not None:
                evaluations.append(evaluate_arm_task.submit(arm, suites, force, split.gpus))
            else:
                evaluate_flow(arm, suites=suites, force=force)
    _settle(ahead)
    wait_all(evaluations, "arm evaluations")


def _compile_ahead(
    ahead: CompileAhead | None, *, beside_training: bool, after: PrefectFuture | None = None
) -> PrefectFuture | None:
    """Submit the schedule's compile-ahead pass if it runs at this point (beside the first
    arm's training or before it), to start once ``after`` is done; else None."""
    if ahead is None or ahead.beside_training != beside_training:
        return None
    waits = [after] if after is not None else None
    arm = ahead.arm
    # Prefect's overloads of submit type wait_for only beside return_state; the method itself
    # takes it alone (its default return_state is False).
    return compile_ahead_task.submit(  # type: ignore[call-overload]
        arm, str(arm.model.path), ahead.suites, ahead.gpus, wait_for=waits
    )


def _settle(ahead: PrefectFuture | None) -> None:
    """Wait for a compile-ahead task; its failure is a warning: it only saves time (the
    evaluations compile whatever it did not)."""
    if ahead is None:
        return
    ahead.wait()
    if not ahead.state.is_completed():
        get_run_logger().warning("compile ahead did not finish: %s", ahead.state.message)


@prefect_task(name="compile-ahead", cache_policy=NO_CACHE, persist_result=False)
def compile_ahead_task(
    cfg: ExperimentConfig, checkpoint: str, suites: list[str], gpus: list[str]
) -> list[str]:
    """:func:`anchorctx.flows.sharded.compile_sharded` as a task beside the first arm's
    training or the arms' data packing."""
    return compile_sharded(cfg, checkpoint, suites, gpus)


def _train_arm(
    scope: Scope, arm: ExperimentConfig, dataset: str, split: TrainingGpus | None
) -> list[str]:
    gpus = split.held if split is not None else None
    if split is None:  # training takes every GPU: the evaluation workers free their memory
        release_workers()
    force = scope.forces("train")
    return train_flow(arm, force=force, timeout_s=scope.train_timeout_s, dataset=dataset, gpus=gpus)


@contextlib.contextmanager
def _overlap(overlap: Overlap | None) -> Iterator[TrainingGpus | None]:
    """Training's share of the GPU slot pool while the arms train (the schedule's overlap), or
    None: each arm is trained, then evaluated. The GPUs go back to the pool on exit."""
    if overlap is None:
        yield None
        return
    with hold_training_gpus(overlap.gpus, len(overlap.train)) as split:
        held = split.held or "none"
        what = "finished arms evaluate on the others meanwhile, then on all of"
        get_run_logger().info("overlap: training on GPU(s) %s; %s %s", held, what, split.gpus)
        yield split


def _report(scope: Scope, datasets: dict[str, str]) -> dict[str, Any]:
    """Compare the arms (all of them, not only those in scope); returns the report's paths."""
    cfg, arms = scope.cfg, scope.all_arms
    # Loss curves, attention work (of the arms whose dataset this run resolved), RoPE study.
    resolved = {a.variant_name: datasets.get(data_key(a)) for a in arms}
    arm_comparison_task(cfg, {name: d for name, d in resolved.items() if d is not None})
    _rope_weights(scope)
    base = cfg.pretraining().variant_name if cfg.pretrain is not None else None
    report = report_task(str(cfg.experiment_dir), [a.variant_name for a in arms], base)
    _publish_report(cfg, arms, report, datasets)
    log_report(cfg, report)
    return report["paths"]


def _rope_weights(scope: Scope) -> None:
    """The RoPE study on learned weights (``analysis.rope_precision``: ``in_report`` and
    ``learned_weights``): random init, the base model and every arm's final checkpoint, each
    with and without the anchor token, one cached task per weights; gathered for the report."""
    cfg = scope.cfg
    spec = cfg.analysis.rope_precision
    if not (spec.in_report and spec.learned_weights):
        return
    # Imported here: the study's tasks import torch and transformers, which the flow module
    # does not need to load (deployments import it to serve).
    from anchorctx.tasks.analysis import (
        rope_inputs_task,
        rope_weights_report_task,
        rope_weights_task,
        weights_keys,
        weights_table,
    )

    force = scope.forces("report")
    inputs = rope_inputs_task(cfg)
    results = []
    for key in weights_keys(cfg):
        params = {"cfg": cfg, "key": key, "inputs": inputs}
        sub = submission(rope_weights_task, params, force=force, intact=_file_intact)
        results.append(sub.task(cfg, key, inputs, force=force))
    path = rope_weights_report_task(cfg, results)
    publish_table(
        f"{cfg.name}-rope-precision-weights",
        weights_table(path),
        "BF16 vs FP32 RoPE on learned weights: D and first-token share, with and without anchor",
    )


def _file_intact(path: Any) -> bool:
    return isinstance(path, str) and Path(path).is_file()


def select_arms(
    all_arms: list[ExperimentConfig], names: list[str] | None
) -> list[ExperimentConfig]:
    """The arms named (in the experiment's order); an unknown name is an error listing them."""
    if not names:
        return all_arms
    known = [a.variant_name for a in all_arms]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"arms: {unknown} not in the experiment's arms {known}")
    return [a for a in all_arms if a.variant_name in names]


def check_stages(stages: Sequence[str] | None, key: str) -> list[str]:
    unknown = [s for s in stages or [] if s not in STAGES]
    if unknown:
        raise ValueError(f"{key}: unknown stage(s) {unknown}; stages are {list(STAGES)}")
    return list(stages or [])


def check_suites(suites: list[str] | None, key: str) -> list[str] | None:
    """``suites`` if each is a registered suite (``lm_eval:<task>`` included), else a one-line
    error naming the valid ones."""
    for name in suites or []:
        try:
            suite_name(name)
        except ValueError as err:
            raise ValueError(f"{key}: {err}") from None
    return None if suites is None else list(suites)


def _publish_report(
    cfg: ExperimentConfig,
    arms: list[ExperimentConfig],
    report: Report,
    datasets: dict[str, str],
) -> None:
    for name, (rows, what) in report_tables(report).items():
        publish_table(f"{cfg.name}-{name}", rows, what)
    markdown = report["markdown"]
    for name, (key, title) in REPORT_PLOTS.items():
        plot = report["paths"].get(name)
        if not plot:
            continue
        publish_plot(f"{cfg.name}-{key}", plot, title)
        # report.md links its PNGs relative to itself; the UI cannot fetch local files, so
        # inline them.
        if uri := png_data_uri(plot):
            link = Path(os.path.relpath(plot, cfg.experiment_dir)).as_posix()
            markdown = markdown.replace(f"]({link})", f"]({uri})")
    runs: dict[str, Path | str | None] = {f"run dir ({a.variant_name})": a.run_dir for a in arms}
    runs.update({f"dataset {i}": d for i, d in enumerate(datasets.values())})
    runs["report"] = report["paths"].get("markdown")
    publish_summary(
        f"{cfg.name}-report",
        markdown
        + "\n\n---\n\n"
        + run_summary_markdown(
            f"full-experiment {cfg.name}",
            cfg,
            dataset=next(iter(datasets.values()), None),
            code_version=code_version(),
            outputs=runs,
            arms=arms,
        ),
        "Experiment report (paper table shapes) with provenance",
    )


# --------------------------------------------------------------------------- rope-precision
@flow(name="rope-precision", flow_run_name=lambda: _run_name("rope-precision"))
@api_errors
def rope_precision_flow(cfg: ExperimentConfig, out_dir: str | None = None) -> str:
    """The paper's Section 2 study: BF16 vs FP32 attention-score discrepancy under RoPE."""
    from anchorctx.tasks.analysis import rope_precision_task

    path = rope_precision_task(cfg, out_dir)
    png, table = Path(path).with_suffix(".png"), Path(path).with_suffix(".md")
    if png.is_file():
        publish_plot(f"{cfg.name}-rope-precision", png, "RoPE BF16 vs FP32 discrepancy by shift")
    publish_summary(
        f"{cfg.name}-rope-precision-summary",
        (table.read_text() + "\n\n---\n\n" if table.is_file() else "")
        + run_summary_markdown(
            "rope-precision",
            cfg,
            code_version=code_version(),
            outputs={"results": path, "plot": png},
        ),
        "RoPE precision study: results table and provenance",
    )
    return path
