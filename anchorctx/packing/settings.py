"""The ``data`` section: sources, mixture, length upsampling, packing options. Read by
:mod:`anchorctx.packing`; ``packing.pipeline.data_fingerprint`` hashes it (the dataset
identity)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from anchorctx.config import Seed, Strict


class SourceConfig(Strict):
    path: Path = Field(description="A file, a directory, or a glob of SlimPajama-layout files.")
    format: Literal["auto", "jsonl", "jsonl.zst", "parquet", "hf"] = "auto"
    text_field: str = "text"
    domain_field: str = Field("meta.redpajama_set_name", description="Dotted path in a record.")
    domain: str | None = Field(None, description="Fixed domain for every record of this source.")


class UpsampleConfig(Strict):
    """Length upsampling. ``mixture: upsampled`` is Fu et al. 2024's per-source rule (the
    paper's data); ``mixture: long_share`` an earlier project rule that uses ``long_share``."""

    threshold: int = Field(
        4096,
        gt=0,
        description="Documents with fewer tokens than this are 'short' (Fu et al.: 4096).",
    )
    keep_short: float = Field(
        0.1,
        gt=0,
        le=1,
        description="upsampled: probability of keeping a short document (--down_sample_ratio 0.1).",
    )
    shares: Literal["auto", "slimpajama", "corpus"] | dict[str, float] = Field(
        "auto",
        description="upsampled: per-source token budget shares. 'slimpajama': the reference's "
        "SLIMPAJAMA_ORIGINAL_MIX; 'corpus': this corpus' own token shares; 'auto': slimpajama "
        "when every domain is a SlimPajama source name, else corpus; or explicit shares.",
    )
    order: Literal["buffered", "permutation"] = Field(
        "buffered",
        description="upsampled: document stream order. 'buffered': the reference's (datasets' "
        "streaming shuffle(seed): input files in a seeded order through a 1000-document "
        "buffer; coins from numpy's legacy generator seeded 15213, drawn only for short "
        "documents of open sources). 'permutation': a full seeded permutation of all documents, "
        "one coin each (mixes documents across files, which matters when each source is one "
        "file; docs/FIDELITY.md).",
    )
    long_share: float = Field(
        0.7,
        gt=0,
        lt=1,
        description="long_share only: target share of tokens from long documents, per domain.",
    )

    @model_validator(mode="after")
    def _shares(self) -> UpsampleConfig:
        if isinstance(self.shares, dict) and (problem := _shares_problem(self.shares)):
            raise ValueError(f"shares {problem}")
        return self


class DemoCorpusConfig(Strict):
    """Generate the seeded synthetic demo corpus and tokenizer here when missing."""

    dir: Path = Path(".demo/corpus")
    seed: Seed = 0
    docs_per_domain: int = Field(40, gt=0)


class DataConfig(Strict):
    demo_corpus: DemoCorpusConfig | None = Field(
        None, description="Demo/tests only: write the synthetic corpus to demo_corpus.dir first."
    )
    sources: list[SourceConfig] = Field(default_factory=list)
    seq_len: int = Field(65536, gt=1)
    token_budget: int | None = Field(None, gt=0, description="Tokens to sample; None: all input.")
    mixture: Literal["original", "upsampled", "long_share"] | dict[str, float] = Field(
        "original",
        description="'original' (natural shares), 'upsampled' (Fu et al. 2024 per-source "
        "upsampling, the paper's data), 'long_share' (an earlier project rule), or shares.",
    )
    upsample: UpsampleConfig = Field(default_factory=UpsampleConfig)
    separator: str = Field(
        "none",
        description="After each document: 'none' (AnchorContext: documents concatenated with no "
        "separator and no BOS; a row's only anchor is at index 0), 'eos' (the tokenizer's EOS "
        "token; for tokenizers whose anchor is EOS, e.g. Qwen, the anchor id then recurs inside "
        "rows), or literal text.",
    )
    domain_tags: bool = False
    tag_template: str = "{domain}\n"
    interleave_chunks: bool = False
    chunks_per_document: tuple[int, int] = (2, 3)
    on_bad_input: Literal["error", "skip"] = "error"
    num_workers: int = Field(1, ge=1)
    tokenize_batch_size: int = Field(256, ge=1)
    output_dir: Path | None = Field(
        None, description="Default: <run_root>/<name>/data/<data fingerprint>."
    )

    @model_validator(mode="after")
    def _chunk_range(self) -> DataConfig:
        lo, hi = self.chunks_per_document
        if not 1 <= lo <= hi:
            raise ValueError(
                f"chunks_per_document must be (min, max) with 1 <= min <= max, got {(lo, hi)}"
            )
        if isinstance(self.mixture, dict) and (problem := _shares_problem(self.mixture)):
            raise ValueError(f"mixture {problem}")
        return self


def _shares_problem(shares: dict[str, float]) -> str | None:
    """Why a mapping of shares (domain -> weight) cannot be normalised, or None."""
    negative = sorted(k for k, v in shares.items() if v < 0)
    if negative:
        return f"must be >= 0 (negative for {', '.join(negative)})"
    if sum(shares.values()) <= 0:
        return f"must have a positive sum (got {shares})"
    return None
