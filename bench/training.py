"""Training throughput on GPUs: full vs anchor attention, and Ulysses SP scaling.

Runs the real training step (DeepSpeed engine, registered attention, loss, optimiser step) on
a Llama-2-7B-wide model of reduced depth (hidden 4096, 32 heads, MLP 11008, vocab 32000) and
synthetic packed rows with heavy-tailed document lengths (no dataset needed).

One GPU, attention variants at several lengths (step time, tokens/s, MFU, peak memory):

    python bench/training.py --lengths 32768 65536 131072 --out training-1gpu.json

Sequence-parallel scaling at a fixed per-GPU load (SP = number of processes; compare with the
one-GPU numbers at the same per-GPU length). Give each rank its share of the host's cores, as
``anchorctx train`` does: torchrun's default of one thread a rank starves an offloaded
optimizer (docs/benchmarks/2026-11-27-sp2-512k-host-threads.md):

    OMP_NUM_THREADS=$(( $(nproc) / 4 )) torchrun --nproc-per-node 4 bench/training.py \
        --per-gpu-tokens 32768 --out sp4.json

Memory of a full-depth model: measure two depths and extrapolate linearly in depth
(``--layers 2 4 --extrapolate-layers 32``; assumption: per-layer memory — parameters, optimiser
state, checkpointed activations — is the same for every layer; embeddings, logits and the loss
are depth-independent and sit in the intercept).

Long rows (DeepSpeed's ALST pieces, ``training.memory``): a full-depth 7B shape, built on the GPU,
with tiled MLP and loss and the optimizer state in CPU memory; every row also prints the
per-component memory model's prediction beside the measured peak:

    python bench/training.py --layers 32 --lengths 262144 --variants anchor --steps 1 \
      --warmup 0 --init-on-device --tiled-mlp --tiled-loss --offload-optimizer

The model's predicted longest rows per machine (no GPU needed): ``--predict``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

# Multicast (NVLS) is unavailable on some hosts and NCCL then fails at init: keep it off.
for _k, _v in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from anchorctx.demo.synthetic import SMOKE, VOCAB, WIDTH_7B, synthetic_row  # noqa: E402
from anchorctx.experiment import config_from_dict, load_config  # noqa: E402
from anchorctx.models.loading import load_model  # noqa: E402
from anchorctx.training import cost_plan, determinism, layout_plan, memory_choice  # noqa: E402
from anchorctx.training import memory as MM  # noqa: E402
from anchorctx.training import metrics as M  # noqa: E402
from anchorctx.training.data import StepData, shard_rows  # noqa: E402
from anchorctx.training.engine import (  # noqa: E402
    build_engine,
    init_distributed,
    loss_scale,
    register_sequence_parallel,
    shutdown_distributed,
)
from anchorctx.training.kernels import use_kernels  # noqa: E402
from anchorctx.training.launch import cuda_allocator_settings  # noqa: E402
from anchorctx.training.loss import count_targets  # noqa: E402
from anchorctx.training.plan import plan_parallelism  # noqa: E402
from anchorctx.training.step import loss_function, train_step  # noqa: E402
from anchorctx.training.tiling import (  # noqa: E402
    apply_memory_options,
    enable_activation_checkpointing,
    init_context,
)

DEVICE = "cuda"


def model_width(args) -> dict:
    """The model's width: the smoke model, a config's ``model.tiny`` (``--shape-from``; its depth
    is ``--layers``), else Llama-2-7B's. ``--kv-heads`` overrides the key/value heads."""
    if args.smoke:
        width = {**SMOKE, "num_key_value_heads": min(args.kv_heads or 4, 4)}
    elif args.shape_from:
        tiny = load_config(args.shape_from).model.tiny
        if tiny is None:
            raise SystemExit(f"--shape-from {args.shape_from}: the config has no model.tiny")
        width = {k: getattr(tiny, k) for k in (*WIDTH_7B, "num_key_value_heads")}
    else:
        width = {**WIDTH_7B, "num_key_value_heads": 32}  # Llama-2-7B: multi-head attention
    if args.kv_heads and not args.smoke:
        width["num_key_value_heads"] = args.kv_heads
    return width


