"""``training.memory.auto``: the fastest combination of the memory options that fits.

The project has five ways to trade time for memory on long rows (kept layers, the tiled MLP and
loss, fused kernels, optimizer and checkpoint offload: ``training.memory``, ``training.kernels``).
Which is fastest depends on the model, the row length, SP and the GPU, and a user should not need
to know them: with ``auto`` (the default) every option the config does not set is chosen here,
from the same two models ``anchorctx plan`` prints (``training.memory`` for bytes,
``training.cost_plan`` for seconds): among the combinations whose predicted peak fits the GPU
(less :data:`anchorctx.training.memory.RESERVED_FRACTION`, the stated margin) and whose offloads
fit the host, the one with the shortest predicted step; ties go to the combination that changes
fewer options. Checkpoint offload is tried only when nothing else fits: its copies are not in the
time model, so it would otherwise look free. Options the config turns on stay on; auto only
turns others on (``training.memory.auto: false`` runs the config's values as they are).

CUDA runs only (on CPU the options are memory savers with nothing to fit). The launcher chooses
before it writes the ranks' config, so every rank and a ``--resume`` on the same GPUs run the
same choice; ``memory_choice.json`` in the run directory and the start-up line say what was chosen
and what each considered alternative predicted.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from anchorctx.training import layout_plan, memory
from anchorctx.training.cost_plan import (
    DEFAULT_HOST_GIB,
    GPUS,
    GpuKind,
    PlanError,
    choose_sp,
    layout,
    memory_options,
    model_shape,
    row_tokens,
    step_seconds,
    usable_gib,
)
from anchorctx.training.memory import GIB, Options, Shape

if TYPE_CHECKING:
    from anchorctx.experiment import ExperimentConfig

RECORD = "memory_choice.json"  # in the run directory: what auto chose and what it predicted
# The options auto may choose: training.memory's fields, and training.kernels.
MEMORY_FIELDS = ("tiled_mlp", "tiled_loss", "offload_optimizer", "offload_checkpoints")


@dataclass(frozen=True)
class Alternative:
    """A layout the plan considered: its fastest fitting memory options' predicted step."""

    sp: int
    dp: int
    zero: int
    step_s: float | None  # None: no combination of options fits
    peak_gib: float | None

    def text(self) -> str:
        where = f"SP {self.sp} × DP {self.dp} ZeRO-{self.zero}"
        if self.step_s is None:
            return f"{where}: does not fit"
        return f"{where}: {self.step_s:.2f} s ({self.peak_gib:.0f} GiB)"


@dataclass(frozen=True)
class Choice:
    options: Options  # options.sp and options.zero are the chosen layout
    peak_gib: float
    usable_gib: float
    host_gib: float
    step_s: float
    fitting: int  # combinations that fit
    considered: int
    changed: tuple[str, ...]  # settings that differ from the config's values
    dp: int = 1
    overlap_comm: bool = False
    alternatives: tuple[Alternative, ...] = ()  # the other layouts, fastest first

    def settings(self) -> dict[str, Any]:
        o = self.options
        return {
            "training.sequence_parallel": o.sp,
            "training.zero_stage": o.zero,
            **{
                f"training.comm.{k}": v for k, v in comm_settings(o.zero, self.overlap_comm).items()
            },
            "training.memory.tiled_mlp": o.tiled_mlp,
            "training.memory.tiled_loss": o.tiled_loss,
            "training.memory.offload_optimizer": o.offload_optimizer,
            "training.memory.offload_checkpoints": o.offload_checkpoints,
            "training.memory.keep_activations": o.keep_activations,
            "training.kernels": o.kernels,
        }

    def record(self) -> dict[str, Any]:
        """What ``memory_choice.json`` holds."""
        return {
            "settings": self.settings(),
            "changed": list(self.changed),
            "predicted_peak_gib": round(self.peak_gib, 2),
            "usable_gib": round(self.usable_gib, 2),
            "predicted_host_gib": round(self.host_gib, 2),
            "predicted_step_s": round(self.step_s, 3),
            "fitting": self.fitting,
            "considered": self.considered,
            "layout": {"sp": self.options.sp, "dp": self.dp, "zero_stage": self.options.zero},
            "alternatives": [dataclasses.asdict(a) for a in self.alternatives],
        }

    def line(self) -> str:
        chosen = " ".join(f"{k.rsplit('.', 1)[1]}={_fmt(v)}" for k, v in self.settings().items())
        o = self.options
        others = "; ".join(a.text() for a in self.alternatives[:3]) or "none"
        return (
            f"layout auto: SP {o.sp} × DP {self.dp}, ZeRO-{o.zero}; {chosen} (predicted "
            f"{self.peak_gib:.1f} of {self.usable_gib:.1f} GiB usable, {self.step_s:.2f} s per "
            f"step; the fastest of {self.fitting} fitting combinations of {self.considered}; "
            f"runners-up: {others}; set training.sequence_parallel, training.zero_stage, "
            "training.comm.* and training.memory.* to choose yourself)"
        )


