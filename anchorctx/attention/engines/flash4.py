"""``fa4``: FlashAttention-4 (``flash_attn.cute``, the ``flash-attn-4`` package) on Hopper and
Blackwell.

FA4's variable-length kernel computes bottom-right-aligned causal attention of each query
sequence over its key sequence, as torch's ``varlen_attn`` and FA2 do, so the ``varlen``
engine's plan (:mod:`.varlen`) describes every layout to it: one sequence per ``full`` row;
per document run, the earlier chunks of the same document gathered before it; for ``anchor``
rows, the anchor's K/V row gathered in front of every other document's keys.

Two ways of adding the anchor were measured (one H200, 2026-11-28,
docs/benchmarks/2026-11-28-attention-fa4.md) and the faster kept: this gather, and the
intra-document kernel with its log-sum-exp followed by a merge of the anchor key
(:func:`.merge.merge_anchor`). In the kernel benchmark they were within 4% of each other
(heavy-tailed 128K rows: 561 and 558 useful TFLOP/s); in the full-depth 7B training step (16K
tokens a GPU) the gather was 1.5% faster and 4 GiB lighter, since the merge keeps float32
tensors for its backward in every layer while the gathered K/V replace the K/V the kernel
would save anyway. A ``mask_mod`` (``doc[q] == doc[k] or k == 0``) is the third way the
package allows; it turns the causal tile schedule off and compiles per mask function, so it
was not built.

FA4 has no training kernels for SM80 (the paper's A100s): there ``flash_attn`` (FA2) is the
varlen engine to use. The package compiles each configuration on its first call (tens of
seconds; ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1`` keeps the result on disk for later
processes); later calls and layers reuse it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from anchorctx.attention.engines.base import AttentionCall, AutoRanks, Capabilities, Engine
from anchorctx.attention.engines.cost import TileCounts
from anchorctx.attention.engines.varlen import HALF, VarlenPlan, cached_plan, flatten, unflatten
from anchorctx.attention.errors import AttentionError

#: compute capabilities (major) with FA4 forward and backward kernels: Hopper, Blackwell
ARCHES = (9, 10)

# Cost rule (engines/cost.py), fitted on one H200 (docs/benchmarks/2026-11-28-attention-fa4.md):
# the kernel's time per visited tile against triton's U + ψ·n_q on the same six heavy-tailed,
# fixed-2K, web-and-books, one-book and tiny-document rows of 32K and 128K (within 2.4% on each):
# ν₄ per visited tile, λ₄ per query tile of anchor rows (the gathered anchor K/V and the
# scatter of their gradients).
NU4 = 0.65
LAMBDA4 = 2.34


def _kernel() -> Callable[..., Any]:
    # Imported here: flash-attn-4 is an optional CUDA package (see available()).
    from flash_attn.cute import flash_attn_varlen_func

    return flash_attn_varlen_func


@functools.cache
def import_problem() -> str | None:
    """Why FA4 does not import here (None: it does). Asked once per process: ``auto`` checks
    fa4 first on every attention call of every layer, and a failing import is not free."""
    try:
        _kernel()
    except Exception as err:  # ImportError, or the CuTe DSL failing to load its libraries
        return f"{type(err).__name__}: {err}"
    return None


def require_arch(engine: str, device: torch.device, instead: str) -> None:
    """FlashAttention-4's kernels exist for Hopper and Blackwell only: refuse another GPU,
    naming what to run ``instead``."""
    major, minor = torch.cuda.get_device_capability(device)
    if major not in ARCHES:
        raise AttentionError(
            f"engine {engine!r} runs FlashAttention-4, on Hopper and Blackwell (sm90, sm100); "
            f"this GPU is sm{major}{minor}: {instead}"
        )


def run_kernel(q, k, v, plan: VarlenPlan, scale: float) -> torch.Tensor:
    """FA4 over a varlen plan: q [N_q, H, D], k/v [N_k, H_kv, D] -> out [N_q, H, D]."""
    out, _ = _kernel()(
        q,
        k,
        v,
        cu_seqlens_q=plan.cu_seq_q,
        cu_seqlens_k=plan.cu_seq_k,
        max_seqlen_q=plan.max_q,
        max_seqlen_k=plan.max_k,
        softmax_scale=scale,
        causal=True,
        deterministic=torch.are_deterministic_algorithms_enabled(),
    )
    return out


class Fa4Engine(Engine):
    name = "fa4"
    alternative = "triton"
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        backward_devices=frozenset({"cuda"}),
        dtypes=HALF,
        max_head_dim=128,  # Blackwell's limit (Hopper's is 256): one declaration for both
        # The kernel's deterministic backward is asked for under torch's deterministic mode.
        deterministic_backward=frozenset({"cuda"}),
    )
    # Ahead of cuDNN on full rows: dense causal 600-610 against 536-547 TFLOP/s forward+backward
    # at 32K-128K; the 7B step at 16K tokens 2.7% faster (docs/benchmarks/2026-11-28-attention-fa4.md).
    auto = AutoRanks(full=5, mixed=5, masked=5)

    def cost(self, tiles: TileCounts) -> float:
        """``ν₄·U`` and the gathered anchor, ``λ₄·n_q``."""
        return NU4 * tiles.u + LAMBDA4 * tiles.n_q

    def available(self) -> tuple[bool, str]:
        problem = import_problem()
        if problem is not None:
            return False, (
                f"flash_attn.cute does not import ({problem}); "
                "pip install 'anchorctx[flash4]' on a Hopper or Blackwell machine"
            )
        return True, ""

    def check(self, call: AttentionCall) -> None:
        super().check(call)
        require_arch(self.name, call.q.device, "use engine='flash_attn' (FA2) or 'triton'")

    def forward(self, call: AttentionCall) -> torch.Tensor:
        plan = cached_plan(call)
        q, k, v = flatten(call, plan)
        return unflatten(run_kernel(q, k, v, plan, call.scale), call)