def parse_setup(text: str) -> dict:
    """``--setups`` entry: ``z<stage>`` then ``:field=value,...`` of ``training.comm``, e.g.
    ``z2:overlap_comm=true,reduce_bucket_size=2e8``; ``auto`` is the layout plan's own choice."""
    if text == "auto":
        return {"name": text, "zero_stage": None, "comm": {}}
    stage, _, rest = text.partition(":")
    if not (stage.startswith("z") and stage[1:].isdigit()):
        raise SystemExit(f"--setups {text}: expected z<stage>[:field=value,...] or auto")
    comm = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        low = value.lower()
        comm[key] = low == "true" if low in ("true", "false") else int(float(value))
    return {"name": text, "zero_stage": int(stage[1:]), "comm": comm}


def make_config(args, layers: int, seq_len: int, world: int, setup: dict | None = None):
    setup = setup or {"zero_stage": args.zero_stage, "comm": {}}
    sp = args.sp or world
    # sp "auto": the layout plan's probe, over a batch that every data-parallel size divides;
    # --rows-per-step: that many rows, accumulated; else one row per data-parallel group.
    batch = world if sp == "auto" else args.rows_per_step or world // sp
    raw = {
        "name": "bench",
        "run_root": "/tmp/anchorctx-bench",
        "seed": 0,
        "model": {
            "tiny": {
                "architecture": "llama",
                **model_width(args),
                "num_hidden_layers": layers,
                "vocab_size": VOCAB,
            },
            "tokenizer": "unused",
            "dtype": "bfloat16",
            "rope_theta": 1e7,
        },
        "data": {"seq_len": seq_len},
        "training": {
            "device": DEVICE,
            "engine": args.engine,
            "kernels": args.kernels,
            "deterministic": args.deterministic,
            "precision": "bf16",
            "zero_stage": setup["zero_stage"],
            "comm": setup["comm"],
            "activation_checkpointing": True,
            "sequence_parallel": sp,
            "nproc": world,
            "micro_batch_size": 1,
            "global_batch_size": batch,
            "steps": args.steps,
            "memory": memory_options(args),
        },
    }
    return config_from_dict(raw)


MEMORY_FLAGS = (
    "tiled_mlp",
    "tiled_loss",
    "offload_optimizer",
    "offload_checkpoints",
    "init_on_device",
    "pin_offload",
)


def memory_options(args) -> dict:
    """``training.memory`` from the command line: the flags and ``--keep-activations``; with
    ``--defaults``, ``auto`` on (the flags are then options auto must keep)."""
    return {
        **{k: getattr(args, k) for k in MEMORY_FLAGS},
        "keep_activations": args.keep_activations,
        "auto": args.defaults,
    }


def launch_defaults(configs: dict, world: int, rank: int, variant: str) -> dict:
    """``training.memory.auto``'s choice for this host's GPU, by the launcher's own function
    (what ``anchorctx train`` runs by default), for rows of ``variant`` (the first measured:
    a document mask's cheaper attention can choose another layout than full attention's)."""
    chosen = {}
    for n, cfg in configs.items():
        cfg = cfg.model_copy(
            update={"training": cfg.training.model_copy(update={"attention": variant})}
        )
        chosen[n], _, note = memory_choice.for_launch(cfg, world, 1)
        if rank == 0:
            print(f"{n} layers: {note}", flush=True)
    return chosen


def load(cfg, device: str = "cpu"):
    """On the CPU unless ``training.memory.init_on_device``: a depth waiting for its turn must
    not sit in GPU memory during another depth's measurement (it would bias the per-layer
    memory slope), so on-device models are built only when their turn comes."""
    with init_context(cfg, device):
        model = load_model(cfg.model, seq_len=cfg.data.seq_len, dtype="bfloat16", device=device)
    use_kernels(model, cfg.training.kernels)
    enable_activation_checkpointing(model)
    apply_memory_options(model, cfg.training.memory)
    return model.train()


def step_data(seq_len: int, variant: str, par, rank: int, seed: int, rows: int) -> StepData:
    """This rank's shards of its data-parallel group's rows, one micro-step each, with the
    global batch's totals. The step holds ``rows`` rows (seeds ``seed`` to ``seed + rows - 1``),
    group ``g`` the ``g``-th run of ``rows / dp`` of them: layouts measured with the same
    ``rows`` train on the same rows (heavy-tailed rows differ in attention work)."""
    from anchorctx.attention import build_layout

    if rows % par.dp:
        raise SystemExit(
            f"--rows-per-step {rows}: not a multiple of the {par.dp} data-parallel groups"
        )
    every = [
        synthetic_row(seq_len, variant, seed=seed + i, vocab=VOCAB, sp=par.sp) for i in range(rows)
    ]
    k = rows // par.dp
    group = rank // par.sp
    device = f"cuda:{torch.cuda.current_device()}" if DEVICE == "cuda" else "cpu"
    mbs = [
        shard_rows([row], variant, par.sp, rank % par.sp, device)
        for row in every[group * k : (group + 1) * k]
    ]
    targets = sum(count_targets(r.targets) for r in every)
    tokens = sum(r.real_tokens for r in every)
    pairs = sum(build_layout(r.seg_lens, variant, r.seg_doc).attended_pairs for r in every)
    return StepData(mbs, targets, tokens, pairs)