def _fmt(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def explicit(cfg: ExperimentConfig) -> set[str]:
    """The options the config turned on itself: auto keeps them. (A value equal to the default
    is open: configs reach the ranks as full dumps, so "set to the default" and "not set" look
    the same there. To rule an option out, set ``training.memory.auto: false``.)"""
    from anchorctx.training.settings import MemoryConfig, TrainingConfig

    t, mem_defaults = cfg.training, MemoryConfig()
    names = {
        f
        for f in (*MEMORY_FIELDS, "keep_activations")
        if getattr(t.memory, f) != getattr(mem_defaults, f)
    }
    if t.kernels != TrainingConfig.model_fields["kernels"].default:
        names.add("kernels")
    return names


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


# The narrowest model on which the fused kernels were measured to save time in a real step (the
# 4-layer Llama-2-7B-wide rows, hidden 4096; docs/benchmarks/2026-11-22-training-step.md and
# 2026-11-27-memory-model-refit.md). On gpu-small's 147M model (hidden 1024, 32 rows of 2K) the
# pretraining step is bound by the host: its fastest steps are 0.33-0.38 s with either kernel, and
# on a quiet host the median was 0.453 s without them against 0.634 s with them
# (docs/benchmarks/2026-11-27-gpu-small-step-and-arm-evaluation.md). So below this width auto leaves
# the kernels to the config.
FUSED_KERNELS_MIN_HIDDEN = 4096


def _keep_values(layers: int) -> list[int]:
    """Every kept-layer count, 0 to the depth: the step time falls with each kept layer, so the
    fastest combination keeps as many as fit, and a coarser grid (powers of two) left 5% on
    the table where 3 of 4 layers fit (docs/benchmarks/2026-11-27-memory-model-refit.md). Each is
    arithmetic."""
    return list(range(layers + 1))


def candidates(
    cfg: ExperimentConfig, shape: Shape, base: Options, liger: bool, offload_checkpoints: bool
) -> Iterator[Options]:
    """Every combination of the options the config leaves open (its own values for the rest);
    the config's own options alone without ``training.memory.auto``."""
    if not cfg.training.memory.auto:
        yield base
        return
    fixed = explicit(cfg)
    t = cfg.training
    ac = t.activation_checkpointing
    # Every GPU default of plan.default_zero_stage is ZeRO, which an offloaded optimizer needs.
    zero_ok = t.zero_stage is None or t.zero_stage >= 1

    def values(name: str, open_values: list[Any]) -> list[Any]:
        return [getattr(base, name)] if name in fixed else open_values

    space = {
        "tiled_loss": values("tiled_loss", [False, True]),
        "tiled_mlp": values("tiled_mlp", [False, True]),
        "kernels": values(
            "kernels",
            ["torch", "liger"] if liger and shape.hidden >= FUSED_KERNELS_MIN_HIDDEN else ["torch"],
        ),
        "offload_optimizer": values("offload_optimizer", [False, True] if zero_ok else [False]),
        "offload_checkpoints": values(
            "offload_checkpoints", [False, True] if ac and offload_checkpoints else [False]
        ),
        "keep_activations": values("keep_activations", _keep_values(shape.layers) if ac else [0]),
    }
    for combo in itertools.product(*space.values()):
        yield dataclasses.replace(base, **dict(zip(space, combo, strict=True)))


def comm_settings(zero: int, overlap_comm: bool) -> dict[str, Any]:
    """training.comm's fields a layout runs with: the plan's settings for its stage."""
    return {**layout_plan.COMM_SETTINGS.get(zero, {}), "overlap_comm": overlap_comm}


def choose(
    cfg: ExperimentConfig,
    shape: Shape,
    world: int,
    sp: int,
    gpu: GpuKind,
    host_gib: float = DEFAULT_HOST_GIB,
    liger: bool | None = None,
    zero: int | None = None,
    nodes: int = 1,
) -> Choice | None:
    """The fastest predicted combination of memory options that fits ``gpu`` (and ``host_gib``
    of host memory per GPU) on ``world`` ranks with SP ``sp`` under ZeRO ``zero`` (default the
    config's, else 3), or None when none does. Without ``training.memory.auto`` only the
    config's own options are considered."""
    liger = liger_installed() if liger is None else liger
    t = cfg.training
    options = memory_options(cfg, shape, world, sp)
    base = dataclasses.replace(options, zero=_zero(cfg, zero, options.zero))
    overlap = layout_plan.overlap_of(t.comm, base.zero)
    tokens = row_tokens(cfg, sp)
    use = usable_gib(gpu)
    dp = world // sp
    accum = max(1, t.global_batch_size // (t.micro_batch_size * dp))
    best: tuple[tuple[float, int], Choice] | None = None
    considered = fitting = 0
    for allow_offload_checkpoints in (False, True):  # its copies are not in the time model
        for opt in candidates(cfg, shape, base, liger, allow_offload_checkpoints):
            considered += 1
            est = memory.predict(shape, tokens, opt)
            if est["peak"] > use * GIB or est["cpu"] > host_gib * GIB:
                continue
            fitting += 1
            step = step_seconds(
                shape,
                tokens,
                t.attention,
                opt,
                gpu,
                nodes=nodes,
                accum=accum,
                rows=t.micro_batch_size,
                checkpointing=t.activation_checkpointing,
                overlap_comm=overlap,
                inter_node_gb_per_s=t.comm.inter_node_gb_per_s,
            )
            changed = tuple(
                f
                for f in (*MEMORY_FIELDS, "keep_activations", "kernels")
                if getattr(opt, f) != getattr(base, f)
            )
            key = (round(step, 4), len(changed))
            if best is None or key < best[0]:
                choice = Choice(
                    opt, est["peak"] / GIB, use, est["cpu"] / GIB, step, 0, 0, changed, dp, overlap
                )
                best = (key, choice)
        if best is not None:
            break
    if best is None:
        return None
    return dataclasses.replace(best[1], fitting=fitting, considered=considered)


def _zero(cfg: ExperimentConfig, zero: int | None, default: int) -> int:
    """The ZeRO stage: ``zero`` if given, else the config's, else ``default``."""
    if zero is not None:
        return zero
    return cfg.training.zero_stage if cfg.training.zero_stage is not None else default


def sp_candidates(cfg: ExperimentConfig, shape: Shape, world: int) -> list[int]:
    """The SP degrees a launch on ``world`` ranks may take: the config's, or with ``auto`` every
    divisor of the world whose heads split (Ulysses: q heads divide; KV heads divide or are
    replicated) and whose data-parallel size divides the global batch."""
    t = cfg.training
    if t.sequence_parallel != "auto":
        return [choose_sp(t.sequence_parallel, shape, world)]
    out = []
    for sp in range(1, world + 1):
        dp = world // sp
        if world % sp or t.global_batch_size % (t.micro_batch_size * dp):
            continue
        if choose_sp(sp, shape, world) == sp:
            out.append(sp)
    return out or [world]


def zero_candidates(cfg: ExperimentConfig, world: int) -> list[int]:
    """The ZeRO stages a CUDA launch may take: the config's, else :data:`layout_plan.STAGES`;
    one rank stepping an offloaded optimizer takes ZeRO-2 (plan.default_zero_stage says why)."""
    t = cfg.training
    if t.zero_stage is not None:
        return [t.zero_stage]
    if world == 1:
        return [2 if t.memory.offload_optimizer else 3]
    return list(layout_plan.STAGES)


def choose_layout(
    cfg: ExperimentConfig,
    shape: Shape,
    gpus: int,
    nodes: int,
    gpu: GpuKind,
    host_gib: float = DEFAULT_HOST_GIB,
    liger: bool | None = None,
) -> Choice | None:
    """The fastest predicted layout (SP × DP and ZeRO stage, each the config's where it names
    one) with its fastest fitting memory options, the others as ``alternatives``; None when
    nothing fits. Ties go to the higher stage and the smaller SP (the long-standing defaults)."""
    world = gpus * nodes
    found: list[tuple[tuple[float, int, int], Choice]] = []
    alternatives = []
    for sp in sp_candidates(cfg, shape, world):
        for zero in zero_candidates(cfg, world):
            c = choose(cfg, shape, world, sp, gpu, host_gib, liger, zero, nodes)
            if c is None:
                alternatives.append(Alternative(sp, world // sp, zero, None, None))
                continue
            found.append(((round(c.step_s, 4), -zero, sp), c))
    if not found:
        return None
    found.sort(key=lambda kc: kc[0])
    best = found[0][1]
    others = [
        Alternative(c.options.sp, c.dp, c.options.zero, round(c.step_s, 3), round(c.peak_gib, 1))
        for _, c in found[1:]
    ]
    return dataclasses.replace(best, alternatives=tuple(others + alternatives))


def apply(cfg: ExperimentConfig, choice: Choice) -> ExperimentConfig:
    """``cfg`` running ``choice``: its layout, communication settings and memory options set,
    ``auto`` off (the ranks run it as written). A communication setting the config names stays."""
    o, t = choice.options, cfg.training
    mem = t.memory.model_copy(
        update={
            "auto": False,
            "tiled_mlp": o.tiled_mlp,
            "tiled_loss": o.tiled_loss,
            "offload_optimizer": o.offload_optimizer,
            "offload_checkpoints": o.offload_checkpoints,
            "keep_activations": o.keep_activations if t.activation_checkpointing else 0,
        }
    )
    planned = comm_settings(o.zero, choice.overlap_comm)
    comm = t.comm.model_copy(
        update={k: v for k, v in planned.items() if getattr(t.comm, k) is None}
    )
    update = {
        "memory": mem,
        "kernels": o.kernels,
        "sequence_parallel": o.sp,
        "zero_stage": o.zero,
        "comm": comm,
    }
    return cfg.model_copy(update={"training": t.model_copy(update=update)})


# ------------------------------------------------------------------------- this host's GPU
def gpu_kind(name: str, memory_gib: float) -> GpuKind:
    """The plan's GPU kind for a device name (its measured speed factors), with the memory the
    device reports; an unknown kind gets the H200's factors (marked an estimate)."""
    upper = name.upper()
    for key, known in (("H200", "h200"), ("H100", "h100"), ("A100", "a100-80g")):
        if key in upper:
            return dataclasses.replace(GPUS[known], memory_gib=memory_gib)
    return dataclasses.replace(GPUS["h200"], name=name, memory_gib=memory_gib, estimate=True)


def host_memory_gib() -> float:
    # Imported here: psutil is DeepSpeed's dependency, needed only by a launch.
    import psutil

    return psutil.virtual_memory().total / GIB


def local_gpu() -> tuple[str, float] | None:
    """The first visible GPU's name and memory (GiB) from ``nvidia-smi``, without creating a
    CUDA context in this process (the launcher must not hold memory on GPU 0 for the whole
    run); None where there is none or it cannot tell."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.strip().splitlines()[0] if out.strip() else ""
    name, _, mib = first.rpartition(",")
    try:
        return name.strip(), float(mib) / 1024
    except ValueError:
        return None


def resolve(
    cfg: ExperimentConfig,
    gpu: GpuKind,
    gpus: int,
    nodes: int = 1,
    host_gib: float = DEFAULT_HOST_GIB,
    shape_name: str | None = None,
    liger: bool | None = None,
) -> tuple[ExperimentConfig, Choice | None]:
    """``cfg`` with auto's choice on ``gpus × nodes`` GPUs of kind ``gpu`` (the plan's and the
    launch's one rule), and the choice; ``cfg`` unchanged and None without ``auto`` or when
    nothing fits."""
    if not plans_layout(cfg):
        return cfg, None
    shape, _ = model_shape(cfg, shape_name)
    layout(cfg, shape, gpus, nodes)  # the config's own layout errors first, in its words
    choice = choose_layout(cfg, shape, gpus, nodes, gpu, host_gib, liger)
    return (apply(cfg, choice), choice) if choice is not None else (cfg, None)


def plans_layout(cfg: ExperimentConfig) -> bool:
    """Whether a CUDA launch leaves anything to the plan: memory options, SP or ZeRO stage."""
    t = cfg.training
    return t.memory.auto or t.sequence_parallel == "auto" or t.zero_stage is None


def for_launch(
    cfg: ExperimentConfig, gpus: int, nodes: int
) -> tuple[ExperimentConfig, Choice | None, str]:
    """auto's choice for a CUDA launch on this host: its GPU (``nvidia-smi``) and its host memory
    shared by ``gpus`` ranks. Returns the config to run, the choice, and the start-up line."""
    found = local_gpu()
    if found is None:
        return cfg, None, "layout auto: nvidia-smi names no GPU; the config's settings as they are"
    kind = gpu_kind(*found)
    host = host_memory_gib() / gpus
    try:
        run, choice = resolve(cfg, kind, gpus, nodes, host)
    except PlanError as err:  # no shape known: the options as configured
        return cfg, None, f"layout auto: {err}; the config's settings as they are"
    if choice is None:
        return (
            cfg,
            None,
            (
                f"layout auto: no layout is predicted to fit {kind.name} "
                f"({usable_gib(kind):.1f} GiB usable); the config's settings as they are "
                "(`anchorctx plan` names what would fit)"
            ),
        )
    return run, choice, choice.line()
