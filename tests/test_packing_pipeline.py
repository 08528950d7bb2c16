"""prepare_data: the packed-dataset contract, mixtures, upsampling, tags, interleaved chunks,
determinism, and bad input (an error naming file and line, or a counted skip)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from anchorctx.experiment import config_from_dict
from anchorctx.packing import DataError, load_packed, prepare_data

DOMAINS3 = ("RedPajamaC4", "RedPajamaCommonCrawl", "RedPajamaWikipedia")


@pytest.fixture(scope="module")
def small_corpus(demo_corpus, tmp_path_factory) -> Path:
    """A few hundred-to-thousand-token documents per domain cut from the demo corpus: fast."""
    rng = np.random.default_rng(0)
    recs = []
    for path in sorted(demo_corpus.data_dir.rglob("*.jsonl")):
        recs += [json.loads(line) for line in path.read_text().splitlines()]
    kept, per_domain = [], defaultdict(int)
    for r in recs:
        dom = r["meta"]["redpajama_set_name"]
        if per_domain[dom] < 8:
            per_domain[dom] += 1
            kept.append({**r, "text": r["text"][: int(rng.integers(300, 9000))]})
    out = tmp_path_factory.mktemp("small") / "data"
    out.mkdir()
    for i in range(2):
        lines = [json.dumps(r) for r in kept[i::2]]
        (out / f"part_{i}.jsonl").write_text("\n".join(lines) + "\n")
    return out


@pytest.fixture(scope="module")
def tokenizer(demo_corpus):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_corpus.tokenizer_dir))


def make_cfg(root: Path, demo_corpus, sources, seed: int = 0, **data):
    sources = sources if isinstance(sources, list) else [{"path": str(sources)}]
    raw = {
        "name": "t",
        "run_root": str(root),
        "seed": seed,
        "model": {"tiny": {}, "tokenizer": str(demo_corpus.tokenizer_dir), "dtype": "float32"},
        "data": {"sources": sources, "seq_len": 256, **data},
    }
    return config_from_dict(raw)


def segments_by_document(ds, anchor: int, seq_len: int) -> dict[int, list[tuple[list, list]]]:
    """Every row starts with the anchor and its segments tile it; pieces per seg_doc in order."""
    pieces: dict[int, list[tuple[list, list]]] = defaultdict(list)
    for row in ds:
        ids, mask, lens = row["input_ids"], row["loss_mask"], row["seg_lens"]
        # rows of seq_len + 1 tokens: seq_len inputs and seq_len targets, as AnchorContext cuts them
        row_len = seq_len + 1
        assert len(ids) == row_len and sum(lens) == row_len and ids[0] == anchor and mask[0] == 0
        assert len(lens) == len(row["seg_doc"]) == len(row["seg_domain"]) and min(lens) > 0
        pos = 0
        for n, doc in zip(lens, row["seg_doc"]):
            start = pos + (1 if pos == 0 else 0)  # the anchor belongs to the first segment
            pieces[doc].append((ids[start : pos + n], mask[start : pos + n]))
            pos += n
    return pieces


def source_text(file: str, line: int) -> str:
    return json.loads(Path(file).read_text().splitlines()[line - 1])["text"]


def check_reconstruction(out: Path, tok, tag_template: str | None = None) -> int:
    """Concatenating each document's segments, minus tag and separator, gives its tokens."""
    ds, manifest = load_packed(out)
    pieces = segments_by_document(ds, manifest["anchor_token_id"], manifest["seq_len"])
    sep = manifest["separator"]["token_ids"]
    complete = 0
    for rec in pq.read_table(out / "documents.parquet").to_pylist():
        if rec["doc"] not in pieces:
            assert not rec["packed"]
            continue
        ids = [t for p, _ in pieces[rec["doc"]] for t in p]
        mask = [m for _, ms in pieces[rec["doc"]] for m in ms]
        n_tag = 0
        if tag_template is not None:
            tag = tok(tag_template.format(domain=rec["domain"]), add_special_tokens=False)[
                "input_ids"
            ]
            n_tag = len(tag)
            assert ids[:n_tag] == tag and not any(mask[:n_tag])  # tag first, masked
        assert all(mask[n_tag:])  # every other token is a training target
        body = ids[n_tag:]
        expected = tok(source_text(rec["file"], rec["line"]), add_special_tokens=False)["input_ids"]
        if len(body) == rec["taken"] + len(sep):  # complete: the separator (if any) closes it
            assert body[len(body) - len(sep) :] == sep
            assert body[: rec["taken"]] == expected[: rec["taken"]]
            complete += 1
        else:  # only the document cut by the dropped final row
            assert body == expected[: len(body)]
    return complete


