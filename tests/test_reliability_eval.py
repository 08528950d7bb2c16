"""Red-team rows of issue #33 on evaluation, orchestration and packaging (docs/RELIABILITY.md):
each failure is one line naming the file or the key, nothing is lost, nothing is written outside
``run_root``. One test per row (CPU, no Prefect server: its client is faked where it matters)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import yaml
from test_eval_core_results import NUM_SAMPLES, FakeSuite, save_tiny_checkpoint

from anchorctx.cli import main
from anchorctx.config import dump_config
from anchorctx.evaluation import results
from anchorctx.evaluation.lm_eval import harness
from anchorctx.evaluation.results import Suite, evaluate_checkpoint
from anchorctx.experiment import config_from_dict

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake(monkeypatch) -> FakeSuite:
    suite = FakeSuite()
    monkeypatch.setitem(results.SUITES, "fake", Suite(suite))
    results.clear_model_cache()
    yield suite
    results.clear_model_cache()


def _cfg(tmp_path: Path, **evaluation):
    return config_from_dict(
        {
            "name": "t",
            "run_root": str(tmp_path / "runs"),
            "model": {"path": str(tmp_path / "unused-model")},
            "evaluation": {"device": "cpu", "dtype": "float32", **evaluation},
        }
    )


def _one_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert err.startswith(f"anchorctx {command}: "), err
    return err


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


# ------------------------------------------------------------------------------------ row 3
def test_external_checkpoint_is_evaluated_under_run_root(tmp_path, fake, capsys):
    """`evaluate --checkpoint DIR` of a model outside run_root: results under
    run_root/<name>/external/<dir>-<hash>, nothing beside the checkpoint."""
    models = tmp_path / "models"
    a = save_tiny_checkpoint(models / "left" / "Llama 2 (7B)", seed=0)
    b = save_tiny_checkpoint(models / "right" / "Llama 2 (7B)", seed=1)
    cfg = _cfg(tmp_path)
    before = _files(tmp_path)
    config = tmp_path / "cfg.yaml"
    dump_config(cfg, config)
    before.add(config)
    assert main(["evaluate", str(config), "--checkpoint", str(a), "--suite", "fake"]) == 0
    out_a = evaluate_checkpoint(cfg, a, "fake", progress=False)  # cached: the same file
    out_b = evaluate_checkpoint(cfg, b, "fake", progress=False)
    capsys.readouterr()

    external = (tmp_path / "runs" / "t" / "external").resolve()
    assert out_a.parent.parent == external and out_b.parent.parent == external
    assert re.fullmatch(r"Llama_2_7B-[0-9a-f]{12}", out_a.parent.name), out_a
    assert out_a.parent != out_b.parent and fake.calls == 2  # one name, two folders, two results
    new = _files(tmp_path) - before
    assert new and all((tmp_path / "runs") in p.parents for p in new), sorted(new)
    assert not (models / "eval").exists() and not (tmp_path / "eval").exists()
    assert results.result_is_intact(a, "fake", cfg)
    # A run's own checkpoint inside run_root keeps the contract's place.
    own = save_tiny_checkpoint(cfg.run_dir / "checkpoints" / "step-000001", seed=2, step=1)
    path = evaluate_checkpoint(cfg, own, "fake", progress=False)
    assert path == (cfg.run_dir / "eval" / "step-000001" / "fake.json").resolve()


# ----------------------------------------------------------------------------------- row 10
def test_empty_harness_files_are_one_error_and_never_cached(tmp_path, fake, capsys):
    ck = save_tiny_checkpoint(tmp_path / "runs" / "t" / "full" / "checkpoints" / "step-1", seed=0)
    hs = tmp_path / "hellaswag"
    hs.mkdir()
    (hs / "validation.jsonl").write_text("\n  \n")  # zero questions
    cfg = _cfg(tmp_path, harness={"hellaswag_dir": str(hs)})
    config = tmp_path / "cfg.yaml"
    dump_config(cfg, config)
    capsys.readouterr()
    rc = main(["evaluate", str(config), "--checkpoint", str(ck), "--suite", "hellaswag"])
    err = _one_line(capsys, "evaluate")
    assert rc == 1 and str(hs / "validation.jsonl") in err and "hellaswag_dir" in err, err
    assert not results.result_path(ck, "hellaswag", cfg).exists()  # no 0.00 from 0 questions

    # MMLU: an empty subject test file is named, before lm-eval sees it.
    mmlu = tmp_path / "mmlu"
    row = {"question": "q", "choices": ["a", "b", "c", "d"], "answer": 0}
    for split in ("dev", "test"):
        (mmlu / split).mkdir(parents=True)
        (mmlu / split / "anatomy.jsonl").write_text(json.dumps(row) + "\n")
    (mmlu / "test" / "anatomy.jsonl").write_text("")
    mcfg = _cfg(tmp_path, harness={"mmlu_dir": str(mmlu)})
    with pytest.raises(harness.HarnessDataError) as err_info:
        harness.run_suite_mmlu(None, None, mcfg, done={}, on_sample=lambda r: None, progress=False)
    message = str(err_info.value)
    assert str(mmlu / "test" / "anatomy.jsonl") in message and "mmlu_dir" in message, message

    # Whatever the suite: a score from 0 items is refused, nothing is written.
    class Empty(FakeSuite):
        def __call__(self, *args, **kwargs):
            super().__call__(*args, **kwargs)
            return {"scores": {"hellaswag": {"acc_norm": 0.0}}, "counts": {"hellaswag": 0}}

    results.SUITES["fake"] = Suite(Empty())
    with pytest.raises(results.EmptyEvaluationError, match="from 0 items") as err_info:
        evaluate_checkpoint(cfg, ck, "fake", progress=False)
    assert err_info.value.exit_code == 1
    assert not results.result_path(ck, "fake", cfg).exists()


# ----------------------------------------------------------------------------------- row 11
def test_report_refuses_a_hand_edited_result(tmp_path, fake, capsys):
    cfg = _cfg(tmp_path)
    for step in (1, 2):
        ck = save_tiny_checkpoint(
            cfg.run_dir / "checkpoints" / f"step-{step:06d}", seed=step, step=step
        )
        evaluate_checkpoint(cfg, ck, "fake", progress=False)
    config = tmp_path / "cfg.yaml"
    dump_config(cfg, config)
    from anchorctx.evaluation.averaging import summarize_run

    honest = summarize_run(cfg.run_dir, 2, verify=True)["suites"]["fake"]["scores"]["alpha"]
    path = results.result_path(cfg.run_dir / "checkpoints" / "step-000002", "fake", cfg)
    written = path.read_text()
    edited = json.loads(written)
    edited["scores"]["alpha"]["4096"] = 99.0  # the fake, result_sha256 left as it was
    path.write_text(json.dumps(edited, indent=2))

    capsys.readouterr()
    assert main(["report", str(config), "--last-k", "2"]) == 1
    err = _one_line(capsys, "report")
    assert str(path) in err and "refused" in err, err
    summary = json.loads((cfg.run_dir / "eval" / "summary.json").read_text())
    assert summary["suites"]["fake"]["scores"]["alpha"] == honest  # 99 never averaged
    # The result as written, but its per-sample records edited: refused too.
    path.write_text(written)
    summarize_run(cfg.run_dir, 2, verify=True)
    samples = path.with_name("fake.samples.jsonl")
    samples.write_text(samples.read_text().replace('"score": ', '"score": 1', 1))
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: refused: its per-sample"):
        summarize_run(cfg.run_dir, 2, verify=True)


# ----------------------------------------------------------------------------------- row 12
RULER_BAD = [
    ("essay", "essays.json", "", "empty file"),
    ("essay", "essays.json", "{not json", "not valid JSON"),
    ("essay", "essays.json", json.dumps({"text": 12}), "'text'"),
    ("essay", "essays.json", json.dumps(["a list"]), "'text'"),
    ("squad", "squad.json", "", "empty file"),
    ("squad", "squad.json", json.dumps({"data": {"title": "x"}}), "'data'"),
    ("squad", "squad.json", json.dumps({"data": [{"paragraphs": [7]}]}), "'context'"),
    ("hotpotqa", "hotpot.json", "", "empty file"),
    ("hotpotqa", "hotpot.json", json.dumps([3]), "'context'"),
    ("hotpotqa", "hotpot.json", json.dumps({"question": "q"}), "JSON list"),
    ("english_words", "words.json", "", "empty file"),
    ("english_words", "words.json", json.dumps({"0": 5}), "'0'"),
]


@pytest.mark.parametrize(("kind", "name", "content", "what"), RULER_BAD)
def test_malformed_ruler_and_longbench_inputs_name_file_key_and_field(
    tmp_path, kind, name, content, what
):
    from anchorctx.evaluation.ruler import data as D
    from anchorctx.evaluation.ruler.runner import plan_samples

    path = tmp_path / name
    path.write_text(content)
    key = f"evaluation.ruler.{D.DATA_KEYS[kind]}"
    reader = {
        "essay": D.essay_words,
        "squad": D.read_squad,
        "hotpotqa": D.read_hotpotqa,
        "english_words": D.english_words,
    }[kind]
    with pytest.raises(D.DataFormatError) as err:
        reader(path)
    message = str(err.value)
    assert key in message and str(path) in message and what in message, message
    assert "\n" not in message
    if kind == "squad":  # through the suite's planning, as `evaluate` meets it
        with pytest.raises(D.DataFormatError, match=re.escape(key)):
            plan_samples(["qa_1"], [1024], 2, {"squad_path": path}, {})


def test_malformed_longbench_file_names_file_line_field_and_key(tmp_path):
    from anchorctx.evaluation.longbench.runner import DATA_KEY, LongBenchDataError, load_rows

    good = {"input": "q", "context": "c", "answers": ["a"], "_id": "1"}
    cases = {
        "": "empty file",
        json.dumps(good) + "\n{oops\n": ":2: invalid JSON",
        json.dumps(good) + "\n" + json.dumps(["x"]) + "\n": ":2: record is list",
        json.dumps({**good, "answers": "a"}) + "\n": ":1: field 'answers' is str",
        json.dumps({**good, "context": None}) + "\n": ":1: field 'context' is NoneType",
        json.dumps({"input": "q", "answers": []}) + "\n": ":1: record lacks ['context']",
    }
    lb = tmp_path / "trec.jsonl"
    for text, expected in cases.items():
        lb.write_text(text)
        with pytest.raises(LongBenchDataError) as err:
            load_rows(lb)
        message = str(err.value)
        assert str(lb) in message and expected in message and DATA_KEY in message, message
        assert "\n" not in message


# ----------------------------------------------------------------------------------- row 14
def test_torn_last_record_is_cut_and_computed_again(tmp_path, fake):
    ck = save_tiny_checkpoint(tmp_path / "runs" / "t" / "full" / "checkpoints" / "step-1", seed=0)
    cfg = _cfg(tmp_path)
    fake.fail_after = 4
    with pytest.raises(RuntimeError, match="simulated crash"):
        evaluate_checkpoint(cfg, ck, "fake", progress=False)
    samples = results.samples_path(ck, "fake", cfg)
    lines = samples.read_text().splitlines()
    torn_key = "beta/4096/4"
    torn = json.dumps({"key": torn_key, "task": "beta", "score": 1.0})
    with samples.open("a") as fh:  # the crash cut the 5th record short
        fh.write(torn[: len(torn) // 2])
    fake.fail_after = None
    out = evaluate_checkpoint(cfg, ck, "fake", progress=False)

    text = samples.read_text()
    assert text.endswith("\n")
    rows = [json.loads(line) for line in text.splitlines()]  # every line is one JSON record
    keys = [r["key"] for r in rows[1:]]
    assert len(keys) == NUM_SAMPLES == len(set(keys)) and torn_key in keys
    assert rows[: len(lines)] == [json.loads(x) for x in lines]  # nothing earlier was lost
    result = json.loads(out.read_text())
    assert result["samples"]["resumed"] == 4 and result["samples"]["new"] == NUM_SAMPLES - 4
    assert results.result_is_intact(ck, "fake", cfg)

    # A shard file torn the same way is repaired before its shard appends again.
    from anchorctx.evaluation import sharding

    shard = sharding.shard_path(ck, "fake", 0, 1, cfg)
    results.start_samples(shard, results.identity(cfg, ck, "fake"))
    with shard.open("a") as fh:
        fh.write('{"key": "alpha/4096/1", "ta')
    sharding.run_shard(cfg, ck, "fake", ["*"], 0, 1)
    assert all(json.loads(line) for line in shard.read_text().splitlines())


# ----------------------------------------------------------------------------------- row 16
def _run(id_: uuid.UUID, state) -> SimpleNamespace:
    return SimpleNamespace(
        id=id_, name="brave-otter", flow_id=uuid.uuid4(), parameters={}, state=state, tags=[]
    )


class FlakyClient:
    """The sync client's calls the follower makes; ConnectError while ``down``."""

    def __init__(self, run) -> None:
        self.run, self.down = run, 0

    def read_flow_run(self, _id):
        if self.down:
            self.down -= 1
            raise httpx.ConnectError("All connection attempts failed")
        return self.run

    def read_flow_runs(self, **_):
        return []

    def read_flow(self, _id):
        return SimpleNamespace(name="full-experiment")

    def read_logs(self, *_a, **_k):
        return []

    def read_task_runs(self, **_):
        return []


