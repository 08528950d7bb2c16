"""The Prefect flows: full-experiment and its stages, each a flow of its own.

``full-experiment`` calls the stage flows as subflows, so every stage is its own run in the UI
(with its own logs, artifacts and provenance summary) and can be re-run alone:

    full-experiment
      ├─ prepare-data        once per distinct data config + tokenizer (tagged arms get their own)
      ├─ train               per arm: a child process group (torchrun for several GPUs)
      ├─ evaluate            per arm: every checkpoint × suite as mapped, content-cached tasks
      └─ report              variants side by side; tables, plot and summary as artifacts

Every flow takes the validated :class:`~anchorctx.config.ExperimentConfig` as its ``cfg``
parameter (the UI renders it as a form) and a ``force`` flag that recomputes instead of
reusing cached results. A cache record only proves that a result *was* computed; before reusing
one, the flows check that its files still exist and recompute when they do not.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, unmapped
from prefect.futures import as_completed
from prefect.runtime import flow_run
from prefect.states import State
from prefect.task_runners import ThreadPoolTaskRunner

from anchorctx.config import ExperimentConfig
from anchorctx.flows.sharded import evaluate_sharded
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
    prepare_data_task,
)
from anchorctx.tasks.evaluation import evaluate_task, report_task, result_exists, summarize_task
from anchorctx.tasks.reporting import report_tables, summary_tables
from anchorctx.tasks.sharding import visible_gpus
from anchorctx.tasks.training import list_checkpoint_paths, train_task

# Evaluation tasks running at once in one flow run. One by default: on a single GPU (or two CPU
# cores) parallel evaluations only compete for the device; raise it on multi-GPU hosts.
EVAL_WORKERS = int(os.environ.get("ANCHORCTX_EVAL_WORKERS", "1"))


def _run_name(stage: str, per_arm: bool = True) -> str:
    cfg = flow_run.parameters.get("cfg")
    if isinstance(cfg, ExperimentConfig):
        return f"{stage}-{cfg.name}-{cfg.variant_name}" if per_arm else f"{stage}-{cfg.name}"
    if isinstance(cfg, dict):  # parameters before validation
        return f"{stage}-{cfg.get('name', 'experiment')}"
    return stage


def _was_cached(state: State) -> bool:
    return state.name == "Cached"


# --------------------------------------------------------------------------- prepare-data
@flow(name="prepare-data", flow_run_name=lambda: _run_name("prepare-data", per_arm=False))
def prepare_data_flow(cfg: ExperimentConfig, force: bool = False) -> str:
    """Pack the training data of ``cfg`` (cached by inputs, data config and tokenizer)."""
    ensure_demo_corpus_task(cfg)
    state = prepare_data_task.with_options(refresh_cache=force)(cfg, force=force, return_state=True)
    dataset = state.result()
    if _was_cached(state) and not dataset_exists(dataset):
        get_run_logger().warning("cached dataset %s is gone: packing again", dataset)
        dataset = prepare_data_task.with_options(refresh_cache=True)(cfg, force=True)
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
def train_flow(
    cfg: ExperimentConfig,
    force: bool = False,
    resume: bool = True,
    timeout_s: float | None = None,
    dataset: str | None = None,
) -> list[str]:
    """Train one arm (``cfg.variant``) and return its checkpoints.

    ``dataset``: an already packed dataset (full-experiment passes it); by default the data is
    prepared first (a cache hit when it exists). ``timeout_s`` kills the training process group
    after that many seconds. ``resume`` continues an interrupted run (a finished one returns at
    once); ``force`` moves an earlier run directory aside and trains from scratch.
    """
    if dataset is None or not dataset_exists(dataset):
        dataset = prepare_data_flow(cfg, force=force)
    state = train_task.with_options(refresh_cache=force)(
        cfg, dataset, resume=resume, timeout_s=timeout_s, fresh=force, return_state=True
    )
    checkpoints = state.result()
    if _was_cached(state) and not all(Path(c).is_dir() for c in checkpoints):
        get_run_logger().warning("cached run's checkpoints are gone from %s: training again",
                                 cfg.run_dir)  # fmt: skip
        checkpoints = train_task.with_options(refresh_cache=True)(cfg, dataset, resume, timeout_s)
    publish_summary(
        f"{cfg.name}-{cfg.variant_name}-train",
        run_summary_markdown(
            f"train {cfg.name}/{cfg.variant_name}", cfg, dataset=dataset,
            code_version=code_version(),
            outputs={"run dir": cfg.run_dir, "checkpoints": len(checkpoints),
                     "last checkpoint": checkpoints[-1] if checkpoints else None},
        ),
        "Training run: provenance, resolved config, outputs",
    )  # fmt: skip
    return checkpoints


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
    task_runner=ThreadPoolTaskRunner(max_workers=EVAL_WORKERS),
)
def evaluate_flow(
    cfg: ExperimentConfig,
    variant: str | None = None,
    run_dir: str | None = None,
    suites: list[str] | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Evaluate every existing checkpoint of a run on each suite, then average the last k.

    The run is ``run_dir`` if given, else the arm named ``variant``, else ``cfg.run_dir``.
    Unchanged checkpoints with unchanged evaluation settings and code are cache hits.
    """
    cfg = _arm(cfg, variant)
    run = Path(run_dir) if run_dir else cfg.run_dir
    checkpoints = list_checkpoint_paths(run)
    if not checkpoints:
        raise FileNotFoundError(f"no checkpoints under {run / 'checkpoints'}: run `train` first")
    suites = list(suites or cfg.evaluation.suites)
    ensure_eval_fixtures_task(cfg)
    results = _evaluate_all(cfg, checkpoints, suites, force)
    summary = summarize_task(str(run), cfg.evaluation.last_k)
    for name, rows in summary_tables(summary).items():
        publish_table(f"{cfg.name}-{run.name}-{name}", rows,
                      f"{run}: {name}, mean ± std over the last {cfg.evaluation.last_k} checkpoints")  # fmt: skip
    summary_md = run / "eval" / "summary.md"
    publish_summary(
        f"{cfg.name}-{run.name}-evaluation",
        run_summary_markdown(f"evaluate {run}", cfg, code_version=code_version(),
                             outputs={"results": len(results), "summary": summary_md})
        + "\n\n" + (summary_md.read_text() if summary_md.is_file() else ""),
        "Evaluation: averaged scores and provenance",
    )  # fmt: skip
    return {"run_dir": str(run), "results": results, "summary": str(summary_md)}


