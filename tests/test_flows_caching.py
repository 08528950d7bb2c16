"""Cache keys of the Prefect tasks are content hashes: equal content -> equal key, any change
that alters the output -> a new key. Plus the artifact helpers' pure functions."""

from __future__ import annotations

import json
import shutil

import pytest

from anchorctx.experiment import VariantSpec
from anchorctx.tasks.api import synchronous
from anchorctx.tasks.artifacts import artifact_key, md_table
from anchorctx.tasks.caching import code_version, data_key, evaluate_cache_key, train_cache_key
from anchorctx.tasks.reporting import report_tables, summary_tables
from anchorctx.tasks.reuse import CACHED_SUFFIX, _cached_name


def _arm(cfg, name, attention, **overrides):
    return cfg.for_variant(VariantSpec(name=name, attention=attention, overrides=overrides))


def test_data_key_shared_by_attention_arms_not_by_tagged_arm(tiny_config):
    full, anchor = _arm(tiny_config, "full", "full"), _arm(tiny_config, "anchor", "anchor")
    tagged = _arm(tiny_config, "anchor_tags", "anchor", **{"data.domain_tags": True})
    assert data_key(full) == data_key(anchor)
    assert data_key(tagged) != data_key(anchor)
    longer = _arm(tiny_config, "a", "anchor", **{"data.seq_len": 1024})
    assert data_key(longer) != data_key(anchor)


def test_data_key_follows_source_files(tiny_config, demo_corpus, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(demo_corpus.data_dir, data)
    cfg = tiny_config.model_copy(deep=True)
    cfg.data.sources[0].path = data
    before = data_key(cfg)
    assert data_key(cfg) == before
    victim = next(p for p in sorted(data.rglob("*")) if p.is_file())
    victim.write_bytes(victim.read_bytes() + b"\n")
    assert data_key(cfg) != before


def test_train_key_depends_on_config_and_dataset_manifest(tiny_config, tmp_path):
    ds = tmp_path / "packed"
    ds.mkdir()
    (ds / "manifest.json").write_text(json.dumps({"fingerprint": "a"}))
    params = {"cfg": tiny_config, "dataset": str(ds)}
    key = train_cache_key(None, params)
    assert train_cache_key(None, dict(params)) == key
    other = tiny_config.model_copy(deep=True)
    other.training.lr = 1e-3
    assert train_cache_key(None, {**params, "cfg": other}) != key
    tracked = tiny_config.model_copy(deep=True)
    tracked.tracking.backends = ["tensorboard"]  # where numbers are logged, not what they are
    assert train_cache_key(None, {**params, "cfg": tracked}) == key
    (ds / "manifest.json").write_text(json.dumps({"fingerprint": "b"}))
    assert train_cache_key(None, params) != key


def _fake_checkpoint(root):
    ckpt = root / "run" / "checkpoints" / "step-000002"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 64)
    return ckpt


def test_evaluate_key_follows_checkpoint_content_and_suite_settings(tiny_config, tmp_path):
    ckpt = _fake_checkpoint(tmp_path)
    params = {"cfg": tiny_config, "checkpoint": str(ckpt), "suite": "ruler"}
    key = evaluate_cache_key(None, params)
    assert evaluate_cache_key(None, dict(params)) == key
    # Settings of another suite do not touch this suite's key; this suite's settings do.
    other_suite = tiny_config.model_copy(deep=True)
    other_suite.evaluation.harness.limit = 3
    assert evaluate_cache_key(None, {**params, "cfg": other_suite}) == key
    fewer = tiny_config.model_copy(deep=True)
    fewer.evaluation.ruler.num_samples = 3
    assert evaluate_cache_key(None, {**params, "cfg": fewer}) != key
    assert evaluate_cache_key(None, {**params, "suite": "mmlu"}) != key
    (ckpt / "model.safetensors").write_bytes(b"\x01" * 64)  # new weights, same size
    assert evaluate_cache_key(None, params) != key


def test_code_version_is_version_plus_source_hash():
    import anchorctx

    version, _, digest = code_version().partition("+")
    assert version == anchorctx.__version__ and len(digest) == 12


@pytest.mark.parametrize(
    ("parts", "key"),
    [
        (("anchor_tags", "RULER"), "anchor-tags-ruler"),
        (("Demo.v2", "x__y"), "demo-v2-x-y"),
        (("",), "artifact"),
    ],
)
def test_artifact_key_is_valid(parts, key):
    assert artifact_key(*parts) == key


def test_md_table_escapes_and_unions_columns():
    text = md_table([{"a": 1.234, "b": "x|y"}, {"a": None, "c": "z"}])
    assert text.splitlines()[0] == "| a | b | c |"
    assert "1.23" in text and "x\\|y" in text


def test_report_and_summary_tables():
    stat = {"mean": 50.0, "std": 5.0, "n": 2}
    report = {
        "tables": {
            "ruler": {"columns": ["4096", "8192"], "rows": {"anchor": {"4096": stat}}},
            "longbench": {"columns": [], "rows": {}},
            "general": {
                "columns": ["MMLU"],
                "rows": {"full": {"MMLU": {"mean": 40.0, "std": 0, "n": 1}}},
            },
        }
    }
    tables = report_tables(report)
    assert set(tables) == {"ruler-by-length", "mmlu-hellaswag"}
    rows, _ = tables["ruler-by-length"]
    assert rows[0]["variant"] == "anchor"
    assert list(rows[0].values())[1:] == ["50.00 ± 5.00", "—"]
    summary = {"suites": {"ruler": {"scores": {"niah": {"4096": stat}}, "average": {"4096": stat}}}}
    ruler = summary_tables(summary)["ruler"]
    assert [r["task"] for r in ruler] == ["average", "niah"]


def test_synchronous_passes_a_value_and_refuses_a_coroutine():
    """Prefect's sync-or-async calls return a coroutine only inside an event loop: an error
    there, never a coroutine handed on unawaited."""
    assert synchronous(3) == 3

    async def later() -> int:
        return 3

    with pytest.raises(TypeError, match="event loop"):
        synchronous(later())


def test_cached_name_keeps_each_kind_of_run_name():
    """A cached run's name is the task's own with the suffix, whether the task names its runs
    with a string, a function of nothing or a function of the run's parameters (which Prefect
    passes only to a callable that asks for them)."""
    from prefect import task

    def run(x: int) -> int:
        return x

    assert _cached_name(task(run)) == f"run{CACHED_SUFFIX}"
    assert _cached_name(task(run, task_run_name="r-{x}")) == f"r-{{x}}{CACHED_SUFFIX}"
    assert _cached_name(task(run, task_run_name=lambda: "plain"))() == f"plain{CACHED_SUFFIX}"
    named = task(run, task_run_name=lambda parameters: f"x-{parameters['x']}")
    assert _cached_name(named)(parameters={"x": 2}) == f"x-2{CACHED_SUFFIX}"
