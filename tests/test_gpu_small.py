"""configs/gpu-small.yaml: the pretrain stage (generated retrieval corpus, base model trained by
the ordinary train flow), the arms continuing from its last checkpoint, and the config's
sizing rules. The flow test runs the shipped config shrunk by dotted overrides, on CPU."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml

from anchorctx.demo import pretrain_corpus as pc
from anchorctx.experiment import config_from_dict, load_config
from anchorctx.models.checkpoints import checkpoint_name
from anchorctx.training.checkpoints import should_save

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "gpu-small.yaml"


# --------------------------------------------------------------------------- the corpus
def _template_words() -> set[str]:
    """Words of the corpus' own fixed templates (not needle or key vocabulary)."""
    texts = [
        *pc._FACT,
        *pc._ATTRS,
        *pc._FUNCTION,
        pc._KV_HEAD,
        pc._KV_QUERY,
        pc._NEEDLE_QUERY,
        pc._NEEDLE_QUERY_MANY,
        pc._CHAIN_FIRST,
        pc._CHAIN_NEXT,
        pc._CHAIN_QUERY,
        pc._COUNT_HEAD,
        pc._COUNT_QUERY,
        *pc._QA_SENTENCE,
        *(q for q, _ in pc._QA_QUERY),
        *pc._INSTRUCT.values(),
        *pc._ECHO.values(),
        "Passage Hall Tower Mill Yard",
    ]
    words = {w.lower() for t in texts for w in re.findall(r"[A-Za-z]+", re.sub(r"{\w+}", " ", t))}
    return words


def test_pretrain_corpus_has_every_retrieval_format_and_no_ruler_vocabulary():
    docs = pc.generate_documents(seed=3, documents=60)
    assert {kind for kind, _ in docs} == set(pc.KINDS)
    framed = {kind for kind, text in docs if text.startswith(pc._INSTRUCT[kind])}
    assert framed == set(pc.KINDS)  # each kind also in the instruction-first framing
    for kind, text in docs:
        body, question = text.rsplit("\n", 1)
        answer = question.split("Answer: ", 1)[1].rsplit(": ", 1)[-1]  # after a prefix if any
        assert question.startswith("Question: "), (kind, question)
        if kind == "count":  # the three most frequent coded tokens, most frequent first
            listed = body.split(pc._COUNT_HEAD)[1].split()
            counts = {w: listed.count(w) for w in set(listed)}
            top = sorted(counts, key=counts.get, reverse=True)[:4]
            assert answer.split() == top[:3] and counts[top[2]] > counts[top[3]], kind
        else:  # every answer is in the document before its question
            for part in re.split(r", | ", answer) if kind != "qa" else [answer]:
                assert part in body, (kind, part)
    # No RULER template, and no needle/key word that RULER draws its keys and values from.
    text = "\n".join(t for _, t in docs)
    for ruler_phrase in ("special magic", "VAR ", "hidden within the following text"):
        assert ruler_phrase not in text
    words = re.sub(r"\b[0-9a-f]{4}(-[0-9a-f]{4}){2}\b", " ", text)  # hex-code values aside
    vocabulary = {w.lower() for w in re.findall(r"[A-Za-z]+", words)} - _template_words()
    assert len(vocabulary) > 500
    assert not vocabulary & pc.english_words()


def test_pretrain_corpus_files_are_reused(tmp_path):
    data = pc.write_pretrain_corpus(tmp_path / "c", seed=1, documents=10)
    files = sorted(data.glob("*.jsonl"))
    assert len(files) == pc.FILES and sum(len(f.read_text().splitlines()) for f in files) == 10
    stamp = files[0].stat().st_mtime_ns
    assert pc.write_pretrain_corpus(tmp_path / "c", seed=1, documents=10) == data
    assert files[0].stat().st_mtime_ns == stamp


