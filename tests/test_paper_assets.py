"""`anchorctx demo-assets --paper`: every input of configs/paper/*.yaml in its published format,
and each loader of the project reading it: the sharded checkpoint, the SentencePiece tokenizer
(anchor = BOS id 1), SlimPajama chunks through Fu et al.'s upsampling, RULER's 13 tasks from the
essay / SQuAD / HotpotQA files, LongBench, MMLU, HellaSwag. A malformed file is one error naming
the file and the field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import zstandard

from anchorctx.demo import model_files as MF
from anchorctx.demo import paper_assets as PA
from anchorctx.demo.fixtures import write_empty_punkt
from anchorctx.evaluation.lm_eval import harness
from anchorctx.evaluation.longbench.runner import LongBenchDataError, load_rows
from anchorctx.evaluation.ruler import TASKS, generate
from anchorctx.evaluation.ruler import data as D
from anchorctx.experiment import config_from_dict, load_config
from anchorctx.models.loading import anchor_token_id, load_model, load_tokenizer
from anchorctx.models.settings import ModelConfig
from anchorctx.packing import DataError, load_packed, prepare_data

pytest.importorskip("sentencepiece")  # writing tokenizer.model needs it

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    return PA.write_paper_assets(tmp_path_factory.mktemp("paper"), tiny=True, progress=False)


@pytest.fixture(scope="module")
def tokenizer(assets):
    return load_tokenizer(ModelConfig(path=assets["model.path"]))


# --------------------------------------------------------------------- command and config
def test_command_help_and_overrides_point_the_paper_config_at_the_assets(assets, capsys):
    from anchorctx.cli import build_parser, main

    sub = build_parser()._subparsers._group_actions[0].choices["demo-assets"]  # type: ignore[union-attr]
    text = sub.format_help()
    for word in ("--paper", "--seed", "--layers", "--tiny", "safetensors", "SlimPajama"):
        assert word in text
    root = assets["model.path"].parents[1]
    assert main(["demo-assets", "--paper", str(root), "--tiny", "--quiet"]) == 0  # reused
    printed = capsys.readouterr().out
    overrides = PA.paper_overrides(root)
    assert all(f"--set {o}" in printed for o in overrides)
    yaml_text = (root / "paper-assets.yaml").read_text()
    assert all(f"--set {o}" in yaml_text for o in overrides)
    for name in ("llama2-7b-64k.yaml", "llama2-7b-128k.yaml"):
        cfg = load_config(REPO / "configs" / "paper" / name, overrides)
        assert Path(cfg.model.path) == assets["model.path"].resolve()
        assert Path(cfg.data.sources[0].path).is_dir()
        ruler = cfg.evaluation.ruler
        assert all(Path(p).is_file() for p in (ruler.essay_path, ruler.squad_path))
        assert Path(cfg.evaluation.harness.mmlu_dir).is_dir()
    meta = json.loads((root / "assets.json").read_text())
    assert meta["params"]["sizes"]["num_hidden_layers"] == 2


def test_refuses_a_directory_of_other_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"notes\.txt"):
        PA.write_paper_assets(tmp_path, tiny=True, progress=False)


# ----------------------------------------------------------------------------- checkpoint
def test_full_size_is_llama2_7b():
    cfg = PA.llama2_config(PA.AssetSizes())
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "rms_norm_eps": 1e-05,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float16",
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    assert {k: cfg[k] for k in expected} == expected
    tensors = PA.llama_tensors(PA.AssetSizes())
    assert sum(int(np.prod(s)) for _, s in tensors) == 6_738_415_616  # Llama-2-7B's parameters
    assert len(MF._shard_plan(tensors, 2)) == 2


def test_sharded_checkpoint_layout_and_project_loader(assets):
    import torch
    from safetensors import safe_open

    d = assets["model.path"]
    config = json.loads((d / "config.json").read_text())
    assert set(config) == set(PA.llama2_config(PA.AssetSizes()))  # same fields, tiny sizes
    assert json.loads((d / "generation_config.json").read_text())["bos_token_id"] == 1
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    names = [n for n, _ in PA.llama_tensors(PA.TINY)]
    assert sorted(index["weight_map"]) == sorted(names)
    total = 0
    for shard in shards:
        with safe_open(str(d / shard), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                assert index["weight_map"][name] == shard
                t = f.get_tensor(name)
                assert t.dtype == torch.float16
                total += t.numel() * 2
    assert total == index["metadata"]["total_size"]

    model = load_model(
        ModelConfig(path=d, dtype="float32"), attn_implementation=None, tokenizer=None
    )
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 2
    with safe_open(str(d / index["weight_map"]["lm_head.weight"]), framework="pt") as f:
        torch.testing.assert_close(model.lm_head.weight, f.get_tensor("lm_head.weight").float())
    logits = model(torch.tensor([[1, 5, 6, 7]])).logits
    assert logits.shape == (1, 4, config["vocab_size"]) and torch.isfinite(logits).all()


def test_missing_shard_is_one_error_naming_the_model(assets, tmp_path):
    from anchorctx.models.loading import ModelFileError

    broken = tmp_path / "model"
    broken.mkdir()
    src = assets["model.path"]
    for f in src.iterdir():
        if f.name != "model-00002-of-00002.safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ModelFileError, match=re.escape(str(broken))):
        load_model(ModelConfig(path=broken, dtype="float32"), attn_implementation=None)


# ------------------------------------------------------------------------------ tokenizer
def test_sentencepiece_tokenizer_as_llama_ships_it(assets, tokenizer):
    import sentencepiece as spm
    from transformers import AutoTokenizer

    d = assets["model.path"]
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "LlamaTokenizer" and cfg["pad_token"] is None
    assert (cfg["add_bos_token"], cfg["add_eos_token"]) == (True, False)
    assert cfg["bos_token"]["content"] == "<s>" and cfg["legacy"] is False
    assert set(json.loads((d / "special_tokens_map.json").read_text())) == {
        "bos_token",
        "eos_token",
        "unk_token",
    }
    sp = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
    assert [sp.id_to_piece(i) for i in range(4)] == ["<unk>", "<s>", "</s>", "<0x00>"]
    assert sp.get_piece_size() == PA.TINY.vocab_size
    auto = AutoTokenizer.from_pretrained(str(d))
    assert (auto.unk_token_id, auto.bos_token_id, auto.eos_token_id) == (0, 1, 2)
    assert anchor_token_id(tokenizer) == 1
    essay = json.loads(assets["evaluation.ruler.essay_path"].read_text())["text"]
    for text in (essay.strip()[:2000], "Numbers 1234567 split, ünïcødé €\n\nand  two  spaces."):
        ids = tokenizer(text)["input_ids"]
        assert ids == [1, *sp.encode(text)]  # BOS first, then exactly sentencepiece's pieces
        assert auto(text)["input_ids"] == ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


# ----------------------------------------------------------------------------- SlimPajama
def _chunk_records(train: Path) -> list[dict]:
    out = []
    for path in sorted(train.rglob("*.jsonl.zst")):
        assert re.fullmatch(
            r"chunk\d+/example_train_\d+\.jsonl\.zst", path.relative_to(train).as_posix()
        )
        raw = zstandard.ZstdDecompressor().stream_reader(path.read_bytes()).read()
        out += [json.loads(line) for line in raw.decode().splitlines()]
    return out


def test_slimpajama_chunks_pack_with_fu_upsampling_and_the_bos_anchor(assets, tokenizer, tmp_path):
    train = assets["data.sources.0.path"]
    records = _chunk_records(train)
    assert {r["meta"]["redpajama_set_name"] for r in records} == set(PA.DOMAINS)
    assert all(set(r) == {"text", "meta"} for r in records)
    lengths = [len(tokenizer(r["text"], add_special_tokens=False)["input_ids"]) for r in records]
    assert max(lengths) > 4096 and min(lengths) < 4096  # both sides of the upsampling threshold
    raw = {
        "name": "paper",
        "run_root": str(tmp_path),
        "seed": 0,
        "model": {"path": str(assets["model.path"]), "dtype": "float32"},
        "data": {
            "sources": [{"path": str(train)}],
            "seq_len": 1024,
            "mixture": "upsampled",
            "token_budget": 60_000,
        },
    }
    out = prepare_data(config_from_dict(raw), progress=False)
    ds, manifest = load_packed(out)
    up = manifest["mixture"]["upsample"]
    assert up["rule"] == "fu2024_per_source" and manifest["counts"]["repeated_documents"] == 0
    assert set(up["by_source"]) <= set(PA.DOMAINS)
    for row in ds["input_ids"]:
        assert row[0] == 1 and 1 not in row[1:]  # one anchor (BOS) per row, never in content


def test_slimpajama_record_without_text_names_file_and_line(assets, tmp_path):
    bad = tmp_path / "chunk1" / "example_train_0.jsonl.zst"
    bad.parent.mkdir(parents=True)
    lines = [
        {"text": "fine", "meta": {"redpajama_set_name": "RedPajamaC4"}},
        {"meta": {"redpajama_set_name": "RedPajamaC4"}},
    ]
    body = "".join(json.dumps(r) + "\n" for r in lines).encode()
    bad.write_bytes(zstandard.ZstdCompressor().compress(body))
    raw = {
        "name": "bad",
        "run_root": str(tmp_path / "runs"),
        "seed": 0,
        "model": {"path": str(assets["model.path"]), "dtype": "float32"},
        "data": {"sources": [{"path": str(tmp_path / "chunk1")}], "seq_len": 64},
    }
    with pytest.raises(DataError, match=rf"{re.escape(str(bad))}:2: record has no 'text' field"):
        prepare_data(config_from_dict(raw), progress=False)


# ----------------------------------------------------------------------------------- RULER
LENGTH = {task: 4096 for task in TASKS} | {"cwe": 8192}


def test_essay_file_has_whitespace_at_both_ends_as_ruler_writes_it(assets):
    text = json.loads(assets["evaluation.ruler.essay_path"].read_text())["text"]
    assert text[0].isspace() and text.endswith("\n\n") and "\n\n\n\n" in text  # essays meet


def test_ruler_all_thirteen_tasks_from_the_published_files(assets, tokenizer):
    paths = {
        "essay_path": str(assets["evaluation.ruler.essay_path"]),
        "squad_path": str(assets["evaluation.ruler.squad_path"]),
        "hotpotqa_path": str(assets["evaluation.ruler.hotpotqa_path"]),
        "nltk_data": str(assets["evaluation.ruler.nltk_data"]),
    }
    for task in TASKS:
        (sample,) = generate(task, LENGTH[task], tokenizer, 1, **paths)
        assert sample["length"] <= LENGTH[task], task
        found = [ref in sample["input"] for ref in sample["outputs"]]
        assert any(found) if task.startswith("qa") else all(found), task


def test_essay_sentences_follow_niah_on_an_essay_with_whitespace_at_both_ends(tmp_path):
    """niah.py: haystack = re.sub(r'\\s+', ' ', essay).split(' '); text = ' '.join((haystack *
    repeats)[:n]); sent_tokenize(text.strip()). The project's cut of one whole-essay split must
    give the same sentences for every n, the empty end words included."""
    nltk_data = write_empty_punkt(tmp_path / "nltk")
    body = " ".join(f"Sentence number {i} has words in it." for i in range(30))
    split = D.punkt_splitter(nltk_data)
    for name, text in {"both": f"\n\n{body}\n\n", "lead": f"  {body}", "clean": body}.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"text": text}))
        haystack = re.sub(r"\s+", " ", text).split(" ")
        for n in (
            1,
            2,
            7,
            50,
            len(haystack) - 1,
            len(haystack),
            len(haystack) + 3,
            3 * len(haystack) + 5,
        ):
            repeats = -(-n // len(haystack))
            want = split(" ".join((haystack * repeats)[:n]).strip())
            assert list(D.essay_sentences(path, n, nltk_data)) == want, (name, n)


@pytest.mark.parametrize(
    ("kind", "content", "field"),
    [
        ("essay", {"txt": "no text key"}, "'text'"),
        ("squad", {"version": "v2.0"}, "'data'"),
        ("squad", {"data": [{"title": "t", "paragraphs": [{"qas": []}]}]}, "'context'"),
        (
            "squad",
            {
                "data": [
                    {
                        "paragraphs": [
                            {
                                "context": "c",
                                "qas": [{"id": "1", "answers": [], "is_impossible": False}],
                            }
                        ]
                    }
                ]
            },
            "'question'",
        ),
        ("hotpotqa", [{"_id": "1", "answer": "a", "context": []}], "'question'"),
        ("hotpotqa", [{"question": "q", "answer": "a"}], "'context'"),
    ],
)
def test_malformed_ruler_file_is_one_error_naming_file_and_field(tmp_path, kind, content, field):
    path = tmp_path / f"{kind}.json"
    path.write_text(json.dumps(content))
    reader = {"essay": D.essay_words, "squad": D.read_squad, "hotpotqa": D.read_hotpotqa}[kind]
    with pytest.raises(ValueError, match=re.escape(str(path))) as err:
        reader(path)
    assert field in str(err.value) and "\n" not in str(err.value)


# --------------------------------------------------------------- LongBench, MMLU, HellaSwag
def test_longbench_mmlu_hellaswag_files_load(assets):
    lb = assets["evaluation.longbench.data_dir"]
    files = sorted(lb.glob("*.jsonl"))
    assert len(files) == 16
    for path in files:
        rows = load_rows(path)
        assert rows and all(
            set(r)
            == {
                "input",
                "context",
                "answers",
                "length",
                "dataset",
                "language",
                "all_classes",
                "_id",
            }
            and r["dataset"] == path.stem
            for r in rows
        )
    found, missing = harness.mmlu_layout(assets["evaluation.harness.mmlu_dir"])
    assert len(found) == PA.TINY.mmlu_subjects and len(missing) == 57 - PA.TINY.mmlu_subjects
    for files_ in found.values():
        for path in files_.values():
            harness.check_jsonl_fields(path, harness.MMLU_FIELDS, "MMLU")
    hs = harness.hellaswag_file(assets["evaluation.harness.hellaswag_dir"])
    harness.check_jsonl_fields(hs, harness.HELLASWAG_FIELDS, "HellaSwag")


def test_full_mmlu_set_covers_all_57_subjects(tmp_path):
    from dataclasses import replace

    PA.write_benchmarks(tmp_path, replace(PA.TINY, mmlu_subjects=57, mmlu_test=1), seed=0)
    found, missing = harness.mmlu_layout(tmp_path / "mmlu")
    assert len(found) == 57 and not missing


def _drop_field(src: Path, dst: Path, field: str) -> Path:
    rows = [json.loads(line) for line in src.read_text().splitlines()]
    del rows[1][field]
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return dst


def test_longbench_record_without_a_field_names_file_line_and_field(assets, tmp_path):
    path = _drop_field(
        assets["evaluation.longbench.data_dir"] / "qasper.jsonl",
        tmp_path / "qasper.jsonl",
        "context",
    )
    with pytest.raises(LongBenchDataError, match=rf"{re.escape(str(path))}:2: .*context"):
        load_rows(path)


@pytest.mark.parametrize("suite", ["mmlu", "hellaswag"])
def test_harness_record_without_a_field_names_file_line_and_field(assets, tmp_path, suite):
    if suite == "mmlu":
        found, _ = harness.mmlu_layout(assets["evaluation.harness.mmlu_dir"])
        subject, files = next(iter(found.items()))
        bad = _drop_field(files["test"], tmp_path / "mmlu" / "test" / f"{subject}.jsonl", "choices")
        write = lambda d: harness.write_mmlu_yaml(d, subject, {**files, "test": bad})  # noqa: E731
        field = "choices"
    else:
        src = harness.hellaswag_file(assets["evaluation.harness.hellaswag_dir"])
        bad = _drop_field(src, tmp_path / "hs" / "validation.jsonl", "endings")
        write = lambda d: harness.write_hellaswag_yaml(d, bad)  # noqa: E731
        field = "endings"
    (tmp_path / "tasks").mkdir()
    with pytest.raises(harness.HarnessDataError, match=rf"{re.escape(str(bad))}:2: .*'{field}'"):
        write(tmp_path / "tasks")