class PhaseTimes:
    """``--breakdown``: wall seconds of the DeepSpeed engine's ``backward`` and ``step`` and of
    the optimizer's own update inside ``step``, each between device synchronisations. The
    instance's methods are wrapped (DeepSpeed looks them up at call time), nothing is patched
    in DeepSpeed. What each phase holds under ZeRO-3: ``backward`` the recomputed forward of
    every checkpointed layer, the gradients, their reduce-scatter and, with an offloaded
    optimizer, the gradients' copy to host memory; ``step`` the norm and clipping, the update
    and the updated bf16 weights' copy back to the GPU; the forward with the loss is what the
    step leaves."""

    def __init__(self, engine, sync) -> None:
        self.totals = {"backward": 0.0, "step": 0.0, "update": 0.0}
        self._sync = sync
        self._wrap(engine, "backward", "backward")
        self._wrap(engine, "step", "step")
        # ZeRO wraps the basic optimizer (DeepSpeedCPUAdam, torch's AdamW) as `.optimizer`.
        self._wrap(getattr(engine.optimizer, "optimizer", engine.optimizer), "step", "update")

    def _wrap(self, owner, attr: str, phase: str) -> None:
        inner = getattr(owner, attr)

        def timed(*args, **kwargs):
            self._sync()
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._sync()
                self.totals[phase] += time.perf_counter() - t0

        setattr(owner, attr, timed)

    def take(self, step_s: float) -> dict[str, float]:
        """This step's phases (and the forward with the loss, the rest), then zero them."""
        out = {"forward_and_loss": step_s - self.totals["backward"] - self.totals["step"]}
        out |= self.totals
        self.totals = dict.fromkeys(self.totals, 0.0)
        return out


# GPU kernels by what they compute, matched on the kernel's name (first match wins). cuBLAS on
# Hopper names its GEMMs nvjet_* and sm90_xmma_*; cuDNN's attention is cudnn_generated_fort_*;
# fwd_kernel and bwd_kernel are the project's Triton attention kernels
# (anchorctx.attention.engines.triton_kernels); at::native's are torch's own elementwise ones.
KERNEL_KINDS = (
    ("copy host<->device", ("memcpy htod", "memcpy dtoh")),
    ("copy on device", ("memcpy dtod", "memset")),
    (
        "attention",
        ("flash", "fmha", "attn", "sdpa", "cudnn_generated_fort", "fwd_kernel", "bwd_kernel"),
    ),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "cublas")),
    ("communication", ("nccl",)),
    ("elementwise and reductions", ("at::native", "elementwise", "reduce", "vectorized")),
    ("fused (triton)", ("triton", "_kernel")),
)


HOST_WAITS = ("Synchronize", "_local_scalar_dense", "cudaMemcpy")


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, marks in KERNEL_KINDS:
        if any(m in low for m in marks):
            return kind
    return "other"


# The plan's attention rates for an engine named on the command line (auto: the plan's own pick).
PLAN_ATTENTION = {"fa4": "fa4", "triton": "cudnn-triton", "sdpa": "cudnn-triton"}


COLLECTIVES = (
    "AllToAll",
    "SendRecv",
    "ReduceScatter",
    "AllGather",
    "AllReduce",
    "Reduce",
    "Broadcast",
)


def collective_of(name: str) -> str:
    """NCCL kernel name -> its collective (``ncclDevKernel_AllGather_RING_LL`` -> AllGather);
    all-to-all runs as send/receive kernels."""
    for c in COLLECTIVES:
        if c.lower() in name.lower():
            return "AllToAll" if c == "SendRecv" else c
    return "other"


