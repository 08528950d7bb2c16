"""Shared fixtures: the seeded demo corpus and tokenizer, a tiny experiment config, its packed
dataset. Everything is generated locally; nothing is downloaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never talk to a hub and never send analytics.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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


def pytest_collection_modifyitems(config, items):
    """`gpu` tests run only where CUDA is available (pytest -m gpu on a GPU machine)."""
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def demo_corpus(tmp_path_factory):
    """A small seeded demo corpus (SlimPajama layout) and its byte-level BPE tokenizer."""
    from anchorctx.demo.corpus import write_demo_corpus

    return write_demo_corpus(
        tmp_path_factory.mktemp("demo_corpus"), seed=0, docs_per_domain=12, progress=False
    )


@pytest.fixture(scope="session")
def tiny_config(demo_corpus, tmp_path_factory):
    """An experiment config on the demo corpus with a tiny random Llama (GQA 4:2)."""
    from anchorctx.config import config_from_dict

    root: Path = tmp_path_factory.mktemp("runs")
    raw = {
        "name": "test",
        "run_root": str(root),
        "seed": 0,
        "model": {
            "tiny": {"architecture": "llama", "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
            "tokenizer": str(demo_corpus.tokenizer_dir),
            "dtype": "float32",
        },
        "data": {"sources": [{"path": str(demo_corpus.data_dir)}], "seq_len": 512,
                 "token_budget": 60_000},
        "training": {"device": "cpu", "engine": "sdpa", "precision": "fp32", "steps": 4,
                     "global_batch_size": 2, "micro_batch_size": 1, "zero_stage": 0,
                     "activation_checkpointing": False, "save": {"every": 2, "last": None}},
    }  # fmt: skip
    return config_from_dict(raw)


@pytest.fixture(scope="session")
def packed_demo(tiny_config) -> Path:
    """The packed dataset of ``tiny_config`` (built once per test session)."""
    from anchorctx.packing import prepare_data

    return prepare_data(tiny_config, progress=False)
