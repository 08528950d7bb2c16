"""DeepSpeed: process group, ZeRO engine, AdamW + warmup schedule, Ulysses sequence parallelism.

How DeepSpeed is imported, its accelerator and its config dict are
:mod:`anchorctx.training.deepspeed_env`'s.

Sequence parallelism uses DeepSpeed's ALST ``UlyssesSPAttentionHF``: it wraps the registered
``"anchorctx"`` attention so that each rank's q/k/v shards ``[B, H, T/SP, D]`` are exchanged
(all-to-all) into ``[B, H/SP, T, D]`` — the full sequence for a subset of heads — before our
attention builds the document mask from the full-row layouts it receives as a kwarg, and back
after. KV heads are split like q heads and replicated only when SP > KV heads.

Gradient normalisation (exact for every ZeRO stage, checked against one process in the tests):
each rank back-propagates ``sum of its token losses / global target count``, so the true
gradient is the SUM of every rank's and every micro-batch's gradient. DeepSpeed instead divides
the loss by the accumulation steps, and the reduced gradients by DP under ZeRO 0/1/2
(``seq_data_parallel_world / SP``) but by DP × SP under ZeRO-3 (its reduce-scatter averages
over the whole sequence-data-parallel group, pinned with ``reduce_scatter: true``).
:func:`loss_scale` returns the factor that undoes both.
"""

from __future__ import annotations

import functools
import math
import os
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from anchorctx.attention.hf import attention_name, select_attention
from anchorctx.process import free_port
from anchorctx.training.deepspeed_env import deepspeed_config, import_deepspeed, use_accelerator
from anchorctx.training.memory import cpu_adam

# Re-exported: scripts/setup.sh names the ops cache from here, beside prebuild_ops.

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine

    from anchorctx.experiment import ExperimentConfig
    from anchorctx.training.plan import Parallelism
    from anchorctx.training.settings import TrainingConfig


def prebuild_ops() -> float:
    """Build (or find already built) the DeepSpeed ops a CPU run needs; returns seconds spent.

    Called once by scripts/setup.sh, so no training process waits for a compiler (several
    processes starting at once would otherwise all wait on the first one's build). Nothing to
    build on CUDA machines: there DeepSpeed's NCCL path needs no JIT op.
    """
    start = time.monotonic()
    if not torch.cuda.is_available():
        # Through the very call a training process makes: the op's compiler flags are part of
        # its build key, and a direct builder.load() computes them differently (a rebuild).
        init_distributed("cpu")
        shutdown_distributed()
    return time.monotonic() - start


_SINGLE_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_owned_env: list[str] = []


def init_distributed(device: str) -> tuple[int, int, int]:
    """Start (or join) the process group; returns (rank, world, local_rank).

    A plain ``anchorctx train`` of one process gets a one-rank group on a free local port, so
    the same DeepSpeed code path serves one process and many; :func:`shutdown_distributed`
    removes those variables again (a later run in this process picks a new port).
    """
    use_accelerator(device)
    deepspeed = import_deepspeed()
    if "RANK" not in os.environ:
        single = {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
        }
        _owned_env[:] = [k for k in _SINGLE_ENV if k not in os.environ]
        os.environ.update({k: single[k] for k in _owned_env})
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    return dist.get_rank(), dist.get_world_size(), local_rank


def shutdown_distributed() -> None:
    """Barrier first: a rank that tears down early would hang the others' last collective."""
    if dist.is_initialized():
        dist.barrier()
        # DeepSpeed's teardown also drops its cached groups (a later run in this process
        # would otherwise broadcast over a destroyed group).
        import_deepspeed().comm.destroy_process_group()
    for key in _owned_env:
        os.environ.pop(key, None)
    _owned_env.clear()
    _ULYSSES.clear()  # their groups belonged to the destroyed process group


def build_optimizer(model: torch.nn.Module, cfg: ExperimentConfig, device: str):
    """AdamW with ``training.weight_decay`` on every parameter (``weight_decay_on: all``, the
    paper's code) or on matrices only (``matrices``: norms and biases are not decayed)."""
    t = cfg.training
    params = [p for p in model.parameters() if p.requires_grad]
    if t.weight_decay_on == "all":
        groups = [{"params": params, "weight_decay": t.weight_decay}]
    else:
        groups = [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
    if t.memory.offload_optimizer and cpu_adam(t.memory, device) == "deepspeed":
        # The offloaded fp32 state is stepped on the host: DeepSpeed's C++ Adam (SIMD, all
        # cores) is 6x torch's there. Its op compiles on first use into TORCH_EXTENSIONS_DIR
        # (about a minute, once per host; deepspeed_env points every run at one cache).
        import_deepspeed()
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=t.lr, betas=t.betas, eps=1e-8, adamw_mode=True)
    fused = {"fused": True} if device == "cuda" else {}
    return torch.optim.AdamW(groups, lr=t.lr, betas=t.betas, eps=1e-8, **fused)