def exposed_communication(events) -> dict[str, float]:
    """Seconds in which a collective's kernel runs while no compute kernel does, by collective,
    and the step's GPU span and the compute kernels' busy time. Kernel time of a collective
    includes waiting for the other ranks, so its sum says little; what no compute overlaps is
    what the step pays for it (or for a straggler)."""
    import bisect

    spans: list[tuple[float, float]] = []
    comm: list[tuple[str, float, float]] = []
    for e in events:
        if str(e.device_type).rsplit(".", 1)[-1] != "CUDA" or e.is_user_annotation:
            continue  # ranges such as ``nccl:all_reduce`` are annotations: their kernels count
        a, b = e.time_range.start, e.time_range.end
        if "nccl" in e.name.lower():
            comm.append((collective_of(e.name), a, b))
        else:
            spans.append((a, b))
    if not spans:
        return {}
    spans.sort()
    merged = [list(spans[0])]
    for a, b in spans[1:]:
        if a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    starts = [m[0] for m in merged]

    def uncovered(a: float, b: float) -> float:
        """Length of [a, b] outside the merged compute spans."""
        free, i = b - a, max(bisect.bisect_right(starts, a) - 1, 0)
        while i < len(merged) and merged[i][0] < b:
            lo, hi = max(a, merged[i][0]), min(b, merged[i][1])
            free -= max(0.0, hi - lo)
            i += 1
        return free

    out: dict[str, float] = {}
    comm.sort(key=lambda c: c[1])
    last = -float("inf")
    for kind, a, b in comm:  # overlapping collectives: each moment counted once
        a = max(a, last)
        if b > a:
            out[kind] = out.get(kind, 0.0) + uncovered(a, b)
            last = b
    first = min([m[0] for m in merged] + [c[1] for c in comm])
    end = max([m[1] for m in merged] + [c[2] for c in comm])
    busy = sum(b - a for a, b in merged)
    res = {k: round(v / 1e6, 4) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}
    return {**res, "gpu_span": round((end - first) / 1e6, 4), "compute_busy": round(busy / 1e6, 4)}


def profiled_step(engine, data, par, scale, loss_fn, rank: int) -> dict[str, float]:
    """``--profile``: one more step under torch's profiler; seconds of GPU time by kernel kind
    (kernels of different streams may overlap, so the kinds can sum past the step's wall time).
    Rank 0 prints the 25 costliest kernels and the sums."""
    from torch.profiler import DeviceType, ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA, ProfilerActivity.CPU]
    with profile(activities=activities) as prof:  # host RAM: the offload fills it
        train_step(engine, data, par.engine, scale, loss_fn)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    # Host waits on the device: each one stops the host from queueing ahead, so ZeRO-3's
    # prefetched gathers (issued by the host in module hooks) cannot run ahead of compute.
    waits = {
        e.key: e.count
        for e in events
        if e.device_type == DeviceType.CPU and any(m in e.key for m in HOST_WAITS)
    }
    if rank == 0:
        print(f"  host waits on the device: {json.dumps(waits)}", flush=True)
    by_kind: dict[str, float] = {}
    for e in kernels:
        kind = kernel_kind(e.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + e.self_device_time_total / 1e6
    out = {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}
    exposed = exposed_communication(prof.events())
    if rank == 0:
        print(f"  exposed communication (no compute kernel running): {json.dumps(exposed)}")
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:25]:
            print(
                f"  {e.self_device_time_total / 1e6:8.3f} s {e.count:7d}x  "
                f"[{kernel_kind(e.key)}] {e.key[:110]}",
                flush=True,
            )
        print("  GPU time by kind: " + json.dumps(out), flush=True)
    return {**out, "host_waits": sum(waits.values()), "exposed": exposed}


def alloc_retries() -> int | None:
    """The caching allocator's retries since the process began: each one is a failed cudaMalloc
    answered by freeing the cache and trying again (a device synchronisation), the cost of a
    step that runs at the memory's edge."""
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if DEVICE == "cuda" else None


def alloc_retries_note() -> str:
    n = alloc_retries()
    return f", {n} allocator retries so far" if n else ""


def median_phases(steps: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(s[k] for s in steps), 4) for k in steps[0]}


