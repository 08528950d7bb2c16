"""The config tree: every shipped YAML validates, overrides coerce, typos are errors that name
the valid keys, arms apply their overrides."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

from anchorctx.config import ConfigError
from anchorctx.experiment import ExperimentConfig, VariantSpec, config_from_dict, load_config
from anchorctx.training.settings import TrainingConfig

CONFIGS = sorted(Path(__file__).resolve().parents[1].glob("configs/**/*.yaml"))
MINIMAL = {"name": "t", "model": {"tiny": {}, "tokenizer": "tok"}}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    assert isinstance(cfg, ExperimentConfig)
    for arm in cfg.arms():
        assert arm.run_dir == cfg.run_root / cfg.name / arm.variant_name


def test_paper_presets_follow_table_1():
    for name, seq, theta in [("64k", 65536, 5e6), ("128k", 131072, 1e7)]:
        cfg = load_config(f"configs/paper/llama2-7b-{name}.yaml")
        t = cfg.training
        assert (cfg.data.seq_len, cfg.model.rope_theta) == (seq, theta)
        assert (t.lr, t.betas, t.weight_decay, t.steps, t.global_batch_size) == (
            2e-5,
            (0.9, 0.95),
            0.1,
            2000,
            8,
        )
        assert (t.save.every, t.save.last, cfg.evaluation.last_k) == (10, 50, 5)


def test_override_coerces_types():
    cfg = config_from_dict(
        MINIMAL,
        [
            "training.steps=12",
            "training.lr=3e-4",
            "data.domain_tags=true",
            "training.betas=[0.8, 0.9]",
        ],
    )
    assert cfg.training.steps == 12 and isinstance(cfg.training.steps, int)
    assert cfg.training.lr == pytest.approx(3e-4)
    assert cfg.data.domain_tags is True
    assert cfg.training.betas == (0.8, 0.9)


def test_override_typo_names_valid_keys():
    with pytest.raises(ConfigError) as err:
        config_from_dict(MINIMAL, ["training.stpes=3"])
    msg = str(err.value)
    assert "training.stpes" in msg and "'steps'" in msg and "global_batch_size" in msg


def test_yaml_typo_is_an_error_not_a_default():
    raw = {**MINIMAL, "training": {"setps": 5}}
    with pytest.raises(ConfigError, match=r"unknown key 'training.setps'.*Did you mean 'steps'"):
        config_from_dict(raw)


def test_bad_value_names_key_and_input():
    with pytest.raises(ConfigError, match=r"training.attention.*'anchr'"):
        config_from_dict(MINIMAL, ["training.attention=anchr"])


def test_override_needs_equals_sign():
    with pytest.raises(ConfigError, match=r"a\.b=value"):
        config_from_dict(MINIMAL, ["training.steps"])


def test_model_needs_exactly_one_source():
    with pytest.raises(ConfigError, match=r"exactly one of model\.path or model\.tiny"):
        config_from_dict({"name": "t", "model": {}})


def test_arms_apply_overrides_and_names():
    raw = {
        **MINIMAL,
        "variants": [
            {"name": "full", "attention": "full"},
            {"name": "tagged", "attention": "anchor", "overrides": {"data.domain_tags": True}},
        ],
    }
    full, tagged = config_from_dict(raw).arms()
    assert (full.training.attention, full.data.domain_tags) == ("full", False)
    assert (tagged.training.attention, tagged.data.domain_tags) == ("anchor", True)
    assert tagged.run_dir.name == "tagged" and not tagged.variants


def test_arm_override_typo_is_reported():
    raw = {
        **MINIMAL,
        "variants": [{"name": "x", "attention": "anchor", "overrides": {"data.tagz": 1}}],
    }
    with pytest.raises(ConfigError, match=r"unknown key 'data\.tagz'"):
        config_from_dict(raw).arms()


def test_fingerprint_tracks_content():
    a = config_from_dict(MINIMAL)
    b = config_from_dict(MINIMAL, ["data.seq_len=1024"])
    assert a.fingerprint() != b.fingerprint()
    assert a.fingerprint("training") == b.fingerprint("training")
    assert a.fingerprint("data") != b.fingerprint("data")


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match=r"not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)


def test_pretraining_is_derived_once_per_content():
    raw = {**MINIMAL, "pretrain": {"overrides": {"training.steps": 3}}}
    cfg = config_from_dict(raw)
    pre = cfg.pretraining()
    assert cfg.pretraining() is pre and config_from_dict(raw).pretraining() is pre
    assert cfg == config_from_dict(raw)  # the derivation leaves equality alone
    changed = cfg.model_copy(deep=True)
    changed.data.seq_len = 1024  # changed in place: a new derivation, not the cached one
    assert changed.pretraining().data.seq_len == 1024 and pre.data.seq_len != 1024
    assert changed.pretraining().variant_name != pre.variant_name
    assert changed.base_model_path.name == "step-000003"


def test_names_are_the_attention_names():
    """The config accepts exactly the variants and engines the attention layer defines."""
    from anchorctx.attention import layout, names

    fields = TrainingConfig.model_fields
    assert get_args(fields["attention"].annotation) == names.VARIANTS
    assert get_args(VariantSpec.model_fields["attention"].annotation) == names.VARIANTS
    assert get_args(fields["engine"].annotation) == names.ENGINE_NAMES
    assert layout.VARIANTS == names.VARIANTS


def test_loading_a_config_stays_light():
    """The config layer (mechanism, every section's settings, the root) imports no heavy
    package (a fresh interpreter: pytest has them)."""
    heavy = ("torch", "transformers", "datasets", "deepspeed", "prefect", "numpy", "pyarrow")
    code = (
        "import sys\n"
        "from anchorctx.experiment import load_config\n"
        "load_config('configs/demo.yaml').arms()\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)\n"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "[]"
