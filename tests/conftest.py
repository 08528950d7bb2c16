"""Shared fixtures: the seeded demo corpus and tokenizer, a tiny experiment config, its packed
dataset. Everything is generated locally; nothing is downloaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Tests never talk to a hub and never send analytics.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# DeepSpeed's CPU comm op: the build scripts/setup.sh made (as scripts/test.sh sets), not a new
# ~40 s build when pytest runs on its own. Workers building it at once take turns (torch locks
# the build directory).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
# With pytest-xdist, one intra-op thread per worker (and per process a test starts): workers that
# each spread small ops over every core contend for the cores and run several times slower. Set
# before torch is first imported (below), which reads it then.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# Without a GPU, Triton kernels (the ``triton`` attention engine) run in Triton's interpreter.
# Triton reads the switch when it is first imported, which torch may do inside any test, so it
# is set here, before every test module.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The modules whose tests use the session's Prefect server (the ``served`` fixture of
# tests/test_flows_e2e.py): with pytest-xdist they all run on one worker, so that one server and
# one demo run serve them (not one a worker). Checked at collection: see below.
SERVED_MODULES = (
    "tests/test_flows_e2e.py",
    "tests/test_flows_stage_control.py",
    "tests/test_ui_browser.py",
)


def pytest_collection_modifyitems(config, items):
    """`gpu` tests run only where CUDA is available (pytest -m gpu on a GPU machine)."""
    skip = None if _has_cuda() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if skip is not None and "gpu" in item.keywords:
            item.add_marker(skip)
        module = item.nodeid.split("::")[0]
        fixtures = getattr(item, "fixturenames", ())
        if "served" in fixtures and module not in SERVED_MODULES:
            raise pytest.UsageError(
                f"{module} uses `served`: add it to SERVED_MODULES ({__file__})"
            )
        if "prefect_harness" in fixtures and TOGETHER.get(item.nodeid) != HARNESS_GROUP:
            raise pytest.UsageError(
                f"{item.nodeid} uses `prefect_harness`: add it to TOGETHER as HARNESS_GROUP "
                f"({__file__})"
            )
    check_listed_tests(items)


def check_listed_tests(items) -> None:
    """Every test SLOW_FIRST and TOGETHER name exists, so that a renamed test cannot silently
    leave its group or lose its place: its module must exist and, when collected, define it."""
    modules = {item.nodeid.split("::")[0]: item.module for item in items if hasattr(item, "module")}
    for nodeid in (*SLOW_FIRST, *TOGETHER):
        path, _, name = nodeid.partition("::")
        name = name.split("[")[0]
        if not (REPO / path).is_file() or (path in modules and not hasattr(modules[path], name)):
            raise pytest.UsageError(f"{nodeid}, named in {__file__}, is not a test")


# The slowest tests outside the served group, slowest first (CI durations on two cores from a
# fresh clone with empty caches, s): with pytest-xdist they go out first, right after the group,
# so that no worker is left with a long test at the end while the other idles (longest-first
# scheduling). A group goes out at its first member's place: the Prefect-harness group (its
# tests together ~200 s) leads, beside the served group on the other worker. A test missing
# here only runs later; the order changes no result; a name here that is no longer a test stops
# the collection (check_listed_tests). Refresh from `--durations` when it drifts.
SLOW_FIRST = (
    "tests/test_flows_overlap.py::test_overlapped_experiment_equals_sequential",  # group: 51
    "tests/test_gpu_small.py::test_miniature_pretrains_then_trains_the_arms_from_it",  # 55
    # group: the two pool tests, ~130 s together
    "tests/test_eval_pool_multinode.py::test_a_host_lost_mid_shard_is_run_again_on_the_other",
    "tests/test_eval_pool_multinode.py::test_shards_run_on_both_hosts_and_equal_one_process",
    "tests/test_training_multinode.py::test_a_killed_node_fails_the_other_and_the_run_resumes",
    "tests/test_tracking.py::test_training_logs_every_step_to_every_backend",  # 57
    "tests/test_decoding.py::test_fused_step_shares_weights_and_compiles",  # 51 (Inductor, cold)
    "tests/test_task_format.py::test_task_format_documents_do_not_depend_on_workers",  # 48
    "tests/test_training_sp.py::test_sp2_and_dp2_equal_one_process",
    "tests/test_tracking.py::test_evaluation_and_report_scores",  # 40
    "tests/test_flows_overlap.py::test_one_gpu_prefetches_ruler_samples_while_training",  # 39
    "tests/test_flows_overlap.py::test_prefetch_thread_starts_after_transformers_is_resolved",
    "tests/test_packing_pipeline.py::test_deterministic_across_runs_and_workers",  # 37
    "tests/test_training_multinode.py::test_a_node_without_the_shared_run_root_fails_at_start",
    "tests/test_eval_sharding.py::test_flow_shards_over_gpu_slots_in_child_processes",
    "tests/test_training_launch.py::test_cli_sp2_launch_matches_one_process",
    "tests/test_task_format.py::test_write_pretrain_corpus_with_task_format_documents",
    "tests/test_training_tools.py::test_a_cpu_run_on_a_gpu_host_uses_deepspeeds_cpu_accelerator",
    "tests/test_analysis_rope_precision.py::test_command_writes_json_figure_and_table",
    "tests/test_attention_triton.py::test_rows_with_different_variants_and_a_shared_layout",
)


# Tests that share something started or computed in processes of their own: with pytest-xdist
# each group runs on one worker (one computation, not one a worker), ordered as its first test.
# The tests using the `prefect_harness` fixture (below) share one Prefect test server, which
# stops after the last of them; every such test must be listed (checked at collection).
HARNESS_GROUP = "prefect-harness"
TOGETHER = {
    "tests/test_eval_sharding.py::test_compile_ahead_plans_the_shards_evaluation_will_run": (
        HARNESS_GROUP
    ),
    "tests/test_training_sp.py::test_sp2_and_dp2_equal_one_process": "sp-runs",
    "tests/test_training_sp.py::test_comparison_catches_one_dropped_token": "sp-runs",
    "tests/test_training_sp.py::test_ulysses_wrapper_survives_a_later_model_load": "sp-runs",
    "tests/test_flows_overlap.py::test_overlapped_experiment_equals_sequential": HARNESS_GROUP,
    "tests/test_gpu_small.py::test_miniature_pretrains_then_trains_the_arms_from_it": HARNESS_GROUP,
    "tests/test_flows_overlap.py::test_one_gpu_prefetches_ruler_samples_while_training": (
        HARNESS_GROUP
    ),
    "tests/test_eval_sharding.py::test_flow_shards_over_gpu_slots_in_child_processes": (
        HARNESS_GROUP
    ),
    "tests/test_flows_control.py::test_full_experiment_evaluates_an_lm_eval_suite": (HARNESS_GROUP),
    # One server and two worker hosts for both (tests/test_eval_pool_multinode.py: `pool`).
    "tests/test_eval_pool_multinode.py::test_shards_run_on_both_hosts_and_equal_one_process": (
        "pool-hosts"
    ),
    "tests/test_eval_pool_multinode.py::test_a_host_lost_mid_shard_is_run_again_on_the_other": (
        "pool-hosts"
    ),
    # The second compiles nothing: Inductor's in-process cache has the first's kernels (~13 s
    # of CPU each when the two compile at once on two workers).
    "tests/test_decoding.py::test_fused_step_shares_weights_and_compiles[llama]": "inductor",
    "tests/test_decoding.py::test_fused_step_shares_weights_and_compiles[qwen2]": "inductor",
}


SERVED_GROUP = "prefect-served"


def xdist_unit(nodeid: str) -> str:
    """The unit of tests ``nodeid`` runs in under pytest-xdist: the served group, its group in
    TOGETHER, or itself."""
    if nodeid.split("::")[0] in SERVED_MODULES:
        return SERVED_GROUP
    return TOGETHER.get(nodeid, nodeid)


def unit_order(unit: str) -> int:
    """Where a unit goes out: the served group first (the largest), then SLOW_FIRST's order
    (a group at its earliest member's place), then the rest in collection order."""
    if unit == SERVED_GROUP:
        return -1
    members = [n for n, group in TOGETHER.items() if group == unit] or [unit]
    return min(SLOW_RANK.get(n.split("[")[0], len(SLOW_FIRST)) for n in members)


SLOW_RANK = {nodeid: i for i, nodeid in enumerate(SLOW_FIRST)}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` (pyproject.toml) runs :func:`xdist_unit`'s units, longest first.

    pytest-xdist's own ``xdist_group`` mark does not group under pytest 9.2 (xdist 3.8 renames
    ``item._nodeid``, which pytest no longer reads), and a mark is seen only by the workers, not
    by the scheduler; so the groups are the tables above and the scheduler is ours, built on
    xdist's public scheduler protocol (tests/xdist_schedule.py)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist_schedule import UnitScheduling

    return UnitScheduling(config, xdist_unit, unit_order)


def shared_dir(tmp_path_factory, name: str) -> Path:
    """``name`` under the test run's base temporary directory, the same for every pytest-xdist
    worker (each worker's own ``tmp_path_factory`` root is a subdirectory of it)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    return root / name


@pytest.fixture(scope="session")
def demo_corpus(tmp_path_factory):
    """A small seeded demo corpus (SlimPajama layout) and its byte-level BPE tokenizer."""
    from filelock import FileLock

    from anchorctx.demo.corpus import write_demo_corpus

    # Written once for all workers: the first writes it, the others wait, then reuse it.
    path = shared_dir(tmp_path_factory, "demo_corpus")
    with FileLock(f"{path}.lock"):
        return write_demo_corpus(path, seed=0, docs_per_domain=12, progress=False)


@pytest.fixture(scope="session")
def tiny_config(demo_corpus, tmp_path_factory):
    """An experiment config on the demo corpus with a tiny random Llama (GQA 4:2)."""
    from anchorctx.experiment import config_from_dict

    root: Path = tmp_path_factory.mktemp("runs")
    raw = {
        "name": "test",
        "run_root": str(root),
        "seed": 0,
        "model": {
            "tiny": {
                "architecture": "llama",
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
            "token_budget": 60_000,
        },
        "training": {
            "device": "cpu",
            "engine": "sdpa",
            "precision": "fp32",
            "steps": 4,
            "global_batch_size": 2,
            "micro_batch_size": 1,
            "zero_stage": 0,
            "activation_checkpointing": False,
            "save": {"every": 2, "last": None},
        },
    }
    return config_from_dict(raw)


@pytest.fixture(scope="session")
def packed_demo(tiny_config) -> Path:
    """The packed dataset of ``tiny_config`` (built once per test session)."""
    from anchorctx.packing import prepare_data

    return prepare_data(tiny_config, progress=False)


@pytest.fixture
def prefect_harness():
    """``with prefect_harness(): ...``: Prefect's test harness on this process' one shared test
    server (tests/shared_prefect.py), stopped after the last test that uses it."""
    from shared_prefect import shared_prefect_harness

    return shared_prefect_harness


# Shared servers still needed by tests of this process that have not run yet: each stops after
# the last of its tests (not at the end of the session, idling meanwhile). With pytest-xdist a
# worker collects every test but runs its share; each group runs on one worker (the scheduler
# below), whose pending set empties, while the others never start the server.
_PENDING: dict[str, set[str]] = {}


def pytest_collection_finish(session):
    _PENDING["served"] = {
        i.nodeid for i in session.items if i.nodeid.split("::")[0] in SERVED_MODULES
    }
    _PENDING["harness"] = {
        i.nodeid for i in session.items if "prefect_harness" in getattr(i, "fixturenames", ())
    }


def pytest_runtest_teardown(item, nextitem):
    import sys

    for name, pending in _PENDING.items():
        if item.nodeid not in pending:
            continue
        pending.discard(item.nodeid)
        if pending:
            continue
        if name == "served" and (e2e := sys.modules.get("test_flows_e2e")) is not None:
            e2e.stop_served()
        if name == "harness" and (harness := sys.modules.get("shared_prefect")) is not None:
            harness.stop_shared_server()


def pytest_sessionfinish(session, exitstatus):
    """A shared Prefect test server still running (tests not run): stopped while logging still
    works (at exit its stop message would meet closed handlers)."""
    import sys

    if (harness := sys.modules.get("shared_prefect")) is not None:
        harness.stop_shared_server()