def measure(engine, par, variant: str, seq_len: int, rank: int, args, cfg) -> dict:
    rows = args.rows_per_step or par.dp
    data = step_data(seq_len, variant, par, rank, seed=args.seed, rows=rows)
    scale = loss_scale(engine, par)
    loss_fn = loss_function(cfg.training.memory.tiled_loss)
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    phases = PhaseTimes(engine, sync) if args.breakdown else None
    times, phase_times = [], []
    for i in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        stats = train_step(engine, data, par.engine, scale, loss_fn)
        sync()
        step_s = time.perf_counter() - t0
        split = phases.take(step_s) if phases else None
        if i >= args.warmup:
            times.append(step_s)
            if split:
                phase_times.append(split)
        if split and rank == 0:
            print("  phases: " + ", ".join(f"{k} {v:.2f} s" for k, v in split.items()), flush=True)
        if rank == 0:  # long full-depth steps: each one is on record even if a later one fails
            print(
                f"step {i + 1}: {time.perf_counter() - t0:.2f} s, loss {stats.loss:.4f}, "
                f"peak {M.peak_memory_gib(DEVICE):.1f} GiB{alloc_retries_note()}",
                flush=True,
            )
    gpu_by_kind = None
    if args.profile and DEVICE == "cuda":
        gpu_by_kind = profiled_step(engine, data, par, scale, loss_fn, rank)
    dt = statistics.median(times)
    text = engine.module.config.get_text_config()
    flops = M.step_flops(
        M.matmul_params(engine.module), data.global_tokens, data.attention_pairs, text
    )
    peak = M.peak_tflops(DEVICE, "bf16", args.peak_tflops)
    per_gpu = flops / dt / par.world
    mem = cfg.training.memory
    opts = MM.Options.of_run(cfg.training, par.world, par.sp, par.zero_stage)
    shape = MM.Shape.from_hf(text)
    predicted = MM.summary(MM.predict(shape, seq_len, opts))
    predicted_step = floor = None
    row_pairs = data.attention_pairs / rows if variant != "full" else None  # full: T²/2
    if DEVICE == "cuda":  # the plan's step for this GPU, layout and options, these rows
        kind = memory_choice.gpu_kind(torch.cuda.get_device_name(), 0.0)
        predicted_step = cost_plan.step_seconds(
            shape,
            seq_len,
            variant,
            opts,
            kind,
            overlap_comm=layout_plan.overlap_of(cfg.training.comm, par.zero_stage),
            accum=rows // par.dp,
            pairs=row_pairs,
            attention=PLAN_ATTENTION.get(par.engine),  # auto: what auto runs here
        )
        # The floor: these rows' compute alone at the plan's rates (matmuls at the fitted rate,
        # attention at the measured kernels'), every layer kept, nothing communicated.
        floor = (rows // par.dp) * cost_plan.row_seconds(
            shape,
            seq_len,
            variant,
            opts,
            kind,
            checkpointing=False,
            pairs=row_pairs,
            attention=PLAN_ATTENTION.get(par.engine),
        )
    return {
        "layers": text.num_hidden_layers,
        "sp": par.sp,
        "seq_len": seq_len,
        "variant": variant,
        "engine": par.engine,
        "kernels": cfg.training.kernels,
        "deterministic": cfg.training.deterministic,
        "zero_stage": par.zero_stage,
        "step_time_s": round(dt, 4),
        "dp": par.dp,
        "rows_per_step": rows,
        "setup": cfg.training.comm.model_dump(exclude_none=True),
        "tokens_per_s": round(seq_len * rows / dt, 1),
        "tokens_per_s_per_gpu": round(seq_len * rows / dt / par.world, 1),
        "tflops_per_gpu": round(per_gpu / 1e12, 1),
        "mfu": round(per_gpu / (peak * 1e12), 4) if peak else None,
        "peak_mem_gib": round(M.peak_memory_gib(DEVICE), 2),
        "alloc_retries": alloc_retries(),
        "predicted_peak_gib": predicted["peak"],
        "predicted_step_s": round(predicted_step, 3) if predicted_step else None,
        "floor_step_s": round(floor, 3) if floor else None,
        "predicted": predicted,
        "host_max_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1),
        "memory": mem.model_dump(),
        "step_times_s": [round(t, 4) for t in times],
        "phases_s": median_phases(phase_times) if phase_times else None,
        "gpu_seconds_by_kind": gpu_by_kind,
        "last_loss": round(stats.loss, 4),  # a real step: finite, ≈ ln(vocab) on random tokens
    }


def run(args) -> list[dict]:
    """Every depth's rows; with ``--deterministic`` inside the training loop's own deterministic
    mode (torch's deterministic algorithms, cuDNN without autotuning, cuBLAS' fixed workspace)."""
    with determinism.deterministic_mode(args.deterministic, args.seed):
        return _run(args)


