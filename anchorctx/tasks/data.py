"""Data tasks: the demo corpus, evaluation fixtures, and the packed dataset (cached by content)."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from anchorctx.config import ExperimentConfig
from anchorctx.demo import ensure_demo_corpus, ensure_eval_fixtures
from anchorctx.packing import prepare_data
from anchorctx.tasks.caching import prepare_data_cache_key


@task(name="ensure-demo-corpus")
def ensure_demo_corpus_task(cfg: ExperimentConfig) -> str | None:
    """Write the seeded demo corpus and tokenizer when ``data.demo_corpus`` is set and missing."""
    corpus = ensure_demo_corpus(cfg)
    return None if corpus is None else str(corpus.root)


@task(name="ensure-eval-fixtures")
def ensure_eval_fixtures_task(cfg: ExperimentConfig) -> dict[str, str] | None:
    """Write the demo evaluation data once, before evaluation tasks run concurrently."""
    paths = ensure_eval_fixtures(cfg)
    return None if paths is None else {k: str(v) for k, v in paths.items()}


@task(
    name="prepare-data",
    cache_key_fn=prepare_data_cache_key,
    persist_result=True,
    result_serializer="json",
)
def prepare_data_task(cfg: ExperimentConfig, force: bool = False) -> str:
    """Sample, tokenise and pack; returns the packed dataset directory."""
    return str(prepare_data(cfg, force=force, progress=False))


def dataset_exists(path: str | Path | None) -> bool:
    return path is not None and (Path(path) / "manifest.json").is_file()
