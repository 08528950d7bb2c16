"""Sampling documents to a token budget by domain mixture, and per-source length upsampling.

Mixtures (``data.mixture``):
- ``original``: each domain keeps its share of the corpus' tokens.
- ``{domain: ratio}``: explicit shares (normalised); documents of other domains are bad input.
- ``upsampled``: Fu et al. 2024 per-source length upsampling, the paper's data recipe
  (FranxYao/Long-Context-Data-Engineering ``data_engineering/slimpajama_packing.py
  --down_sample_mode per_source --down_sample_ratio 0.1``). Documents stream in the reference's
  order (``upsample.order: buffered``): ``datasets``' streaming ``shuffle(seed)``, i.e. the input
  files in an order permuted by the seed, read through a 1000-document shuffle buffer (see
  :func:`buffered_stream`). Each source (domain) has a token budget ``token_budget x share``
  (``share``: SlimPajama's original mix, ``SLIMPAJAMA_ORIGINAL_MIX``, for SlimPajama sources;
  see ``upsample.shares``). A document of a source whose kept tokens already exceed its budget
  is skipped; otherwise a document shorter than ``upsample.threshold`` (4096) tokens is kept
  with probability ``upsample.keep_short`` (0.1) and a longer one always. The coin is the
  reference's ``np.random.random()`` (the legacy global generator seeded 15213 at import),
  drawn only for the short documents of sources still open; the stream stops once every source
  has met its budget. Nothing is repeated or cut, so a source may end one document over its
  budget, or under it when its documents run out. ``upsample.order: permutation`` (an option)
  streams a full seeded permutation of all documents with one coin per document instead.
- ``long_share``: an earlier project rule (not the paper's): per domain, documents of at least
  ``upsample.threshold`` tokens supply ``max(upsample.long_share, their natural share)`` of the
  domain's tokens, repeating long documents when a domain has too few.

For ``original``, explicit shares and ``long_share`` documents are drawn per domain in a seeded
random order without replacement (long documents in fresh permutations per pass when repeated);
the last document of each domain is cut to the remaining quota, so every domain gets exactly its
share of the budget. The output order is a seeded shuffle over all domains. Every random draw
happens here, from ``seed`` alone, so the plan does not depend on the number of tokenisation
workers.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from anchorctx.packing.settings import DataConfig
from anchorctx.packing.sources import BadInput, DataError
from anchorctx.packing.tokens import DocIndex


@dataclass
class DocumentPlan:
    """Planned document occurrences in packing order; position = the document id (seg_doc)."""

    doc: np.ndarray  # int64 [M]: index into DocIndex
    take: np.ndarray  # int64 [M]: tokens used (a prefix; < length only for the cut last doc)
    repeat: np.ndarray  # int32 [M]: 0 for the first use of an input document, k for the k-th repeat
    target_shares: dict[str, float]
    budget: int
    upsample: dict[str, Any] | None = None  # the upsampled rule's statistics (describe())

    def __len__(self) -> int:
        return int(self.doc.shape[0])


def domain_tokens(index: DocIndex) -> dict[str, int]:
    sums = np.bincount(index.domain, weights=index.length, minlength=len(index.domains))
    return {d: int(sums[i]) for i, d in enumerate(index.domains)}


def target_shares(cfg: DataConfig, index: DocIndex) -> dict[str, float]:
    if isinstance(cfg.mixture, dict):
        total = sum(cfg.mixture.values())
        if any(v < 0 for v in cfg.mixture.values()) or total <= 0:
            raise DataError(f"data.mixture ratios must be >= 0 with a positive sum: {cfg.mixture}")
        missing = sorted(d for d, v in cfg.mixture.items() if v > 0 and d not in index.domains)
        if missing:
            raise DataError(
                f"data.mixture names domains with no documents in data.sources: {missing}; "
                f"domains found: {sorted(index.domains)}"
            )
        return {d: v / total for d, v in sorted(cfg.mixture.items()) if v > 0}
    tokens = domain_tokens(index)
    total = sum(tokens.values())
    return {d: tokens[d] / total for d in sorted(tokens)}


def _budget(cfg: DataConfig, shares: dict[str, float], tokens: dict[str, int]) -> int:
    if cfg.token_budget is not None:
        return int(cfg.token_budget)
    if isinstance(cfg.mixture, dict):  # the largest budget that every domain can supply
        return int(min(tokens[d] / s for d, s in shares.items()))
    return int(sum(tokens.values()))


def _quotas(budget: int, shares: dict[str, float]) -> dict[str, int]:
    """Integer quotas summing exactly to ``budget`` (largest remainder)."""
    raw = {d: budget * s for d, s in shares.items()}
    quotas = {d: int(np.floor(v)) for d, v in raw.items()}
    rest = budget - sum(quotas.values())
    for d in sorted(raw, key=lambda d: (quotas[d] - raw[d], d))[:rest]:
        quotas[d] += 1
    return quotas


def _take(docs: np.ndarray, lengths: np.ndarray, quota: int) -> tuple[np.ndarray, np.ndarray]:
    """The shortest prefix of ``docs`` holding ``quota`` tokens; the last one cut to fit."""
    if quota <= 0 or docs.size == 0:
        return docs[:0], lengths[:0]
    cum = np.cumsum(lengths)
    n = min(int(np.searchsorted(cum, quota)) + 1, docs.size)
    take = lengths[:n].copy()
    take[-1] -= max(int(cum[n - 1]) - quota, 0)
    return docs[:n], take


def _domain_rng(seed: int, domain: str) -> np.random.Generator:
    return np.random.default_rng([seed, 1, *domain.encode()])


def _plain(docs, lengths, quota, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    order = rng.permutation(docs.size)
    d, t = _take(docs[order], lengths[order], quota)
    return d, t, np.zeros(d.size, dtype=np.int32)


def _long_share(docs, lengths, quota, rng, cfg: DataConfig):
    long = lengths >= cfg.upsample.threshold
    short_d, short_l = docs[~long], lengths[~long]
    long_d, long_l = docs[long], lengths[long]
    if long_d.size == 0:
        return _plain(short_d, short_l, quota, rng)
    natural = long_l.sum() / lengths.sum()
    # Never downsample long documents (Book/ArXiv are mostly long already).
    long_q = round(quota * max(cfg.upsample.long_share, natural))
    short_q = min(quota - long_q, int(short_l.sum()))
    sd, st, sr = _plain(short_d, short_l, short_q, rng)
    long_q = quota - int(st.sum())
    passes = max(1, int(np.ceil(long_q / long_l.sum())))
    perms = [rng.permutation(long_d.size) for _ in range(passes)]
    cyc_d = np.concatenate([long_d[p] for p in perms])
    cyc_l = np.concatenate([long_l[p] for p in perms])
    cyc_r = np.repeat(np.arange(passes, dtype=np.int32), long_d.size)
    ld, lt = _take(cyc_d, cyc_l, long_q)
    return (
        np.concatenate([sd, ld]),
        np.concatenate([st, lt]),
        np.concatenate([sr, cyc_r[: ld.size]]),
    )


def plan_documents(
    cfg: DataConfig, index: DocIndex, seed: int, bad: BadInput, n_files: int | None = None
) -> DocumentPlan:
    """Which documents (and how many of their tokens) go into the packed dataset, in order.

    ``n_files``: the number of resolved input files (``upsampled`` streams them as shards; files
    without a valid document still take part in the shard shuffle). Default: the index's files.
    """
    if len(index) == 0:
        raise DataError("no valid documents in data.sources (see the skipped-input counts)")
    if cfg.mixture == "upsampled":
        return plan_per_source(cfg, index, seed, n_files)
    shares = target_shares(cfg, index)
    tokens = domain_tokens(index)
    budget = _budget(cfg, shares, tokens)
    budget = _check_budget(cfg, budget, shares, tokens, bad)
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for domain, quota in _quotas(budget, shares).items():
        code = index.domains.index(domain)
        docs = np.flatnonzero(index.domain == code)
        rng = _domain_rng(seed, domain)
        if cfg.mixture == "long_share":
            parts.append(_long_share(docs, index.length[docs], quota, rng, cfg))
        else:
            parts.append(_plain(docs, index.length[docs], min(quota, tokens[domain]), rng))
    doc, take, rep = (np.concatenate([p[i] for p in parts]) for i in range(3))
    order = np.random.default_rng([seed, 2]).permutation(doc.size)
    return DocumentPlan(doc[order], take[order], rep[order].astype(np.int32), shares, budget)


def _check_budget(cfg, budget: int, shares, tokens, bad: BadInput) -> int:
    total = sum(tokens.values())
    if budget > total:
        bad.report(
            "budget_exceeds_corpus",
            "data.token_budget",
            f"token budget {budget} is larger than the corpus ({total} tokens)",
            budget - total,
        )
        return total
    if cfg.mixture == "long_share":
        return budget
    for domain, quota in _quotas(budget, shares).items():
        if quota > tokens[domain]:
            bad.report(
                "budget_exceeds_corpus",
                f"data.mixture[{domain}]",
                f"domain {domain} needs {quota} tokens for its share, the corpus has "
                f"{tokens[domain]}",
                quota - tokens[domain],
            )
    return budget


def describe(plan: DocumentPlan) -> dict[str, Any]:
    out = {
        "budget": plan.budget,
        "target_shares": {d: round(s, 6) for d, s in plan.target_shares.items()},
        "documents": len(plan),
        "repeated_documents": int((plan.repeat > 0).sum()),
    }
    if plan.upsample is not None:
        out["upsample"] = plan.upsample
    return out


# ------------------------------------------------------------- Fu et al. per-source upsampling
# data_engineering/utils.py of FranxYao/Long-Context-Data-Engineering: the token share of each
# SlimPajama source (its ``meta.redpajama_set_name``) in the original SlimPajama mix.
SLIMPAJAMA_ORIGINAL_MIX: dict[str, float] = {
    "RedPajamaC4": 0.26609933,
    "RedPajamaCommonCrawl": 0.53374772,
    "RedPajamaStackExchange": 0.03169647,
    "RedPajamaWikipedia": 0.03402128,
    "RedPajamaGithub": 0.05004782,
    "RedPajamaArXiv": 0.04290379,
    "RedPajamaBook": 0.0414836,
}
# Token-length buckets of the statistics (upper edges; the last bucket is open).
LENGTH_BUCKETS: tuple[int, ...] = (4096, 8192, 16384, 32768, 65536, 131072)


def bucket_names() -> list[str]:
    edges = [0, *LENGTH_BUCKETS]
    names = [f"{_k(lo)}-{_k(hi)}" for lo, hi in itertools.pairwise(edges)]
    return [*names, f">={_k(LENGTH_BUCKETS[-1])}"]


def _k(n: int) -> str:
    return f"{n // 1024}K" if n else "0"


def bucket_tokens(lengths: np.ndarray) -> dict[str, int]:
    """Tokens of documents per length bucket (``[lo, hi)`` token ranges)."""
    which = np.searchsorted(np.asarray(LENGTH_BUCKETS), lengths, side="right")
    sums = np.bincount(which, weights=lengths, minlength=len(LENGTH_BUCKETS) + 1)
    return {name: int(v) for name, v in zip(bucket_names(), sums)}


def source_shares(cfg: DataConfig, index: DocIndex) -> tuple[dict[str, float], str]:
    """Per-source budget shares of the upsampled rule, and where they come from."""
    choice = cfg.upsample.shares
    if isinstance(choice, dict):
        return dict(sorted(choice.items())), "config"
    slimpajama = all(d in SLIMPAJAMA_ORIGINAL_MIX for d in index.domains)
    if choice == "slimpajama" or (choice == "auto" and slimpajama):
        if not slimpajama:
            unknown = sorted(set(index.domains) - set(SLIMPAJAMA_ORIGINAL_MIX))
            raise DataError(
                f"data.upsample.shares=slimpajama but the corpus has non-SlimPajama domains "
                f"{unknown}; use 'corpus' or explicit shares"
            )
        return dict(SLIMPAJAMA_ORIGINAL_MIX), "slimpajama"
    tokens = domain_tokens(index)
    total = sum(tokens.values())
    return {d: tokens[d] / total for d in sorted(tokens)}, "corpus"


# slimpajama_packing.py seeds numpy's legacy global generator at import
# (``np.random.seed(15213)``) and draws every coin from it with ``np.random.random()``.
REFERENCE_COIN_SEED = 15213
# ``IterableDataset.shuffle``'s default buffer, which the reference's ``dataset.shuffle(42)`` uses.
SHUFFLE_BUFFER = 1000
# datasets draws the buffer's random slots in batches of this many (``random_batch_size``).
_SLOT_BATCH = 1000


def buffered_stream(
    index: DocIndex, n_files: int, seed: int, buffer_size: int = SHUFFLE_BUFFER
) -> np.ndarray:
    """Document order of ``datasets``' streaming ``IterableDataset.shuffle(seed, buffer_size)``
    (the 2.x releases the reference ran), reproduced without streaming. int64 [N], DocIndex rows.

    Shards (here: the resolved input files, in their sorted order) are reordered by
    ``default_rng(seed).shuffle`` of their indices; documents stream shard by shard in file
    order into a buffer of ``buffer_size``. Once it is full, each new document replaces the one
    at a random slot, which is emitted; slots come from a second ``default_rng(seed)`` in batches
    of 1000 ``integers(0, buffer_size)``. At the end the buffer is shuffled by that second
    generator and emitted. Both generators start from the seed (datasets copies one generator).
    """
    if n_files <= int(index.file.max(initial=-1)):
        raise ValueError(f"n_files={n_files} but the index names file {int(index.file.max())}")
    shards = list(range(n_files))
    np.random.default_rng(seed).shuffle(shards)
    rank = np.empty(n_files, dtype=np.int64)
    rank[shards] = np.arange(n_files)
    source = np.argsort(rank[index.file], kind="stable").tolist()  # file order kept within a file
    rng = np.random.default_rng(seed)
    out: list[int] = []
    buffer: list[int] = []
    slots: list[int] = []
    for doc in source:
        if len(buffer) < buffer_size:
            buffer.append(doc)
            continue
        if not slots:
            slots = rng.integers(0, buffer_size, size=_SLOT_BATCH).tolist()[::-1]
        slot = slots.pop()
        out.append(buffer[slot])
        buffer[slot] = doc
    rng.shuffle(buffer)
    out.extend(buffer)
    return np.asarray(out, dtype=np.int64)


def plan_per_source(
    cfg: DataConfig, index: DocIndex, seed: int, n_files: int | None = None
) -> DocumentPlan:
    """Fu et al.'s ``per_source`` down-sampling of short documents (see the module docstring)."""
    shares, origin = source_shares(cfg, index)
    total = int(index.length.sum())
    # A budget above what the sources can supply is not an error: as in the reference, a
    # source then simply runs out (``budget_met`` false in the statistics).
    budget = int(cfg.token_budget) if cfg.token_budget is not None else total
    up = cfg.upsample
    budgets = [budget * shares.get(d, 0.0) for d in index.domains]
    if up.order == "buffered":
        files = int(index.file.max(initial=-1)) + 1 if n_files is None else n_files
        order = buffered_stream(index, files, seed)
        # Sources of the mix with no document here never meet their budget: as in the reference
        # (which checks every SlimPajama source), the stream then runs to its end.
        absent = any(d not in index.domains for d in shares)
        keep, dropped = _stream_select(order, index, budgets, up, stop=not absent)
    else:
        order, keep, dropped = _permuted_select(index, seed, budgets, up)
    dom = index.domain[order]
    lengths_all = index.length[order]
    short_all = lengths_all < up.threshold
    by_source: dict[str, Any] = {}
    for code, domain in enumerate(index.domains):
        mine = dom == code
        lengths = lengths_all[mine]
        k, short, drop = keep[mine], short_all[mine], dropped[mine]
        by_source[domain] = {
            "share": round(shares.get(domain, 0.0), 8),
            "budget": round(budgets[code]),
            "tokens": int(lengths[k].sum()),
            "budget_met": bool(lengths[k].sum() >= budgets[code]),
            "documents_kept": {"short": int((k & short).sum()), "long": int((k & ~short).sum())},
            "documents_dropped_short": int(drop.sum()),
            "documents_unused": int((~k & ~drop).sum()),
            "input_tokens_by_length": bucket_tokens(lengths),
            "tokens_by_length": bucket_tokens(lengths[k]),
        }
    doc = order[keep].astype(np.int64)  # packed in stream order
    if doc.size == 0:
        raise DataError("data.mixture=upsampled kept no documents: raise data.token_budget")
    stats = {
        "rule": "fu2024_per_source",
        "order": up.order,
        "threshold": up.threshold,
        "keep_short": up.keep_short,
        "shares_from": origin,
        "by_source": by_source,
    }
    return DocumentPlan(
        doc,
        index.length[doc].astype(np.int64),
        np.zeros(doc.size, dtype=np.int32),
        shares,
        budget,
        stats,
    )


