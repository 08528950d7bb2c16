"""Stage/arm control and progress following, without a server: the training log line the
follower parses, the CLI's flow parameters, arm and stage selection, and the forced-training
rule that a forced run which does not finish puts the previous run back."""

from __future__ import annotations

import argparse
import logging

import pytest

from anchorctx.cli import build_parser
from anchorctx.flows import experiment as fx
from anchorctx.flows.commands import run_parameters
from anchorctx.flows.follow import arm_of, parse_step, step_text
from anchorctx.tasks import training as tt
from anchorctx.training.metrics import step_line


def test_follower_reads_the_training_step_line():
    row = {
        "step": 12,
        "loss": 2.34567,
        "grad_norm": 0.8,
        "lr": 2e-5,
        "tokens_per_s": 1000.0,
        "mfu": None,
        "peak_mem_gib": 1.0,
        "step_time_s": 0.5,
    }
    line = step_line(row, total=20, eta_s=42)
    # as the train task streams it into the Prefect log (logger prefix in front)
    step = parse_step(f"12:00:01 INFO anchorctx.training.loop: {line}")
    assert step == {"step": "12", "total": "20", "pct": "60.0", "loss": "2.3457", "eta": "0m42s"}
    assert step_text("train", "anchor", step) == (
        "train · anchor · step 12/20 (60.0%) · loss 2.3457 · eta 0m42s"
    )
    assert parse_step("checkpoint runs/demo/anchor/checkpoints/step-000012") is None


def test_arm_of_stage_run_names():
    assert arm_of("train-demo-anchor_tags", "train", "demo") == "anchor_tags"
    assert arm_of("evaluate-demo-intra_doc_reset", "evaluate", "demo") == "intra_doc_reset"
    assert arm_of("prepare-data-demo", "prepare-data", "demo") is None
    assert arm_of("full-experiment-demo", "full-experiment", "demo") is None


def _run_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["run", *argv])


def test_follower_takes_the_arm_from_a_run_renamed_after_it_was_first_seen():
    """Prefect may hand out a subflow run before it carries its templated name (a random name
    first, ``train-demo-anchor`` after): the arm comes from the name the run has now."""
    from types import SimpleNamespace
    from uuid import uuid4

    from anchorctx.flows.follow import Follower

    flow_id, run_id = uuid4(), uuid4()
    names = iter(["tricky-raptor", "train-demo-anchor"])

    class Client:
        def read_flow(self, _id):
            return SimpleNamespace(name="train")

    said: list[str] = []
    follower = Follower(Client(), uuid4(), out=said.append)
    follower.experiment = "demo"
    for state in ("Pending", "Running"):
        run = SimpleNamespace(
            id=run_id,
            flow_id=flow_id,
            name=next(names),
            tags=[],
            state=SimpleNamespace(name=state, is_final=lambda: False),
        )
        follower._state(run)
    assert [line.split("] ", 1)[1] for line in said] == [
        "train · Pending",
        "train · anchor · Running",
    ]
    assert follower.runs[run_id].arm == "anchor"


def test_run_command_parameters():
    args = _run_args("--arm", "anchor", "--stage", "evaluate", "--suite", "ruler", "--force")
    assert run_parameters(args) == {
        "arms": ["anchor"],
        "stages": ["evaluate"],
        "suites": ["ruler"],
        "force": True,
    }
    args = _run_args("--force", "--force-stage", "train", "--param", "train_timeout_s=60")
    assert run_parameters(args) == {"force_stages": ["train"], "force": True, "train_timeout_s": 60}
    with pytest.raises(ValueError, match="needs --force"):
        run_parameters(_run_args("--force-stage", "train"))
    with pytest.raises(ValueError, match="only full-experiment"):
        run_parameters(_run_args("evaluate/default", "--arm", "anchor"))
    assert run_parameters(
        _run_args("evaluate/default", "--suite", "mmlu", "--param", "variant=anchor")
    ) == {"suites": ["mmlu"], "variant": "anchor"}


def test_arm_and_stage_selection(tiny_config):
    raw = tiny_config.model_dump(mode="json")
    raw["variants"] = [
        {"name": "full", "attention": "full"},
        {"name": "anchor", "attention": "anchor"},
    ]
    arms = type(tiny_config).model_validate(raw).arms()
    assert [a.variant_name for a in fx.select_arms(arms, ["anchor"])] == ["anchor"]
    assert fx.select_arms(arms, None) == arms
    with pytest.raises(ValueError, match=r"\['anchr'\] not in the experiment's arms"):
        fx.select_arms(arms, ["anchr"])
    assert fx.check_stages(["train", "evaluate"], "stages") == ["train", "evaluate"]
    with pytest.raises(ValueError, match="force_stages: unknown stage"):
        fx.check_stages(["training"], "force_stages")


# ------------------------------------------------------------------ forced training rule
@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(tt, "get_run_logger", lambda: logging.getLogger("test"))
    run = tmp_path / "exp" / "anchor"
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / "eval").mkdir()
    (run / "eval" / "summary.json").write_text("{}")
    return run


class _Cfg:
    def __init__(self, run_dir):
        self.run_dir = run_dir


