"""Data tasks: the demo corpus, evaluation fixtures, and the packed dataset (cached by content)."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from anchorctx.demo import ensure_demo_corpus, ensure_eval_fixtures
from anchorctx.demo.heldout_eval import ensure_heldout_eval
from anchorctx.demo.pretrain_corpus import ensure_pretrain_corpus
from anchorctx.experiment import ExperimentConfig
from anchorctx.packing import prepare_data
from anchorctx.tasks.caching import prepare_data_cache_key


@task(name="ensure-demo-corpus")
def ensure_demo_corpus_task(cfg: ExperimentConfig) -> str | None:
    """Write the seeded demo corpus and tokenizer when ``data.demo_corpus`` is set and missing."""
    corpus = ensure_demo_corpus(cfg)
    return None if corpus is None else str(corpus.root)


@task(name="ensure-pretrain-corpus")
def ensure_pretrain_corpus_task(cfg: ExperimentConfig) -> str | None:
    """Write the generated retrieval corpus of ``pretrain.corpus`` when it is missing."""
    data = ensure_pretrain_corpus(cfg)
    return None if data is None else str(data)


@task(name="ensure-eval-fixtures")
def ensure_eval_fixtures_task(cfg: ExperimentConfig) -> dict[str, str] | None:
    """Write the demo evaluation data once, before evaluation tasks run concurrently."""
    paths = ensure_eval_fixtures(cfg)
    return None if paths is None else {k: str(v) for k, v in paths.items()}


@task(name="ensure-heldout-eval")
def ensure_heldout_eval_task(cfg: ExperimentConfig) -> dict[str, str] | None:
    """Write the generated held-out evaluation data of ``evaluation.heldout_data`` if missing."""
    paths = ensure_heldout_eval(cfg)
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
