"""A seeded synthetic corpus in the SlimPajama layout, and a byte-level BPE tokenizer for it.

The demo and every test run on this corpus, so nothing is downloaded. It mimics what matters
for long-context packing: the seven SlimPajama domains, heavy-tailed per-domain document
lengths (log-normal; Book and ArXiv longest, and at least one document in each of them longer
than 32K tokens), and text that looks like its domain (code for Github, LaTeX for ArXiv,
questions and answers for StackExchange). Words follow a Zipf law over per-domain vocabularies
of pronounceable pseudo-words plus shared English function words.

Layout of ``out``::

    data/chunk1/example_train_<i>.jsonl   {"text": ..., "meta": {"redpajama_set_name": ...}}
    tokenizer/                            Hugging Face tokenizer dir (<s>, </s>, <pad>, <unk>)
    demo.json                             parameters, counts; written last (marks completion)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm.auto import tqdm

from anchorctx.io import DirectoryOwner, atomic_write_json, check_replaceable, owned_directory
from anchorctx.process import spawn_pool

if TYPE_CHECKING:
    from anchorctx.experiment import ExperimentConfig

DOMAINS: tuple[str, ...] = (
    "RedPajamaCommonCrawl",
    "RedPajamaC4",
    "RedPajamaGithub",
    "RedPajamaBook",
    "RedPajamaArXiv",
    "RedPajamaWikipedia",
    "RedPajamaStackExchange",
)
DEMO_VERSION = 2
SPECIAL_TOKENS = {
    "bos_token": "<s>",
    "eos_token": "</s>",
    "pad_token": "<pad>",
    "unk_token": "<unk>",
}
LONG_DOC_WORDS = 36_000  # every word is >= 1 token, so >= 36K words guarantees > 32K tokens
FILES = 4  # documents of all domains are spread over this many shuffled files, as in SlimPajama
FUNCTION_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "been",
    "one",
    "all",
    "we",
    "their",
    "has",
    "would",
    "when",
    "if",
    "so",
    "no",
    "will",
    "can",
    "more",
    "other",
    "its",
    "into",
    "than",
    "them",
    "these",
    "some",
    "then",
    "two",
    "may",
    "only",
    "also",
]


class DemoCorpus(NamedTuple):
    root: Path
    data_dir: Path
    tokenizer_dir: Path


@dataclass(frozen=True)
class DomainStyle:
    median_words: float  # log-normal median of the document length, in words
    sigma: float  # log-normal shape: the heavy tail
    vocab: int  # size of the domain's own pseudo-word vocabulary
    count: int = 1  # documents per ``docs_per_domain`` (web text has many short documents)
    force_long: bool = False  # guarantee one document longer than 32K tokens


STYLES: dict[str, DomainStyle] = {
    "RedPajamaCommonCrawl": DomainStyle(600, 1.1, 900, count=4),
    "RedPajamaC4": DomainStyle(300, 0.8, 700, count=4),
    "RedPajamaGithub": DomainStyle(500, 1.2, 400),
    "RedPajamaBook": DomainStyle(6000, 0.9, 1200, force_long=True),
    "RedPajamaArXiv": DomainStyle(3500, 0.7, 900, force_long=True),
    "RedPajamaWikipedia": DomainStyle(400, 1.0, 1000, count=2),
    "RedPajamaStackExchange": DomainStyle(250, 0.9, 600, count=2),
}


# ------------------------------------------------------------------------------ word sampling
class Lexicon:
    """Zipf-distributed words of one domain (function words are the most frequent)."""

    def __init__(self, rng: np.random.Generator, size: int) -> None:
        onsets = [*list("bcdfghjklmnprstvwz"), "br", "ch", "st", "th", "tr", "pl", "gr", "sh"]
        vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou"]
        codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st"]
        words: set[str] = set()
        while len(words) < size:
            n_syl = int(rng.integers(1, 4))
            words.add(
                "".join(
                    onsets[rng.integers(len(onsets))]
                    + vowels[rng.integers(len(vowels))]
                    + codas[rng.integers(len(codas))]
                    for _ in range(n_syl)
                )
            )
        self.words = np.array(FUNCTION_WORDS + sorted(words), dtype=object)
        ranks = np.arange(1, len(self.words) + 1, dtype=np.float64)
        self.p = ranks**-1.05 / np.sum(ranks**-1.05)
        self.rng = rng

    def sample(self, n: int) -> list[str]:
        return list(self.rng.choice(self.words, size=n, p=self.p))

    def sentence(self, n: int) -> str:
        words = self.sample(max(n, 2))
        return words[0].capitalize() + " " + " ".join(words[1:]) + "."

    def paragraph(self, n_words: int) -> str:
        out, left = [], n_words
        while left > 0:
            k = int(min(left, max(3, self.rng.normal(16, 6))))
            out.append(self.sentence(k))
            left -= k
        return " ".join(out)

    def ident(self) -> str:
        return "_".join(self.rng.choice(self.words[len(FUNCTION_WORDS) :], size=2))


# ----------------------------------------------------------------------- per-domain documents
def _prose_blocks(lex: Lexicon, n_words: int, para: float) -> list[str]:
    blocks, left = [], n_words
    while left > 0:
        k = int(min(left, max(20, lex.rng.normal(para, para / 3))))
        blocks.append(lex.paragraph(k))
        left -= k
    return blocks


def _commoncrawl(lex: Lexicon, n: int) -> str:
    nav = " | ".join(w.capitalize() for w in lex.sample(5))
    return (
        nav
        + "\n\n"
        + "\n\n".join(_prose_blocks(lex, n, 80))
        + "\n\nCopyright 2019. All rights reserved."
    )


def _c4(lex: Lexicon, n: int) -> str:
    return "\n".join(_prose_blocks(lex, n, 60))


def _github(lex: Lexicon, n: int) -> str:
    lines, left = [f"import {lex.ident()}", f"from {lex.ident()} import {lex.ident()}", ""], n
    while left > 0:
        fn, args = lex.ident(), ", ".join(lex.ident() for _ in range(int(lex.rng.integers(1, 4))))
        body = [f"def {fn}({args}):", f'    """{lex.sentence(8)}"""']
        for _ in range(int(lex.rng.integers(2, 9))):
            a, b = lex.ident(), lex.ident()
            op = lex.rng.choice(["+", "-", "*", "//", "%"])
            body.append(f"    {a} = {b} {op} {int(lex.rng.integers(0, 1000))}  # {lex.sentence(5)}")
        body += [f"    return {a}", ""]
        lines += body
        left -= 12 * (len(body) - 2)
    return "\n".join(lines)


def _book(lex: Lexicon, n: int) -> str:
    parts, left, chapter = [], n, 1
    while left > 0:
        k = int(min(left, int(lex.rng.integers(2000, 6000))))
        paras = _prose_blocks(lex, k, 120)
        for i in range(0, len(paras), 3):  # some dialogue
            paras[i] = f'"{lex.sentence(10)}" {paras[i]}'
        parts.append(f"CHAPTER {chapter}\n\n" + "\n\n".join(paras))
        left, chapter = left - k, chapter + 1
    return "\n\n".join(parts)


def _arxiv(lex: Lexicon, n: int) -> str:
    sections = ["Introduction", "Related Work", "Method", "Experiments", "Conclusion"]
    per = max(n // len(sections), 20)
    parts = [f"\\begin{{abstract}}\n{lex.paragraph(120)}\n\\end{{abstract}}"]
    for name in sections:
        paras = _prose_blocks(lex, per, 140)
        for i in range(1, len(paras), 2):  # inline and display math
            a, b = lex.ident().split("_")
            paras[i] += f" We have $\\{a[:3]}_{{i}} = \\sum_{{j=1}}^{{n}} {b[:2]}_{{ij}} x_j$."
        parts.append(f"\\section{{{name}}}\n" + "\n\n".join(paras))
    return "\n\n".join(parts)


def _wikipedia(lex: Lexicon, n: int) -> str:
    title = " ".join(w.capitalize() for w in lex.sample(2))
    year = int(lex.rng.integers(1700, 2020))
    lead = f"{title} is a {lex.sample(1)[0]} founded in {year}. "
    heads = ["History", "Geography", "Culture", "See also"]
    blocks = _prose_blocks(lex, n, 90)
    body = "\n\n".join(
        (f"== {heads[i % len(heads)]} ==\n" if i % 2 else "") + b for i, b in enumerate(blocks)
    )
    return f"{title}\n\n{lead}{body}"


def _stackexchange(lex: Lexicon, n: int) -> str:
    q = max(n // 3, 10)
    snippet = f"    {lex.ident()} = {lex.ident()}({int(lex.rng.integers(1, 99))})"
    answers = _prose_blocks(lex, n - q, 70)
    return f"Q: {lex.sentence(10)[:-1]}?\n\n{lex.paragraph(q)}\n\n{snippet}\n\n" + "\n\n".join(
        f"A: {a}" for a in answers
    )


WRITERS: dict[str, Callable[[Lexicon, int], str]] = {
    "RedPajamaCommonCrawl": _commoncrawl,
    "RedPajamaC4": _c4,
    "RedPajamaGithub": _github,
    "RedPajamaBook": _book,
    "RedPajamaArXiv": _arxiv,
    "RedPajamaWikipedia": _wikipedia,
    "RedPajamaStackExchange": _stackexchange,
}


def _domain_documents(domain: str, seed: int, docs: int) -> list[str]:
    """``docs`` documents of one domain; independent of the other domains' settings."""
    style = STYLES[domain]
    docs *= style.count
    rng = np.random.default_rng([seed, DOMAINS.index(domain)])
    lex = Lexicon(rng, style.vocab)
    lengths = np.clip(rng.lognormal(np.log(style.median_words), style.sigma, docs), 30, 60_000)
    if style.force_long:
        lengths[int(rng.integers(docs))] = max(lengths.max(), LONG_DOC_WORDS)
    return [WRITERS[domain](lex, int(n)) for n in lengths]


