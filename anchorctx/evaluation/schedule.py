"""full-experiment's schedule: what runs where and when, decided once, before anything runs.

The flow (``anchorctx/flows/experiment.py``) only carries it out. Four decisions, all from the
config, the run's scope (arms, stages, suites) and what the machine has:

- **prefetch**: generate the arms' RULER samples in the flow process while the GPU trains, into
  the experiment's sample store, which the GPUs' evaluation workers read;
- **base evaluation**: evaluate the pretrained base model beside the arms' data packing (GPU
  beside CPU), done before the arms train;
- **overlap** (``evaluation.overlap``): training holds some GPUs out of the flow's GPU slot pool
  while the arms train, and each finished arm evaluates on the others beside the next arm's
  training; without it each arm is trained on every GPU, then evaluated;
- **compile-ahead**: the first arm's decode steps compiled on GPUs idle anyway, with the arms'
  base model: beside the first arm's training on the evaluation GPUs (with overlap), else on
  every GPU while the arms' data is packed (after the base model's evaluation).

Library code: no Prefect; what it reads of the machine comes through :class:`Machine`, whose
probes it calls only when a decision needs them (listing GPUs may import torch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from anchorctx.evaluation.results import get_suite
from anchorctx.experiment import ExperimentConfig
from anchorctx.models.checkpoints import list_checkpoints


def _has_checkpoints(arm: ExperimentConfig) -> bool:
    return bool(list_checkpoints(arm.run_dir))


def _has_tokenizer(cfg: ExperimentConfig) -> bool:
    return Path(cfg.model.tokenizer_path).is_dir()


@dataclass(frozen=True)
class Machine:
    """What the schedule reads of the machine and the disk (tests give their own)."""

    gpus: Callable[[], Sequence[str]]  # the device ids the flow may use
    trained: Callable[[ExperimentConfig], bool] = _has_checkpoints  # an arm has checkpoints
    has_tokenizer: Callable[[ExperimentConfig], bool] = _has_tokenizer


@dataclass(frozen=True)
class Prefetch:
    """RULER samples generated in the flow process into the sample store while training runs:
    ``arm``'s (every arm answers the same samples) with ``tokenizer``'s tokenizer (before
    pretraining the arms' base model does not exist yet: the pretraining config's, the same
    tokenizer)."""

    arm: ExperimentConfig
    tokenizer: ExperimentConfig


@dataclass(frozen=True)
class CompileAhead:
    """The compile-only pass of ``arm``'s evaluation on ``suites`` (those that decode), run in
    the evaluation workers of ``gpus`` with the arm's base model (``arm.model.path``).
    ``beside_training``: on the evaluation GPUs while ``arm`` trains (overlap); else on every
    GPU while the arms' data is packed, after the base model's evaluation."""

    arm: ExperimentConfig
    suites: list[str]
    gpus: list[str]
    beside_training: bool


@dataclass(frozen=True)
class Overlap:
    """Training holds ``len(train)`` GPUs out of the slot pool of ``gpus`` (every GPU) while the
    arms train; finished arms evaluate on the rest meanwhile, then on all of them."""

    gpus: list[str]
    train: list[str]


@dataclass(frozen=True)
class Schedule:
    """full-experiment's decisions (:func:`decide_schedule`); None or False: not done."""

    prefetch: Prefetch | None = None
    evaluate_base: bool = False
    compile_ahead: CompileAhead | None = None
    overlap: Overlap | None = None

    @property
    def evaluate_beside_training(self) -> bool:
        """Each arm evaluates as a task beside the next arm's training (on ``overlap.gpus``);
        else the flow trains it on every GPU, then evaluates it."""
        return self.overlap is not None


def evaluated_suites(arm: ExperimentConfig, only: Sequence[str] | None) -> list[str]:
    """The suites a run evaluates ``arm`` on: its ``evaluation.suites``, those in ``only`` if
    given."""
    return [s for s in arm.evaluation.suites if not only or s in only]


def decide_schedule(
    cfg: ExperimentConfig,
    arms: Sequence[ExperimentConfig],
    stages: Collection[str],
    suites: Sequence[str] | None,
    machine: Machine,
) -> Schedule:
    """The schedule of a full-experiment run of ``arms`` (those in scope, the first one first)
    through ``stages``, evaluating ``suites`` of each arm's (None: all of them)."""
    gpus = functools.cache(lambda: list(machine.gpus()))  # listed once, if at all
    overlap = _overlap(cfg, arms, stages, gpus)
    return Schedule(
        prefetch=_prefetch(cfg, arms, stages, suites, machine),
        evaluate_base=_evaluate_base(cfg, stages),
        compile_ahead=_compile_ahead(arms[0], stages, suites, machine, overlap, gpus),
        overlap=overlap,
    )


