"""Seeded stand-ins, in the published file formats, for every input the paper configs name.

``configs/paper/*.yaml`` point at a local Llama-2-7B, SlimPajama and the benchmark files, none of
which can be shipped or downloaded here. :func:`write_paper_assets` writes, offline and from one
seed, files shaped exactly like the published ones, at the same relative paths the configs use,
so a config pointed at the directory (:data:`PAPER_FILES`, ``paper-assets.yaml``) runs every
stage on them: packing, training, RULER, LongBench, MMLU and HellaSwag. The content is synthetic
(random weights, pseudo-word text): the files rehearse the pipeline, never the paper's numbers.

Layout of ``out`` (each path mirrors the config's default under ``configs/paper/``)::

    models/Llama-2-7b-hf/             as Hugging Face publishes meta-llama/Llama-2-7b-hf:
        config.json                   the real config's fields (LlamaForCausalLM, 4096 hidden,
                                      11008 intermediate, 32 layers/heads/kv heads, 32000 vocab)
        generation_config.json
        model-0000K-of-0000N.safetensors  fp16, random (seeded), written tensor by tensor
        model.safetensors.index.json  {"metadata": {"total_size"}, "weight_map"}
        tokenizer.model               SentencePiece BPE trained on the demo corpus, byte
                                      fallback, <unk>=0 <s>=1 </s>=2 (Llama's trainer options)
        tokenizer.json                the same tokenizer in the fast format (Llama-2 ships both)
        tokenizer_config.json, special_tokens_map.json
    data/SlimPajama-627B/train/chunkN/example_train_K.jsonl.zst
                                      {"text", "meta": {"redpajama_set_name"}}, all 7 sources,
                                      heavy-tailed lengths (Book and ArXiv above 4096 tokens)
    data/ruler/PaulGrahamEssays.json  {"text"}: essays concatenated as RULER's
                                      download_paulgraham_essay.py does (whitespace at both ends)
    data/ruler/squad_v2_dev.json      SQuAD v2.0 dev layout
    data/ruler/hotpotqa_dev_distractor.json  HotpotQA dev distractor layout
    data/nltk_data/                   a parameter-free Punkt model (the real run needs NLTK's)
    data/LongBench/{dataset}.jsonl    THUDM LongBench v1 layout
    data/mmlu/{dev,test}/{subject}.jsonl   cais/mmlu records, all 57 subjects
    data/hellaswag/validation.jsonl   Rowan/hellaswag records
    paper-assets.yaml                 the ``--set`` overrides that point a paper config here
    assets.json                       parameters; written last (marks a complete set)
    .anchorctx-owner.json             here and in each directory above: the files this command
                                      wrote; a re-run replaces those and refuses anything else

``tiny=True`` keeps every file, name and field but shrinks the sizes (a 64-wide model, a 1000-piece
tokenizer, a few documents per source): what the CPU tests use.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

from anchorctx.demo.corpus import DOMAINS, generate_documents
from anchorctx.demo.fixtures import (
    FixtureWriter,
    dump_json,
    dump_jsonl,
    hellaswag_rows,
    hotpotqa_json,
    longbench_rows,
    mmlu_rows,
    paul_graham_json,
    squad_json,
    write_empty_punkt,
)
from anchorctx.demo.model_files import (  # re-exported: the stand-ins' own names
    AssetSizes,
    llama_tensors,
    special_tokens_map,
    tokenizer_config,
    train_sentencepiece,
    write_checkpoint_weights,
)
from anchorctx.io import (
    DirectoryOwner,
    WriterLock,
    atomic_write_json,
    atomic_write_text,
    check_replaceable,
    claim_directory,
    owned_directory,
    record_owner,
)

ASSETS_VERSION = 2  # 2: Table 6 families and english_words.json
MODEL_DIR = "models/Llama-2-7b-hf"
# config key -> path under the assets directory; the paths are the paper configs' own defaults.
PAPER_FILES: dict[str, str] = {
    "model.path": MODEL_DIR,
    "data.sources.0.path": "data/SlimPajama-627B/train",
    "evaluation.ruler.essay_path": "data/ruler/PaulGrahamEssays.json",
    "evaluation.ruler.squad_path": "data/ruler/squad_v2_dev.json",
    "evaluation.ruler.hotpotqa_path": "data/ruler/hotpotqa_dev_distractor.json",
    "evaluation.ruler.english_words_path": "data/ruler/english_words.json",
    "evaluation.ruler.nltk_data": "data/nltk_data",
    "evaluation.longbench.data_dir": "data/LongBench",
    "evaluation.harness.mmlu_dir": "data/mmlu",
    "evaluation.harness.hellaswag_dir": "data/hellaswag",
}
# Table 6's presets (configs/paper/<stem>.yaml) -> the family whose stand-in their model.path
# names (anchorctx.demo.paper_families.FAMILIES); every other key is PAPER_FILES'.
TABLE6_PRESETS: dict[str, str] = {
    "llama3-8b-128k": "llama3",
    "mistral-7b-v0.3-128k": "mistral",
    "qwen1.5-1.8b-128k": "qwen",
}
# Who may replace the assets directory and each directory in it: this command, whatever the
# seed or sizes; anything in it this command did not write and record is someone else's.
ASSETS_OWNER = DirectoryOwner("demo-assets", "a directory of paper stand-ins")


TINY = AssetSizes(
    hidden_size=64,
    intermediate_size=172,
    num_attention_heads=4,
    num_key_value_heads=4,
    num_hidden_layers=2,
    vocab_size=1000,
    docs_per_domain=2,
    chunks=2,
    files_per_chunk=2,
    essay_words=4000,
    english_words=9000,
    squad_titles=6,
    squad_paragraphs=5,
    hotpotqa_questions=16,
    hotpotqa_pool=160,
    longbench_samples=2,
    mmlu_subjects=3,
    mmlu_dev=5,
    mmlu_test=2,
    hellaswag=8,
)


def asset_paths(out: str | Path) -> dict[str, Path]:
    """Config key -> path of its stand-in under ``out``."""
    return {key: Path(out) / rel for key, rel in PAPER_FILES.items()}


def family_paths(out: str | Path) -> dict[str, Path]:
    """Table 6 family (``llama3``, ``mistral``, ``qwen``) -> its stand-in model directory."""
    from anchorctx.demo.paper_families import FAMILIES

    return {name: Path(out) / family.directory for name, family in FAMILIES.items()}


def paper_overrides(out: str | Path, preset: str | None = None) -> list[str]:
    """``--set`` overrides that point ``configs/paper/*.yaml`` at the assets in ``out``; for a
    Table 6 preset (its file stem, :data:`TABLE6_PRESETS`) ``model.path`` names its family's."""
    root = Path(out).resolve()
    files = dict(PAPER_FILES)
    if preset is not None and preset in TABLE6_PRESETS:
        files["model.path"] = str(family_paths(".")[TABLE6_PRESETS[preset]])
    return [f"{key}={root / rel}" for key, rel in files.items()]


# ------------------------------------------------------------------------------ checkpoint
def llama2_config(sizes: AssetSizes) -> dict[str, Any]:
    """``config.json`` of meta-llama/Llama-2-7b-hf, with the sizes of ``sizes``."""
    return {
        "_name_or_path": "meta-llama/Llama-2-7b-hf",
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": sizes.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": sizes.intermediate_size,
        "max_position_embeddings": 4096,
        "model_type": "llama",
        "num_attention_heads": sizes.num_attention_heads,
        "num_hidden_layers": sizes.num_hidden_layers,
        "num_key_value_heads": sizes.num_key_value_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "transformers_version": "4.31.0.dev0",
        "use_cache": True,
        "vocab_size": sizes.vocab_size,
    }


GENERATION_CONFIG = {
    "bos_token_id": 1,
    "do_sample": True,
    "eos_token_id": 2,
    "max_length": 4096,
    "pad_token_id": 0,
    "temperature": 0.6,
    "top_p": 0.9,
    "transformers_version": "4.31.0.dev0",
}


def write_tokenizer(model_dir: Path, texts: list[str], vocab_size: int) -> int:
    """tokenizer.model, tokenizer.json and the two JSON configs; returns the vocabulary size."""
    model, pieces = train_sentencepiece(texts, vocab_size)
    (model_dir / "tokenizer.model").write_bytes(model)
    dump_json(model_dir / "tokenizer_config.json", tokenizer_config())
    dump_json(model_dir / "special_tokens_map.json", special_tokens_map())
    # Imported here: transformers costs seconds to import; only a new tokenizer needs it. Its own
    # conversion of tokenizer.model gives the tokenizer.json that Llama-2 ships beside it.
    from transformers import AutoTokenizer

    fast = AutoTokenizer.from_pretrained(str(model_dir))
    fast.backend_tokenizer.save(str(model_dir / "tokenizer.json"))
    return pieces


# ----------------------------------------------------------------------------- SlimPajama
def write_slimpajama(
    train_dir: Path, docs: dict[str, list[str]], sizes: AssetSizes, seed: int
) -> dict[str, int]:
    """``chunkN/example_train_K.jsonl.zst`` files, the sources shuffled together as in the
    release; returns documents per source."""
    records = [(d, t) for d in DOMAINS for t in docs[d]]
    order = np.random.default_rng([seed, 7]).permutation(len(records))
    slots = [(c, k) for c in range(1, sizes.chunks + 1) for k in range(sizes.files_per_chunk)]
    lines: dict[tuple[int, int], list[bytes]] = {s: [] for s in slots}
    for pos, i in enumerate(order):
        domain, text = records[i]
        rec = {"text": text, "meta": {"redpajama_set_name": domain}}
        lines[slots[pos % len(slots)]].append(json.dumps(rec).encode() + b"\n")
    compressor = zstandard.ZstdCompressor(level=3)
    for (c, k), body in lines.items():
        path = train_dir / f"chunk{c}" / f"example_train_{k}.jsonl.zst"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(compressor.compress(b"".join(body)))
    return {d: len(docs[d]) for d in DOMAINS}


# --------------------------------------------------------------------------- benchmarks
def write_benchmarks(data_dir: Path, sizes: AssetSizes, seed: int) -> None:
    """RULER's three files, LongBench, MMLU and HellaSwag under ``data_dir`` (each its own
    seeded writer, as in :mod:`anchorctx.demo.fixtures`)."""
    for key, write in BENCHMARKS.items():
        write(data_dir / key, sizes, seed)


def _ruler(out: Path, sizes: AssetSizes, seed: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    dump_json(
        out / "PaulGrahamEssays.json", paul_graham_json(FixtureWriter(seed), sizes.essay_words)
    )
    squad = squad_json(FixtureWriter(seed + 1), sizes.squad_titles, sizes.squad_paragraphs)
    dump_json(out / "squad_v2_dev.json", squad)
    hotpot = hotpotqa_json(FixtureWriter(seed + 2), sizes.hotpotqa_questions, sizes.hotpotqa_pool)
    dump_json(out / "hotpotqa_dev_distractor.json", hotpot)
    dump_json(out / "english_words.json", english_words_json(seed + 6, sizes.english_words))


def english_words_json(seed: int, n: int) -> dict[str, str]:
    """RULER's english_words.json layout (an object whose *values* are the words): wonderwords'
    words, then seeded pseudo-words up to ``n``, so CWE near 128K has more than wonderwords."""
    # Imported here: the word lists are evaluation data; only this file needs them.
    from anchorctx.evaluation.ruler.data import wonderwords_lists

    words = sorted({w for group in wonderwords_lists() for w in group})
    seen, rng = set(words), np.random.default_rng([seed, 11])
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    while len(words) < n:
        word = "".join(rng.choice(letters, size=int(rng.integers(5, 10))))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return {str(i): w for i, w in enumerate(words[:n])}


def _nltk_data(out: Path, sizes: AssetSizes, seed: int) -> None:
    write_empty_punkt(out)


def _longbench(out: Path, sizes: AssetSizes, seed: int) -> None:
    for name, rows in longbench_rows(FixtureWriter(seed + 3), sizes.longbench_samples).items():
        dump_jsonl(out / f"{name}.jsonl", rows)


def _mmlu(out: Path, sizes: AssetSizes, seed: int) -> None:
    # Imported here: the harness module is evaluation code; the list is the one place the 57
    # subjects are written down.
    from anchorctx.evaluation.lm_eval.harness import MMLU_SUBJECTS

    subjects = MMLU_SUBJECTS[: sizes.mmlu_subjects]
    mmlu = mmlu_rows(FixtureWriter(seed + 4), sizes.mmlu_dev, sizes.mmlu_test, subjects=subjects)
    for split, by_subject in mmlu.items():
        for subject, rows in by_subject.items():
            dump_jsonl(out / split / f"{subject}.jsonl", rows)


def _hellaswag(out: Path, sizes: AssetSizes, seed: int) -> None:
    dump_jsonl(out / "validation.jsonl", hellaswag_rows(FixtureWriter(seed + 5), sizes.hellaswag))


# Each benchmark directory under data/ and its writer: one directory each, so each is replaced
# on its own and only when it is the one this command wrote (anchorctx.io.owned_directory).
BENCHMARKS: dict[str, Callable[[Path, AssetSizes, int], None]] = {
    "ruler": _ruler,
    "nltk_data": _nltk_data,
    "LongBench": _longbench,
    "mmlu": _mmlu,
    "hellaswag": _hellaswag,
}


# ---------------------------------------------------------------------------------- all
def _params(seed: int, sizes: AssetSizes) -> dict[str, Any]:
    return {"version": ASSETS_VERSION, "seed": seed, "sizes": asdict(sizes)}


def _is_complete(out: Path, params: dict[str, Any]) -> bool:
    marker = out / "assets.json"
    try:
        return json.loads(marker.read_text()).get("params") == params
    except (OSError, json.JSONDecodeError):
        return False


def overrides_yaml(out: Path) -> str:
    lines = [
        "# Overrides that point configs/paper/*.yaml at the stand-ins in this directory:",
        "#   anchorctx config configs/paper/llama2-7b-64k.yaml \\",
        *(f"#     --set {o} \\" for o in paper_overrides(out)),
        "# Table 6's presets (configs/paper/{llama3-8b,mistral-7b-v0.3,qwen1.5-1.8b}-128k.yaml):",
        "# the same, with model.path one of",
        *(f"#   --set model.path={p}" for p in family_paths(out.resolve()).values()),
        "# The files are synthetic (random weights, pseudo-word text): they rehearse the",
        "# pipeline and cannot reproduce the paper's numbers. Replace each with the real file.",
    ]
    body = [f"{key}: {json.dumps(str(path))}" for key, path in asset_paths(out.resolve()).items()]
    return "\n".join(lines + body) + "\n"


def write_paper_assets(
    out: str | Path,
    *,
    seed: int = 0,
    tiny: bool = False,
    layers: int | None = None,
    force: bool = False,
    progress: bool = True,
) -> dict[str, Path]:
    """Write (or reuse, when complete with the same parameters) the stand-ins under ``out``;
    returns their paths by config key. ``layers`` overrides the number of decoder layers.

    ``out`` must be new, empty or a directory this function wrote; in it, only the files it
    wrote and recorded are replaced (:func:`anchorctx.io.check_replaceable`): real weights or
    benchmark files put there since are refused, never overwritten. One writer at a time."""
    root = Path(out)
    sizes = TINY if tiny else AssetSizes()
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        sizes = replace(sizes, num_hidden_layers=layers)
    params = _params(seed, sizes)
    if not force and _is_complete(root, params):
        return asset_paths(root)
    check_replaceable(root, ASSETS_OWNER)  # a refusal leaves no lock file beside the user's
    with WriterLock.beside(root, f"paper assets directory {root}"):
        if not force and _is_complete(root, params):
            return asset_paths(root)  # the writer we would have waited for just finished it
        return _write_all(root, params, sizes, seed, progress)


def _write_all(
    root: Path, params: dict[str, Any], sizes: AssetSizes, seed: int, progress: bool
) -> dict[str, Path]:
    claim_directory(root, ASSETS_OWNER)  # refuses a directory of anyone else's before writing
    marker = root / "assets.json"
    marker.unlink(missing_ok=True)  # the set is incomplete from here until the new marker
    start = time.perf_counter()

    def say(text: str) -> None:
        if progress:
            print(f"[{time.perf_counter() - start:6.1f} s] {text}", flush=True)

    say("demo corpus documents (the SlimPajama stand-in and the tokenizer's training text)")
    docs = generate_documents(seed, sizes.docs_per_domain, progress=False)
    paths = asset_paths(root)
    with owned_directory(paths["data.sources.0.path"], ASSETS_OWNER) as tmp:
        counts = write_slimpajama(tmp, docs, sizes, seed)
    say(f"SlimPajama chunks: {sum(counts.values())} documents")
    for key, write in BENCHMARKS.items():
        with owned_directory(root / "data" / key, ASSETS_OWNER) as tmp:
            write(tmp, sizes, seed)
    say("RULER, LongBench, MMLU and HellaSwag files")
    texts = [t for d in DOMAINS for t in docs[d]]
    texts.append(json.loads(paths["evaluation.ruler.essay_path"].read_text())["text"])
    needs = sum(2 * int(np.prod(shape)) for _, shape in llama_tensors(sizes))
    with owned_directory(paths["model.path"], ASSETS_OWNER, needs=needs) as tmp:
        pieces = write_tokenizer(tmp, texts, sizes.vocab_size)
        say(f"tokenizer: {pieces} pieces (asked for {sizes.vocab_size})")
        dump_json(tmp / "config.json", llama2_config(sizes))
        dump_json(tmp / "generation_config.json", GENERATION_CONFIG)
        index = write_checkpoint_weights(tmp, sizes, seed)
    files = sorted(set(index["weight_map"].values()))
    say(f"checkpoint: {len(files)} shards, {index['metadata']['total_size'] / 2**30:.2f} GiB")
    families = _write_families(root, texts, seed)
    say("Table 6 families: " + ", ".join(f"{k} ({v['vocab']} tokens)" for k, v in families.items()))
    atomic_write_text(root / "paper-assets.yaml", overrides_yaml(root))
    summary = {
        "tokenizer_pieces": pieces,
        "documents": counts,
        "shards": files,
        "families": {k: {"vocab": v["vocab"]} for k, v in families.items()},
    }
    atomic_write_json(marker, {"params": params, "summary": summary})
    record_owner(root, ASSETS_OWNER)  # the two files above are now this writer's to replace
    return paths


def _write_families(root: Path, texts: list[str], seed: int) -> dict[str, dict[str, Any]]:
    """Table 6's stand-ins (small shapes in every size: their conventions are the point), each
    directory replaced only when this command wrote it."""
    from anchorctx.demo.paper_families import FAMILIES, family_bytes, write_family

    out = {}
    for name, path in family_paths(root).items():
        family = FAMILIES[name]
        with owned_directory(path, ASSETS_OWNER, needs=family_bytes(family)) as tmp:
            out[name] = write_family(tmp, family, texts, seed)
    return out
