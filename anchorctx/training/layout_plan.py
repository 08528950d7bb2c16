"""The run's layout, planned: the DP × SP split, the ZeRO stage and DeepSpeed's communication
settings, chosen together with ``training.memory``'s options from the memory and step-time models.

A step is ``accumulation`` micro-steps (one row on each data-parallel group) and the optimizer
step. A micro-step is the row's compute on each GPU (:func:`cost_plan.row_seconds`: matmuls at
the fitted rate, attention at the kernels' measured rates) plus the communication that compute
does not hide; the optimizer step adds the update and, under ZeRO-1/2, the gathering of the
updated weights. Communication, per GPU, in bus bytes (nccl-tests' convention: a collective of
``S`` bytes over ``N`` ranks moves ``S·(N−1)/N`` through each GPU's link):

- Ulysses' all-to-alls (SP > 1): q, k, v and the attention output of every layer, ``2·t·(2·Hq +
  2·Hkv)`` bytes, in the forward, again in the backward (their gradients) and once more for
  each recomputed layer; DeepSpeed runs them on the compute stream between the projections and
  attention, so nothing hides them (:data:`EXPOSED`).
- ZeRO-3's parameter gathers: the bf16 weights ``2P`` twice a micro-step (forward; backward,
  which reuses them for the recomputation), prefetched on a side stream.
- gradient reduce-scatter (ZeRO-2/3): ``2P`` a micro-step, overlapped with backward when
  ``overlap_comm`` is on.
- ZeRO-1/2's gather of the updated weights, ``2P`` a step, and the optimizer's update of the
  rank's ``P/N`` fp32 parameters at the GPU's memory bandwidth.

Each collective's time is ``latency + bus bytes / bandwidth`` (:class:`Link`), measured by
``bench/links.py`` (:data:`LINKS`). Within a node the GPUs' NVLink; across nodes
``training.comm.inter_node_gb_per_s`` (default :data:`INTER_NODE_GB_PER_S`), which the ZeRO
collectives over all ranks then run at, and Ulysses' too when an SP group spans nodes. The share
of each collective left exposed is fitted to the measured full-depth 7B steps
(docs/benchmarks/2026-11-28-layout-2gpu.md); :data:`EXPOSED` says what each value rests on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from anchorctx.training.memory import BF16, Shape
from anchorctx.training.settings import COMM_SETTINGS

# Stages the plan chooses among on GPUs. ZeRO-1 under bf16 runs DeepSpeed's BF16_Optimizer,
# which keeps whole fp32 gradients (4P bytes, 27 GB for a 7B model) on every GPU: more memory
# than ZeRO-2 for the same communication per step at one micro-step, so it never wins here.
STAGES = (2, 3)


@dataclass(frozen=True)
class Link:
    """One kind of collective on one kind of link: ``latency_s + bus_bytes / bandwidth``."""

    latency_s: float
    gb_per_s: float  # bus bandwidth of large messages

    def seconds(self, bus_bytes: float, calls: int = 1) -> float:
        return calls * self.latency_s + bus_bytes / (self.gb_per_s * 1e9)


@dataclass(frozen=True)
class Links:
    gather: Link  # all-gather and reduce-scatter within a node
    all_to_all: Link  # within a node
    hbm_gb_per_s: float  # the optimizer's update streams its state at this rate
    source: str


# bench/links.py on 2× H200 (NVLink 4, one host, 2026-11-28): all-gather 16 MB-1 GB fitted as
# 65 µs + bytes / 274 GB/s (the 64 MB and 256 MB calls within 4% and 9%), reduce-scatter the
# same within 3%, all-to-all 77 µs + bytes / 334 GB/s. HBM: the measured copy bandwidths
# (H200 4.25 TB/s, H100 3.00 TB/s; cost_plan's GPU notes). The H100 has the same NVLink 4.
# A100 (NVLink 3, 600 GB/s against 900 bidirectional): the H200's links scaled by 2/3, an
# estimate like the rest of the A100 plan.
LINKS = {
    "h200": Links(Link(65e-6, 274.0), Link(77e-6, 334.0), 4250.0, "bench/links.py, 2× H200"),
    "h100": Links(Link(65e-6, 274.0), Link(77e-6, 334.0), 3000.0, "2× H200's NVLink 4"),
    "a100-80g": Links(Link(65e-6, 183.0), Link(77e-6, 223.0), 1830.0, "estimate: NVLink 3"),
}
# Between nodes, per GPU: one 400 Gb/s InfiniBand NIC per GPU at the ~90% of line rate NCCL's
# ring collectives reach (training.comm.inter_node_gb_per_s overrides it). Not measured here.
INTER_NODE_GB_PER_S = 45.0
INTER_NODE_LATENCY_S = 20e-6

# What each collective costs the step, as a multiple of its bandwidth time above. Fitted by
# least squares, together with ULYSSES_CALL_S and LAYER_OVERHEAD_S, to 18 measured steps of the
# full-depth 7B shape on 2 and 4 H200s (SP 1, 2, 4; ZeRO-2 with and without overlap_comm,
# ZeRO-3; 8K and 16K tokens a GPU; docs/benchmarks/2026-11-28-layout-2gpu.md): 16 within 5%, the
# other two (4 GPUs, 8K a GPU, ZeRO-3) at -21% (anchor) and +9% (full).
EXPOSED = {
    "ulysses": 1.0,  # on the compute stream between the projections and attention
    # ZeRO-3's gathers cost 2.8× their bandwidth time: ~500 calls a step of a few MB each, which
    # NCCL runs on its low-latency protocol at a fraction of the link's bandwidth (the profile
    # of 2026-11-28: 492 all-gathers, RING_LL, 0.89 s of 1.9), and the prefetch hides little.
    "zero3_gather": 2.83,
    "grad_reduce": 1.0,  # overlap_comm off: each bucket reduced on the compute stream
    "grad_reduce_overlapped": 0.0,  # overlap_comm on: behind the rest of backward
    "param_gather": 1.0,  # after the update, before the next forward
    "optimizer": 1.0,
}
# Per all-to-all call beyond its bandwidth time (DeepSpeed's Ulysses: each q, k, v and output
# exchange is made contiguous, sent and waited for on the compute stream): fitted, 0.40 ms.
ULYSSES_CALL_S = 0.40e-3
# Per decoder layer and micro-step, what the one-GPU fit of 4 layers does not see of a
# full-depth step (DeepSpeed's per-module hooks, kernel launches): fitted, 89 ms over 32 layers.
LAYER_OVERHEAD_S = 0.089 / 32
# The optimizer's update per fp32 parameter: reads weight, gradient and two moments (16 bytes),
# writes weight and moments (12) and the bf16 copy (2).
UPDATE_BYTES = 30


@dataclass(frozen=True)
class Layout:
    """Where a step's rows and state go: ``gpus`` per node × ``nodes``, SP × DP, the ZeRO stage
    and whether ZeRO-2/3 overlap their gradient reduction."""

    gpus: int
    nodes: int
    sp: int
    zero: int
    overlap_comm: bool

    @property
    def world(self) -> int:
        return self.gpus * self.nodes

    @property
    def dp(self) -> int:
        return self.world // self.sp


def links_for(gpu: str, inter_node_gb_per_s: float | None = None) -> tuple[Links, Link]:
    """The GPU kind's links within a node and the link between nodes."""
    inter = Link(INTER_NODE_LATENCY_S, inter_node_gb_per_s or INTER_NODE_GB_PER_S)
    return LINKS.get(gpu, LINKS["h200"]), inter