@pytest.mark.parametrize("separator", ["none", "eos"])
def test_rows_follow_the_contract_and_reproduce_documents(
    small_corpus, demo_corpus, tokenizer, tmp_path, separator
):
    cfg = make_cfg(tmp_path, demo_corpus, small_corpus, separator=separator)
    out = prepare_data(cfg, progress=False)
    ds, manifest = load_packed(out)
    assert set(ds.column_names) == {"input_ids", "seg_lens", "seg_doc", "seg_domain", "loss_mask"}
    assert manifest["anchor_token_id"] == tokenizer.bos_token_id
    assert manifest["counts"]["rows"] == len(ds) > 10
    # AnchorContext (the default): no separator, the anchor only at index 0 of each row.
    sep = [] if separator == "none" else [tokenizer.eos_token_id]
    assert manifest["separator"] == {"setting": separator, "token_ids": sep}
    assert all(row["input_ids"].count(tokenizer.bos_token_id) == 1 for row in ds)
    counts = manifest["counts"]
    # No silent loss: every input token is packed except the final partial row's.
    assert counts["text_tokens"] + counts["separator_tokens"] + counts[
        "dropped_final_row_tokens"
    ] == (
        counts["input_tokens"]
        + len(sep) * (counts["documents"] + counts["documents_only_in_dropped_row"])
    )
    assert check_reconstruction(out, tokenizer) >= counts["input_documents"] - 1
    assert (out / "doc_lengths.png").stat().st_size > 0 and (out / "stats.md").is_file()
    # Idempotent: the same inputs return the existing dataset untouched.
    stamp = (out / "manifest.json").stat().st_mtime_ns
    assert prepare_data(cfg, progress=False) == out
    assert (out / "manifest.json").stat().st_mtime_ns == stamp


def test_tags_masked_and_interleaved_chunk_order(small_corpus, demo_corpus, tokenizer, tmp_path):
    template = "<{domain}>\n"
    cfg = make_cfg(
        tmp_path,
        demo_corpus,
        small_corpus,
        domain_tags=True,
        tag_template=template,
        interleave_chunks=True,
    )
    out = prepare_data(cfg, progress=False)
    assert check_reconstruction(out, tokenizer, template) > 0  # tags masked, chunk order kept
    ds, manifest = load_packed(out)
    assert manifest["counts"]["tag_tokens"] > 0
    order = [d for row in ds for d in row["seg_doc"]]
    # Chunks are really interleaved: some document's segments have another document between.
    first, last = {}, {}
    for i, d in enumerate(order):
        first.setdefault(d, i)
        last[d] = i
    assert any(len(set(order[first[d] : last[d] + 1])) > 1 for d in first)


def _packed_shares(manifest) -> dict[str, float]:
    by = manifest["counts"]["by_domain"]
    total = sum(v["tokens"] for v in by.values())
    return {d: v["tokens"] / total for d, v in by.items()}


def test_explicit_mixture_shares_and_unknown_domain_skips(small_corpus, demo_corpus, tmp_path):
    mix = {"RedPajamaC4": 0.5, "RedPajamaCommonCrawl": 0.3, "RedPajamaWikipedia": 0.2}
    # seq_len 32: the dropped final row (< 32 tokens) cannot move a share by 1%.
    cfg = make_cfg(
        tmp_path,
        demo_corpus,
        small_corpus,
        mixture=mix,
        token_budget=5000,
        seq_len=32,
        on_bad_input="skip",
    )
    _, manifest = load_packed(prepare_data(cfg, progress=False))
    shares = _packed_shares(manifest)
    assert set(shares) == set(mix)
    for d, target in mix.items():
        assert abs(shares[d] - target) < 0.01, (d, shares[d], target)
    assert manifest["skipped"]["counts"]["unknown_domain"] == 4 * 8  # the other four domains
    with pytest.raises(DataError, match=r"part_\d\.jsonl:\d+: domain 'RedPajama\w+' is not in"):
        prepare_data(
            cfg.model_copy(update={"data": cfg.data.model_copy(update={"on_bad_input": "error"})}),
            progress=False,
        )


