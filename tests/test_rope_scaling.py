"""``model.rope_scaling`` (paper Table 2): YaRN and NTK-aware as the paper configures them, and the
explicit rule for a checkpoint's own ``rope_scaling`` when ``model.rope_theta`` overrides the base
(docs/FIDELITY.md)."""

from __future__ import annotations

import json
import logging

import pytest

from anchorctx.config import ConfigError
from anchorctx.experiment import config_from_dict
from anchorctx.models import loading
from anchorctx.models.loading import build_hf_config, ntk_theta, position_limit, rope_type
from anchorctx.models.settings import ModelConfig

TINY = {"tiny": {"hidden_size": 64, "num_attention_heads": 4}, "tokenizer": "tok"}


def _model(**extra) -> ModelConfig:
    return ModelConfig.model_validate({**TINY, **extra})


def _llama31_dir(tmp_path):
    """A Llama-3.1-style config.json: base 5e5 with the ``llama3`` rope_scaling."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.fixture(autouse=True)
def _fresh_notes():
    loading._NOTED.clear()  # each test sees its one-per-process log lines
    yield
    loading._NOTED.clear()


# ------------------------------------------------------------------------------ settings
@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        ({"type": "yarn"}, r"model\.rope_scaling.*factor is required"),
        ({"type": "ntk"}, r"model\.rope_scaling.*factor is required"),
        ({"type": "keep", "factor": 4}, r"model\.rope_scaling.*only to type yarn or ntk"),
        ({"type": "ntk", "factor": 4, "original_max_position_embeddings": 4096}, r"only to type"),
        ({"type": "linear", "factor": 4}, r"model\.rope_scaling\.type"),
        ({"type": "yarn", "factor": 1}, r"model\.rope_scaling\.factor"),
    ],
)
def test_bad_rope_scaling_is_one_line_naming_the_key(scaling, message):
    with pytest.raises(ConfigError, match=message) as err:
        config_from_dict({"name": "t", "model": {**TINY, "rope_scaling": scaling}})
    assert "\n" not in str(err.value)


def test_rope_scaling_override_key_is_checked():
    with pytest.raises(ConfigError, match=r"unknown key 'model.rope_scaling.factr'"):
        config_from_dict({"name": "t", "model": TINY}, ["model.rope_scaling.factr=16"])
    cfg = config_from_dict(
        {"name": "t", "model": TINY},
        ["model.rope_scaling.type=yarn", "model.rope_scaling.factor=16"],
    )
    assert (cfg.model.rope_scaling.type, cfg.model.rope_scaling.factor) == ("yarn", 16.0)


# ------------------------------------------------------------------------------ methods
def test_ntk_raises_the_base_by_factor_to_d_over_d_minus_2():
    hf = build_hf_config(
        _model(rope_theta=1e6, rope_scaling={"type": "ntk", "factor": 16}),
        seq_len=2048,
        vocab_size=128,
    )
    head_dim = 64 // 4
    expected = 1e6 * 16 ** (head_dim / (head_dim - 2))
    assert loading.rope_theta(hf) == pytest.approx(expected, rel=1e-12)  # float64 arithmetic
    assert rope_type(hf) == "default"  # positions are not scaled: only the base moves
    assert ntk_theta(10000.0, 16, 128) == pytest.approx(10000.0 * 16 ** (128 / 126))


def test_yarn_is_transformers_yarn_over_the_checkpoints_length():
    import torch
    from transformers import AutoModelForCausalLM

    cfg = _model(rope_theta=1e6, rope_scaling={"type": "yarn", "factor": 16})
    hf = build_hf_config(cfg, seq_len=8192, vocab_size=128)
    params = hf.rope_parameters
    assert params["rope_type"] == "yarn" and params["factor"] == 16.0
    assert params["original_max_position_embeddings"] == 4096  # the tiny model's own limit
    assert loading.rope_theta(hf) == 1e6
    assert hf.max_position_embeddings == 8192  # the training length: RULER may go that far
    plain = build_hf_config(_model(rope_theta=1e6), seq_len=8192, vocab_size=128)
    yarn_freq = AutoModelForCausalLM.from_config(hf).model.rotary_emb.inv_freq
    plain_freq = AutoModelForCausalLM.from_config(plain).model.rotary_emb.inv_freq
    assert torch.equal(yarn_freq[:1], plain_freq[:1])  # the fastest frequency is kept ...
    assert yarn_freq[-1] < plain_freq[-1]  # ... the slowest is interpolated by the factor


def test_position_limit_follows_the_rope_setting():
    assert position_limit(_model(), 8192) is None  # the model's own
    assert position_limit(_model(rope_scaling={"type": "yarn", "factor": 2}), 8192) == 8192
    assert position_limit(_model(rope_scaling={"type": "ntk", "factor": 2}), 8192) == 8192
    assert position_limit(_model(rope_scaling={"type": "none"}), 8192) is None


# ------------------------------------------------------------------------------ the rule
def test_base_override_keeps_a_checkpoints_llama3_scaling_and_says_so(tmp_path, caplog):
    path = _llama31_dir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="anchorctx.models"):
        hf = build_hf_config(ModelConfig(path=path, rope_theta=1e7), seq_len=131072)
        build_hf_config(ModelConfig(path=path, rope_theta=1e7), seq_len=131072)
    assert rope_type(hf) == "llama3" and loading.rope_theta(hf) == 1e7
    notes = [r.getMessage() for r in caplog.records if "rope_scaling" in r.getMessage()]
    assert len(notes) == 1  # one line, not one per build
    assert "keeps" in notes[0] and "'llama3'" in notes[0] and "type=none" in notes[0]


def test_rope_scaling_none_drops_it_for_plain_rope_with_the_base(tmp_path, caplog):
    path = _llama31_dir(tmp_path)
    cfg = ModelConfig(path=path, rope_theta=1e7, rope_scaling={"type": "none"})
    with caplog.at_level(logging.WARNING, logger="anchorctx.models"):
        hf = build_hf_config(cfg, seq_len=131072)
    assert rope_type(hf) == "default" and loading.rope_theta(hf) == 1e7
    assert any("dropped" in r.getMessage() and "llama3" in r.getMessage() for r in caplog.records)


def test_keep_without_a_base_override_says_nothing(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="anchorctx.models"):
        hf = build_hf_config(ModelConfig(path=_llama31_dir(tmp_path)), seq_len=None)
    assert rope_type(hf) == "llama3" and loading.rope_theta(hf) == 5e5
    assert not [r for r in caplog.records if "rope_scaling" in r.getMessage()]


def test_yarn_replaces_a_checkpoints_scaling_and_says_so(tmp_path, caplog):
    cfg = ModelConfig(
        path=_llama31_dir(tmp_path),
        rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 8192},
    )
    with caplog.at_level(logging.WARNING, logger="anchorctx.models"):
        hf = build_hf_config(cfg, seq_len=32768)
    assert hf.rope_parameters["rope_type"] == "yarn"
    assert hf.rope_parameters["original_max_position_embeddings"] == 8192
    assert "low_freq_factor" not in hf.rope_parameters  # nothing of llama3's is left over
    assert any("replaced" in r.getMessage() for r in caplog.records)


def test_pretraining_drops_rope_scaling_and_keeps_its_hash():
    raw = {
        "name": "t",
        "model": {**TINY, "rope_scaling": {"type": "yarn", "factor": 2}},
        "pretrain": {},
    }
    plain = config_from_dict({**raw, "model": TINY}).pretraining()
    pre = config_from_dict(raw).pretraining()
    assert pre.model.rope_scaling.type == "keep"
    assert pre.variant == plain.variant  # the arms' RoPE is not the pretraining run's identity
