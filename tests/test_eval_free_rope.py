"""Table 2's Free* rows: `anchorctx evaluate --checkpoint BASE` applies `model.rope_scaling` (YaRN,
NTK-aware) to a base model that was never trained with it, records it in the result's identity,
and never re-applies it to a run's own checkpoints (their config.json holds what training used)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from anchorctx.demo.corpus import DOMAINS, generate_documents
from anchorctx.demo.paper_families import FAMILIES, write_family
from anchorctx.evaluation import results
from anchorctx.evaluation.generation import load_eval_model
from anchorctx.experiment import load_config
from anchorctx.models.loading import rope_theta, rope_type

REPO = Path(__file__).resolve().parents[1]
PRESET = REPO / "configs" / "paper" / "llama2-7b-64k-rope-methods.yaml"
YARN = ["model.rope_scaling.type=yarn", "model.rope_scaling.factor=16"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A small base model outside any run (Llama-3's layout: max_position_embeddings 8192)."""
    out = tmp_path_factory.mktemp("base") / "Meta-Llama-3-8B"
    out.mkdir()
    docs = generate_documents(0, 1, progress=False)
    write_family(out, FAMILIES["llama3"], [t for d in DOMAINS for t in docs[d]], 0)
    return out


def _cfg(tmp_path: Path, *sets: str):
    return load_config(PRESET, [f"run_root={tmp_path / 'runs'}", *sets])


def test_yarn_reaches_the_base_model_and_its_identity(base, tmp_path):
    cfg = _cfg(tmp_path, *YARN)
    overrides = results.eval_model_overrides(cfg, base)
    assert overrides == {
        "rope_scaling": {"type": "yarn", "factor": 16.0},
        "max_position_embeddings": 131072,
    }
    ident = results.identity(cfg, base, "ruler")
    assert json.loads(ident["model_overrides"]) == overrides
    model, _ = load_eval_model(base, device="cpu", dtype="float32", model_overrides=overrides)
    hf = model.config
    assert rope_type(hf) == "yarn" and hf.max_position_embeddings == 131072
    scaling = getattr(hf, "rope_parameters", None) or hf.rope_scaling
    assert scaling["factor"] == 16.0 and scaling["original_max_position_embeddings"] == 8192
    plain, _ = load_eval_model(base, device="cpu", dtype="float32")  # the checkpoint's own RoPE
    assert rope_type(plain.config) == "default"


def test_ntk_raises_the_base_models_theta(base, tmp_path):
    cfg = _cfg(tmp_path, "model.rope_scaling.type=ntk", "model.rope_scaling.factor=16")
    overrides = results.eval_model_overrides(cfg, base)
    model, _ = load_eval_model(base, device="cpu", dtype="float32", model_overrides=overrides)
    head = model.config.hidden_size // model.config.num_attention_heads
    assert rope_theta(model.config) == pytest.approx(500000.0 * 16 ** (head / (head - 2)))


def test_keep_and_a_runs_own_checkpoint_get_nothing(base, tmp_path):
    keep = _cfg(tmp_path)
    assert keep.model.rope_scaling.type == "keep"
    assert results.eval_model_overrides(keep, base) == {}
    assert "model_overrides" not in results.identity(keep, base, "ruler")  # identities unchanged
    cfg = _cfg(tmp_path, *YARN)
    own = tmp_path / "runs" / "exp" / "yarn-10k" / "checkpoints" / "step-10"
    assert results.eval_model_overrides(cfg, own) == {}


def test_the_lm_eval_model_applies_the_configs_rope_as_the_suites_do(base, tmp_path):
    """`anchorctx lm-eval --model_args pretrained=BASE,config=CFG` loads the base model with the
    config's YaRN, as `anchorctx evaluate --checkpoint BASE` does (the one rule,
    results.eval_model_overrides); it used to load the checkpoint's own RoPE whatever the
    config said."""
    from anchorctx.evaluation.lm_eval.model import AnchorctxLM

    cfg = _cfg(tmp_path, *YARN)
    config = tmp_path / "yarn.yaml"
    config.write_text(cfg.to_yaml())
    lm = AnchorctxLM(str(base), config=str(config), dtype="float32", device="cpu")
    suites, _ = load_eval_model(
        base, device="cpu", dtype="float32", model_overrides=results.eval_model_overrides(cfg, base)
    )
    assert rope_type(lm.model.config) == rope_type(suites.config) == "yarn"
    assert lm.model.config.max_position_embeddings == 131072 == lm.max_length
    plain = AnchorctxLM(str(base), dtype="float32", device="cpu")  # no config: its own RoPE
    assert rope_type(plain.model.config) == "default"
    own = tmp_path / "runs" / "exp" / "yarn-10k" / "checkpoints" / "step-10"
    with pytest.raises(ValueError, match="config: applies to a checkpoint directory"):
        AnchorctxLM(plain.model, tokenizer=plain.tokenizer, config=str(config))
    assert results.eval_model_overrides(cfg, own) == {}  # a run's own checkpoint: nothing applied
