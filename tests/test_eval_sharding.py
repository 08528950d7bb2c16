"""Sharded evaluation: the same records and scores whatever the sharding; resumable; cached."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checkpoints import save_checkpoint

from anchorctx.demo import ensure_eval_fixtures
from anchorctx.evaluation import results, sharding
from anchorctx.experiment import ExperimentConfig, config_from_dict
from anchorctx.io import read_jsonl

LENGTHS = (1024, 2048)  # RULER lengths of _cfg


def _cfg(
    tmp_path: Path, demo_corpus, name: str, checkpoint: bool = True, lengths=LENGTHS
) -> tuple[ExperimentConfig, Path]:
    """Two tasks at ``lengths``, two samples each: one unit a (task, length), so two or more."""
    raw = {
        "name": name,
        "run_root": str(tmp_path / name),
        "model": {"tiny": {}, "tokenizer": str(demo_corpus.tokenizer_dir), "dtype": "float32"},
        "evaluation": {
            "suites": ["ruler"],
            "demo_fixtures": str(tmp_path / "eval_data"),
            "device": "cpu",
            "dtype": "float32",
            "batch_size": 2,
            # fit tight: RULER's smallest QA haystack overflows these lengths with the demo
            # tokenizer; these tests are about sharding, the fit rules have their own tests.
            "ruler": {
                "tasks": ["niah_single_1", "qa_1"],
                "lengths": list(lengths),
                "fit": "tight",
                "num_samples": 2,
                "squad_path": str(tmp_path / "eval_data" / "squad.json"),
            },
        },
    }
    cfg = config_from_dict(raw)
    ensure_eval_fixtures(cfg)  # as the commands and flows do before evaluating
    ckpt = cfg.run_dir / "checkpoints" / "step-000010"
    if checkpoint:
        save_checkpoint(ckpt, demo_corpus.tokenizer_dir, seed=3, step=10)
    return cfg, ckpt


def _sorted_records(path: Path) -> list[dict]:
    rows = read_jsonl(path)[1:]
    return sorted(rows, key=lambda r: r["key"])


def test_plan_shards_balances_and_covers(tmp_path, demo_corpus):
    cfg, _ = _cfg(tmp_path, demo_corpus, "plan", checkpoint=False)
    cfg = cfg.model_copy(deep=True)
    cfg.evaluation.ruler.lengths = [4096, 8192, 32768, 131072]
    plan = sharding.plan_shards(cfg, "ruler", 2)
    units = sharding.units(cfg, "ruler")
    assert sorted(u for s in plan for u in s) == sorted(units)
    loads = [sum(units[u] for u in s) for s in plan]
    assert max(loads) / min(loads) < 1.2  # two 128K units, one per shard
    assert sharding.plan_shards(cfg, "longbench", 4) == [[sharding.WHOLE]]
    assert sharding.unit_of("ruler", "qa_1/4096/17") == "qa_1/4096"


def test_unit_cost_counts_samples_prefill_and_decode(tmp_path, demo_corpus):
    cfg, _ = _cfg(tmp_path, demo_corpus, "cost", checkpoint=False)
    cfg = cfg.model_copy(deep=True)
    r = cfg.evaluation.ruler
    r.tasks, r.lengths, r.num_samples = (
        ["niah_single_1", "vt", "qa_1", "niah_multikey_2"],
        [4096, 16384, 32768],
        24,
    )
    cost = sharding.units(cfg, "ruler")
    # niah answers in up to 128 tokens, vt in 30: same prompt length, more decode.
    assert cost["niah_single_1/32768"] > cost["vt/32768"] > cost["niah_single_1/16384"]
    assert cost["vt/32768"] == 24 * sharding.sample_cost(32768, 30)
    # Against the measured per-sample seconds it is fitted to (H200, 7B shape,
    # docs/benchmarks/2026-11-23-eval-generation-static-engine.md):
    # prefill 1.351 s at 32K; 128 decode steps of 5.47 ms each at 32K. The fit is within 4%
    # (prefill) and 16% (decode) of each measured length, so 5% on the sum here.
    assert sharding.sample_cost(32768, 128) == pytest.approx(1.351 + 128 * 5.47e-3, rel=0.05)
    # Twelve units of three lengths and two answer budgets over two GPUs: LPT evens them out.
    loads = [sum(cost[u] for u in s) for s in sharding.plan_shards(cfg, "ruler", 2)]
    assert max(loads) / min(loads) < 1.02


def test_sharded_equals_unsharded_and_resumes(tmp_path, demo_corpus):
    plain_cfg, plain_ckpt = _cfg(tmp_path, demo_corpus, "plain")
    ref = results.load_result(
        results.evaluate_checkpoint(plain_cfg, plain_ckpt, "ruler", progress=False)
    )
    ref_records = _sorted_records(results.samples_path(plain_ckpt, "ruler"))
    assert len(ref_records) == 8

    cfg, ckpt = _cfg(tmp_path, demo_corpus, "sharded")
    # The config travels to shard processes as JSON.
    assert ExperimentConfig.model_validate_json(cfg.model_dump_json()) == cfg
    assert sharding.prepare(cfg, ckpt, "ruler", force=False)
    # An interrupted first attempt over 3 GPUs did shard 0 only ...
    three = sharding.plan_shards(cfg, "ruler", 3)
    first = sharding.run_shard(cfg, ckpt, "ruler", three[0], 0, 3)
    done_first = {r["key"] for r in read_jsonl(first)[1:]}
    assert done_first and {sharding.unit_of("ruler", k) for k in done_first} == set(three[0])
    # ... and the re-run over 2 GPUs keeps those records and generates only the rest.
    two = sharding.plan_shards(cfg, "ruler", 2)
    made, covered = set(), set(three[0])
    for i, owned in enumerate(two):
        rows = read_jsonl(sharding.run_shard(cfg, ckpt, "ruler", owned, i, 2))[1:]
        made |= {r["key"] for r in rows}
        covered |= set(owned)
        # The shard whose records complete the evaluation merges it; before that, none does.
        out = sharding.finalize_if_complete(cfg, ckpt, "ruler", 2)
        assert (out is not None) == (covered == set(sharding.units(cfg, "ruler"))), i
    assert not made & done_first and len(made | done_first) == 8
    assert sharding.finalize_if_complete(cfg, ckpt, "ruler", 2) == out  # done: left alone
    got = results.load_result(out)
    samples = dict(got["samples"])
    assert len(samples.pop("sha256")) == 64  # the records' hash, checked by cached re-runs
    assert samples == {"resumed": 8, "new": 0, "file": "ruler.samples.jsonl"}
    # What the records cost: every process that generated them, not the merge's own moment
    # (duration_s). Four processes: shard 0 of 3, both shards of 2, and the merge.
    log = read_jsonl(results.time_log_path(results.samples_path(ckpt, "ruler")))
    assert [r["process"] for r in log] == [
        "shard 0 of 3",
        "shard 0 of 2",
        "shard 1 of 2",
        "evaluate",
    ]
    assert sum(r["records"] for r in log) == 8 and log[-1]["records"] == 0
    spent = sum(v for r in log for k, v in r.items() if k.endswith("_s"))
    assert got["processes"] == 4 and got["process_s"] == pytest.approx(spent, abs=1e-3)
    assert got["process_s"] > got["duration_s"]
    # Unsharded: one process, whose logged load and generation are the result's process_s
    # (not compared with duration_s, which also counts the writing after generation).
    (one,) = read_jsonl(results.time_log_path(results.samples_path(plain_ckpt, "ruler")))
    assert one["process"] == "evaluate" and one["records"] == 8
    assert ref["processes"] == 1
    assert ref["process_s"] == pytest.approx(one["load_s"] + one["generate_s"], abs=1e-3)
    for field in ("scores", "counts", "not_run", "checkpoint_hash", "evaluation_fingerprint"):
        assert got[field] == ref[field], field
    assert _sorted_records(results.samples_path(ckpt, "ruler")) == ref_records
    assert not sharding._shard_files(ckpt, "ruler")
    # Cached: nothing to do, and the result is untouched.
    before = out.read_text()
    assert not sharding.prepare(cfg, ckpt, "ruler", force=False)
    assert json.loads(out.read_text()) == json.loads(before)
    # force restarts from nothing.
    assert sharding.prepare(cfg, ckpt, "ruler", force=True) and not out.exists()
    assert read_jsonl(results.samples_path(ckpt, "ruler"))[1:] == []
    assert not results.time_log_path(results.samples_path(ckpt, "ruler")).exists()


@pytest.mark.slow
def test_flow_shards_over_gpu_slots_in_child_processes(tmp_path, demo_corpus, prefect_harness):
    """Two GPU slots (the children run on CPU here): child processes, then one merge per pair;
    the same scores as in-process; the re-run is cached (no child process at all)."""
    from prefect import flow

    from anchorctx.flows.sharded import evaluate_sharded

    # One length: two units, one a slot (each child process costs CI time).
    plain_cfg, plain_ckpt = _cfg(tmp_path, demo_corpus, "plain", lengths=LENGTHS[:1])
    ref = results.load_result(
        results.evaluate_checkpoint(plain_cfg, plain_ckpt, "ruler", progress=False)
    )
    cfg, ckpt = _cfg(tmp_path, demo_corpus, "flow", lengths=LENGTHS[:1])

    @flow
    def run() -> list[str]:
        return evaluate_sharded(cfg, [str(ckpt)], ["ruler"], False, ["0", "1"])

    with prefect_harness():
        (path,) = run()
        got = results.load_result(path)
        assert got["scores"] == ref["scores"] and got["samples"]["new"] == 0
        assert _sorted_records(results.samples_path(ckpt, "ruler")) == _sorted_records(
            results.samples_path(plain_ckpt, "ruler")
        )
        stamp = Path(path).stat().st_mtime_ns
        assert run() == [path] and Path(path).stat().st_mtime_ns == stamp


def test_missing_report_names_missing_cells_and_foreign_shard_files(tmp_path, demo_corpus):
    """What a shard that cannot merge (and a merge that must generate) prints: the records
    missing by cell, and every shard file whose header is another identity's (ignored)."""
    cfg, ckpt = _cfg(tmp_path, demo_corpus, "report", lengths=LENGTHS[:1])
    assert sharding.prepare(cfg, ckpt, "ruler", force=False)
    first, second = sharding.plan_shards(cfg, "ruler", 2)
    sharding.run_shard(cfg, ckpt, "ruler", first, 0, 2)
    (task, length) = second[0].split("/")
    assert sharding.missing_report(cfg, ckpt, "ruler") == (
        f"2 recorded, 2 RULER samples missing in 1 cell(s) ['{task}@{length}']"
    )
    # A shard file written under another checkpoint hash: its records do not count.
    path = sharding.shard_path(ckpt, "ruler", 1, 2, cfg)
    ident = results.identity(cfg, ckpt, "ruler")
    rows = [{results.HEADER_KEY: {**ident, "checkpoint_hash": "0" * 64}}]
    rows += [
        {"key": f"{second[0]}/{i}", "task": task, "length": int(length), "score": 0.0}
        for i in range(2)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = sharding.missing_report(cfg, ckpt, "ruler")
    assert got.startswith("2 recorded, 2 RULER samples missing"), got
    assert got.endswith(f"ignored as another identity's: ['{path.name} (other checkpoint_hash)']")


def test_evaluation_is_split_over_the_gpus_training_does_not_hold(
    tmp_path, demo_corpus, monkeypatch
):
    """While training holds GPUs of the pool (full-experiment's overlap), an evaluation is
    split into as many shards as GPUs are left, not one per GPU of the pool: its shards could
    only queue on those, each paying a process start and a model load."""
    from anchorctx.flows import sharded
    from anchorctx.tasks.sharding import evaluation_gpus, give_gpus, gpu_slots, take_gpus

    slots = gpu_slots(["5", "6", "7"])
    assert evaluation_gpus(slots) == 3
    held = take_gpus(slots, 2)
    assert evaluation_gpus(slots) == 1

    cfg, ckpt = _cfg(tmp_path, demo_corpus, "held", lengths=LENGTHS[:1])
    planned = []

    class Planned(Exception):
        pass

    def plan(cfg, suite, count):
        planned.append(count)
        raise Planned  # before any shard is submitted

    monkeypatch.setattr(sharded, "plan_shards", plan)
    with pytest.raises(Planned):
        sharded.evaluate_sharded(cfg, [str(ckpt)], ["ruler"], False, ["5", "6", "7"])
    give_gpus(slots, held)
    assert evaluation_gpus(slots) == 3
    with pytest.raises(Planned):
        sharded.evaluate_sharded(cfg, [str(ckpt)], ["ruler"], False, ["5", "6", "7"])
    assert planned == [1, 3]


def test_compile_shard_replays_the_shards_batches_and_writes_nothing(
    tmp_path, demo_corpus, monkeypatch, capsys
):
    """The compile-ahead pass of a shard asks the decoder for the batches the shard's own
    process will decode, in the same order, and prefills, decodes and writes nothing."""
    from anchorctx.models.decoding import GreedyDecoder

    cfg, ckpt = _cfg(tmp_path, demo_corpus, "ahead")  # two units a shard: two batches
    calls: list[tuple[str, tuple[int, ...], int]] = []
    generate, prepare = GreedyDecoder.generate, GreedyDecoder.prepare

    def record_generate(self, rows, **kw):
        calls.append(("decoded", tuple(len(r) for r in rows), kw["max_new_tokens"]))
        return generate(self, rows, **kw)

    def record_prepare(self, lengths, **kw):
        calls.append(("compiled", tuple(lengths), kw["max_new_tokens"]))
        return prepare(self, lengths, **kw)

    monkeypatch.setattr(GreedyDecoder, "generate", record_generate)
    monkeypatch.setattr(GreedyDecoder, "prepare", record_prepare)
    plan = sharding.plan_shards(cfg, "ruler", 2)
    assert len(plan) == 2
    for i, owned in enumerate(plan):
        calls.clear()
        argv = ["--config", str(_config_json(tmp_path, cfg)), "--checkpoint", str(ckpt)]
        argv += ["--suite", "ruler", "--shard", str(i), "2", "--compile-only", "--units", *owned]
        assert sharding.main(argv) == 0
        assert capsys.readouterr().out.splitlines()[-1] == "compiled the decode steps of 4 samples"
        compiled = [c[1:] for c in calls]
        assert len(compiled) == 2 and {c[0] for c in calls} == {"compiled"}
        # Nothing written: no samples, shard or time-log file.
        assert not list(results.samples_path(ckpt, "ruler", cfg).parent.glob("ruler*"))
        calls.clear()
        sharding.prepare(cfg, ckpt, "ruler", force=False)
        sharding.run_shard(cfg, ckpt, "ruler", owned, i, 2)
        assert [c[1:] for c in calls] == compiled and {c[0] for c in calls} == {"decoded"}
        sharding.prepare(cfg, ckpt, "ruler", force=True)  # the next shard starts from nothing
        for path in results.samples_path(ckpt, "ruler", cfg).parent.glob("ruler*"):
            path.unlink()
    with pytest.raises(ValueError, match="'mmlu' does not decode"):
        sharding.compile_shard(cfg, ckpt, "mmlu", [sharding.WHOLE])


def _config_json(tmp_path: Path, cfg: ExperimentConfig) -> Path:
    path = tmp_path / "config.json"
    path.write_text(cfg.model_dump_json())
    return path


def test_first_arm_compiles_ahead_before_it_evaluates(tmp_path, demo_corpus, monkeypatch):
    """full-experiment submits the compile-ahead pass of its first arm (with the arms' base
    model) where the schedule puts it (tests/test_schedule.py has every decision): with
    overlap, on the evaluation GPUs while that arm trains; without, on every GPU while the data
    is packed, after the base model's evaluation. Whether the arm has trained is read from its
    run directory."""
    from anchorctx.evaluation.schedule import Machine, decide_schedule
    from anchorctx.flows import experiment

    base = tmp_path / "base"
    save_checkpoint(base, demo_corpus.tokenizer_dir, seed=1, step=0)
    cfg, _ = _cfg(tmp_path, demo_corpus, "ahead-flow", checkpoint=False)
    raw = cfg.model_dump(mode="json")
    raw["model"] = {"path": str(base), "dtype": "float32"}
    raw["evaluation"]["device"] = "auto"
    raw["training"]["nproc"] = 1
    raw["variants"] = [
        {"name": "full", "attention": "full"},
        {"name": "anchor", "attention": "anchor"},
    ]
    cfg = config_from_dict(raw)
    submitted = []

    def submit(*args, wait_for=None):
        submitted.append((*args, wait_for))
        return "future"

    monkeypatch.setattr(experiment.compile_ahead_task, "submit", submit)

    def ahead(gpus: list[str]):
        schedule = decide_schedule(cfg, cfg.arms(), experiment.STAGES, None, Machine(lambda: gpus))
        return schedule.compile_ahead

    # One GPU: before training, after the base model's evaluation; nothing beside training.
    one = ahead(["0"])
    assert experiment._compile_ahead(one, beside_training=True) is None
    assert experiment._compile_ahead(one, beside_training=False, after="base") == "future"
    ((arm, checkpoint, suites, gpus, after),) = submitted
    assert arm.variant_name == "full" and checkpoint == str(base)
    assert suites == ["ruler"] and gpus == ["0"] and after == ["base"]
    # Three GPUs (the arms train on one): beside the first arm's training, on the pool's GPUs.
    three = ahead(["0", "1", "2"])
    assert experiment._compile_ahead(three, beside_training=False) is None
    assert experiment._compile_ahead(three, beside_training=True) == "future"
    assert submitted[-1][3:] == (["0", "1", "2"], None)
    step = arm.run_dir / "checkpoints" / "step-000002"
    save_checkpoint(step, demo_corpus.tokenizer_dir, seed=2, step=2)
    assert ahead(["0"]) is None  # trained (or resuming): its training may end at once


def test_compile_ahead_plans_the_shards_evaluation_will_run(
    tmp_path, demo_corpus, monkeypatch, prefect_harness
):
    """One compile-only shard command per shard of each decoding suite, planned as the
    evaluation plans it (over the GPUs training leaves), with the given checkpoint."""
    from prefect import flow

    from anchorctx.flows.sharded import compile_sharded
    from anchorctx.tasks import sharding as tasks
    from anchorctx.tasks.sharding import give_gpus, gpu_slots, take_gpus

    cfg, ckpt = _cfg(tmp_path, demo_corpus, "ahead-plan")
    commands = []
    monkeypatch.setattr(tasks, "_run_on_gpu", lambda cmd, slots: commands.append(cmd) or "ok")
    slots = gpu_slots(["3", "4", "5"])
    held = take_gpus(slots, 1)

    @flow
    def run() -> list[str]:
        return compile_sharded(cfg, str(ckpt), ["ruler", "mmlu"], ["3", "4", "5"])

    try:
        with prefect_harness():
            assert run() == ["ok", "ok"]
    finally:
        give_gpus(slots, held)
    plan = sharding.plan_shards(cfg, "ruler", 2)
    got = sorted(commands, key=lambda c: c[c.index("--shard") + 1])
    for i, (cmd, units) in enumerate(zip(got, plan)):
        assert cmd[cmd.index("--checkpoint") + 1] == str(ckpt)
        assert cmd[cmd.index("--shard") + 1 : cmd.index("--shard") + 3] == [str(i), "2"]
        assert "--compile-only" in cmd and cmd[cmd.index("--units") + 1 :] == units


def test_a_shard_reuses_the_callers_checkpoint_hash_while_the_files_are_unchanged(
    tmp_path, demo_corpus, monkeypatch
):
    """The flow hashes a checkpoint before its shards start and passes the hash with the files'
    signature; a shard trusts it only while every file keeps its name, size, mtime and inode,
    as this process' own memo does. Another process is stood for by an empty memo."""
    _, ckpt = _cfg(tmp_path, demo_corpus, "hash-token")
    token = results.checkpoint_hash_token(ckpt)
    digest = results.checkpoint_hash(ckpt)
    assert token.endswith(":" + digest)
    read: list[Path] = []
    real = results.hash_tree
    monkeypatch.setattr(results, "hash_tree", lambda p: read.append(p) or real(p))
    monkeypatch.setattr(results, "_HASH_MEMO", {})
    assert results.trust_checkpoint_hash(ckpt, token)
    assert results.checkpoint_hash(ckpt) == digest and read == []
    # A file rewritten since: the token is refused and the files are read.
    monkeypatch.setattr(results, "_HASH_MEMO", {})
    config = ckpt / "config.json"
    config.write_text(config.read_text() + " ")
    assert not results.trust_checkpoint_hash(ckpt, token)
    assert results.checkpoint_hash(ckpt) != digest and len(read) == 1
    assert not results.trust_checkpoint_hash(tmp_path / "missing", token)


def test_compile_ahead_takes_the_base_model_at_the_arms_length(tmp_path, demo_corpus):
    """The pass compiles for the architecture the arm will have: a base model pretrained short
    (position limit 1024) is taken at the limit the arm's training gives it (its RoPE base set
    for data.seq_len), so RULER's longer lengths compile instead of being refused (gpu-small's
    pass failed so on a GPU host). Without a RoPE base the arm keeps the base's limit, and the
    pass refuses them as the evaluation would."""
    from anchorctx.evaluation.ruler.runner import RulerLengthError

    cfg, _ = _cfg(tmp_path, demo_corpus, "ahead-long", checkpoint=False)
    base = tmp_path / "base"
    save_checkpoint(base, demo_corpus.tokenizer_dir, seed=1, step=0, positions=1024)
    long_arm = cfg.model_copy(deep=True)
    long_arm.model.rope_theta = 40000.0
    long_arm.data.seq_len = 2048
    units = list(sharding.units(cfg, "ruler"))
    assert sharding.compile_shard(long_arm, base, "ruler", units) == 8
    results.clear_model_cache()
    with pytest.raises(RulerLengthError, match="2048"):
        sharding.compile_shard(cfg, base, "ruler", units)