def test_lost_server_is_one_line_and_cancel_still_kills_training(tmp_path, monkeypatch, capsys):
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Cancelling, Completed, Running
    from prefect.utilities.engine import capture_sigterm

    from anchorctx.flows.follow import follow
    from anchorctx.process import free_port, run_process_group
    from anchorctx.tasks import api
    from anchorctx.tasks.artifacts import Progress

    url = f"http://127.0.0.1:{free_port()}/api"  # nothing listens there
    run_id = uuid.uuid4()
    with temporary_settings(updates={PREFECT_API_URL: url}):
        # `anchorctx run` against a server that is down: one line, exit 1.
        assert main(["run", "--no-follow"]) == 1
        err = _one_line(capsys, "run")
        assert f"Prefect server at {url} is unreachable" in err and "start it" in err, err

        # The follower waits out a restart ...
        client = FlakyClient(_run(run_id, Completed()))
        client.down = 2
        lines: list[str] = []
        state = follow(client, run_id, poll_s=0, out=lines.append, reconnect_s=60)
        assert state.is_completed()
        assert any("does not answer" in x for x in lines) and any(
            "answers again" in x for x in lines
        )
        # ... and gives up on an outage with one line: which server, how to resume.
        client = FlakyClient(_run(run_id, Running()))
        client.down = 10**6
        ticks = iter(range(0, 10**6, 30))
        with pytest.raises(api.ServerUnreachable) as lost:
            follow(
                client,
                run_id,
                poll_s=0,
                out=lambda _: None,
                reconnect_s=60,
                clock=lambda: next(ticks),
            )
        message = str(lost.value)
        assert url in message and f"anchorctx run --follow {run_id}" in message
        assert "\n" not in message

        # The training tick's progress update skips while the server is away (it used to
        # raise there and kill training).
        monkeypatch.setattr(
            "anchorctx.tasks.artifacts.create_progress_artifact", lambda **_: run_id
        )
        calls = []

        def update(**kw):
            calls.append(kw)
            if len(calls) == 1:
                raise httpx.ConnectError("All connection attempts failed")
            return run_id

        monkeypatch.setattr("anchorctx.tasks.artifacts.update_progress_artifact", update)
        progress = Progress("train-t-full", "d", min_interval_s=0)
        progress.update(0.5)  # server down: no exception
        progress.update(0.5)  # back: the same value is sent now
        assert [c["progress"] for c in calls] == [50.0, 50.0]

        # A flow body's lost connection is one line naming the server and how to resume.
        @api.api_errors
        def body():
            raise httpx.ConnectError("All connection attempts failed")

        with pytest.raises(api.ServerUnreachable, match=re.escape(url)) as lost:
            body()
        assert "run this flow again" in str(lost.value) and "\n" not in str(lost.value)

    # Cancel after a restart: the watch sees the outage, then Cancelling; the runner does not
    # act; the flow process stops itself (SIGTERM through Prefect's bridge) and the training
    # process group is killed.
    states = iter([httpx.ConnectError("refused")] * 2 + [Running()] + [Cancelling()] * 10**4)

    def read_state(_id):
        item = next(states)
        if isinstance(item, Exception):
            raise item
        return item

    marked: list[uuid.UUID] = []
    now = [0.0]

    def clock():
        now[0] += 1.0
        return now[0]

    watch = api.CancelWatch(
        run_id,
        interval_s=0.05,
        grace_s=3.0,
        read_state=read_state,
        mark_cancelled=lambda i, _m: marked.append(i),
        clock=clock,
    )
    assert watch.poll() == "unreachable"
    pids: list[int] = []
    started = time.monotonic()
    from prefect._internal import control_listener
    from prefect.exceptions import TerminationSignal

    term_handler = signal.getsignal(signal.SIGTERM)
    try:
        with capture_sigterm(), pytest.raises(TerminationSignal):
            run_process_group(
                ["sleep", "600"],
                on_line=lambda _: None,
                on_start=lambda pid: (pids.append(pid), watch.start()),
                timeout_s=60,  # without the watch: ProcessTimeout, a failure, not a hang
            )
        assert control_listener.get_intent() == "cancel"  # nested flow runs end Cancelled
    finally:
        watch.close()
        control_listener.clear_intent()
        signal.signal(signal.SIGTERM, term_handler)  # Prefect keeps its bridge after an intent
    assert time.monotonic() - started < 30 and marked == [run_id]
    with pytest.raises(ProcessLookupError):
        os.killpg(pids[0], 0)  # the whole training group is gone

    # A runner that still watches acts first: the flow process leaves it to the runner.
    healthy = api.CancelWatch(
        run_id,
        grace_s=0,
        read_state=lambda _i: Cancelling(),
        terminate=lambda: pytest.fail("terminated although the runner acts"),
        runner_intent=lambda: "cancel",
    )
    assert healthy.poll() == "runner"


