"""full-experiment's schedule, decided once by ``evaluation.schedule.decide_schedule``: RULER
sample prefetch, the base model's evaluation, overlap of evaluation with training (the GPU slot
split) and compile-ahead, on one GPU, several, none and CPU. No Prefect, no torch, no files:
the machine is a fake (:class:`Machine`), the configs are only validated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from anchorctx.evaluation.schedule import (
    CompileAhead,
    Machine,
    Overlap,
    Prefetch,
    decide_schedule,
    evaluated_suites,
    overlap_training_gpus,
)
from anchorctx.experiment import ExperimentConfig, config_from_dict

ALL = ("pretrain", "data", "train", "evaluate", "report")


def _raw(tmp_path: Path) -> dict[str, Any]:
    """Two arms from a model on disk, each training on one GPU, evaluated on RULER (decodes)
    and MMLU (scores log-likelihoods, nothing to compile)."""
    return {
        "name": "sched",
        "run_root": str(tmp_path / "runs"),
        "model": {"path": str(tmp_path / "base")},
        "training": {"device": "auto", "nproc": 1},
        "evaluation": {"suites": ["ruler", "mmlu"], "device": "auto"},
        "variants": [
            {"name": "full", "attention": "full"},
            {"name": "anchor", "attention": "anchor"},
        ],
    }


def _cfg(tmp_path: Path, **sections: dict[str, Any]) -> ExperimentConfig:
    raw = _raw(tmp_path)
    for key, value in sections.items():
        raw[key] = {**raw[key], **value}
    return config_from_dict(raw)


class FakeMachine:
    """GPUs, trained arms and tokenizers as given; counts how often the GPUs are listed."""

    def __init__(self, gpus=("0", "1", "2"), trained=(), tokenizer=True) -> None:
        self.listed = 0
        self._gpus, self._trained, self._tokenizer = list(gpus), set(trained), tokenizer
        self.tokenizers: list[str] = []

    def gpus(self) -> list[str]:
        self.listed += 1
        return self._gpus

    def machine(self) -> Machine:
        def has_tokenizer(cfg: ExperimentConfig) -> bool:
            self.tokenizers.append(cfg.variant_name)
            return self._tokenizer

        return Machine(self.gpus, lambda arm: arm.variant_name in self._trained, has_tokenizer)


def _decide(cfg, machine=None, stages=ALL, suites=None, arms=None):
    fake = machine or FakeMachine()
    schedule = decide_schedule(cfg, arms or cfg.arms(), stages, suites, fake.machine())
    return schedule, fake


def test_several_gpus_overlap_and_compile_beside_the_first_arms_training(tmp_path):
    cfg = _cfg(tmp_path)
    first = cfg.arms()[0]
    schedule, fake = _decide(cfg)
    # Training holds one GPU (nproc 1) of the three; the arms evaluate on the others meanwhile.
    assert schedule.overlap == Overlap(["0", "1", "2"], ["0"])
    assert schedule.evaluate_beside_training
    # The first arm's decoding suites, compiled on the pool's GPUs while it trains.
    assert schedule.compile_ahead == CompileAhead(
        first, ["ruler"], ["0", "1", "2"], beside_training=True
    )
    assert schedule.prefetch == Prefetch(first, first)
    assert not schedule.evaluate_base  # no pretrain section
    assert fake.listed == 1  # listed once for every decision (it may import torch)


def test_one_gpu_trains_then_evaluates_and_compiles_while_the_data_is_packed(tmp_path):
    cfg = _cfg(tmp_path)
    schedule, _ = _decide(cfg, FakeMachine(gpus=["0"]))
    assert schedule.overlap is None and not schedule.evaluate_beside_training
    assert schedule.compile_ahead == CompileAhead(
        cfg.arms()[0], ["ruler"], ["0"], beside_training=False
    )
    # The GPU's evaluation worker reads the samples from the store: prefetch still pays.
    assert schedule.prefetch is not None


def test_overlap_off_compiles_on_every_gpu_before_training(tmp_path):
    cfg = _cfg(tmp_path, evaluation={"overlap": "off"})
    schedule, _ = _decide(cfg)
    assert schedule.overlap is None
    assert schedule.compile_ahead.gpus == ["0", "1", "2"]
    assert not schedule.compile_ahead.beside_training


@pytest.mark.parametrize(
    ("section", "value"),
    [
        ("training", {"nproc": None}),  # training takes every GPU
        ("training", {"nproc": 3}),  # ... or as many as there are
        ("training", {"nnodes": 2}),
    ],
)
def test_training_on_every_gpu_leaves_none_to_overlap(tmp_path, section, value):
    schedule, _ = _decide(_cfg(tmp_path, **{section: value}))
    assert schedule.overlap is None
    assert schedule.compile_ahead is not None and not schedule.compile_ahead.beside_training


def test_one_arm_never_overlaps(tmp_path):
    cfg = _cfg(tmp_path)
    schedule, _ = _decide(cfg, arms=cfg.arms()[1:])
    assert schedule.overlap is None
    assert schedule.compile_ahead.arm.variant_name == "anchor"  # the first arm in scope
    assert not schedule.compile_ahead.beside_training


def test_arms_training_on_cpu_leave_every_gpu_to_evaluation(tmp_path):
    cfg = _cfg(tmp_path, training={"device": "cpu", "nproc": None})
    schedule, _ = _decide(cfg)
    assert schedule.overlap == Overlap(["0", "1", "2"], [])


def test_cpu_evaluation_prefetches_compiles_and_overlaps_nothing(tmp_path):
    cfg = _cfg(tmp_path, evaluation={"device": "cpu"})
    schedule, _ = _decide(cfg)
    assert (schedule.prefetch, schedule.compile_ahead, schedule.overlap) == (None, None, None)
    # One arm on CPU: no decision needs the GPUs, so they are not listed (no torch import).
    schedule, fake = _decide(cfg, arms=cfg.arms()[:1])
    assert schedule.compile_ahead is None and fake.listed == 0


def test_a_machine_without_gpus_compiles_nothing(tmp_path):
    schedule, _ = _decide(_cfg(tmp_path), FakeMachine(gpus=[]))
    assert schedule.overlap is None and schedule.compile_ahead is None


def test_a_work_pool_schedules_its_own_gpus(tmp_path):
    schedule, _ = _decide(_cfg(tmp_path, evaluation={"work_pool": "pool"}))
    assert (schedule.prefetch, schedule.compile_ahead, schedule.overlap) == (None, None, None)


def test_compile_ahead_only_for_an_arm_about_to_train_on_a_decoding_suite(tmp_path):
    cfg = _cfg(tmp_path)
    # Trained or resuming: its training may end at once, nothing to hide the compile behind.
    schedule, _ = _decide(cfg, FakeMachine(trained=["full"]))
    assert schedule.compile_ahead is None and schedule.overlap is not None
    # Only its first arm matters: the later ones find the graphs compiled.
    assert _decide(cfg, FakeMachine(trained=["anchor"]))[0].compile_ahead is not None
    assert _decide(cfg, suites=["mmlu"])[0].compile_ahead is None  # nothing decodes
    # Only the suites in scope that decode.
    three = _cfg(tmp_path, evaluation={"suites": ["mmlu", "longbench", "ruler"]})
    assert _decide(three)[0].compile_ahead.suites == ["longbench", "ruler"]
    assert _decide(three, suites=["mmlu", "ruler"])[0].compile_ahead.suites == ["ruler"]
    # Nothing trains first, or nothing evaluates.
    assert _decide(cfg, stages=["evaluate", "report"])[0].compile_ahead is None
    assert _decide(cfg, stages=["data", "train"])[0].compile_ahead is None
    # A model built in the config (model.tiny): no base model on disk to compile with.
    raw = _raw(tmp_path)
    raw["model"] = {"tiny": {}, "tokenizer": str(tmp_path / "tok")}
    assert _decide(config_from_dict(raw))[0].compile_ahead is None


def test_prefetch_needs_training_ruler_gpus_and_the_sample_store(tmp_path):
    cfg = _cfg(tmp_path)
    assert _decide(cfg, stages=["data", "train", "evaluate"])[0].prefetch is not None
    assert _decide(cfg, stages=["evaluate", "report"])[0].prefetch is None  # nothing trains
    assert _decide(cfg, stages=["data", "train"])[0].prefetch is None  # nothing evaluates
    assert _decide(cfg, suites=["mmlu"])[0].prefetch is None  # no RULER in this run
    no_ruler = _cfg(tmp_path, evaluation={"suites": ["mmlu"]})
    assert _decide(no_ruler)[0].prefetch is None
    # Without the store the samples would not reach the GPUs' worker processes.
    no_store = _cfg(tmp_path, evaluation={"ruler": {"sample_store": False}})
    assert _decide(no_store)[0].prefetch is None
    assert _decide(cfg, FakeMachine(tokenizer=False))[0].prefetch is None


def test_pretraining_evaluates_the_base_model_and_prefetches_with_its_tokenizer(tmp_path):
    raw = _raw(tmp_path)
    raw["model"] = {"tiny": {}, "tokenizer": str(tmp_path / "tok")}
    raw["pretrain"] = {"corpus": {"dir": str(tmp_path / "pre")}}
    cfg = config_from_dict(raw)
    pre = cfg.pretraining()
    schedule, fake = _decide(cfg)
    assert schedule.evaluate_base
    # Before pretraining the arms' model does not exist: the pretraining run's tokenizer.
    assert schedule.prefetch == Prefetch(cfg.arms()[0], pre)
    assert fake.tokenizers == [pre.variant_name]
    # The arms start from the pretrained model on disk: compiled with it, as before.
    assert schedule.compile_ahead.arm.model.path == cfg.base_model_path
    assert not _decide(cfg, stages=["data", "train", "evaluate"])[0].evaluate_base
    assert not _decide(cfg, stages=["pretrain", "data", "train"])[0].evaluate_base
    assert not _decide(_cfg(tmp_path))[0].evaluate_base  # no pretrain section


def test_overlap_training_gpus_takes_what_training_needs():
    cfg = config_from_dict(_raw(Path("/nonexistent")))
    arms = cfg.arms()
    assert overlap_training_gpus(cfg, arms, ["0", "1", "2"]) == ["0"]
    assert overlap_training_gpus(cfg, arms, ["0"]) is None  # one GPU: sequential


def test_evaluated_suites_keep_the_arms_order():
    cfg = config_from_dict(_raw(Path("/nonexistent")))
    arm = cfg.arms()[0]
    assert evaluated_suites(arm, None) == evaluated_suites(arm, []) == ["ruler", "mmlu"]
    assert evaluated_suites(arm, ["mmlu", "ruler"]) == ["ruler", "mmlu"]
    assert evaluated_suites(arm, ["longbench"]) == []