def _stream_select(
    order: np.ndarray, index: DocIndex, budgets: list[float], up: Any, stop: bool
) -> tuple[np.ndarray, np.ndarray]:
    """slimpajama_packing.py's loop over the stream: (kept, dropped short) flags per position.

    A source is closed once its kept tokens exceed its budget; an open source's short document
    costs one coin (kept when ``random() <= keep_short``); after each kept document the stream
    stops when every source has at least its budget (``stop``). Sequential by nature: which
    documents get a coin depends on every earlier decision.
    """
    coins = np.random.RandomState(REFERENCE_COIN_SEED)
    doms = index.domain[order].tolist()
    lengths = index.length[order].tolist()
    kept_tokens = [0] * len(budgets)
    keep = np.zeros(order.size, dtype=bool)
    dropped = np.zeros(order.size, dtype=bool)
    for pos, (d, n) in enumerate(zip(doms, lengths)):
        if kept_tokens[d] > budgets[d]:
            continue
        if n < up.threshold and coins.random_sample() > up.keep_short:
            dropped[pos] = True
            continue
        keep[pos] = True
        kept_tokens[d] += n
        if stop and all(t >= b for t, b in zip(kept_tokens, budgets)):
            break
    return keep, dropped


def _permuted_select(
    index: DocIndex, seed: int, budgets: list[float], up: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``upsample.order: permutation``: a full seeded permutation and one coin per document,
    drawn up front (the same rules for closing a source and keeping a short document)."""
    rng = np.random.default_rng([seed, 3])
    order = rng.permutation(len(index))
    coins = rng.random(len(index))[order]  # coin of each stream position's document
    dom = index.domain[order]
    lengths = index.length[order]
    keep = np.zeros(order.size, dtype=bool)
    dropped = np.zeros(order.size, dtype=bool)
    for code in range(len(index.domains)):
        at = np.flatnonzero(dom == code)
        passes = (lengths[at] >= up.threshold) | (coins[at] <= up.keep_short)
        kept_len = np.where(passes, lengths[at], 0)
        before = np.cumsum(kept_len) - kept_len  # tokens kept before each document
        open_ = before <= budgets[code]  # closed once the source exceeds its budget
        keep[at] = passes & open_
        dropped[at] = open_ & ~passes
    return order, keep, dropped