def test_long_share_has_more_long_documents_same_shares(small_corpus, demo_corpus, tmp_path):
    threshold = 1200
    common = {"token_budget": 12000, "upsample": {"threshold": threshold, "long_share": 0.8}}
    manifests, docs = {}, {}
    for mix in ("original", "long_share"):
        cfg = make_cfg(tmp_path / mix, demo_corpus, small_corpus, mixture=mix, **common)
        out = prepare_data(cfg, progress=False)
        docs[mix] = pq.read_table(out / "documents.parquet").to_pandas()
        manifests[mix] = load_packed(out)[1]
    # The domain mixture is kept: compared on the planned tokens, which the dropped final row
    # (up to seq_len + 1 = 257 of 12000 tokens, one domain's) cannot move.
    planned = {k: v.groupby("domain", observed=True).taken.sum() for k, v in docs.items()}
    planned = {k: v / v.sum() for k, v in planned.items()}
    for d, share in planned["original"].items():
        assert abs(planned["long_share"][d] - share) < 0.01
    long = {k: v[v.tokens >= threshold] for k, v in docs.items()}
    long_tokens = {k: long[k].taken.sum() / docs[k].taken.sum() for k in docs}
    assert long_tokens["long_share"] > long_tokens["original"]
    assert len(long["long_share"]) > len(long["original"])
    up = docs["long_share"]
    for _, group in up.groupby("domain"):  # long_share per domain where long documents exist
        is_long = group.tokens >= threshold
        if is_long.any() and (~is_long).any():
            assert group.taken[is_long].sum() / group.taken.sum() >= 0.79


def _fu_reference(lengths, domains, shares, budget, seed, threshold=4096, keep=0.1):
    """slimpajama_packing.py's per_source loop, step by step. The stream is datasets'
    ``shuffle(seed)`` of one file holding fewer documents than its 1000-document buffer: one
    ``default_rng(seed).shuffle`` of the file order. The coins come from numpy's legacy global
    generator seeded 15213 and are drawn only for the short documents of open sources."""
    order = list(range(len(lengths)))
    np.random.default_rng(seed).shuffle(order)
    coins = np.random.RandomState(15213)
    budgets = {d: budget * s for d, s in shares.items()}
    tokens = {d: 0 for d in shares}
    kept = []
    for i in order:
        d = domains[i]
        if tokens[d] > budgets[d]:  # the source's budget is used up
            continue
        if lengths[i] < threshold and coins.random_sample() > keep:  # short, filtered out
            continue
        kept.append(int(i))
        tokens[d] += int(lengths[i])
        if all(tokens[s] >= budgets[s] for s in budgets):
            break
    return kept


def test_upsampled_is_fu_et_al_per_source():
    from anchorctx.packing.mixture import SLIMPAJAMA_ORIGINAL_MIX, plan_documents
    from anchorctx.packing.settings import DataConfig
    from anchorctx.packing.sources import BadInput
    from anchorctx.packing.tokens import DocIndex

    rng = np.random.default_rng(7)
    names = ["RedPajamaBook", "RedPajamaC4", "RedPajamaCommonCrawl"]
    n = 600
    dom = rng.integers(0, 3, n).astype(np.int32)
    length = np.where(rng.random(n) < 0.3, rng.integers(4096, 20000, n), rng.integers(50, 4096, n))
    index = DocIndex(
        offset=np.cumsum(length) - length,
        length=length.astype(np.int64),
        domain=dom,
        file=np.zeros(n, np.int32),
        line=np.arange(n),
        domains=names,
    )
    data = DataConfig(mixture="upsampled", token_budget=2_000_000)
    plan = plan_documents(data, index, 5, BadInput(skip=False))
    shares = {d: SLIMPAJAMA_ORIGINAL_MIX[d] for d in names}  # 'auto': SlimPajama source names
    assert plan.doc.tolist() == _fu_reference(length, [names[c] for c in dom], shares, 2_000_000, 5)
    assert (plan.take == length[plan.doc]).all() and len(set(plan.doc.tolist())) == plan.doc.size
    up = plan.upsample
    assert up["shares_from"] == "slimpajama" and (up["threshold"], up["keep_short"]) == (4096, 0.1)
    book = up["by_source"]["RedPajamaBook"]  # 4 % of 2M: met before its documents run out
    assert book["budget"] == round(2_000_000 * SLIMPAJAMA_ORIGINAL_MIX["RedPajamaBook"])
    assert book["budget_met"] and book["documents_unused"] > 0
    cc = up["by_source"]["RedPajamaCommonCrawl"]  # 53 % of 2M: runs out of documents
    is_cc = dom == 2
    assert not cc["budget_met"] and cc["documents_unused"] == 0
    assert cc["documents_kept"]["long"] == int((is_cc & (length >= 4096)).sum())  # all long kept
    short_cc = int((is_cc & (length < 4096)).sum())
    assert cc["documents_kept"]["short"] + cc["documents_dropped_short"] == short_cc
    assert 0.03 < cc["documents_kept"]["short"] / short_cc < 0.2  # kept with probability 0.1
    assert sum(cc["tokens_by_length"].values()) == cc["tokens"]


