"""Suite ``perplexity`` (paper Figure 4): token-level perplexity of held-out packed rows.

Perplexity of a causal LM here is exp(mean negative log-likelihood over the predicted tokens) of
rows built exactly as training builds its own:

- the documents of ``evaluation.perplexity.data_path`` (a held-out file, read as ``data.sources``
  are: :func:`anchorctx.packing.sources.read_file`) are tokenised by the checkpoint's tokenizer
  and packed in file order into rows of ``length + 1`` tokens by the packer prepare-data uses
  (:class:`anchorctx.packing.pack.RowPacker`: the anchor at index 0, ``data.separator`` after
  each document, a document that does not fit continuing in the next row);
- each row becomes a model input and its targets by training's own
  :func:`anchorctx.training.data.make_row` (``training.boundary_targets`` applies), so the
  predicted tokens are the ones training's loss counts;
- the model reads it with the attention the checkpoint was trained with (``anchorctx.json``'s
  ``attention``; anchor rows: each document sees itself and the anchor, position ids
  continuing), through the project's registered attention (:mod:`anchorctx.attention.hf`),
  selected for the forward and put back after it, since the evaluation model is shared with the
  other suites, which decode with SDPA;
- the negative log-likelihood is summed in float32 over the predicted tokens, the output
  embedding running over chunks of positions (a 128K row never holds its [T, V] logits whole).

One record per row (``<length>/<row>``: its summed NLL and its number of predicted tokens), so an
interrupted evaluation resumes; the score of a length is exp(Σ NLL / Σ tokens) over its rows.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from anchorctx.io import read_json
from anchorctx.models.checkpoints import META_FILE
from anchorctx.models.loading import lengths_beyond
from anchorctx.packing.settings import SourceConfig

if TYPE_CHECKING:
    from anchorctx.experiment import ExperimentConfig

TASK = "perplexity"
KEY = "evaluation.perplexity.data_path"
# Float32 logits of at most this many elements at once (256 MiB), as the lm-eval model scores.
HEAD_CHUNK_ELEMENTS = 1 << 26


class PerplexityDataError(ValueError):
    """The held-out data cannot give the rows asked for; the message names the file or key."""


def data_file(cfg: ExperimentConfig) -> Path:
    """The held-out file, or an error naming the key."""
    path = cfg.evaluation.perplexity.data_path
    if path is None:
        raise PerplexityDataError(
            f"suite 'perplexity' needs {KEY}: a held-out .jsonl, .jsonl.zst or .parquet file "
            "of documents (kept out of data.sources)"
        )
    if not Path(path).is_file():
        raise PerplexityDataError(f"{KEY} = {path} is not a file")
    return Path(path)


def read_documents(cfg: ExperimentConfig) -> list[str]:
    """The held-out texts in file order; a bad record is an error naming its file and line."""
    # Imported here: the readers import pyarrow, which the suite registry (and so `anchorctx
    # evaluate --help`) skips.
    from anchorctx.packing.sources import BadInput, DataError, read_file, source_format

    path = data_file(cfg)
    src = SourceConfig(path=path, text_field=cfg.evaluation.perplexity.text_field, domain="heldout")
    try:
        if source_format(path, "auto") not in ("jsonl", "jsonl.zst", "parquet"):
            raise DataError(f"{path}: expected a .jsonl, .jsonl.zst or .parquet file")
        texts = [r.text for r in read_file(src, path, 0, BadInput(skip=False), None)]
    except DataError as err:
        message = str(err).replace(" (set data.on_bad_input=skip to skip and count)", "")
        raise PerplexityDataError(f"{KEY}: {message}") from None
    if not texts:
        raise PerplexityDataError(f"{KEY} = {path} holds no document")
    return texts


def check_data(cfg: ExperimentConfig) -> None:
    """Before the model loads: the file is set, readable and holds documents."""
    read_documents(cfg)


def lengths(cfg: ExperimentConfig) -> list[int]:
    """The row lengths: ``evaluation.perplexity.lengths``, by default ``data.seq_len``."""
    return list(cfg.evaluation.perplexity.lengths or [cfg.data.seq_len])


def resolved_settings(cfg: ExperimentConfig) -> dict[str, Any]:
    """The settings outside ``evaluation.perplexity`` that change its scores (they go into the
    suite's evaluation fingerprint): the lengths as resolved, how documents are separated and
    which targets count."""
    return {
        "lengths": lengths(cfg),
        "separator": cfg.data.separator,
        "boundary_targets": cfg.training.boundary_targets,
    }


def checkpoint_attention(checkpoint: str | Path | None, setting: str) -> str:
    """The variant rows are read with: ``setting`` unless ``checkpoint``, then the
    ``attention`` the checkpoint's ``anchorctx.json`` records; ``full`` where it records none
    (a base model: plain causal attention, as it was pretrained)."""
    if setting != "checkpoint":
        return setting
    meta = Path(checkpoint) / META_FILE if checkpoint is not None else None
    if meta is None or not meta.is_file():
        return "full"
    attention = read_json(meta).get("attention")
    return str(attention) if attention else "full"


def packed_rows(
    documents: list[np.ndarray], separator: np.ndarray, anchor: int, length: int, rows: int
) -> list[dict[str, Any]]:
    """The first ``rows`` rows of ``length + 1`` tokens the documents fill, packed as
    prepare-data packs (no domain tags); fewer when the documents run out."""
    # Imported here: the packer imports pyarrow, which the suite registry skips.
    from anchorctx.packing.pack import SEP, TEXT, RowPacker

    packer = RowPacker(length, anchor, len(documents))
    out: list[dict[str, Any]] = []
    sep_kinds = np.full(separator.size, SEP, dtype=np.uint8)
    for d, ids in enumerate(documents):
        kinds = np.concatenate([np.full(ids.size, TEXT, dtype=np.uint8), sep_kinds])
        for row in packer.add(np.concatenate([ids, separator]), kinds, d, "heldout"):
            out.append(row)
            if len(out) == rows:
                return out
    return out


@contextlib.contextmanager
def packed_attention(model: Any) -> Iterator[None]:
    """``model`` dispatches to the project's registered attention (which reads the rows'
    layouts) inside, to the implementation it had before after."""
    # Imported here: torch and transformers load with the model, not with the suite registry.
    from anchorctx.attention.hf import attention_name, register, select_attention

    before = attention_name(model)
    select_attention(model, register())
    try:
        yield
    finally:
        select_attention(model, before)


def row_nll(model: Any, row: Any, variant: str, engine: str) -> tuple[float, int]:
    """(summed NLL in float32, predicted tokens) of one row (:func:`make_row`'s ``Row``)."""
    # Imported here: torch loads with the model, not with the suite registry.
    import torch

    from anchorctx.attention import build_layout
    from anchorctx.attention.hf import model_inputs
    from anchorctx.training.loss import count_targets, summed_cross_entropy

    device = model.get_input_embeddings().weight.device
    layout = build_layout(row.seg_lens, variant, row.seg_doc)
    ids = row.input_ids[None].to(device)  # [1, T]
    targets = row.targets[None].to(device)
    with torch.inference_mode():
        kwargs = model_inputs([layout], engine=engine, device=device)
        hidden = model.get_decoder()(input_ids=ids, use_cache=False, **kwargs).last_hidden_state
        head = model.get_output_embeddings()
        chunk = max(1, HEAD_CHUNK_ELEMENTS // model.config.get_text_config().vocab_size)
        total = torch.zeros((), dtype=torch.float32, device=device)
        for lo in range(0, ids.shape[1], chunk):
            part = slice(lo, lo + chunk)
            total += summed_cross_entropy(head(hidden[:, part]), targets[:, part])
    return float(total), count_targets(row.targets)


def _check_lengths(model: Any, wanted: list[int]) -> None:
    limit, too_long = lengths_beyond(model, wanted)
    if too_long:
        raise PerplexityDataError(
            f"evaluation.perplexity.lengths {too_long} exceed the model's "
            f"max_position_embeddings={limit}: lower them (or extend the model's RoPE)"
        )


def _rows_of(cfg: ExperimentConfig, tokenizer: Any, length: int) -> list[dict[str, Any]]:
    """The held-out rows of one length, or an error naming the file when it fills too few."""
    # Imported here: the packing pipeline pulls in datasets, which the registry skips.
    from anchorctx.models.loading import anchor_token_id
    from anchorctx.packing.pipeline import separator_ids
    from anchorctx.packing.tokens import encode_texts

    pcfg = cfg.evaluation.perplexity
    flat, sizes = encode_texts(tokenizer, read_documents(cfg))
    anchor = anchor_token_id(tokenizer)
    if (flat == anchor).any():
        raise PerplexityDataError(
            f"{KEY} = {pcfg.data_path}: a document holds the anchor token id {anchor} in its "
            "text (the anchor may only open a row, as in training)"
        )
    documents = np.split(flat, np.cumsum(sizes)[:-1])
    rows = packed_rows(documents, separator_ids(cfg.data, tokenizer), anchor, length, pcfg.rows)
    if len(rows) < pcfg.rows:
        raise PerplexityDataError(
            f"{KEY} = {pcfg.data_path}: {int(sizes.sum())} tokens fill {len(rows)} row(s) of "
            f"{length} tokens, evaluation.perplexity.rows asks for {pcfg.rows}: add documents "
            "or lower evaluation.perplexity.rows / lengths"
        )
    return rows


def run_suite(
    model: Any,
    tokenizer: Any,
    cfg: ExperimentConfig,
    *,
    checkpoint: str | Path | None = None,
    done: Mapping[str, dict[str, Any]],
    on_sample: Any,
    progress: bool = True,
) -> dict[str, Any]:
    """Perplexity at each length (the suite runner, :data:`anchorctx.evaluation.results.
    SUITES`); ``checkpoint``: the evaluated directory, whose ``anchorctx.json`` names the
    attention (``evaluation.perplexity.attention: checkpoint``)."""
    # Imported here: training's row builder imports torch, which the suite registry skips.
    from anchorctx.training.data import make_row

    pcfg = cfg.evaluation.perplexity
    wanted = lengths(cfg)
    _check_lengths(model, wanted)
    variant = checkpoint_attention(checkpoint, pcfg.attention)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    records = {k: v for k, v in done.items() if k.split("/")[0] in {str(n) for n in wanted}}
    todo = [(n, i) for n in wanted for i in range(pcfg.rows) if f"{n}/{i}" not in done]
    bar = tqdm(total=len(todo), desc="perplexity", unit="row", disable=not progress)
    with packed_attention(model):
        for length in sorted({n for n, _ in todo}):
            rows = _rows_of(cfg, tokenizer, length)
            for n, i in todo:
                if n != length:
                    continue
                row = make_row(rows[i], length, 1, variant, pad, cfg.training.boundary_targets)
                nll, tokens = row_nll(model, row, variant, pcfg.engine)
                key = f"{n}/{i}"
                record = {"key": key, "length": n, "row": i, "nll": nll, "tokens": tokens}
                on_sample(record)
                records[key] = record
                bar.update()
    bar.close()
    return summarize(records, wanted, variant)


def summarize(
    records: Mapping[str, dict[str, Any]], wanted: list[int], variant: str
) -> dict[str, Any]:
    """Scores from the per-row records: exp(Σ NLL / Σ tokens) per length."""
    scores: dict[str, float] = {}
    counts: dict[str, int] = {}
    tokens: dict[str, int] = {}
    nll: dict[str, float] = {}
    for n in wanted:
        rows = [r for r in records.values() if r.get("length") == n]
        total = sum(int(r["tokens"]) for r in rows)
        counts[str(n)], tokens[str(n)] = len(rows), total
        if total:
            nll[str(n)] = sum(float(r["nll"]) for r in rows) / total
            scores[str(n)] = math.exp(nll[str(n)])
    return {
        "scores": {TASK: scores},
        "counts": {TASK: counts},
        "not_run": {},
        "tokens": {TASK: tokens},
        "mean_nll": {TASK: nll},
        "attention": variant,
    }
