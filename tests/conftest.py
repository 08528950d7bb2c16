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
        if "served" in getattr(item, "fixturenames", ()) and module not in SERVED_MODULES:
            raise pytest.UsageError(
                f"{module} uses `served`: add it to SERVED_MODULES ({__file__})"
            )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` (pyproject.toml) where the tests of SERVED_MODULES are one group.

    pytest-xdist's own ``xdist_group`` mark does not group under pytest 9.2 (xdist 3.8 renames
    ``item._nodeid``, which pytest no longer reads), hence a scheduler. Every other test is its
    own unit; the largest unit (the group) goes out first."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class ServedTogether(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.split("::")[0] in SERVED_MODULES:
                return "prefect-served"
            return super()._split_scope(nodeid)

    return ServedTogether(config, log)


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