# ---------------------------------------------------------------------------------- tokenizer
def train_tokenizer(files: list[Path], out: Path, vocab_size: int = 3000) -> None:
    """Byte-level BPE with Llama-like specials; BOS is prepended by the post-processor."""
    # Imported here: transformers costs seconds to import; the CLI imports this module, and only a
    # new demo corpus trains a tokenizer.
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(f) for f in files], trainer)
    bos = SPECIAL_TOKENS["bos_token"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
        **SPECIAL_TOKENS,
    )
    fast.save_pretrained(str(out))


def _tokenizer_training_text(docs: dict[str, list[str]], path: Path, chars: int) -> Path:
    # A per-domain character cap keeps training fast and the merges balanced across domains.
    with path.open("w") as fh:
        for texts in docs.values():
            left = chars
            for t in texts:
                fh.write(t[:left] + "\n")
                left -= min(len(t), left)
                if left <= 0:
                    break
    return path


# --------------------------------------------------------------------------------- the corpus
def _write_data(docs: dict[str, list[str]], data_dir: Path, seed: int) -> None:
    records = [(d, t) for d, texts in docs.items() for t in texts]
    order = np.random.default_rng([seed, 99]).permutation(len(records))
    files = [(data_dir / "chunk1" / f"example_train_{i}.jsonl") for i in range(FILES)]
    files[0].parent.mkdir(parents=True, exist_ok=True)
    handles = [f.open("w") for f in files]
    try:
        for pos, i in enumerate(order):
            domain, text = records[i]
            rec = {"text": text, "meta": {"redpajama_set_name": domain}}
            handles[pos % FILES].write(json.dumps(rec) + "\n")
    finally:
        for h in handles:
            h.close()