# The cosine schedule ends at this fraction of the peak rate (the Chinchilla recipe's 10%).
COSINE_FLOOR = 0.1


def lr_factor(step: int, warmup_steps: int, steps: int, schedule: str = "constant") -> float:
    """The learning rate of optimiser step ``step`` (0-based) over ``training.lr``: a linear
    warmup over ``warmup_steps``, then constant, or a cosine from 1 down to ``COSINE_FLOOR`` at
    the last of ``steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or steps - 1 <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (steps - 1 - warmup_steps))
    return COSINE_FLOOR + (1 - COSINE_FLOOR) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer, t: TrainingConfig):
    """``lr_factor`` of ``training``'s warmup, steps and schedule, per optimiser step."""
    factor = functools.partial(
        lr_factor, warmup_steps=t.warmup_steps, steps=t.steps, schedule=t.schedule
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# DeepSpeed's wrapper replaces the registry entry of the name it is given. It is given a name of
# its own, ``<model's attention>+ulysses``, so the plain ``"anchorctx"`` entry stays unwrapped:
# a model loaded later (``load_model`` registers and selects the plain name) cannot undo the
# wrapping of this one, and a non-SP model in the same process never runs the all-to-alls.
ULYSSES_SUFFIX = "+ulysses"
# DeepSpeed creates the SP groups once per process: one wrapper (and mpu) per layout, shared by
# every model of that layout (several DeepSpeed engines in one process, as the exactness tests
# build).
_ULYSSES: dict[tuple[str, int, int, int], Any] = {}


def register_sequence_parallel(model, par: Parallelism, seq_len: int):
    """Make ``model`` run its attention inside DeepSpeed's Ulysses all-to-alls; returns
    DeepSpeed's ``mpu`` (SP and SP×DP groups) or None without SP. Idempotent and independent of
    the order in which models are loaded and wrapped (see ULYSSES_SUFFIX)."""
    if par.sp == 1:
        return None
    import_deepspeed()
    # Imported here: DeepSpeed loads only through import_deepspeed() (its op cache set first).
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    base = attention_name(model).removesuffix(ULYSSES_SUFFIX)
    name = base + ULYSSES_SUFFIX
    key = (name, par.sp, par.micro, seq_len)
    if key not in _ULYSSES:
        AttentionInterface.register(name, ALL_ATTENTION_FUNCTIONS[base])  # wrapped next
        select_attention(model, name)
        _ULYSSES[key] = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model,
            core_attn_implementation=name,
            sequence_parallel_size=par.sp,
            micro_batch_size=par.micro,
            seq_length=seq_len,
            seq_length_is_variable=False,
        )
    select_attention(model, name)
    return _ULYSSES[key]


def build_engine(
    model, cfg: ExperimentConfig, par: Parallelism, mpu, optimizer=None
) -> DeepSpeedEngine:
    """``deepspeed.initialize`` with our optimizer (or the given one: the exactness tests step
    with plain SGD, whose update is proportional to the gradient) and schedule."""
    deepspeed = import_deepspeed()
    if optimizer is None:
        optimizer = build_optimizer(model, cfg, par.device)
    scheduler = build_scheduler(optimizer, cfg.training)
    ds_engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=deepspeed_config(cfg, par),
        mpu=mpu,
    )
    return ds_engine


def loss_scale(ds_engine: DeepSpeedEngine, par: Parallelism) -> float:
    """Factor on ``local loss sum / global targets`` that makes DeepSpeed's gradients the
    exact global-batch gradient (see the module docstring)."""
    if ds_engine.zero_optimization_stage() == 3:
        divisor = ds_engine.seq_dp_world_size  # reduce-scatter averages over DP × SP
    else:
        divisor = ds_engine.seq_dp_world_size / ds_engine.sequence_parallel_size  # = DP
    return float(par.accum * divisor)
