"""Table 6's stand-ins from `anchorctx demo-assets --paper`: Llama-3-8B, Mistral-7B-v0.3 and
Qwen-1.5-1.8B in their published formats, read by the project's own loaders, each giving its
family's anchor (Llama-3: <|begin_of_text|>; Mistral: <s>; Qwen, which has no BOS: EOS
<|endoftext|>); the Table 6 presets pointed at them; CWE's english_words.json as a named input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from anchorctx.demo import paper_assets as PA
from anchorctx.demo import paper_families as F
from anchorctx.evaluation.ruler import constants as C
from anchorctx.evaluation.ruler import data as D
from anchorctx.evaluation.ruler import tasks as T
from anchorctx.experiment import load_config
from anchorctx.models.loading import anchor_token_id, build_hf_config, load_model, load_tokenizer
from anchorctx.models.settings import ModelConfig

pytest.importorskip("sentencepiece")  # Mistral's tokenizer.model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("paper")
    PA.write_paper_assets(out, tiny=True, progress=False)
    return out


def _loaded(root: Path, family: str):
    cfg = ModelConfig(path=root / F.FAMILIES[family].directory)
    tok = load_tokenizer(cfg)
    return cfg, tok


# (family, files it ships, anchor token, its role, model_type, architecture)
CASES = [
    (
        "llama3",
        {"tokenizer.json", "model.safetensors.index.json"},
        "<|begin_of_text|>",
        "bos",
        "llama",
        "LlamaForCausalLM",
    ),
    (
        "mistral",
        {"tokenizer.model", "tokenizer.json", "model.safetensors.index.json"},
        "<s>",
        "bos",
        "mistral",
        "MistralForCausalLM",
    ),
    (
        "qwen",
        {"tokenizer.json", "vocab.json", "merges.txt", "model.safetensors"},
        "<|endoftext|>",
        "eos",
        "qwen2",
        "Qwen2ForCausalLM",
    ),
]


@pytest.mark.parametrize(("family", "files", "anchor", "role", "model_type", "arch"), CASES)
def test_family_stand_in_gives_its_anchor_through_the_project_loaders(
    root, family, files, anchor, role, model_type, arch
):
    cfg, tok = _loaded(root, family)
    present = {p.name for p in cfg.path.iterdir()}
    assert files | {"config.json", "tokenizer_config.json"} <= present
    anchor_id = anchor_token_id(tok)
    assert tok.convert_ids_to_tokens(anchor_id) == anchor
    assert anchor_id == getattr(tok, f"{role}_token_id")
    hf = build_hf_config(cfg, seq_len=1024, tokenizer=tok)
    assert (hf.model_type, hf.bos_token_id) == (model_type, anchor_id)
    published = json.loads((cfg.path / "config.json").read_text())
    assert published["architectures"] == [arch]
    assert published["bos_token_id"] == anchor_id  # the model's own config agrees: no override
    model = load_model(cfg, tokenizer=tok, attn_implementation=None)
    assert type(model).__name__ == arch
    assert model.get_input_embeddings().num_embeddings == len(tok)


def test_llama3_tokenizer_json_prepends_begin_of_text_and_has_256_specials(root):
    _, tok = _loaded(root, "llama3")
    assert not (root / F.FAMILIES["llama3"].directory / "tokenizer.model").exists()
    ids = tok("hello world")["input_ids"]
    bos = tok.convert_tokens_to_ids("<|begin_of_text|>")
    assert ids[0] == bos and bos not in ids[1:]
    # Llama-3: the 256 special tokens follow the ordinary vocabulary, BOS first, EOS second.
    assert tok.convert_tokens_to_ids("<|end_of_text|>") == bos + 1 == len(tok) - 255
    assert tok.eos_token == "<|end_of_text|>"
    published = json.loads((root / F.FAMILIES["llama3"].directory / "config.json").read_text())
    assert (published["rope_theta"], published["rope_scaling"]) == (500000.0, None)
    assert published["num_attention_heads"] == 4 * published["num_key_value_heads"]  # GQA 4:1


def test_mistral_v03_has_exactly_32768_sentencepiece_pieces(root):
    import sentencepiece as spm

    model_dir = root / F.FAMILIES["mistral"].directory
    sp = spm.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
    assert sp.get_piece_size() == 32768
    pieces = [sp.id_to_piece(i) for i in (0, 1, 2, 3, 4, 770)]
    assert pieces == ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[control_768]"]
    assert sp.id_to_piece(771) == "<0x00>"  # byte fallback right after the controls
    _, tok = _loaded(root, "mistral")
    assert len(tok) == 32768 and tok("hello")["input_ids"][0] == 1
    published = json.loads((model_dir / "config.json").read_text())
    assert (published["vocab_size"], published["rope_theta"]) == (32768, 1000000.0)


def test_qwen_has_no_bos_and_q_k_v_biases(root):
    _, tok = _loaded(root, "qwen")
    assert tok.bos_token is None and tok.eos_token == "<|endoftext|>"
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert eos not in tok("hello world")["input_ids"]  # nothing prepended: no BOS
    cfg = ModelConfig(path=root / F.FAMILIES["qwen"].directory)
    model = load_model(cfg, tokenizer=tok, attn_implementation=None)
    assert model.model.layers[0].self_attn.q_proj.bias is not None


@pytest.mark.parametrize("preset", sorted(PA.TABLE6_PRESETS))
def test_table6_presets_point_at_their_family_stand_in(root, preset):
    family = PA.TABLE6_PRESETS[preset]
    raw = (REPO / "configs" / "paper" / f"{preset}.yaml").read_text()
    # The preset's own default is the stand-in's relative path: the layouts agree.
    assert f"path: {F.FAMILIES[family].directory}\n" in raw
    cfg = load_config(
        REPO / "configs" / "paper" / f"{preset}.yaml", PA.paper_overrides(root, preset)
    )
    assert Path(cfg.model.path) == (root / F.FAMILIES[family].directory).resolve()
    assert Path(cfg.evaluation.ruler.english_words_path).is_file()
    tok = load_tokenizer(cfg.model)
    assert tok.convert_ids_to_tokens(anchor_token_id(tok)) == F.FAMILIES[family].anchor


def test_english_words_stand_in_serves_cwe_beyond_wonderwords(root):
    path = root / PA.PAPER_FILES["evaluation.ruler.english_words_path"]
    words = D.english_words(path)
    builder = T.CWEBuilder(C.TASK_SPECS["cwe"].args, 131072, 42, {"english_words_path": str(path)})
    n = len(builder.words) + 1  # one past wonderwords: the size that needs english_words.json
    assert len(words) > n and builder._pool(n) == words


def test_cwe_names_a_missing_english_words_file_in_one_line(tmp_path):
    missing = tmp_path / "english_words.json"
    builder = T.CWEBuilder(C.TASK_SPECS["cwe"].args, 131072, 42, {"english_words_path": missing})
    with pytest.raises(D.MissingDataError) as err:
        builder._pool(len(builder.words) + 1)
    text = str(err.value)
    assert "\n" not in text
    assert f"evaluation.ruler.english_words_path points to a missing file: {missing}" in text


def test_a_named_english_words_file_is_checked_before_the_suite(root, tmp_path):
    from anchorctx.evaluation.ruler.runner import plan_samples

    present = {"english_words_path": root / "data" / "ruler" / "english_words.json"}
    plan, not_run = plan_samples(["cwe"], [1024], 2, present, {})
    assert not not_run and plan[("cwe", 1024)] == [0, 1]
    missing = tmp_path / "english_words.json"
    plan, not_run = plan_samples(["cwe"], [1024], 2, {"english_words_path": missing}, {})
    assert not plan and "\n" not in not_run["cwe"]
    assert (
        f"evaluation.ruler.english_words_path points to a missing file: {missing}"
        in (not_run["cwe"])
    )
    missing.write_text("[]")
    with pytest.raises(D.DataFormatError, match=r"evaluation\.ruler\.english_words_path"):
        plan_samples(["cwe"], [1024], 2, {"english_words_path": missing}, {})
    plan, not_run = plan_samples(["cwe"], [1024], 2, {}, {})  # unnamed: wonderwords suffice
    assert not not_run and ("cwe", 1024) in plan