def test_upsampled_pipeline_records_statistics(small_corpus, demo_corpus, tmp_path):
    cfg = make_cfg(
        tmp_path,
        demo_corpus,
        small_corpus,
        mixture="upsampled",
        token_budget=20000,
        upsample={"threshold": 1000, "keep_short": 0.5},
    )
    out = prepare_data(cfg, progress=False)
    _, manifest = load_packed(out)
    up = manifest["mixture"]["upsample"]
    assert up["rule"] == "fu2024_per_source" and manifest["counts"]["repeated_documents"] == 0
    assert set(up["by_source"]) == set(manifest["counts"]["by_domain"])
    stats = json.loads((out / "stats.json").read_text())
    assert stats["upsample"] == up and set(stats["tokens_by_length"]) == {"input", "packed"}
    assert "Length upsampling (Fu et al. 2024" in (out / "stats.md").read_text()


def _arrow_bytes(out: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(out.glob("data-*.arrow")))


def test_deterministic_across_runs_and_workers(small_corpus, demo_corpus, tmp_path):
    kwargs = {"interleave_chunks": True, "domain_tags": True, "tokenize_batch_size": 5}
    outs = []
    for i, workers in enumerate((1, 1, 2)):
        cfg = make_cfg(
            tmp_path,
            demo_corpus,
            small_corpus,
            num_workers=workers,
            output_dir=str(tmp_path / f"out{i}"),
            **kwargs,
        )
        outs.append(prepare_data(cfg, progress=False))
    assert _arrow_bytes(outs[0]) == _arrow_bytes(outs[1]) == _arrow_bytes(outs[2])
    other = make_cfg(tmp_path, demo_corpus, small_corpus, seed=1, **kwargs)
    assert _arrow_bytes(prepare_data(other, progress=False)) != _arrow_bytes(outs[0])