def _run(args) -> list[dict]:
    # The launcher's allocator setting (unless set) is read at the first CUDA allocation: first.
    note = cuda_allocator_settings(DEVICE, os.environ) if args.defaults else None
    if note and os.environ.get("RANK", "0") == "0":  # every rank sets it; rank 0 says so
        print(note, flush=True)
    rank, world, local_rank = init_distributed(DEVICE)
    # Ulysses fixes the sequence length at registration (once per process): SP runs measure
    # one length; one-GPU runs measure all of them.
    planned = args.sp == "auto"
    if planned:  # rows of --lengths' first value, split as the layout plan splits them
        args.sp = plan_sp(args, world, rank)
        # the plan's batch: a row per GPU, whatever the split (so the step is whole: its
        # micro-steps and the optimizer step, and every layout trains on the same rows)
        args.rows_per_step = args.rows_per_step or world
    sp = args.sp or world
    if world % sp:
        raise SystemExit(f"--sp {sp} does not divide the {world} processes")
    # Rows of per-GPU-tokens × SP tokens (one per data-parallel group); one GPU: every length.
    if planned:
        lengths = [args.lengths[0]]
    else:
        lengths = [args.per_gpu_tokens[0] * sp] if world > 1 else args.lengths
    setups = [parse_setup(x) for x in args.setups] if args.setups else [None]
    if args.init_on_device and world > 1 and len(args.layers) > 1:
        raise SystemExit("--init-on-device with several processes measures one depth (--layers N)")
    # On-device models are built when their turn comes (one depth when SP > 1), so a depth
    # waiting for its turn does not sit in GPU memory.
    results = []
    try:
        for setup in setups:
            configs = {n: make_config(args, n, max(lengths), world, setup) for n in args.layers}
            if args.defaults and DEVICE == "cuda":
                configs = launch_defaults(configs, world, rank, args.variants[0])
            results += _measure_setup(args, configs, world, rank, local_rank, lengths, setup)
    finally:
        shutdown_distributed()
    return results if rank == 0 else []


def plan_sp(args, world: int, rank: int) -> int:
    """``--sp auto``: the SP degree the layout plan chooses for rows of ``--lengths``' first
    value on this host's GPUs (the launcher's own function), the variants' first."""
    args.sp = "auto"
    probe = make_config(
        args, args.layers[0], args.lengths[0], world, {"zero_stage": None, "comm": {}}
    )
    variant = args.variants[0]
    probe = probe.model_copy(
        update={"training": probe.training.model_copy(update={"attention": variant})}
    )
    _, choice, note = memory_choice.for_launch(probe, world, 1)
    if rank == 0:
        print(f"--sp auto ({variant}): {note}", flush=True)
    return choice.options.sp if choice else 1


def _measure_setup(args, configs, world, rank, local_rank, lengths, setup) -> list[dict]:
    """Every depth and variant of one engine setup (ZeRO stage and communication settings);
    each depth's engine is freed before the next is built."""
    par = plan_parallelism(configs[args.layers[0]], world=world)
    device = f"cuda:{local_rank}" if DEVICE == "cuda" else "cpu"
    t0 = time.perf_counter()
    models = {n: None if args.init_on_device else load(cfg) for n, cfg in configs.items()}
    results = []
    for n in args.layers:
        model = models.pop(n)
        model = load(configs[n], device) if model is None else model
        # One Ulysses wrapper (and mpu) per process, selected on each model.
        mpu = register_sequence_parallel(model, par, lengths[0])
        engine = build_engine(model.to(device), configs[n], par, mpu)
        ready_s = time.perf_counter() - t0  # model built and inside DeepSpeed
        name = setup["name"] if setup else f"z{par.zero_stage}"
        if rank == 0:
            print(f"{n} layers, {name}: engine ready after {ready_s:.1f} s", flush=True)
        for seq_len in lengths:
            for variant in args.variants:
                results.append(measure(engine, par, variant, seq_len, rank, args, configs[n]))
                results[-1]["engine_ready_s"] = round(ready_s, 1)
                results[-1]["setup_name"] = name
                if rank == 0:
                    print(json.dumps(results[-1]), flush=True)
        del engine, model
        gc.collect()  # engines hold reference cycles; free this one before the next
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        t0 = time.perf_counter()
    return results