def _is_complete(root: Path, params: dict) -> bool:
    marker = root / "demo.json"
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("params") == params
    except json.JSONDecodeError:
        return False


DEMO_OWNER = DirectoryOwner("demo-corpus", "a demo corpus")


def write_demo_corpus(
    out: str | Path,
    *,
    seed: int = 0,
    docs_per_domain: int = 40,
    progress: bool = True,
    workers: int = 1,
) -> DemoCorpus:
    """Write (or reuse, when complete with the same parameters) the demo corpus at ``out``.
    ``workers`` > 1 generates the domains in that many processes (the corpus does not depend
    on it)."""
    root = Path(out)
    corpus = DemoCorpus(root, root / "data", root / "tokenizer")
    params = {"version": DEMO_VERSION, "seed": seed, "docs_per_domain": docs_per_domain}
    if _is_complete(root, params):
        return corpus
    check_replaceable(root, DEMO_OWNER)  # before minutes of generating
    if docs_per_domain < 1:
        raise ValueError(f"docs_per_domain must be >= 1, got {docs_per_domain}")
    start = time.perf_counter()
    docs = generate_documents(seed, docs_per_domain, progress, workers)
    with owned_directory(root, DEMO_OWNER) as tmp:
        _write_data(docs, tmp / "data", seed)
        text = _tokenizer_training_text(docs, tmp / "tokenizer-train.txt", chars=400_000)
        train_tokenizer([text], tmp / "tokenizer")
        text.unlink()
        summary = _summary(docs, tmp / "tokenizer")
        atomic_write_json(tmp / "demo.json", {"params": params, "domains": summary})
    if progress:
        _print_summary(summary, root, time.perf_counter() - start)
    return corpus


