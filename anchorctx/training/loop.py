"""``train(cfg)``: the training run of one experiment arm, in this process.

One process, or one rank of a ``torchrun``/``deepspeed`` launch (see
:mod:`anchorctx.training.launch`). The order is: pre-flight checks (config, dataset,
tokenizer, heads — nothing on the GPU yet), process group, run directory, model, Ulysses
registration, DeepSpeed engine, optional resume, then the step loop with logging,
checkpoints and resume state. A non-finite loss or gradient norm stops the loop before that
step is logged or saved (:func:`check_finite`); ``--resume`` continues only on the packed
dataset the resume state was trained on (:func:`check_resume_data`).

The parallel plan, the pre-flight result and the restart state are computed once per process:
a launcher that already has them (``anchorctx train`` of one process) passes them in as
:class:`Prepared`; a launched rank computes them itself.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from anchorctx.config import dump_config
from anchorctx.experiment import ExperimentConfig
from anchorctx.io import (
    append_jsonl,
    atomic_write_json,
    atomic_write_text,
    read_json,
    read_jsonl,
    sha256_file,
)
from anchorctx.manifest import base_manifest
from anchorctx.models.checkpoints import list_checkpoints
from anchorctx.models.loading import (
    anchor_decision,
    build_hf_config,
    load_model,
    load_tokenizer,
    resolve_device,
)
from anchorctx.packing import load_packed, prepare_data
from anchorctx.packing.pipeline import MANIFEST, dataset_identity, input_change
from anchorctx.tracking import Tracker, train_metrics
from anchorctx.training import checkpoints as ckpt
from anchorctx.training import determinism
from anchorctx.training import metrics as M
from anchorctx.training.data import BatchPlan
from anchorctx.training.deepspeed_env import comm_entries
from anchorctx.training.determinism import deterministic_mode
from anchorctx.training.engine import (
    build_engine,
    init_distributed,
    loss_scale,
    register_sequence_parallel,
    shutdown_distributed,
)
from anchorctx.training.kernels import use_kernels
from anchorctx.training.memory_choice import RECORD as LAYOUT_RECORD
from anchorctx.training.nodes import check_shared_run_dir
from anchorctx.training.plan import (
    Parallelism,
    ResumeDataError,
    TrainingError,
    TrainingStopped,
    check_batch_memory,
    check_dataset,
    check_heads,
    check_model_source,
    check_vocab,
    layout_change,
    padded_length,
    plan_parallelism,
)
from anchorctx.training.run_dir import run_lock
from anchorctx.training.settings import TrainingConfig
from anchorctx.training.step import loss_function, train_step
from anchorctx.training.tiling import (
    apply_memory_options,
    enable_activation_checkpointing,
    init_context,
)

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine

log = logging.getLogger("anchorctx.training")
# Settings that may change between a run and its resumption (extend a run, save more often).
# zero_stage: a run may name the stage it was written with (its default changed); the
# recorded parallel layout still refuses any other.
RESUMABLE_CHANGES = ("steps", "save", "log_every", "zero_stage")


@dataclass
class Preflight:
    data_dir: Path
    manifest: dict[str, Any]
    tokenizer: Any
    hf_config: Any
    anchor_note: str | None = None  # the anchor rule's recorded decision (models.loading)


@dataclass
class Prepared:
    """What the launcher computed before training in its own process: the plan, the pre-flight
    result and the restart state (after recovering resume state and moving an old run aside)."""

    par: Parallelism
    pre: Preflight
    state: ckpt.ResumeState


@dataclass(frozen=True, kw_only=True)
class RunContext:
    """One process's run once its process group, pre-flight and restart state are settled: what
    the build, the step loop and the saves read."""

    cfg: ExperimentConfig
    par: Parallelism
    rank: int
    device: str  # this rank's torch device: "cuda:<local rank>" or "cpu"
    pre: Preflight
    state: ckpt.ResumeState  # where the run starts (ResumeState.none(): step 0)


def preflight(
    cfg: ExperimentConfig, par: Parallelism, *, data_dir: Path | None = None
) -> Preflight:
    """Every check that needs no GPU. The packed dataset is ``data_dir`` when given (a
    launcher already prepared it), else built by ``prepare_data`` if missing."""
    check_model_source(cfg)
    tokenizer = load_tokenizer(cfg.model)
    where = str(cfg.model.path) if cfg.model.path is not None else "model.tiny"
    if cfg.model.path is not None:  # the config as the directory has it, before the rule
        _, note = anchor_decision(tokenizer, build_hf_config(cfg.model, seq_len=None), where)
    else:
        note = None
    hf_config = build_hf_config(
        cfg.model, seq_len=cfg.data.seq_len, vocab_size=len(tokenizer), tokenizer=tokenizer
    )
    check_heads(hf_config, par.sp)
    check_vocab(hf_config, tokenizer)
    check_batch_memory(cfg, par)  # before the data is built or a batch allocated
    if data_dir is None:
        data_dir = prepare_data(cfg, progress=True)
    _, manifest = load_packed(data_dir)
    check_dataset(cfg, manifest, tokenizer)
    return Preflight(Path(data_dir), manifest, tokenizer, hf_config, note)


def train(
    cfg: ExperimentConfig,
    *,
    resume: bool = False,
    data_dir: Path | None = None,
    hold_lock: bool = True,
    prepared: Prepared | None = None,
) -> dict[str, Any]:
    """Train ``cfg``'s arm to ``training.steps``; returns a summary dict.

    ``resume=True`` continues from ``<run_dir>/resume`` when it exists (identical batches,
    RNG, optimizer and scheduler state), returns at once when the run is already complete, and
    starts fresh when there is no resume state. Without ``resume`` a run directory holding an
    earlier run is an error (:func:`restart_state`). ``data_dir``: the packed dataset, when the
    caller already prepared it (default: ``prepare_data(cfg)`` on rank 0). ``hold_lock``: take
    the run directory's writer lock on rank 0 (a launcher that holds it passes False).
    ``prepared``: the launcher's plan, pre-flight and restart state (one process only).
    """
    lock = None
    if hold_lock and os.environ.get("RANK", "0") == "0":
        lock = run_lock(cfg).acquire()
    try:
        with deterministic_mode(cfg.training.deterministic, cfg.seed):
            return _train_ranks(cfg, resume=resume, data_dir=data_dir, prepared=prepared)
    finally:
        if lock is not None:
            lock.release()


def _train_ranks(
    cfg: ExperimentConfig, *, resume: bool, data_dir: Path | None, prepared: Prepared | None
) -> dict[str, Any]:
    """:func:`train` in this process' rank, between the process group's start and end."""
    want = cfg.training.device
    device = prepared.par.device if prepared else resolve_device(want, "training.device")
    rank, world, local_rank = init_distributed(device)
    try:
        par = prepared.par if prepared else plan_parallelism(cfg, world=world)
        if cfg.training.nnodes > 1:
            check_shared_run_dir(cfg.run_dir, rank, world)
        if prepared is None:  # a launched rank: it computes them itself
            prepared = _prepare_rank(cfg, par, rank, resume=resume, data_dir=data_dir)
        run = RunContext(
            cfg=cfg,
            par=par,
            rank=rank,
            device=f"cuda:{local_rank}" if par.device == "cuda" else "cpu",
            pre=prepared.pre,
            state=prepared.state,
        )
        return _train(run)
    finally:
        shutdown_distributed()


def _prepare_rank(
    cfg: ExperimentConfig, par: Parallelism, rank: int, *, resume: bool, data_dir: Path | None
) -> Prepared:
    """A launched rank's pre-flight and restart state (one process gets them from the
    launcher): rank 0 prepares the dataset and recovers the resume state first."""
    if rank == 0:
        pre = preflight(cfg, par, data_dir=data_dir)
        if note := ckpt.recover_resume(cfg.run_dir):
            print(note, flush=True)
    dist.barrier()  # rank 0 built the dataset; the others now find it finished
    if rank != 0:
        pre = preflight(cfg, par, data_dir=data_dir)
    # Every rank checks: none waits on a failed one.
    state = restart_state(cfg, par, resume, pre=pre)
    return Prepared(par, pre, state)


def _train(run: RunContext) -> dict[str, Any]:
    cfg, state = run.cfg, run.state
    dataset, _ = load_packed(run.pre.data_dir)
    if run.rank == 0:
        _prepare_run_dir(run)
    dist.barrier()
    _setup_logging(cfg.run_dir / "train.log", run.rank)
    if state.step >= cfg.training.steps:
        log.info("run already complete at step %d: %s", state.step, cfg.run_dir)
        return _summary(cfg, state.step, state.tokens_seen, state.loss, state.step)
    if run.par.device == "cuda":  # its device part needs CUDA initialised (plan.py)
        check_batch_memory(cfg, run.par)
    built = time.perf_counter()
    ds_engine = _build(run)
    if state.found:
        ckpt.load_resume(ds_engine, cfg.run_dir, state)
        log.info("resumed from step %d", state.step)
    if run.rank == 0:
        log.info(startup_line(time.perf_counter() - built))
    plan = BatchPlan(
        dataset,
        seed=cfg.seed,
        par=run.par,
        seq_len=cfg.data.seq_len,
        variant=cfg.training.attention,
        pad_id=int(run.pre.manifest["anchor_token_id"]),
        boundary_targets=cfg.training.boundary_targets,
        rank=run.rank,
    )
    return _loop(run, ds_engine, plan)


def startup_line(engine_s: float) -> str:
    """How long this process took to reach its first step, and how much of it the model,
    DeepSpeed engine and resume state took (the rest: interpreter, imports, checks, data,
    process group)."""
    import psutil  # DeepSpeed's own dependency: there wherever training runs

    since = time.time() - psutil.Process().create_time()
    return (
        f"ready for the first step {since:.1f} s after the process started (model and "
        f"DeepSpeed engine {engine_s:.1f} s, with any resume state; the rest: imports, checks, "
        "data, process group)"
    )


def _build(run: RunContext) -> DeepSpeedEngine:
    """Model with the registered attention (and Ulysses around it), inside DeepSpeed."""
    cfg, par = run.cfg, run.par
    dtype = "bfloat16" if cfg.training.precision == "bf16" else "float32"
    with init_context(cfg, run.device):
        model = load_model(
            cfg.model,
            seq_len=cfg.data.seq_len,
            dtype=dtype,
            device=run.device,
            tokenizer=run.pre.tokenizer,
        )
    use_kernels(model, cfg.training.kernels)
    if cfg.training.activation_checkpointing:
        enable_activation_checkpointing(model)
    apply_memory_options(model, cfg.training.memory)
    model.config.use_cache = False
    model.train()
    mpu = register_sequence_parallel(model, par, padded_length(cfg.data.seq_len, par.sp))
    return build_engine(model, cfg, par, mpu)


def _loop(run: RunContext, ds_engine: DeepSpeedEngine, plan: BatchPlan) -> dict[str, Any]:
    cfg, par, rank, t = run.cfg, run.par, run.rank, run.cfg.training
    start, tokens_seen = run.state.step, run.state.tokens_seen
    scale = loss_scale(ds_engine, par)
    loss_fn = loss_function(t.memory.tiled_loss)  # once: plain, or tiled logits and loss
    n_matmul = M.matmul_params(ds_engine.module)
    text_cfg = ds_engine.module.config.get_text_config()
    meter = M.Throughput(t.steps, par.world, M.peak_tflops(par.device, t.precision, t.peak_tflops))
    bar = _progress_bar(rank, start, t.steps)
    loss = None
    tracker = Tracker(cfg, "train", enabled=rank == 0)  # only rank 0 logs
    try:
        for step in range(start + 1, t.steps + 1):
            t0 = time.perf_counter()
            data = plan.step_data(step - 1, run.device)
            stats = train_step(ds_engine, data, par.engine, scale, loss_fn)
            _sync(par.device)
            check_finite(cfg, step, stats.loss, stats.grad_norm)
            dt = time.perf_counter() - t0
            tokens_seen += data.global_tokens
            loss = stats.loss
            flops = M.step_flops(n_matmul, data.global_tokens, data.attention_pairs, text_cfg)
            row = {
                "step": step,
                "loss": round(stats.loss, 6),
                "grad_norm": stats.grad_norm,
                "lr": stats.lr,
                "tokens": data.global_tokens,
                "tokens_seen": tokens_seen,
                **meter.record(dt, data.global_tokens, flops),
                "peak_mem_gib": round(M.peak_memory_gib(par.device), 2),
            }
            if rank == 0:
                _report(cfg, row, meter.eta(step), bar)
                tracker.metrics(train_metrics(row), step=step)
            _save(run, ds_engine, step, tokens_seen, loss)
    finally:
        tracker.close()
    if bar is not None:
        bar.close()
    return _summary(cfg, t.steps, tokens_seen, loss, start)


def check_finite(cfg: ExperimentConfig, step: int, loss: float, grad_norm: float | None) -> None:
    """Stop at a non-finite loss or gradient norm, before this step is logged or saved: its
    update has already changed the weights in memory, and nothing of it reaches the disk. Every
    rank holds the same global values, so every rank stops here together."""
    bad = not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm))
    if not bad:
        return
    found = list_checkpoints(cfg.run_dir)
    good = f"the last good checkpoint is {found[-1]}" if found else "there is no checkpoint yet"
    state = ckpt.resume_step(cfg.run_dir)
    resume = (
        f"; the resume state is at step {state} (--resume repeats the steps after it)"
        if state is not None
        else ""
    )
    norm = "not tracked" if grad_norm is None else f"{grad_norm}"
    raise TrainingStopped(
        f"step {step}: the loss is {loss} and the gradient norm {norm}: training stopped "
        f"before saving this step; {good}{resume}"
    )


def _report(cfg, row: dict, eta_s: float, bar) -> None:
    append_jsonl(cfg.run_dir / "metrics.jsonl", row)
    if row["step"] % cfg.training.log_every == 0 or row["step"] == cfg.training.steps:
        line = M.step_line(row, cfg.training.steps, eta_s)
        if bar is not None:
            bar.clear()
        log.info(line)
    if bar is not None:
        bar.set_postfix(loss=f"{row['loss']:.4f}", refresh=False)
        bar.update(1)


def _save(
    run: RunContext, ds_engine: DeepSpeedEngine, step: int, tokens_seen: int, loss: float
) -> None:
    cfg, pre, t = run.cfg, run.pre, run.cfg.training
    if ckpt.should_save(step, t.steps, t.save):
        t0 = time.perf_counter()
        meta = _checkpoint_meta(cfg, pre, tokens_seen, loss)
        path = ckpt.save_checkpoint(ds_engine, pre.tokenizer, cfg.run_dir, step, meta, t.save)
        log.info("checkpoint %s (%.1f s)", path, time.perf_counter() - t0)
    if ckpt.should_save_resume(step, t.steps, t.save):
        t0 = time.perf_counter()
        state = ckpt.ResumeState(
            step=step,
            tokens_seen=tokens_seen,
            loss=loss,
            parallel=run.par.to_dict(),
            config_fingerprint=resume_fingerprint(cfg),
            data_fingerprint=pre.manifest.get("fingerprint"),
            data_dir=str(pre.data_dir),
            run=run_identity(cfg),
        )
        ckpt.save_resume(ds_engine, cfg.run_dir, state)
        log.info("resume state at step %d (%.1f s)", step, time.perf_counter() - t0)


def _checkpoint_meta(cfg, pre: Preflight, tokens_seen: int, loss: float) -> dict[str, Any]:
    return {
        "tokens_seen": tokens_seen,
        "loss": loss,
        "variant": cfg.variant_name,
        "attention": cfg.training.attention,
        "seq_len": cfg.data.seq_len,
        "config_hash": cfg.fingerprint(),
        "data_manifest_hash": sha256_file(pre.data_dir / "manifest.json"),
        "data_fingerprint": pre.manifest.get("fingerprint"),
        # The anchor training used: evaluation refuses a checkpoint whose tokenizer now gives
        # another (models.loading.check_trained_anchor).
        "anchor_token_id": pre.manifest.get("anchor_token_id"),
        **({"anchor_note": pre.anchor_note} if pre.anchor_note else {}),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _summary(cfg, step: int, tokens_seen: int, loss, start: int) -> dict[str, Any]:
    return {
        "run_dir": str(cfg.run_dir),
        "steps": step,
        "resumed_from": start or None,
        "tokens_seen": tokens_seen,
        "final_loss": loss,
        "checkpoints": [str(p) for p in list_checkpoints(cfg.run_dir)],
    }


# ----------------------------------------------------------------------------- run directory
def resume_fingerprint(cfg: ExperimentConfig) -> str:
    """Hash of what determines the training computation (seed, model, data, training), without
    the settings a resumed run may change. Evaluation settings may change freely."""

    defaults, copy = TrainingConfig(), cfg.model_copy(deep=True)
    for key in RESUMABLE_CHANGES:
        setattr(copy.training, key, getattr(defaults, key))
    return copy.fingerprint("seed", "model", "data", "training")


def run_identity(cfg: ExperimentConfig) -> dict[str, Any]:
    """Which run wrote a resume state (``trainer.json`` ``run``, for the reader). The seed is
    compared on ``--resume`` through the config fingerprint; the names are not: a run directory
    copied under another experiment or variant name is the same computation. The engine files
    carry a hash of all of it (``ResumeState.engine_client_state``)."""
    return {"experiment": cfg.name, "variant": cfg.variant_name, "seed": cfg.seed}


def restart_state(
    cfg: ExperimentConfig, par: Parallelism, resume: bool, pre: Preflight | None = None
) -> ckpt.ResumeState:
    """The resume state to continue from (``ResumeState.none()``: a fresh start), after checking
    it is safe.

    Never a silent restart: a run directory with resume state or checkpoints needs ``resume``
    (continue) or the caller's ``--force`` (which moves it aside first); corrupt resume state
    is a :class:`ResumeStateError` naming the file. ``pre``: the pre-flight result, whose
    packed dataset is the one the run continues on (default: the one ``cfg`` packs now).
    """
    run_dir = cfg.run_dir
    if not resume:
        found = list_checkpoints(run_dir)
        held = (["resume state"] if ckpt.has_resume_state(run_dir) else []) + (
            [f"{len(found)} checkpoint(s)"] if found else []
        )
        if held:
            raise TrainingError(
                f"{run_dir} holds an earlier run ({' and '.join(held)}); continue it with "
                "--resume, or start over with --force (moves it aside to <run>.old-<time>)"
            )
        return ckpt.ResumeState.none()
    state = ckpt.read_trainer_state(run_dir, par.world)
    if state.found:
        _check_resumable(cfg, par, state, pre)
    elif list_checkpoints(run_dir):
        raise TrainingError(
            f"{run_dir} holds checkpoints of an earlier run but no resume state to continue "
            "from; start over with --force (moves it aside), or choose another name or variant"
        )
    return state


def _check_resumable(
    cfg: ExperimentConfig, par: Parallelism, state: ckpt.ResumeState, pre: Preflight | None
) -> None:
    """The recorded parallel layout first (another process count also changes which per-rank
    files exist), then the config, then the data."""
    saved = state.parallel
    if saved != par.to_dict():
        raise TrainingError(
            f"the resume state in {cfg.run_dir / 'resume'} was written with another parallel "
            f"layout ({layout_change(saved, par.to_dict())}): resume with the same processes, "
            "SP size, batch and ZeRO stage as the run that wrote it"
        )
    if state.config_fingerprint != resume_fingerprint(cfg):
        raise TrainingError(
            f"the resume state in {cfg.run_dir / 'resume'} was written with a different config "
            f"(only training.{', training.'.join(RESUMABLE_CHANGES)} may change on --resume); "
            "compare with its config.yaml, or start a new run under another name"
        )
    check_resume_data(cfg, state, pre)


def check_resume_data(
    cfg: ExperimentConfig, state: ckpt.ResumeState | None = None, pre: Preflight | None = None
) -> None:
    """``--resume`` trains on the data the resume state was trained on: the packed dataset
    the run continues on (``pre``'s, else the one ``cfg`` packs now) must have the fingerprint
    recorded in ``trainer.json`` (an input file edited in place gives another one). Without
    ``pre`` it is cheap (inputs are listed, nothing is packed), so the launcher calls it
    before packing; ``state`` None: read ``resume/trainer.json`` leniently (its full checks
    come later, in :func:`restart_state`). A finished run is not checked."""
    if state is None:
        try:
            state = ckpt.ResumeState.from_trainer_json(
                read_json(cfg.run_dir / ckpt.RESUME_DIR / ckpt.TRAINER_FILE)
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return
    recorded = state.data_fingerprint
    if not recorded or state.step >= cfg.training.steps:
        return  # written before data fingerprints were recorded, or nothing left to train
    if pre is not None:
        now, inputs = pre.manifest.get("fingerprint"), pre.manifest.get("inputs") or []
    else:
        now, inputs = dataset_identity(cfg)
    if now == recorded:
        return
    was = f" ({state.data_dir})" if state.data_dir else ""
    change = None
    if state.data_dir:
        try:
            change = input_change(read_json(Path(state.data_dir) / MANIFEST)["inputs"], inputs)
        except (OSError, ValueError, KeyError, TypeError):
            change = None
    sources = ", ".join(str(s.path) for s in cfg.data.sources)
    raise ResumeDataError(
        f"the resume state in {cfg.run_dir / ckpt.RESUME_DIR} was trained on the packed "
        f"dataset {recorded}{was}, but data.sources ({sources}) now pack to {now}"
        f"{f': {change}' if change else ' (an input file or the data config changed)'}; "
        "resuming would train its remaining steps on other data: restore the inputs, or start "
        "over with --force (or under another name)"
    )


def _prepare_run_dir(run: RunContext) -> None:
    cfg, par, pre, state = run.cfg, run.par, run.pre, run.state
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    _trim_metrics(run_dir / "metrics.jsonl", state.step)
    dump_config(cfg, run_dir / "config.yaml")
    atomic_write_json(
        run_dir / "manifest.json",
        base_manifest(
            seed=cfg.seed,
            variant=cfg.variant_name,
            attention=cfg.training.attention,
            data={
                "dir": str(pre.data_dir),
                "fingerprint": pre.manifest.get("fingerprint"),
                "manifest_sha256": sha256_file(pre.data_dir / "manifest.json"),
            },
            parallel=par.to_dict(),
            resumed_from=state.step if state.found else None,
            optimizer={
                "weight_decay": cfg.training.weight_decay,
                "weight_decay_on": cfg.training.weight_decay_on,
            },
            deterministic=determinism.record(cfg.training.deterministic),
            layout=_layout_record(cfg, par, run_dir),
        ),
    )


def _layout_record(cfg: ExperimentConfig, par: Parallelism, run_dir: Path) -> dict[str, Any]:
    """The layout the run trains with: SP × DP, ZeRO stage, DeepSpeed's communication settings
    and, when the layout plan chose them, its prediction and runners-up (memory_choice.json)."""
    record = {
        "sp": par.sp,
        "dp": par.dp,
        "zero_stage": par.zero_stage,
        "deepspeed_comm": comm_entries(cfg.training.comm, par.zero_stage),
    }
    chosen = run_dir / LAYOUT_RECORD
    if chosen.is_file():
        record["plan"] = read_json(chosen)
    return record


def _trim_metrics(path: Path, keep_through: int) -> None:
    """Metric rows after the resume point were computed again: keep only earlier ones."""
    rows = [r for r in read_jsonl(path) if r.get("step", 0) <= keep_through]
    if path.exists() or rows:
        atomic_write_text(path, "".join(_json_line(r) for r in rows))


def _json_line(row: dict) -> str:
    return json.dumps(row, default=str) + "\n"


def _setup_logging(path: Path, rank: int) -> None:
    """Rank 0 logs to stdout and ``train.log``; other ranks only warnings."""
    for handler in log.handlers:
        handler.close()
    log.handlers.clear()
    log.propagate = False
    if rank != 0:
        log.setLevel(logging.WARNING)
        log.addHandler(logging.StreamHandler(sys.stderr))
        return
    log.setLevel(logging.INFO)
    fmt = logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S")
    for handler in (logging.StreamHandler(sys.stdout), logging.FileHandler(path)):
        handler.setFormatter(fmt)
        log.addHandler(handler)


def _progress_bar(rank: int, start: int, total: int):
    if rank != 0 or not sys.stderr.isatty():
        return None  # piped output (launchers, CI) gets the per-step lines only
    return tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