def test_heldout_eval_data_is_in_the_benchmark_layouts_and_shares_no_pretraining_words(tmp_path):
    from anchorctx.demo.heldout_eval import SUBJECTS, write_heldout_eval
    from anchorctx.evaluation.lm_eval.harness import hellaswag_file, mmlu_layout
    from anchorctx.evaluation.ruler.data import read_squad
    from anchorctx.io import read_jsonl

    paths = write_heldout_eval(tmp_path / "h", essay_words=500, squad_paragraphs=8, items=7)
    found, _ = mmlu_layout(paths["mmlu_dir"])
    assert sorted(found) == sorted(SUBJECTS)
    tests = [row for s in SUBJECTS for row in read_jsonl(found[s]["test"])]
    assert len(tests) == 7
    for row in tests:  # the right choice is the person the question names
        assert row["choices"][row["answer"]] in row["question"]
    swag = read_jsonl(hellaswag_file(paths["hellaswag_dir"]))
    for row in swag:  # the right ending repeats the context's adjective
        assert row["endings"][int(row["label"])].rstrip(".") in row["ctx_a"]
    squad = read_squad(paths["squad"])
    assert len(squad.items) == 8 and len(squad.docs) == 8
    assert paths["essay"].is_file() and paths["nltk_data"].is_dir()
    # Built from English words only: nothing from the pretraining corpus' pseudo-word vocabulary.
    heldout = " ".join([paths["squad"].read_text(), *(json.dumps(r) for r in tests + swag)])
    pretraining = "\n".join(t for _, t in pc.generate_documents(seed=0, documents=60))
    words = lambda text: {w.lower() for w in re.findall(r"[A-Za-z]{4,}", text)}  # noqa: E731
    shared = words(heldout) & (words(pretraining) - _template_words())
    assert not shared, sorted(shared)[:10]


# --------------------------------------------------------------------------- the config
def test_gpu_small_config_sizing():
    cfg = load_config(CONFIG)
    pre = cfg.pretraining()
    tiny = cfg.model.tiny
    vocab = 3000  # the demo tokenizer's
    layer = (
        2 * tiny.hidden_size**2
        + 2
        * tiny.hidden_size
        * tiny.hidden_size
        * tiny.num_key_value_heads
        // tiny.num_attention_heads
        + 3 * tiny.hidden_size * tiny.intermediate_size
    )
    params = tiny.num_hidden_layers * layer + 2 * vocab * tiny.hidden_size
    assert 100e6 <= params <= 200e6, params
    assert (pre.data.seq_len, pre.training.attention, pre.model.rope_theta) == (2048, "full", None)
    assert pre.data.token_budget == pre.training.steps * pre.training.global_batch_size * 2048
    assert cfg.base_model_path == pre.run_dir / "checkpoints" / checkpoint_name(pre.training.steps)
    arms = cfg.arms()
    variants = ["full", "intra_doc", "intra_doc_reset", "anchor"]
    assert [a.training.attention for a in arms] == variants
    for arm in arms:  # same data and steps; only the attention differs
        assert arm.model.path == cfg.base_model_path and arm.model.tiny is None
        assert arm.data == arms[0].data and arm.data.seq_len >= 16384
        assert arm.training.model_copy(update={"attention": "full"}) == arms[0].training
        assert arm.training.precision == "bf16" and arm.model.dtype == "bfloat16"
    # The paper's RoPE base is proportional to the target length (5e6 at 64K, 1e7 at 128K).
    assert cfg.model.rope_theta == pytest.approx(1e7 / 131072 * cfg.data.seq_len, rel=1e-3)
    # 95% interval of a length's average over the tasks within +-5 points at p = 0.5.
    ruler = cfg.evaluation.ruler
    n = ruler.num_samples * len(ruler.tasks)
    assert 1.96 * math.sqrt(0.25 / n) <= 0.05
    assert min(ruler.lengths) <= 2048 and max(ruler.lengths) >= 16384
    # One checkpoint per arm, evaluated alone (the config's comment says why).
    saved = [
        s
        for s in range(1, cfg.training.steps + 1)
        if should_save(s, cfg.training.steps, cfg.training.save)
    ]
    assert saved == [50]
    assert cfg.evaluation.last_k == 1


def test_pretraining_run_identity():
    raw = yaml.safe_load(CONFIG.read_text())
    base = config_from_dict(raw).pretraining().variant_name
    # Evaluation settings do not re-pretrain; pretraining settings do.
    assert config_from_dict(raw, ["evaluation.last_k=1"]).pretraining().variant_name == base
    other = config_from_dict(raw, ["pretrain.corpus.documents=10"]).pretraining().variant_name
    assert other != base
    with pytest.raises(ValueError, match=r"pretrain needs model\.tiny"):
        config_from_dict(raw, ["model.tiny=null", "model.path=m"])