def _partial_training(run_dir, exc):
    def fake(cfg, dataset, resume, timeout_s, gpus):
        (run_dir / "checkpoints").mkdir(parents=True)  # the new run had started writing
        raise exc

    return fake


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), RuntimeError("training crashed")])
def test_forced_run_that_does_not_finish_restores_the_previous_run(run_dir, monkeypatch, exc):
    monkeypatch.setattr(tt, "_train", _partial_training(run_dir, exc))
    with pytest.raises(type(exc)):
        tt.train_task.fn(_Cfg(run_dir), "data", fresh=True)
    assert (run_dir / "checkpoints" / "step-000002").is_dir()  # the previous results are back
    assert (run_dir / "eval" / "summary.json").is_file()
    assert not tt.previous_dir(run_dir).exists()
    (failed,) = run_dir.parent.glob("anchor.failed-*")  # the partial run is kept, not deleted
    assert not (failed / "checkpoints" / "step-000002").exists()


def test_killed_forced_run_is_undone_by_the_next_run(run_dir, monkeypatch):
    # a forced run killed hard (no chance to clean up) left the previous run aside
    run_dir.rename(tt.previous_dir(run_dir))
    (run_dir / "checkpoints").mkdir(parents=True)
    seen = []
    monkeypatch.setattr(
        tt,
        "_train",
        lambda cfg, *a: (
            seen.append(sorted(p.name for p in (cfg.run_dir / "checkpoints").iterdir())) or ["ok"]
        ),
    )
    assert tt.train_task.fn(_Cfg(run_dir), "data") == ["ok"]
    assert seen == [["step-000002"]]  # it resumed the restored run, not the partial one


def test_forced_run_that_finishes_keeps_the_previous_run_aside(run_dir, monkeypatch):
    def fake(cfg, *a):
        (run_dir / "checkpoints" / "step-000004").mkdir(parents=True)
        return ["new"]

    monkeypatch.setattr(tt, "_train", fake)
    assert tt.train_task.fn(_Cfg(run_dir), "data", fresh=True) == ["new"]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-000004"]
    (old,) = run_dir.parent.glob("anchor.old-*")
    assert (old / "checkpoints" / "step-000002").is_dir()
    assert not tt.previous_dir(run_dir).exists()


def test_run_suite_takes_lm_eval_tasks_and_refuses_typos(capsys):
    args = _run_args("--suite", "lm_eval:babilong", "--suite", "ruler")
    assert run_parameters(args) == {"suites": ["lm_eval:babilong", "ruler"]}
    with pytest.raises(SystemExit):
        _run_args("--suite", "lm_eval:babilong_qa99")
    assert "'lm_eval:babilong_qa99' is not a suite" in capsys.readouterr().err


# ------------------------------------------------------------- suites of the registry
LM_EVAL_SUITE = "lm_eval:babilong"  # one of lm-eval's long-context tasks (a registered suite)


def test_flow_suites_are_the_registrys_and_a_typo_is_one_line(tiny_config):
    from anchorctx.evaluation.results import SUITES, get_suite
    from anchorctx.evaluation.settings import PROJECT_SUITES

    assert set(PROJECT_SUITES) == set(SUITES)  # the names the flow checks are the registry's
    every = [*SUITES, LM_EVAL_SUITE]
    assert fx.check_suites(every, "suites") == every
    assert get_suite(LM_EVAL_SUITE) is not None
    assert fx.check_suites(None, "suites") is None
    with pytest.raises(ValueError) as err:
        fx.Scope.of(tiny_config, None, None, ["lm_eval:babilong_qa99"], False, None, None)
    message = str(err.value)
    assert message.startswith("suites: 'lm_eval:babilong_qa99' is not a suite: expected ruler, ")
    assert "lm_eval:babilong" in message and "\n" not in message


def test_a_served_deployment_takes_lm_eval_suites(tiny_config):
    """A deployment's run parameters are checked by the server against the flow's parameter
    schema (Prefect's ``enforce_parameter_schema``), with the same function as here: every
    registered suite passes it (the flow checks the names, one line for a typo)."""
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools import validate

    schema = parameter_schema(fx.full_experiment).model_dump(exclude_unset=True)
    params = {"cfg": tiny_config.model_dump(mode="json"), "suites": ["ruler", LM_EVAL_SUITE]}
    assert validate(params, schema, raise_on_error=True) == []


def test_full_experiment_evaluates_an_lm_eval_suite(tmp_path, monkeypatch, prefect_harness):
    """``suites=["lm_eval:<task>"]`` through full-experiment (Prefect validates the parameters,
    as for a served run): only that suite of the arm's is evaluated, into its result file. Its
    runner is a fake: lm-eval's own scoring has its tests (tests/test_lm_eval_suites.py)."""
    from test_eval_core_results import FakeSuite, save_tiny_checkpoint

    from anchorctx.evaluation import results
    from anchorctx.experiment import config_from_dict

    base = save_tiny_checkpoint(tmp_path / "base", seed=0)
    cfg = config_from_dict(
        {
            "name": "lm",
            "run_root": str(tmp_path / "runs"),
            "model": {"path": str(base)},
            "evaluation": {"device": "cpu", "dtype": "float32", "suites": ["ruler", LM_EVAL_SUITE]},
        }
    )
    ckpt = save_tiny_checkpoint(cfg.run_dir / "checkpoints" / "step-000001", seed=1, step=1)
    fake = FakeSuite()
    monkeypatch.setattr(results, "_lm_eval_suite", lambda name: results.Suite(fake))
    with prefect_harness():
        fx.full_experiment(cfg, stages=["evaluate"], suites=[LM_EVAL_SUITE])
    assert fake.calls == 1
    assert results.load_result(results.result_path(ckpt, LM_EVAL_SUITE))["suite"] == LM_EVAL_SUITE
    assert not results.result_path(ckpt, "ruler").exists()  # not in this run's suites