def _evaluate_all(
    cfg: ExperimentConfig, checkpoints: list[str], suites: list[str], force: bool
) -> list[str]:
    """Map the (checkpoint, suite) pairs onto evaluation tasks; pairs whose result file is
    missing (or all of them, with ``force``) bypass the cache. On a host with several GPUs
    the pairs are sharded over all of them (flows/sharded.py)."""
    gpus = visible_gpus() if cfg.evaluation.device != "cpu" else []
    if len(gpus) > 1:
        return evaluate_sharded(cfg, checkpoints, suites, force, gpus)
    pairs = [(c, s) for c in checkpoints for s in suites]
    stale = [p for p in pairs if force or not result_exists(*p)]
    fresh = [p for p in pairs if p not in stale]
    futures = []
    for group, task in ((fresh, evaluate_task),
                        (stale, evaluate_task.with_options(refresh_cache=True))):  # fmt: skip
        if group:
            futures += task.map(
                cfg=unmapped(cfg), checkpoint=[c for c, _ in group], suite=[s for _, s in group],
                force=unmapped(force),
            )  # fmt: skip
    progress = Progress(
        artifact_key("evaluate", cfg.name, cfg.variant_name),
        f"Evaluating {cfg.name}/{cfg.variant_name}: {len(pairs)} checkpoint × suite pairs",
    )
    failed = []
    for done, future in enumerate(as_completed(futures), start=1):
        progress.update(done / len(futures), force=done == len(futures))
        if future.state.is_failed():
            failed.append(future.state.message or str(future.task_run_id))
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(futures)} evaluations failed: {failed[:3]}")
    return [f.result() for f in futures]


# ------------------------------------------------------------------------ full-experiment
@flow(name="full-experiment", flow_run_name=lambda: _run_name("full-experiment", per_arm=False))
def full_experiment(
    cfg: ExperimentConfig, force: bool = False, train_timeout_s: float | None = None
) -> dict[str, Any]:
    """Prepare data, train every arm, evaluate every checkpoint, compare the variants."""
    logger = get_run_logger()
    arms = cfg.arms()
    ensure_demo_corpus_task(cfg)  # before data keys: they fingerprint the corpus files
    datasets: dict[str, str] = {}
    for arm in arms:
        key = data_key(arm)
        if key not in datasets:
            datasets[key] = prepare_data_flow(arm, force=force)
        logger.info("arm %s: dataset %s", arm.variant_name, datasets[key])
    for arm in arms:
        train_flow(arm, force=force, timeout_s=train_timeout_s, dataset=datasets[data_key(arm)])
        evaluate_flow(arm, force=force)
    variants = [a.variant_name for a in arms]
    report = report_task(str(cfg.experiment_dir), variants)
    _publish_report(cfg, arms, report, datasets)
    return {"experiment_dir": str(cfg.experiment_dir), "report": report["paths"]}


def _publish_report(
    cfg: ExperimentConfig, arms: list[ExperimentConfig], report: dict[str, Any],
    datasets: dict[str, str],
) -> None:  # fmt: skip
    for name, (rows, what) in report_tables(report).items():
        publish_table(f"{cfg.name}-{name}", rows, what)
    markdown = report["markdown"]
    plot = report["paths"].get("ruler_plot")
    if plot:
        publish_plot(f"{cfg.name}-ruler-by-length-plot", plot, "RULER score by context length")
        # report.md links the PNG beside it; the UI cannot fetch local files, so inline it.
        if uri := png_data_uri(plot):
            markdown = markdown.replace(f"]({Path(plot).name})", f"]({uri})")
    runs = {f"run dir ({a.variant_name})": a.run_dir for a in arms}
    runs.update({f"dataset {i}": d for i, d in enumerate(datasets.values())})
    runs["report"] = report["paths"].get("markdown")
    publish_summary(
        f"{cfg.name}-report",
        markdown + "\n\n---\n\n"
        + run_summary_markdown(f"full-experiment {cfg.name}", cfg,
                               dataset=next(iter(datasets.values()), None),
                               code_version=code_version(), outputs=runs),
        "Experiment report (paper table shapes) with provenance",
    )  # fmt: skip


# --------------------------------------------------------------------------- rope-precision
@flow(name="rope-precision", flow_run_name=lambda: _run_name("rope-precision"))
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
        + run_summary_markdown("rope-precision", cfg, code_version=code_version(),
                               outputs={"results": path, "plot": png}),
        "RoPE precision study: results table and provenance",
    )  # fmt: skip
    return path