# ----------------------------------------------------------------------------------- row 19
def _interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error}."""

    def one(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        value = env.get(name)
        if op in (":?", "?") and (value is None or (op == ":?" and value == "")):
            raise ValueError(f"required variable {name} is missing a value: {arg}")
        if op in (":-", "-") and (value is None or (op == ":-" and value == "")):
            return arg
        return value or ""

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}", one, text)


def test_docker_binds_loopback_needs_a_password_and_installs_the_lock():
    raw = (REPO / "docker" / "compose.yaml").read_text()
    with pytest.raises(ValueError, match="POSTGRES_PASSWORD"):
        _interpolate(raw, {})  # no default password: compose refuses to start
    compose = yaml.safe_load(_interpolate(raw, {"POSTGRES_PASSWORD": "s3cret"}))
    services = compose["services"]
    assert "ports" not in services["postgres"]  # the database is never published
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"] == "s3cret"
    assert (
        ":s3cret@postgres:"
        in services["prefect-server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    )
    for name, service in services.items():
        auth = (service.get("environment") or {}).get("PREFECT_SERVER_API_AUTH_STRING")
        for port in service.get("ports") or []:
            host_ip = str(port).rsplit(":", 2)[0] if str(port).count(":") == 2 else "0.0.0.0"
            assert host_ip == "127.0.0.1" or auth, f"{name} publishes {port} on every interface"
    assert services["prefect-server"]["ports"] == ["127.0.0.1:4200:4200"]

    # The image: torch the GPU tests passed on, then the lock, then the project without deps.
    text = (REPO / "docker" / "Dockerfile").read_text()
    logical = [
        " ".join(line.split())
        for line in re.sub(r"\\\n", " ", text).splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", "\n".join(logical), re.M))
    tested = set(
        re.findall(r"torch (\d+\.\d+\.\d+\+cu\d+)", (REPO / "docs" / "PERFORMANCE.md").read_text())
    )
    assert f"{args['TORCH_VERSION']}+{args['TORCH_CUDA']}" in tested, (args, tested)
    cuda = args["TORCH_CUDA"][2:]
    assert f"cuda:{cuda[:-1]}.{cuda[-1]}" in args["CUDA_IMAGE"], args["CUDA_IMAGE"]
    installs = [line for line in logical if re.search(r"\bpip install\b", line)]
    torch_at = next(
        i for i, x in enumerate(installs) if "torch==${TORCH_VERSION}+${TORCH_CUDA}" in x
    )
    lock_at = next(i for i, x in enumerate(installs) if "-r requirements/gpu.txt" in x)
    project_at = next(
        i for i, x in enumerate(installs) if re.search(r"install[^&]* (-e )?\.( |$)", x)
    )
    assert torch_at < lock_at < project_at, installs
    for line in installs:
        if re.search(r"install[^&]* (-e )?\.( |$)", line):
            assert "--no-deps" in line, f"the project must not resolve dependencies: {line}"
    assert "COPY requirements requirements" in logical
    assert any("torch.__version__ == want" in x for x in logical)  # nothing replaced torch


# --------------------------------------------------------- inputs rewritten during a run
def test_inputs_rewritten_during_an_evaluation_write_no_result(tmp_path, fake, capsys):
    """Another process rewrites a suite's input file while it runs (run 13,
    docs/runs/2026-11-27-run-13-seeds-4x-samples.md:
    seed arms rewriting the shared evaluation data): the evaluation fails with one line naming
    the change and writes no result, whole or sharded; the next run, on stable data, completes
    from fresh records."""
    from anchorctx.evaluation import sharding

    data = tmp_path / "essay.json"
    data.write_text('{"text": "before"}')

    class Rewrites(FakeSuite):
        def __call__(self, *args, **kwargs):
            out = super().__call__(*args, **kwargs)
            if self.calls == 1:  # only during the first run
                data.write_text('{"text": "after, from another seed"}')
            return out

    suite = Rewrites()
    results.SUITES["fake"] = Suite(suite, inputs=lambda cfg: {"essay": data})
    cfg = _cfg(tmp_path)
    ck = save_tiny_checkpoint(cfg.run_dir / "checkpoints" / "step-000001", seed=0, step=1)
    with pytest.raises(results.EvaluationError, match="changed while it ran") as err_info:
        evaluate_checkpoint(cfg, ck, "fake", progress=False)
    assert "another process rewrote them" in str(err_info.value)
    assert not results.result_path(ck, "fake", cfg).exists()
    out = evaluate_checkpoint(cfg, ck, "fake", progress=False)  # the data is stable now
    result = json.loads(out.read_text())
    assert result["samples"]["resumed"] == 0 and suite.calls == 2  # nothing of the mixed run
    assert result["inputs"] == results.input_fingerprints(cfg, "fake")

    # A shard: the same check before it reports its records as written.
    suite.calls = 0
    data.write_text('{"text": "before"}')
    with pytest.raises(results.EvaluationError, match="changed while it ran"):
        sharding.run_shard(cfg, ck, "fake", [sharding.WHOLE], 0, 1)