def test_zst_and_parquet_sources_match_jsonl(small_corpus, demo_corpus, tmp_path):
    import pyarrow as pa
    import zstandard

    src = tmp_path / "src"
    src.mkdir()
    for i, path in enumerate(sorted(small_corpus.glob("*.jsonl"))):
        raw = path.read_bytes()
        if i == 0:
            (src / "p0.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
        else:
            recs = [json.loads(x) for x in raw.decode().splitlines()]
            pq.write_table(pa.Table.from_pylist(recs), src / "p1.parquet")
    a = prepare_data(make_cfg(tmp_path / "a", demo_corpus, small_corpus), progress=False)
    b = prepare_data(make_cfg(tmp_path / "b", demo_corpus, src), progress=False)
    assert _arrow_bytes(a) == _arrow_bytes(b)


# ------------------------------------------------------------------------------- bad input
GOOD = {
    "text": "A good short document about the sky.",
    "meta": {"redpajama_set_name": "RedPajamaC4"},
}
BAD_LINES = {
    "invalid_json": '{"text": "unterminated',
    "missing_text": json.dumps({"meta": {"redpajama_set_name": "RedPajamaC4"}}),
    "empty_text": json.dumps({"text": "   ", "meta": {"redpajama_set_name": "RedPajamaC4"}}),
    "non_string_text": json.dumps({"text": 42, "meta": {"redpajama_set_name": "RedPajamaC4"}}),
    "missing_domain": json.dumps({"text": "no domain here"}),
}


def _bad_corpus(tmp_path: Path, bad_line: str) -> Path:
    lines = [json.dumps(GOOD)] * 30
    lines.insert(3, bad_line)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "c.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path / "data"


@pytest.mark.parametrize("reason", sorted(BAD_LINES))
def test_bad_record_error_names_file_and_line_or_counted_skip(reason, demo_corpus, tmp_path):
    data = _bad_corpus(tmp_path, BAD_LINES[reason])
    with pytest.raises(DataError, match=r"c\.jsonl:4: "):
        prepare_data(make_cfg(tmp_path, demo_corpus, data, seq_len=32), progress=False)
    cfg = make_cfg(tmp_path, demo_corpus, data, seq_len=32, on_bad_input="skip")
    _, manifest = load_packed(prepare_data(cfg, progress=False))
    assert manifest["skipped"]["counts"] == {reason: 1}
    assert "c.jsonl:4" in manifest["skipped"]["first"][reason]
    assert manifest["counts"]["input_documents"] == 30


def test_unreadable_file(demo_corpus, tmp_path):
    data = _bad_corpus(tmp_path, json.dumps(GOOD))
    (data / "broken.jsonl.zst").write_bytes(b"this is not zstd")
    with pytest.raises(DataError, match=r"broken\.jsonl\.zst: cannot read file"):
        prepare_data(make_cfg(tmp_path, demo_corpus, data, seq_len=32), progress=False)
    missing = [{"path": str(data)}, {"path": str(tmp_path / "nowhere")}]
    cfg = make_cfg(tmp_path, demo_corpus, missing, seq_len=32, on_bad_input="skip")
    _, manifest = load_packed(prepare_data(cfg, progress=False))
    assert manifest["skipped"]["counts"] == {"unreadable_file": 2}


def test_budget_larger_than_corpus(demo_corpus, tmp_path):
    data = _bad_corpus(tmp_path, json.dumps(GOOD))
    with pytest.raises(DataError, match="token budget 100000 is larger than the corpus"):
        prepare_data(
            make_cfg(tmp_path, demo_corpus, data, seq_len=32, token_budget=100_000), progress=False
        )
    cfg = make_cfg(
        tmp_path, demo_corpus, data, seq_len=32, token_budget=100_000, on_bad_input="skip"
    )
    _, manifest = load_packed(prepare_data(cfg, progress=False))
    assert (
        manifest["skipped"]["counts"]["budget_exceeds_corpus"]
        == 100_000 - manifest["counts"]["input_tokens"]
    )


def test_impossible_seq_len(demo_corpus, tmp_path):
    data = _bad_corpus(tmp_path, json.dumps(GOOD))
    tags = {"domain_tags": True, "tag_template": "a long domain tag for {domain}\n"}
    with pytest.raises(DataError, match=r"impossible data\.seq_len=8"):
        prepare_data(make_cfg(tmp_path, demo_corpus, data, seq_len=8, **tags), progress=False)
    with pytest.raises(DataError, match=r"impossible data\.seq_len=100000"):
        prepare_data(make_cfg(tmp_path, demo_corpus, data, seq_len=100_000), progress=False)


def test_load_packed_rejects_other_directories(tmp_path):
    with pytest.raises(DataError, match="not a packed dataset"):
        load_packed(tmp_path)


def test_anchor_in_content_is_an_error(demo_corpus, tokenizer, tmp_path):
    """AnchorContext asserts the anchor id never occurs in document content."""
    src = tmp_path / "docs.jsonl"
    texts = ["plain words " * 200, f"a document that spells {tokenizer.bos_token} inside " * 20]
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = make_cfg(tmp_path, demo_corpus, [{"path": str(src), "domain": "web"}])
    with pytest.raises(
        DataError,
        match=rf"1 sampled documents contain the anchor token id {tokenizer.bos_token_id} .*docs\.jsonl:2",
    ):
        prepare_data(cfg, progress=False)