def table(results: list[dict]) -> str:
    head = (
        "| layers | SP × DP | setup | seq_len | variant | engine | step s | tok/s | tok/s/GPU "
        "| TFLOP/s/GPU | MFU | peak GiB | predicted GiB | plan's step s | floor s |\n"
        "|---:|---:|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    rows = [
        f"| {r['layers']} | {r['sp']} × {r['dp']} | {r['setup_name']} | {r['seq_len']} | "
        f"{r['variant']} | {r['engine']} | "
        f"{r['step_time_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s_per_gpu']:,.0f} | "
        f"{r['tflops_per_gpu']:.0f} | "
        + (f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a")
        + f" | {r['peak_mem_gib']:.1f} | {r['predicted_peak_gib']:.1f} | "
        + (f"{r['predicted_step_s']:.3f} |" if r.get("predicted_step_s") else "n/a |")
        + (f" {r['floor_step_s']:.3f} |" if r.get("floor_step_s") else " n/a |")
        for r in results
    ]
    return "\n".join([head, *rows])


def speedups(results: list[dict]) -> str:
    """Anchor (and the other variants) step time over full attention's, per depth and length."""
    out = [
        "| layers | SP × DP | setup | seq_len | variant | step time / full | floor |",
        "|---:|---:|---|---:|---|---:|---:|",
    ]
    for r in results:
        full = next(
            (
                f
                for f in results
                if f["variant"] == "full"
                and all(f[k] == r[k] for k in ("seq_len", "layers", "setup_name", "sp", "dp"))
            ),
            None,
        )
        if full and r["variant"] != "full":
            ratio = r["step_time_s"] / full["step_time_s"]
            floor = (
                f"{r['floor_step_s'] / full['floor_step_s']:.3f}"
                if r.get("floor_step_s") and full.get("floor_step_s")
                else "n/a"
            )
            out.append(
                f"| {r['layers']} | {r['sp']} × {r['dp']} | {r['setup_name']} | {r['seq_len']} | "
                f"{r['variant']} | {ratio:.3f} | {floor} |"
            )
    return "\n".join(out)


def extrapolate(results: list[dict], target_layers: int) -> list[dict]:
    """Linear fit of peak memory in depth between the two smallest measured depths."""
    out = []
    for r in results:
        same = sorted(
            (x for x in results if x["seq_len"] == r["seq_len"] and x["variant"] == r["variant"]),
            key=lambda x: x["layers"],
        )
        if len(same) < 2 or r is not same[0]:
            continue
        a, b = same[0], same[1]
        per_layer = (b["peak_mem_gib"] - a["peak_mem_gib"]) / (b["layers"] - a["layers"])
        est = b["peak_mem_gib"] + per_layer * (target_layers - b["layers"])
        out.append(
            {
                "seq_len": r["seq_len"],
                "variant": r["variant"],
                "sp": r["sp"],
                "per_layer_gib": round(per_layer, 3),
                "layers": target_layers,
                "estimated_peak_gib": round(est, 1),
            }
        )
    return out


def predictions() -> str:
    """The memory model's longest row per machine (SP = GPUs, one row per step, tiled MLP and
    loss, optimizer offload; with and without checkpoint offload)."""
    out = ["| model | machine | max tokens | + checkpoint offload |", "|---|---|---:|---:|"]
    for name, shape in (("Llama-2-7B", MM.LLAMA2_7B), ("Llama-3-8B", MM.LLAMA3_8B)):
        for m in MM.MACHINES:
            opt = MM.Options(
                gpus=m.gpus, sp=m.gpus, tiled_mlp=True, tiled_loss=True, offload_optimizer=True
            )
            off = MM.Options(**{**opt.__dict__, "offload_checkpoints": True})
            out.append(
                f"| {name} | {m.name} | {MM.max_seq_len(shape, opt, m):,} | "
                f"{MM.max_seq_len(shape, off, m):,} |"
            )
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    p.add_argument(
        "--per-gpu-tokens",
        type=int,
        nargs="+",
        default=[32768],
        help="SP runs (torchrun): sequence length = this × SP (first value).",
    )
    p.add_argument("--variants", nargs="+", default=["full", "anchor"])
    p.add_argument("--layers", type=int, nargs="+", default=[4])
    p.add_argument(
        "--kv-heads",
        type=int,
        default=None,
        help="Key/value heads (default: the shape's; Llama-2-7B has 32, multi-head attention).",
    )
    p.add_argument(
        "--shape-from",
        type=Path,
        default=None,
        metavar="CONFIG",
        help="Measure the width of CONFIG's model.tiny (hidden, MLP, heads, key/value heads) "
        "instead of Llama-2-7B's, e.g. configs/gpu-small.yaml; the depth is --layers, the "
        "vocabulary the synthetic rows' 32000.",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="Time the step's phases apart (forward with the loss, backward, optimizer step and, "
        "within it, the optimizer's own update): a device synchronisation at each phase "
        "boundary, so the step time of these rows carries them.",
    )
    p.add_argument("--engine", default="auto")
    p.add_argument(
        "--kernels",
        default="torch",
        choices=["torch", "liger"],
        help="training.kernels: RMSNorm and SwiGLU as transformers' modules or "
        "Liger-Kernel's fused kernels.",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="After the timed steps, one more step under torch's profiler: GPU seconds by "
        "kernel kind (matmul, attention, fused, copies host<->device, ...) and the costliest "
        "kernels. Not in the step time.",
    )
    p.add_argument(
        "--zero-stage",
        type=int,
        default=None,
        help="training.zero_stage (default: the launcher's, anchorctx.training.plan."
        "default_zero_stage: 3, or 2 on one GPU with an offloaded optimizer).",
    )
    p.add_argument(
        "--sp",
        type=lambda v: v if v == "auto" else int(v),
        default=None,
        help="Sequence-parallel degree (default: every process); the data-parallel groups "
        "(processes / SP) each read a row of their own, so a step is processes / SP rows. "
        "auto: the layout plan's choice for rows of --lengths' first value and the first of "
        "--variants (as anchorctx train chooses); a step is then one row per process "
        "(--rows-per-step's default), accumulated as the plan's batch is.",
    )
    p.add_argument(
        "--setups",
        nargs="+",
        default=None,
        metavar="SETUP",
        help="Engine setups measured one after another in this process: z<stage> then "
        "optional training.comm fields (z3, z2:overlap_comm=true,reduce_bucket_size=2e8), or "
        "auto (the layout plan's choice). Default: one, --zero-stage's.",
    )
    p.add_argument(
        "--rows-per-step",
        type=int,
        default=None,
        help="Rows a step trains on, accumulated over rows / DP micro-steps (default: one row "
        "per data-parallel group). Give layouts of different DP the same rows to compare them "
        "on the same data: heavy-tailed rows differ in attention work.",
    )
    p.add_argument("--steps", type=int, default=3, help="Timed steps (median reported).")
    p.add_argument("--warmup", type=int, default=2, help="Untimed steps (compilation).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="training.deterministic: deterministic kernels (and engines with a deterministic "
        "backward), as a reproducible run trains.",
    )
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--extrapolate-layers", type=int, default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="Tiny model on CPU (checks the script).")
    for flag in MEMORY_FLAGS:
        p.add_argument(
            "--" + flag.replace("_", "-"), action="store_true", help=f"training.memory.{flag}"
        )
    p.add_argument(
        "--keep-activations",
        type=int,
        default=0,
        metavar="N",
        help="training.memory.keep_activations: the last N layers are not "
        "checkpointed (selective activation checkpointing).",
    )
    p.add_argument(
        "--defaults",
        action="store_true",
        help="Run what a training launch runs by default: PYTORCH_CUDA_ALLOC_CONF="
        "expandable_segments:True (unless set) and training.memory.auto's choice for this GPU "
        "and host (printed; the memory flags above are options it must keep).",
    )
    p.add_argument(
        "--predict",
        action="store_true",
        help="Print the memory model's longest rows per machine and exit.",
    )
    args = p.parse_args()
    if args.predict:
        print(predictions())
        return 0
    if args.smoke:
        global DEVICE
        DEVICE = "cpu"
        args.engine, args.zero_stage = "sdpa", 0
    results = run(args)
    if not results:
        return 0
    print("\n" + table(results) + "\n\n" + speedups(results))
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    report = {"device": device, "world": results[0]["sp"], "results": results}
    if args.extrapolate_layers:
        report["memory_extrapolation"] = extrapolate(results, args.extrapolate_layers)
        print("\nPeak memory extrapolated linearly in depth:")
        for e in report["memory_extrapolation"]:
            print(
                f"  {e['layers']} layers, SP={e['sp']}, {e['seq_len']} tokens, {e['variant']}: "
                f"{e['estimated_peak_gib']} GiB/GPU ({e['per_layer_gib']} GiB per layer)"
            )
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