# --------------------------------------------------------------------------- the flow
def _miniature(tmp_path: Path, demo_corpus) -> list[str]:
    eval_dir = tmp_path / "eval"
    return [
        f"run_root={tmp_path / 'runs'}",
        "model.tiny={hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
        "num_attention_heads: 4, num_key_value_heads: 2}",
        f"model.tokenizer={demo_corpus.tokenizer_dir}",
        "model.dtype=float32",
        "model.rope_theta=40000",
        "data.demo_corpus=null",
        f"data.sources=[{{path: {demo_corpus.data_dir}}}, {{path: {tmp_path / 'pre' / 'data'}}}]",
        "data.seq_len=512",
        "data.token_budget=20000",
        "data.num_workers=1",
        f"pretrain.corpus={{dir: {tmp_path / 'pre'}, seed: 0, documents: 40}}",
        "pretrain.overrides={data.seq_len: 512, data.token_budget: 6000, data.mixture: original, "
        "training.steps: 2, training.global_batch_size: 2, training.micro_batch_size: 1, "
        "training.save: {every: 2, last: null}}",
        "training={device: cpu, engine: sdpa, precision: fp32, zero_stage: 0, steps: 2, "
        "global_batch_size: 2, micro_batch_size: 1, activation_checkpointing: false, "
        "save: {every: 2, last: null}}",
        f"evaluation={{suites: [ruler], heldout_data: {eval_dir}, device: cpu, dtype: float32, "
        f"batch_size: 2, last_k: 1, ruler: {{tasks: [niah_single_1], lengths: [512], "
        f"fit: tight, num_samples: 1, essay_path: {eval_dir}/fixtures/essays.json, "
        f"squad_path: {eval_dir}/squad.json, nltk_data: {eval_dir}/fixtures/nltk_data}}}}",
        "tracking=[]",
        # One arm shows every arm's path (test_flows_overlap runs two); each arm costs CI time.
        "variants=[{name: anchor, attention: anchor}]",
    ]


@pytest.mark.slow
def test_miniature_pretrains_then_trains_the_arms_from_it(tmp_path, demo_corpus, prefect_harness):
    from anchorctx.evaluation import results
    from anchorctx.flows import commands
    from anchorctx.flows.experiment import STAGES, _check_base_model, full_experiment, pretrain_flow

    assert commands.STAGES == STAGES and STAGES[0] == "pretrain"  # `--stage pretrain` exists

    raw = yaml.safe_load(CONFIG.read_text())
    cfg = config_from_dict(raw, _miniature(tmp_path, demo_corpus))
    base = cfg.base_model_path
    with prefect_harness():
        full_experiment(cfg, stages=["pretrain", "data", "train", "evaluate"])
        assert (base / "config.json").is_file() and (base / "tokenizer.json").is_file()
        stamp = (base / "anchorctx.json").stat().st_mtime_ns
        assert pretrain_flow(cfg) == str(base)  # a second run reuses the pretrained model
        assert (base / "anchorctx.json").stat().st_mtime_ns == stamp
    pre = yaml.safe_load((cfg.pretraining().run_dir / "config.yaml").read_text())
    assert pre["training"]["attention"] == "full" and pre["data"]["seq_len"] == 512
    # The base model is evaluated too, RULER at the lengths it was pretrained for.
    assert results.load_result(results.result_path(base, "ruler"))["scores"]["niah_single_1"]
    assert str(tmp_path / "pre" / "data") in [s["path"] for s in pre["data"]["sources"]]
    for arm in cfg.arms():
        run = yaml.safe_load((arm.run_dir / "config.yaml").read_text())
        assert run["model"]["path"] == str(base) and run["model"]["tiny"] is None
        (ckpt,) = sorted((arm.run_dir / "checkpoints").iterdir())
        assert results.load_result(results.result_path(ckpt, "ruler"))["scores"]
    _check_base_model(cfg)
    # Arms whose pretraining config changed have no base model yet: an error, not a new tiny.
    other = config_from_dict(raw, [*_miniature(tmp_path, demo_corpus), "pretrain.corpus.seed=1"])
    with pytest.raises(FileNotFoundError, match="run the pretrain stage first"):
        _check_base_model(other)


