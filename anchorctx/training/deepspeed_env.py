"""DeepSpeed's process environment and configuration: where its JIT-built ops live, how it is
imported, which accelerator it uses, and the config dict given to ``deepspeed.initialize``.

A leaf of the training package (it imports only :mod:`anchorctx.training.plan`): the engine
(:mod:`anchorctx.training.engine`) and the long-row memory options
(:mod:`anchorctx.training.tiling`) both load DeepSpeed through :func:`import_deepspeed`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anchorctx.training.plan import TrainingError
from anchorctx.training.settings import COMM_SETTINGS

if TYPE_CHECKING:
    from anchorctx.experiment import ExperimentConfig
    from anchorctx.training.plan import Parallelism
    from anchorctx.training.settings import CommConfig, MemoryConfig


# DeepSpeed JIT-compiles C++ ops into TORCH_EXTENSIONS_DIR the first time a process needs them
# (on CPU: its shared-memory comm op, ~40-140 s on two cores, at every process-group start). One
# cache for every arm and run: the environment's TORCH_EXTENSIONS_DIR when set (scripts/*.sh set
# it to the checkout's .cache/torch_extensions), else ~/.cache/anchorctx/torch_extensions. Child
# processes (torchrun, the flow's training tasks) inherit it through the environment.
EXTENSIONS_ENV = "TORCH_EXTENSIONS_DIR"


def ops_cache_dir() -> str:
    """Where DeepSpeed's JIT-built ops live; set in the environment for this process and its
    children before DeepSpeed is imported."""
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return os.environ.setdefault(EXTENSIONS_ENV, str(default / "anchorctx" / "torch_extensions"))


def environment_tools_first() -> None:
    """Put this interpreter's own ``bin`` directory first on PATH when it holds ``ninja``.

    DeepSpeed's JIT build runs whichever ``ninja`` PATH finds. A process started without its
    virtualenv activated (the flow's training tasks under ``anchorctx serve``, or
    ``.venv/bin/python -m anchorctx``) finds another one, say a system ninja 1.11 next to the
    locked 1.13 that scripts/setup.sh built the ops with. A different ninja treats the other's
    build log as stale and compiles the op again: measured 56 s of the CPU demo's first arm on
    two cores, and every later switch between the two pays it again. Where no other ninja is
    installed, the build fails outright."""
    bindir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if os.path.isfile(os.path.join(bindir, "ninja")) and path.split(os.pathsep)[0] != bindir:
        os.environ["PATH"] = bindir + os.pathsep + path if path else bindir


def import_deepspeed():
    ops_cache_dir()
    environment_tools_first()
    try:
        # Imported here: DeepSpeed is slow to import and needed only to train.
        deepspeed = _import_without_mlflow()
    except Exception as err:  # ImportError, or a broken CUDA/op build at import time
        raise RuntimeError(
            f"DeepSpeed is required for training but failed to import ({type(err).__name__}: "
            f"{err}); install it with `pip install 'deepspeed>=0.18,<0.20'`"
        ) from err
    return deepspeed


def _import_without_mlflow():
    """``import deepspeed`` with MLflow hidden for the length of that import.

    DeepSpeed's autotuner (``deepspeed/autotuning/autotuner.py``, imported by
    ``deepspeed.runtime.config``) imports MLflow at module level when it is installed, as it is
    here for the tracker: 1.2 s of CPU (of DeepSpeed's 3.5 s import) in every training process
    and torchrun worker, measured on two cores, for DeepSpeed's autotuning, which the project
    never runs. DeepSpeed guards that import (``has_mlflow = False`` when it fails), and no other
    DeepSpeed module uses MLflow. A ``None`` entry in ``sys.modules`` makes ``import mlflow``
    fail; it is removed once DeepSpeed is in, so the tracker's own ``import mlflow`` (later, in
    the same process) loads MLflow as usual. A process that has MLflow loaded already keeps it."""
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed

        return deepspeed
    sys.modules["mlflow"] = None
    try:
        import deepspeed
    finally:
        if "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
    return deepspeed


def use_accelerator(device: str) -> None:
    """Make DeepSpeed's accelerator the training device's.

    DeepSpeed detects its accelerator once per process, CUDA wherever a GPU is visible, and
    ``deepspeed.initialize`` moves the model there. A CPU run on a GPU host (the demo's
    ``training.device: cpu``) then trained a model on cuda:0 fed with CPU batches ("index is on
    cpu, different from other tensors on cuda:0"). Before DeepSpeed is imported the choice goes
    through ``DS_ACCELERATOR`` (torchrun's workers inherit it); after, the accelerator object is
    replaced (a process that trains on both, as the test suite does)."""
    name = "cpu" if device == "cpu" else "cuda"
    if "deepspeed" not in sys.modules:
        os.environ["DS_ACCELERATOR"] = name
        return
    # Imported here: DeepSpeed is already loaded (checked above); its accelerator modules are
    # needed only to switch.
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() == name:
        return
    if name == "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator as Accelerator
    else:
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator as Accelerator
    set_accelerator(Accelerator())


def deepspeed_config(cfg: ExperimentConfig, par: Parallelism) -> dict[str, Any]:
    t = cfg.training
    zero: dict[str, Any] = {"stage": par.zero_stage}
    if par.zero_stage == 3:
        # Stage 3 gathers weights layer by layer; these keep whole-model saves possible.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
        # The averaging path that training.engine.loss_scale() accounts for.
        zero["reduce_scatter"] = True
    zero.update(comm_entries(t.comm, par.zero_stage))
    zero_extra, top_extra = offload_entries(t.memory, par)  # training.memory.offload_optimizer
    zero.update(zero_extra)
    return {
        "train_micro_batch_size_per_gpu": par.micro,
        "gradient_accumulation_steps": par.accum,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": t.precision == "bf16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        **top_extra,
    }


# training.comm's fields by DeepSpeed's ``zero_optimization`` key, and the stages that read it.
_COMM_KEYS = {
    "overlap_comm": ("overlap_comm", (1, 2, 3)),
    "reduce_bucket_size": ("reduce_bucket_size", (1, 2, 3)),
    "allgather_bucket_size": ("allgather_bucket_size", (1, 2)),
    "prefetch_bucket_size": ("stage3_prefetch_bucket_size", (3,)),
    "param_persistence_threshold": ("stage3_param_persistence_threshold", (3,)),
    "max_live_parameters": ("stage3_max_live_parameters", (3,)),
}


def comm_entries(comm: CommConfig, stage: int) -> dict[str, Any]:
    """``zero_optimization`` keys of ``training.comm`` for ``stage``: each field set in the
    config, else the layout plan's setting for that stage (a run launched with the defaults has
    them written into its config already; this covers a config built in process)."""
    planned = COMM_SETTINGS.get(stage, {})
    out = {}
    for field, (key, stages) in _COMM_KEYS.items():
        value = getattr(comm, field)
        value = planned.get(field) if value is None else value
        if value is not None and stage in stages:
            out[key] = value
    return out


def offload_entries(memory: MemoryConfig, par: Parallelism) -> tuple[dict, dict]:
    """DeepSpeed config entries of ``offload_optimizer``: (``zero_optimization`` keys, top-level
    keys)."""
    if not memory.offload_optimizer:
        return {}, {}
    if par.zero_stage == 0:
        raise TrainingError(
            "training.memory.offload_optimizer needs ZeRO (training.zero_stage 1, 2 or 3)"
        )
    # Not pinned unless asked (training.memory.pin_offload): DeepSpeed then page-locks its host
    # gradient buffers (tens of GB for a 7B model), which can exhaust a host whose fp32 state
    # already fills most of its RAM. The price of pageable buffers: slower copies
    # (docs/benchmarks/2026-11-27-sp2-512k-host-threads.md, "Host copies").
    # The optimizer engine.build_optimizer made steps the CPU partitions (training.memory.cpu_adam:
    # DeepSpeedCPUAdam, or torch's AdamW, which DeepSpeed would otherwise refuse here).
    return (
        {"offload_optimizer": {"device": "cpu", "pin_memory": memory.pin_offload}},
        {"zero_force_ds_cpu_optimizer": False},
    )