def generate_documents(
    seed: int, docs_per_domain: int, progress: bool, workers: int = 1
) -> dict[str, list[str]]:
    """Every domain's documents. Each domain has its own random stream ([seed, domain index]),
    so they can be written in any order or process: with 600 documents per domain this is
    75 s of CPU in one process (measured on a 2-core machine; Book alone 26 s)."""
    bar = tqdm(total=len(DOMAINS), desc="demo corpus", unit="domain", disable=not progress)
    workers = min(workers, len(DOMAINS))
    if workers <= 1:
        docs = {}
        for d in DOMAINS:
            docs[d] = _domain_documents(d, seed, docs_per_domain)
            bar.update()
        bar.close()
        return docs
    with spawn_pool(workers) as pool:
        futures = {d: pool.submit(_domain_documents, d, seed, docs_per_domain) for d in DOMAINS}
        for _ in as_completed(futures.values()):
            bar.update()
    bar.close()
    return {d: futures[d].result() for d in DOMAINS}


def _summary(docs: dict[str, list[str]], tokenizer_dir: Path) -> dict[str, dict[str, int]]:
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    out = {}
    for domain, texts in docs.items():
        lens = [len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False)]
        out[domain] = {"documents": len(texts), "tokens": int(sum(lens)), "max_tokens": max(lens)}
    return out


def _print_summary(summary: dict[str, dict[str, int]], root: Path, seconds: float) -> None:
    print(f"demo corpus at {root} ({seconds:.1f} s)")
    print(f"{'domain':<24}{'docs':>6}{'tokens':>10}{'longest':>9}")
    for domain, s in summary.items():
        print(f"{domain:<24}{s['documents']:>6}{s['tokens']:>10}{s['max_tokens']:>9}")


def ensure_demo_corpus(cfg: ExperimentConfig, *, progress: bool = True) -> DemoCorpus | None:
    """Write the demo corpus named by ``cfg.data.demo_corpus`` when it is missing."""
    demo = cfg.data.demo_corpus
    if demo is None:
        return None
    return write_demo_corpus(
        demo.dir,
        seed=demo.seed,
        docs_per_domain=demo.docs_per_domain,
        progress=progress,
        workers=cfg.data.num_workers,
    )