def test_the_two_gpu_deployment_is_the_same_comparison_with_sequence_parallelism():
    """full-experiment/gpu-small-sp2: the shipped config with Ulysses SP=2 over two processes,
    for the pretraining and every arm: one data-parallel replica, so the same global batch and
    steps as on one GPU; its own experiment directory (no mixing with the one-GPU runs)."""
    from anchorctx.flows.deployments import GPU_SMALL_SP2, build_deployments
    from anchorctx.models.loading import build_hf_config
    from anchorctx.training.plan import check_heads, plan_parallelism

    one = load_config(CONFIG)
    two = load_config(CONFIG, [*GPU_SMALL_SP2, "training.device=cpu"])
    assert two.name != one.name and two.experiment_dir != one.experiment_dir
    for cfg, ref in ((two.pretraining(), one.pretraining()), *zip(two.arms(), one.arms())):
        par = plan_parallelism(cfg)
        assert (par.world, par.sp, par.dp) == (2, 2, 1)
        assert par.micro * par.accum == ref.training.global_batch_size
        assert cfg.training.steps == ref.training.steps and cfg.data == ref.data
    pre = two.pretraining()  # the arms continue this model: Ulysses splits its heads over 2
    served = {d.name: d for d in build_deployments(ROOT / "configs")}
    assert served["gpu-small-sp2"].parameters["cfg"].training.sequence_parallel == 2
    check_heads(build_hf_config(pre.model, seq_len=pre.data.seq_len, vocab_size=3000), 2)


def test_the_two_gpu_seeds_deployment_pretrains_on_both_and_overlaps_the_arms():
    """full-experiment/gpu-small-seeds-2gpu: gpu-small-seeds from nothing on two GPUs. The
    pretraining is two data-parallel replicas (the same global batch and steps, no accumulation);
    the six seed arms train on one GPU each while the other evaluates; its own directory."""
    from anchorctx.evaluation.schedule import overlap_training_gpus
    from anchorctx.flows.deployments import (
        GPU_SMALL_SEEDS,
        GPU_SMALL_SEEDS_2GPU_NAME,
        build_deployments,
        gpu_small_seeds_two_gpus,
    )
    from anchorctx.training.plan import plan_parallelism

    seeds = load_config(CONFIG, GPU_SMALL_SEEDS)
    built = gpu_small_seeds_two_gpus(CONFIG)
    raw = built.model_dump(mode="json")
    # Only the name and the pretraining's process count differ from gpu-small-seeds.
    ref = seeds.model_dump(mode="json")
    assert {k for k in raw if raw[k] != ref[k]} == {"name", "pretrain"}
    assert raw["pretrain"]["overrides"] == {**ref["pretrain"]["overrides"], "training.nproc": 2}
    assert built.experiment_dir != seeds.experiment_dir
    raw["training"]["device"] = "cpu"  # plan_parallelism checks the device
    two = config_from_dict(raw)
    pre, one_pre = two.pretraining(), seeds.pretraining()
    par = plan_parallelism(pre)
    assert (par.world, par.sp, par.dp) == (2, 1, 2)
    assert par.micro * par.accum * par.dp == one_pre.training.global_batch_size == 32
    assert par.accum == 1 and pre.training.steps == one_pre.training.steps
    assert pre.data == one_pre.data
    arms = two.arms()
    assert [a.variant_name for a in arms] == [a.variant_name for a in seeds.arms()]
    assert all(a.training.nproc == 1 for a in arms)
    assert overlap_training_gpus(built, built.arms(), ["0", "1"]) == ["0"]
    served = {d.name: d for d in build_deployments(ROOT / "configs")}
    cfg = served[GPU_SMALL_SEEDS_2GPU_NAME].parameters["cfg"]
    assert cfg.name == GPU_SMALL_SEEDS_2GPU_NAME
    assert cfg.pretrain.overrides["training.nproc"] == 2
