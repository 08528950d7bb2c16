"""full-experiment on a multi-GPU host overlaps evaluating a finished arm with training the
next: the same checkpoints, records and scores as the sequential run, and arm 1's evaluation
starts before arm 2's training ends. The GPUs are faked with CUDA_VISIBLE_DEVICES on a machine
without CUDA (every child process runs on CPU), as in tests/test_eval_sharding.py."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from anchorctx.evaluation import results
from anchorctx.evaluation.schedule import Machine, decide_schedule, overlap_training_gpus
from anchorctx.experiment import ExperimentConfig, config_from_dict
from anchorctx.io import read_jsonl


def _raw(root: Path, demo_corpus, overlap: str) -> dict:
    fixtures = root.parent / "eval_data"
    return {
        "name": "overlap",
        "run_root": str(root),
        "seed": 0,
        "model": {
            "tiny": {
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
            },
            "tokenizer": str(demo_corpus.tokenizer_dir),
            "dtype": "float32",
        },
        "data": {
            "sources": [{"path": str(demo_corpus.data_dir)}],
            "seq_len": 512,
            "token_budget": 20_000,
        },
        # device auto + nproc 1: one GPU for training where there are GPUs (CPU here)
        "training": {
            "device": "auto",
            "nproc": 1,
            "engine": "sdpa",
            "precision": "fp32",
            "steps": 2,
            "global_batch_size": 2,
            "micro_batch_size": 1,
            "zero_stage": 0,
            "activation_checkpointing": False,
            "save": {"every": 2, "last": None},
        },
        "evaluation": {
            "suites": ["ruler"],
            "demo_fixtures": str(fixtures),
            "device": "auto",
            "dtype": "float32",
            "batch_size": 2,
            "overlap": overlap,
            # fit tight: at 512 tokens RULER's smallest haystack overflows the demo tokenizer's
            # budget; these tests are about the flow, the fit rules have their own tests.
            "ruler": {
                "tasks": ["niah_single_1"],
                "lengths": [512],
                "num_samples": 1,
                "fit": "tight",
                "squad_path": str(fixtures / "squad.json"),
            },
        },
        "variants": [
            {"name": "full", "attention": "full"},
            {"name": "anchor", "attention": "anchor"},
        ],
    }


def _cfg(root: Path, demo_corpus, overlap: str) -> ExperimentConfig:
    return config_from_dict(_raw(root, demo_corpus, overlap))


def test_overlap_needs_spare_gpus(tmp_path, demo_corpus):
    cfg = _cfg(tmp_path / "runs", demo_corpus, "auto")
    arms = cfg.arms()
    assert overlap_training_gpus(cfg, arms, ["0", "1", "2"]) == ["0"]
    assert overlap_training_gpus(cfg, arms, ["0"]) is None  # one GPU: sequential
    for key, value in (
        ("evaluation", {"overlap": "off"}),
        ("evaluation", {"device": "cpu"}),
        ("evaluation", {"work_pool": "pool"}),
        ("training", {"nproc": None}),
        ("training", {"nproc": 3}),
        ("training", {"nnodes": 2}),
    ):
        raw = _raw(tmp_path / "runs", demo_corpus, "auto")
        raw[key].update(value)
        other = config_from_dict(raw)
        assert overlap_training_gpus(other, other.arms(), ["0", "1", "2"]) is None, value
    raw = _raw(tmp_path / "runs", demo_corpus, "auto")
    raw["training"]["device"] = "cpu"  # training takes no GPU: all of them evaluate
    cpu = config_from_dict(raw)
    assert overlap_training_gpus(cpu, cpu.arms(), ["0", "1"]) == []


def _outputs(cfg: ExperimentConfig) -> dict:
    out = {}
    for arm in cfg.arms():
        for ckpt in sorted((arm.run_dir / "checkpoints").iterdir()):
            got = results.load_result(results.result_path(ckpt, "ruler"))
            # Sorted: the file's order follows the schedule (a sharded evaluation writes its
            # units by cost), the records do not depend on it.
            records = sorted(
                read_jsonl(results.samples_path(ckpt, "ruler"))[1:], key=lambda r: r["key"]
            )
            out[(arm.variant_name, ckpt.name)] = (got["scores"], got["counts"], records)
    return out


@pytest.mark.slow
def test_overlapped_experiment_equals_sequential(
    tmp_path, demo_corpus, monkeypatch, prefect_harness
):
    """Three fake GPUs: arm 1 trains on one, then evaluates on the other two while arm 2
    trains, and arm 2 evaluates on all three. Reference: the same checkpoints evaluated again
    one after the other in this process (the CPU path, no sharding)."""
    import asyncio
    from datetime import datetime, timezone

    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterName,
        FlowRunFilterStartTime,
    )

    from anchorctx.flows.experiment import full_experiment

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    cfg = _cfg(tmp_path / "runs", demo_corpus, "auto")
    names = ["train-overlap-anchor", "evaluate-overlap-full"]
    with prefect_harness():
        started = datetime.now(timezone.utc)  # the server is shared: this run's flow runs only
        full_experiment(cfg, stages=["data", "train", "evaluate"])

        async def flow_runs() -> list:
            async with get_client() as client:
                return await client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(
                        name=FlowRunFilterName(any_=names),
                        start_time=FlowRunFilterStartTime(after_=started),
                    )
                )

        found = asyncio.run(flow_runs())
    assert sorted(r.name for r in found) == sorted(names), [r.name for r in found]
    runs = {r.name: r for r in found}
    # Arm 1's evaluation began while arm 2 was training.
    assert runs["evaluate-overlap-full"].start_time < runs["train-overlap-anchor"].end_time
    overlapped = _outputs(cfg)
    assert len(overlapped) == 2
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    for arm in cfg.arms():
        for ckpt in (arm.run_dir / "checkpoints").iterdir():
            results.evaluate_checkpoint(arm, ckpt, "ruler", force=True, progress=False)
    assert _outputs(cfg) == overlapped


@pytest.mark.slow
def test_one_gpu_prefetches_ruler_samples_while_training(
    tmp_path, demo_corpus, monkeypatch, prefect_harness
):
    """On one GPU the flow generates the arms' RULER samples in a thread while training runs,
    into the experiment's sample store: the evaluation (in the GPU's worker process) reads them
    there, and the records equal an evaluation that generated its own."""
    import inspect

    from anchorctx.evaluation.ruler import runner
    from anchorctx.flows.experiment import full_experiment

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    raw = _raw(tmp_path / "runs", demo_corpus, "auto")
    raw["evaluation"]["ruler"].update(tasks=["niah_single_1", "fwe"], lengths=[512, 768])
    raw["variants"] = raw["variants"][1:]  # one arm (anchor) shows it; each arm costs CI time
    cfg = config_from_dict(raw)
    calls: list[tuple[str, int, bool]] = []
    real = runner.generate

    def spy(task, length, *args, **kwargs):
        in_suite = any(frame.function == "run_suite" for frame in inspect.stack())
        calls.append((task, length, in_suite))
        return real(task, length, *args, **kwargs)

    monkeypatch.setattr(runner, "generate", spy)
    runner.SAMPLES.clear()
    with prefect_harness():
        full_experiment(cfg, stages=["data", "train", "evaluate"])
    # This process generated every cell, outside any evaluation: the prefetch.
    assert sorted(calls) == sorted(
        (t, n, False) for t in ("fwe", "niah_single_1") for n in (768, 512)
    )
    assert len(list(runner.sample_store(cfg).glob("*.json"))) == 4
    prefetched = _outputs(cfg)
    # The reference: this process, no store, an empty cache; it generates its own.
    runner.SAMPLES.clear()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    for arm in cfg.arms():
        ref = arm.model_copy(deep=True)
        ref.evaluation.ruler.sample_store = False
        for ckpt in (arm.run_dir / "checkpoints").iterdir():
            results.evaluate_checkpoint(ref, ckpt, "ruler", force=True, progress=False)
    assert _outputs(cfg) == prefetched
    assert any(in_suite for *_, in_suite in calls[4:])  # the reference generated its own
    runner.SAMPLES.clear()


def test_prefetch_goes_through_the_sample_store_only(tmp_path, demo_corpus, monkeypatch):
    """The evaluations run in the GPUs' worker processes, on one GPU as on several: prefetching
    in the flow process helps them only through the experiment's sample store, so it runs with
    ``sample_store`` and not without."""
    import threading

    import anchorctx.flows.experiment as fx

    submitted: list[str] = []
    monkeypatch.setattr(fx, "ensure_eval_fixtures_task", lambda arm: None)
    monkeypatch.setattr(
        fx,
        "prefetch_ruler_task",
        types.SimpleNamespace(submit=lambda arm, tok, stop: submitted.append(arm.variant) or 1),
    )

    def prefetch(gpus: list[str], store: bool):
        raw = _raw(tmp_path / "runs", demo_corpus, "auto")
        raw["evaluation"]["ruler"]["sample_store"] = store
        cfg = config_from_dict(raw)
        # The tokenizer the samples are made with must exist (demo_corpus built it).
        schedule = decide_schedule(cfg, cfg.arms(), fx.STAGES, None, Machine(lambda: gpus))
        return fx._prefetch_samples(schedule.prefetch, threading.Event())

    assert prefetch(["0"], store=True) == 1  # through the store, for the GPU's worker
    assert prefetch(["0", "1"], store=True) == 1
    assert prefetch(["0"], store=False) is None  # nothing would reach the workers
    assert prefetch(["0", "1"], store=False) is None
    assert submitted == ["full", "full"]


def test_prefetch_thread_starts_after_transformers_is_resolved(tmp_path, demo_corpus):
    """transformers' lazy module is not thread-safe: the RULER prefetch thread and the flow
    both resolving it at once failed a paper rehearsal on a GPU host ("cannot import name
    'AutoTokenizer' from 'transformers'"). The flow resolves what both use before the thread
    is submitted; checked in a fresh interpreter, where nothing else has resolved them."""
    import subprocess
    import sys

    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(_cfg(tmp_path / "runs", demo_corpus, "auto").to_yaml())
    code = f"""
import sys, threading, types
import anchorctx.flows.experiment as fx
from anchorctx.evaluation.schedule import Machine, decide_schedule
from anchorctx.experiment import load_config
cfg = load_config({str(cfg_path)!r}, ["evaluation.device=cuda"])
seen = []
def submit(*args):
    t = vars(sys.modules["transformers"])
    seen.append(all(n in t for n in ("AutoTokenizer", "AutoConfig", "AutoModelForCausalLM")))
fx.ensure_eval_fixtures_task = lambda arm: None
fx.prefetch_ruler_task = types.SimpleNamespace(submit=submit)
schedule = decide_schedule(cfg, cfg.arms(), fx.STAGES, None, Machine(lambda: ["0"]))
fx._prefetch_samples(schedule.prefetch, threading.Event())
print(seen)
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[True]"
