"""What an experiment's evaluation will cost, and the whole experiment's plan.

Evaluation GPU-hours reuse the shard cost model of :mod:`anchorctx.evaluation.sharding`
(seconds per sample = prefill of its length + its answer budget × a decode step, fitted to the
static engine on one H200, Llama-2-7B shape), per checkpoint evaluated (the last
``evaluation.last_k`` of each arm), scaled to the GPU kind (prefill by its compute, decode by its
memory bandwidth: :data:`anchorctx.training.cost_plan.GPUS`) and to the model's size
(parameters over the 7B shape's; both prefill and decode move the weights' FLOPs or bytes).
MMLU and HellaSwag (lm-eval log-likelihoods, no generation) are their requests' tokens at the
same fit's per-token prefill rate. docs/benchmarks/2026-11-24-plan-model.md lists the constants.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from anchorctx.evaluation.longbench.tasks import ALL_DATASETS, DATASET2MAXLEN
from anchorctx.evaluation.ruler.constants import task_spec
from anchorctx.evaluation.ruler.runner import selected_tasks
from anchorctx.evaluation.settings import LM_EVAL_PREFIX
from anchorctx.evaluation.sharding import (
    DECODE_S_PER_TOKEN,
    DECODE_S_PER_TOKEN_KTOKEN,
    PREFILL_S_PER_KTOKEN,
    PREFILL_S_PER_KTOKEN2,
)
from anchorctx.training import cost_plan, memory_choice
from anchorctx.training.checkpoints import should_save
from anchorctx.training.memory import LLAMA2_7B, Shape

if TYPE_CHECKING:
    from anchorctx.experiment import ExperimentConfig

# LongBench v1 test-set sizes (THUDM/LongBench data, one jsonl per dataset): 200 samples each,
# 150 for multifieldqa_en, 500 for lcc and repobench-p (4,750 in all, 3,750 English).
LONGBENCH_SAMPLES = {"multifieldqa_en": 150, "lcc": 500, "repobench-p": 500}
LONGBENCH_DEFAULT_SAMPLES = 200
# Estimate, not measured here: the LongBench paper gives English samples an average of 6,711
# words; at ~1.3 Llama tokens per word, 8,700 tokens per prompt (capped at the prompt limit).
LONGBENCH_MEAN_TOKENS = 8700
# MMLU's test split has 14,042 questions (57 subjects), HellaSwag's validation split 10,042
# items; lm-eval scores 4 choices each as separate log-likelihood requests.
MMLU_QUESTIONS, MMLU_SUBJECTS, HELLASWAG_ITEMS, CHOICES = 14042, 57, 10042, 4
# Estimates, not measured here: tokens per request of a 5-shot MMLU prompt and of a HellaSwag
# context with one ending.
MMLU_REQUEST_TOKENS, HELLASWAG_REQUEST_TOKENS = 600, 100


def prefill_s(length: int) -> float:
    """H200 seconds to prefill one ``length``-token row (evaluation.sharding's fit)."""
    k = length / 1024
    return PREFILL_S_PER_KTOKEN * k + PREFILL_S_PER_KTOKEN2 * k * k


def decode_s(length: int, new_tokens: int) -> float:
    """H200 seconds of ``new_tokens`` decode steps of one sample at ``length`` (batched as the
    memory rule batches them on an H200; evaluation.sharding's fit)."""
    return new_tokens * (DECODE_S_PER_TOKEN + DECODE_S_PER_TOKEN_KTOKEN * length / 1024)


def checkpoints_evaluated(cfg: ExperimentConfig) -> int:
    """Checkpoints of one arm the report averages: the last ``last_k`` of those it saves."""
    t = cfg.training
    saved = sum(should_save(s, t.steps, t.save) for s in range(1, t.steps + 1))
    return min(cfg.evaluation.last_k, saved)


@dataclass(frozen=True)
class SuitePlan:
    suite: str
    samples: int  # per checkpoint
    prefill_h: float  # GPU-hours per checkpoint
    decode_h: float
    detail: str

    @property
    def hours(self) -> float:
        return self.prefill_h + self.decode_h


def _suite(suite: str, items: list[tuple[int, int, int]], scale: float, detail: str):
    """``items``: (samples, prompt tokens, new tokens) groups; hours at the fit's rates × scale."""
    pre = sum(n * prefill_s(length) for n, length, _ in items) / 3600
    dec = sum(n * decode_s(length, new) for n, length, new in items) / 3600
    return SuitePlan(suite, sum(n for n, _, _ in items), pre * scale, dec * scale, detail)


def suite_plans(cfg: ExperimentConfig, shape: Shape) -> list[SuitePlan]:
    """Per-checkpoint cost of each configured suite on one H200 (no GPU-kind factor yet)."""
    e = cfg.evaluation
    size = shape.params / LLAMA2_7B.params
    out = []
    if "ruler" in e.suites:
        r = e.ruler
        tasks = selected_tasks(r.tasks, r.exclude)
        items = [
            (r.num_samples, length, task_spec(task).max_new_tokens)
            for task in tasks
            for length in r.lengths
        ]
        detail = f"{len(tasks)} tasks × {len(r.lengths)} lengths × {r.num_samples} samples"
        out.append(_suite("ruler", items, size, detail))
    if "longbench" in e.suites:
        lb = e.longbench
        names = lb.datasets or list(ALL_DATASETS)
        positions = cfg.model.max_position_embeddings or cfg.data.seq_len
        limit = lb.max_length or (1000 * (positions // 1024) - 500)
        length = min(LONGBENCH_MEAN_TOKENS, limit)
        items = []
        for name in names:
            n = LONGBENCH_SAMPLES.get(name, LONGBENCH_DEFAULT_SAMPLES)
            items.append((min(n, lb.limit or n), length, DATASET2MAXLEN[name]))
        detail = f"{len(names)} datasets, prompts ≈ {length} tokens (estimate)"
        out.append(_suite("longbench", items, size, detail))
    h = e.harness
    if "mmlu" in e.suites:
        q = MMLU_QUESTIONS if h.limit is None else min(MMLU_QUESTIONS, MMLU_SUBJECTS * h.limit)
        items = [(q * CHOICES, MMLU_REQUEST_TOKENS, 0)]
        detail = f"{q} questions × {CHOICES} choices, ≈ {MMLU_REQUEST_TOKENS} tokens (estimate)"
        out.append(_suite("mmlu", items, size, detail))
    if "hellaswag" in e.suites:
        n = HELLASWAG_ITEMS if h.limit is None else min(HELLASWAG_ITEMS, h.limit)
        items = [(n * CHOICES, HELLASWAG_REQUEST_TOKENS, 0)]
        detail = f"{n} items × {CHOICES} endings, ≈ {HELLASWAG_REQUEST_TOKENS} tokens (estimate)"
        out.append(_suite("hellaswag", items, size, detail))
    if "perplexity" in e.suites:
        p = e.perplexity
        lengths = p.lengths or [cfg.data.seq_len]
        items = [(p.rows, length, 0) for length in lengths]  # one prefill per row, no decoding
        detail = f"{p.rows} rows × {len(lengths)} lengths (prefill only)"
        out.append(_suite("perplexity", items, size, detail))
    return out


@dataclass(frozen=True)
class EvaluationPlan:
    gpu: str
    checkpoints_per_arm: int
    arms: int
    suites: tuple[SuitePlan, ...]  # per checkpoint, on this GPU kind
    # Suites with no cost model, left out of the totals: lm-eval's tasks (their sample counts
    # and prompt lengths are known only once lm-eval builds them).
    unestimated: tuple[str, ...] = ()

    @property
    def per_checkpoint_hours(self) -> float:
        return sum(s.hours for s in self.suites)

    @property
    def gpu_hours(self) -> float:
        return self.per_checkpoint_hours * self.checkpoints_per_arm * self.arms

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for s, plan in zip(d["suites"], self.suites, strict=True):
            s["hours"] = plan.hours
        d["per_checkpoint_hours"] = self.per_checkpoint_hours
        d["gpu_hours"] = self.gpu_hours
        return d


def plan_evaluation(cfg: ExperimentConfig, shape: Shape, gpu: str = "h200") -> EvaluationPlan:
    kind = cost_plan.GPUS[gpu]
    suites = tuple(
        dataclasses.replace(
            s, prefill_h=s.prefill_h * kind.prefill, decode_h=s.decode_h * kind.decode
        )
        for s in suite_plans(cfg, shape)
    )
    unestimated = tuple(s for s in cfg.evaluation.suites if s.startswith(LM_EVAL_PREFIX))
    return EvaluationPlan(gpu, checkpoints_evaluated(cfg), len(cfg.arms()), suites, unestimated)


# ------------------------------------------------------------------------------ the experiment
@dataclass(frozen=True)
class ExperimentPlan:
    training: cost_plan.TrainingPlan
    evaluation: EvaluationPlan
    memory_auto: str | None = None  # what training.memory.auto chose, and why

    @property
    def gpu_hours(self) -> float:
        return self.training.gpu_hours + self.evaluation.gpu_hours

    def to_dict(self) -> dict[str, Any]:
        return {
            "training": self.training.to_dict(),
            "evaluation": self.evaluation.to_dict(),
            "gpu_hours": self.gpu_hours,
            "memory_auto": self.memory_auto,
        }


def plan_experiment(
    cfg: ExperimentConfig,
    gpu: str = "h200",
    gpus: int = 1,
    nodes: int = 1,
    host_gib: float = cost_plan.DEFAULT_HOST_GIB,
    shape_name: str | None = None,
) -> ExperimentPlan:
    """Training and evaluation of every arm: :func:`cost_plan.plan_training` (refuses a run that
    does not fit) and :func:`plan_evaluation`."""
    if gpu not in cost_plan.GPUS:
        raise cost_plan.PlanError(f"unknown --gpu {gpu}; known: {', '.join(cost_plan.GPUS)}")
    kind = cost_plan.GPUS[gpu]
    # training.memory.auto: the options a launch on these GPUs would choose (the base config's
    # attention ranks them; nothing fits: the config as it is, which the plan then refuses)
    cfg, choice = memory_choice.resolve(cfg, kind, gpus, nodes, host_gib, shape_name)
    train = cost_plan.plan_training(cfg, gpu, gpus, nodes, host_gib, shape_name)
    note = choice.line() if choice else None
    return ExperimentPlan(train, plan_evaluation(cfg, train.shape, gpu), note)


def _h(hours: float) -> str:
    return f"{hours:,.1f}"


def step_parts_lines(arms) -> list[str]:
    """Where a step goes, once per split (arms of equal splits share a line): the compute, then
    each exposed communication and the update (cost_plan.step_parts; parts under 5 ms left
    out)."""
    groups: dict[tuple, list[str]] = {}
    for a in arms:
        if a.parts:
            key = tuple((k, round(v, 2)) for k, v in a.parts.items())
            if a.variant not in groups.setdefault(key, []):
                groups[key].append(a.variant)
    lines = []
    for key, variants in groups.items():
        parts = dict(key)
        named = [
            f"{cost_plan.STEP_PARTS[k]} {v:.2f}"
            for k, v in parts.items()
            if k != "compute" and v > 0
        ]
        rest = f"; {', '.join(named)}" if named else "; no communication exposed"
        lines.append(
            f"  where a step goes ({', '.join(variants)}): compute {parts['compute']:.2f} s{rest}"
        )
    return lines


def format_plan(plan: ExperimentPlan) -> str:
    """The plan as a readable report (what ``anchorctx plan`` prints)."""
    t, e = plan.training, plan.evaluation
    kind = cost_plan.GPUS[t.gpu]
    s = t.shape
    est = " (an estimate: not measured on this GPU kind)" if kind.estimate else ""
    o = t.options
    opts = [
        f"tiled_mlp={str(o.tiled_mlp).lower()}",
        f"tiled_loss={str(o.tiled_loss).lower()}",
        f"offload_optimizer={str(o.offload_optimizer).lower()}",
        f"offload_checkpoints={str(o.offload_checkpoints).lower()}",
        f"keep_activations={o.keep_activations}",
        f"kernels={o.kernels}",
    ]
    m = t.memory_gib
    lines = [
        f"GPUs      {t.gpus * t.nodes} × {kind.name} ({t.nodes} node(s)){est}",
        f"model     {s.params / 1e9:.2f}B parameters, {s.layers} layers, hidden {s.hidden}, "
        f"{s.heads}/{s.kv_heads} heads, vocab {s.vocab} [{t.shape_source}]",
        f"layout    {t.seq_len} tokens per row, SP {t.sp} × DP {t.dp}, micro {t.micro} × "
        f"accumulation {t.accum}, ZeRO-{t.zero_stage}",
        "",
        "training: memory per GPU (GiB, training/memory.py)",
        f"  {'parameters':<26}{m['parameters']:>8.1f}",
        f"  {'gradients':<26}{m['gradients']:>8.1f}",
        f"  {'optimizer state':<26}{m['optimizer_state']:>8.1f}",
        f"  {'checkpointed activations':<26}{m['checkpointed_activations']:>8.1f}",
        f"  {'kept activations':<26}{m['kept_activations']:>8.1f}",
        f"  {'layer working set':<26}{m['layer_working_set']:>8.1f}",
        f"  {'logits':<26}{m['logits']:>8.1f}",
        f"  {'peak':<26}{m['peak']:>8.1f}   of {t.usable_gib:.1f} usable",
        f"  {'host (offloads)':<26}{m['cpu']:>8.1f}   of {t.host_gib:g} per GPU",
        f"  options: {' '.join(opts)}",
        *([f"  {plan.memory_auto}"] if plan.memory_auto else []),
        "",
        f"training: time ({kind.source})",
        f"  {'arm':<18}{'variant':<17}{'steps':>7}{'step s':>9}{'GPU-hours':>12}",
    ]
    for a in t.arms:
        lines.append(
            f"  {a.name:<18}{a.variant:<17}{a.steps:>7}{a.step_s:>9.2f}{_h(a.gpu_hours):>12}"
        )
    lines.append(f"  {'all arms':<51}{_h(t.gpu_hours):>12}")
    lines += step_parts_lines(t.arms)
    sources: dict[str, list[str]] = {}  # the document-masked arms' attention work, by source
    for a in t.arms:
        if a.document_lengths is not None:
            sources.setdefault(a.document_lengths.detail, []).append(a.name)
    for detail, names in sources.items():
        which = "" if len(sources) == 1 else f" [{', '.join(names)}]"
        lines.append(f"  document lengths: {detail}{which}")
    lines += [
        "",
        f"evaluation: GPU-hours per checkpoint, × {e.checkpoints_per_arm} checkpoints × "
        f"{e.arms} arms (evaluation/sharding.py cost model)",
        f"  {'suite':<11}{'prefill':>9}{'decode':>9}{'total':>9}{'all ckpts':>11}  what",
    ]
    n = e.checkpoints_per_arm * e.arms
    for sp in e.suites:
        lines.append(
            f"  {sp.suite:<11}{_h(sp.prefill_h):>9}{_h(sp.decode_h):>9}{_h(sp.hours):>9}"
            f"{_h(sp.hours * n):>11}  {sp.detail}"
        )
    lines.append(f"  {'all suites':<29}{_h(e.per_checkpoint_hours):>9}{_h(e.gpu_hours):>11}")
    if e.unestimated:
        lines.append(
            f"  not estimated (no cost model; not in the totals): {', '.join(e.unestimated)}"
        )
    wall = plan.gpu_hours / (t.gpus * t.nodes)
    lines += [
        "",
        f"total     {_h(plan.gpu_hours)} GPU-hours (training {_h(t.gpu_hours)}, evaluation "
        f"{_h(e.gpu_hours)}); ≈ {_h(wall)} h on {t.gpus * t.nodes} GPU(s)",
    ]
    return "\n".join(lines)