def _prefetch(
    cfg: ExperimentConfig,
    arms: Sequence[ExperimentConfig],
    stages: Collection[str],
    suites: Sequence[str] | None,
    machine: Machine,
) -> Prefetch | None:
    """Why not: nothing to gain without training before the evaluation, without RULER, on CPU
    (the thread would only compete with training for the cores) or a work pool's nodes, and
    without the sample store (the evaluations run in the GPUs' worker processes, which get the
    samples through it alone); nor before the tokenizer exists."""
    ev = cfg.evaluation
    if not ({"pretrain", "train"} & set(stages) and "evaluate" in stages):
        return None
    if ev.device == "cpu" or ev.work_pool or "ruler" not in (suites or ev.suites):
        return None
    if not any("ruler" in a.evaluation.suites for a in arms):
        return None
    if not arms[0].evaluation.ruler.sample_store:
        return None
    # The sample cache keys samples by vocabulary: were the pretraining tokenizer to differ,
    # the evaluation would just generate its own.
    tokenizer = cfg.pretraining() if cfg.pretrain is not None else arms[0]
    if not machine.has_tokenizer(tokenizer):
        return None
    return Prefetch(arms[0], tokenizer)


def _evaluate_base(cfg: ExperimentConfig, stages: Collection[str]) -> bool:
    """The pretrained base model is evaluated (the report's base row) when it is pretrained in
    this run, evaluation runs and its config has suites."""
    if cfg.pretrain is None or not {"pretrain", "evaluate"} <= set(stages):
        return False
    return bool(cfg.pretraining().evaluation.suites)


def _overlap(
    cfg: ExperimentConfig,
    arms: Sequence[ExperimentConfig],
    stages: Collection[str],
    gpus: Callable[[], list[str]],
) -> Overlap | None:
    """Overlap needs both training and evaluation in the run and a next arm to train."""
    if not ({"train", "evaluate"} <= set(stages) and len(arms) > 1):
        return None
    train = overlap_training_gpus(cfg, arms, gpus())
    return None if train is None else Overlap(gpus(), train)


def overlap_training_gpus(
    cfg: ExperimentConfig, arms: Sequence[ExperimentConfig], gpus: Sequence[str]
) -> list[str] | None:
    """The GPUs full-experiment trains on while evaluating finished arms on the others, or
    None: no overlap (off, evaluation on CPU or a work pool, fewer than two GPUs, or training
    needs every GPU: ``training.nproc`` unset, multi-node or a hostfile)."""
    ev = cfg.evaluation
    if ev.overlap == "off" or ev.work_pool or ev.device == "cpu" or len(gpus) < 2:
        return None
    need = 0
    for arm in arms:
        t = arm.training
        if t.device == "cpu":  # trains on CPU processes: every GPU evaluates
            continue
        if t.nproc is None or t.nnodes > 1 or t.hostfile is not None:
            return None
        need = max(need, t.nproc)
    return list(gpus[:need]) if need < len(gpus) else None


def _compile_ahead(
    arm: ExperimentConfig,
    stages: Collection[str],
    suites: Sequence[str] | None,
    machine: Machine,
    overlap: Overlap | None,
    gpus: Callable[[], list[str]],
) -> CompileAhead | None:
    """Why: the decode step compiles one graph per batch shape; the first arm's evaluation
    would compile them all (~30 s on gpu-small's 8K evaluation,
    docs/benchmarks/2026-11-27-static-decode-graphs.md), while later arms find them in the workers' memory (kept through training)
    or torch's on-disk caches. So the same evaluation runs first, compile-only, on GPUs idle
    anyway. Only when the arm is about to train (no checkpoint yet: a resumed training may be
    short) from a model on disk, evaluates on GPUs, and evaluates a suite that decodes."""
    if not {"train", "evaluate"} <= set(stages):
        return None
    decoding = [s for s in evaluated_suites(arm, suites) if get_suite(s).decodes]
    if not decoding or arm.model.path is None:
        return None
    if arm.evaluation.device == "cpu" or arm.evaluation.work_pool:
        return None
    if machine.trained(arm):
        return None
    if overlap is not None:
        return CompileAhead(arm, decoding, overlap.gpus, beside_training=True)
    # Without overlap the GPUs are idle while the arms' data is packed.
    return CompileAhead(arm, decoding, gpus(), beside_training=False) if gpus() else None