def comm_seconds(
    shape: Shape, tokens: int, lay: Layout, recomputed: int, links: Links, inter: Link
) -> dict[str, float]:
    """Seconds of each collective, before overlap: per micro-step (``ulysses``, ``zero3_gather``,
    ``grad_reduce``, and the per-layer ``overhead``) and per optimizer step (``param_gather``,
    ``optimizer``). ``tokens``: the row; ``recomputed``: layers whose forward runs again in
    backward."""
    n, sp = lay.world, lay.sp
    p_bytes = shape.params * BF16
    ring = (n - 1) / n
    zero_link = links.gather if lay.nodes == 1 else inter
    out = dict.fromkeys(("ulysses", "zero3_gather", "grad_reduce", "param_gather"), 0.0)
    if sp > 1:
        t = tokens / sp
        q_width = shape.heads * (shape.head_dim or shape.hidden // shape.heads)
        per_layer = BF16 * t * (2 * q_width + 2 * shape.kv_width) * (sp - 1) / sp
        passes = 2 * shape.layers + recomputed  # forward, backward, recomputed forwards
        a2a = links.all_to_all if sp <= lay.gpus else inter
        calls = 4 * passes
        out["ulysses"] = a2a.seconds(per_layer * passes, calls=calls) + calls * ULYSSES_CALL_S
    if n > 1:
        if lay.zero >= 3:
            out["zero3_gather"] = zero_link.seconds(2 * p_bytes * ring, calls=4 * shape.layers)
        if lay.zero >= 2:
            out["grad_reduce"] = zero_link.seconds(p_bytes * ring)
        else:  # ZeRO-0/1: one all-reduce of the accumulated gradients a step (2× the bytes)
            out["param_gather"] += zero_link.seconds(2 * p_bytes * ring)
        if lay.zero <= 2:
            out["param_gather"] += zero_link.seconds(p_bytes * ring)
    out["optimizer"] = shape.params / n * UPDATE_BYTES / (links.hbm_gb_per_s * 1e9)
    out["overhead"] = LAYER_OVERHEAD_S * shape.layers
    return out


def overlap_of(comm_cfg: Any, zero: int) -> bool:
    """Whether ZeRO overlaps its gradient reduction: ``training.comm.overlap_comm``, else the
    plan's setting for the stage, else DeepSpeed's default (on at stage 3 only)."""
    if comm_cfg is not None and comm_cfg.overlap_comm is not None:
        return comm_cfg.overlap_comm
    return COMM_SETTINGS.get(zero, {}).get("overlap_comm", zero >= 3)


def exposed_parts(comm: dict[str, float], overlap_comm: bool) -> dict[str, float]:
    """Per micro-step seconds the compute does not hide, by collective (and the per-layer
    overhead); the optimizer step's own parts are ``param_gather`` and ``optimizer``."""
    reduce = EXPOSED["grad_reduce_overlapped" if overlap_comm else "grad_reduce"]
    return {
        "ulysses": EXPOSED["ulysses"] * comm["ulysses"],
        "zero3_gather": EXPOSED["zero3_gather"] * comm["zero3_gather"],
        "grad_reduce": reduce * comm["grad_reduce"],
        "overhead": comm["overhead"],
    }
