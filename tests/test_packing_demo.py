"""The seeded demo corpus: SlimPajama layout, seven domains, heavy tails, a loadable tokenizer."""

from __future__ import annotations

import json

import pytest

from anchorctx.demo.corpus import DOMAINS, write_demo_corpus


def _records(data_dir):
    for path in sorted(data_dir.rglob("*.jsonl")):
        for line in path.read_text().splitlines():
            yield json.loads(line)


def test_layout_domains_and_long_documents(demo_corpus):
    recs = list(_records(demo_corpus.data_dir))
    assert {r["meta"]["redpajama_set_name"] for r in recs} == set(DOMAINS)
    assert all(isinstance(r["text"], str) and r["text"].strip() for r in recs)
    summary = json.loads((demo_corpus.root / "demo.json").read_text())["domains"]
    # Heavy tails: Book and ArXiv hold documents longer than 32K tokens, and are longest.
    assert summary["RedPajamaBook"]["max_tokens"] > 32_768
    assert summary["RedPajamaArXiv"]["max_tokens"] > 32_768
    mean = {d: s["tokens"] / s["documents"] for d, s in summary.items()}
    assert sorted(mean, key=mean.get)[-2:] == sorted(
        ["RedPajamaBook", "RedPajamaArXiv"], key=mean.get
    )
    assert any(
        "def " in r["text"] for r in recs if r["meta"]["redpajama_set_name"] == "RedPajamaGithub"
    )


def test_tokenizer_loads_with_autotokenizer(demo_corpus):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_corpus.tokenizer_dir))
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
        "<s>",
        "</s>",
        "<pad>",
        "<unk>",
    )
    assert 2000 <= len(tok) <= 4096
    ids = tok("def foo(x):\n    return x")["input_ids"]
    assert ids[0] == tok.bos_token_id  # BOS is prepended like Llama's tokenizer
    assert tok.decode(ids[1:]) == "def foo(x):\n    return x"  # byte-level: lossless


def test_idempotent_and_deterministic(demo_corpus, tmp_path):
    marker = demo_corpus.root / "demo.json"
    before = marker.stat().st_mtime_ns
    again = write_demo_corpus(demo_corpus.root, seed=0, docs_per_domain=12, progress=False)
    assert again == demo_corpus and marker.stat().st_mtime_ns == before
    small_a = write_demo_corpus(tmp_path / "a", seed=3, docs_per_domain=2, progress=False)
    small_b = write_demo_corpus(tmp_path / "b", seed=3, docs_per_domain=2, progress=False)
    assert list(_records(small_a.data_dir)) == list(_records(small_b.data_dir))
    # Domains generated in three processes: the very same files and tokenizer.
    small_c = write_demo_corpus(
        tmp_path / "c", seed=3, docs_per_domain=2, progress=False, workers=3
    )
    assert list(_records(small_c.data_dir)) == list(_records(small_a.data_dir))
    names = ("tokenizer.json", "tokenizer_config.json")
    for name in names:
        assert (small_c.tokenizer_dir / name).read_bytes() == (
            small_a.tokenizer_dir / name
        ).read_bytes()


def test_refuses_foreign_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="not a demo corpus"):
        write_demo_corpus(tmp_path, docs_per_domain=1, progress=False)
    assert (tmp_path / "notes.txt").exists()
