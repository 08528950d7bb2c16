"""Throughput, model FLOPs utilisation, memory, and the per-step log line.

MFU counts model FLOPs (PaLM convention, no activation recomputation): ``6·N`` per token for
the matmul parameters (everything but the input embedding) plus the attention matmuls that the
variant's mask allows: ``3 × 4·d·heads·pairs`` per layer (forward + 2× backward), where
``pairs`` is the number of allowed (query, key) pairs of each row — so a document-masked run is
credited only with the attention it really needs, not with dense causal work.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Dense bf16 tensor-core peaks (TFLOP/s) per device, by name fragment; most specific first.
PEAK_BF16_TFLOPS = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.4),
    ("H100", 989.4),
    ("H800", 989.4),
    ("H20", 148.0),
    ("L40S", 362.1),
    ("A100", 312.0),
    ("A800", 312.0),
    ("A10", 125.0),
)


def peak_tflops(device: str, precision: str, configured: float | None) -> float | None:
    if configured is not None:
        return configured
    if device != "cuda" or precision != "bf16":
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None)


def matmul_params(model: PreTrainedModel) -> int:
    """Parameters that take part in a matmul per token (all but the input embedding).

    ZeRO-3 partitions parameters; ``ds_numel`` keeps their full size."""
    total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    emb = model.get_input_embeddings().get_parameter("weight")
    return total - getattr(emb, "ds_numel", emb.numel())


def step_flops(n_matmul: int, tokens: int, attention_pairs: int, text_config) -> float:
    layers = text_config.num_hidden_layers
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    attention = 3 * 4.0 * head_dim * heads * attention_pairs * layers
    return 6.0 * n_matmul * tokens + attention


def peak_memory_gib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    # ru_maxrss is KiB on Linux, bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


@dataclass
class Throughput:
    """Step timing; the first timed step (warm-up, compilation) is left out of the ETA."""

    total_steps: int
    world: int
    peak: float | None
    start: float = field(default_factory=time.perf_counter)
    times: list[float] = field(default_factory=list)

    def record(self, dt: float, tokens: int, flops: float) -> dict[str, float | None]:
        self.times.append(dt)
        per_device_flops = flops / dt / self.world
        return {
            "step_time_s": round(dt, 4),
            "tokens_per_s": round(tokens / dt, 1),
            "tokens_per_s_per_device": round(tokens / dt / self.world, 1),
            # significant digits, not decimals: a tiny test model's MFU is ~1e-6, not zero
            "tflops_per_device": float(f"{per_device_flops / 1e12:.4g}"),
            "mfu": float(f"{per_device_flops / (self.peak * 1e12):.4g}") if self.peak else None,
            "elapsed_s": round(time.perf_counter() - self.start, 1),
        }

    def eta(self, step: int) -> float:
        recent = self.times[1:] or self.times
        return sum(recent) / len(recent) * (self.total_steps - step)


def step_line(row: dict, total: int, eta_s: float) -> str:
    """``step 12/2000 (0.6%) | loss 2.3456 | grad 0.812 | lr 2.00e-05 | ...`` (one per step)."""
    step = row["step"]
    parts = [
        f"step {step:>{len(str(total))}}/{total} ({100 * step / total:.1f}%)",
        f"loss {row['loss']:.4f}",
        f"grad {row['grad_norm']:.3f}" if row["grad_norm"] is not None else "grad n/a",
        f"lr {row['lr']:.2e}",
        f"tok/s {row['tokens_per_s']:,.0f}",
        f"mfu {100 * row['mfu']:.1f}%" if row["mfu"] is not None else "mfu n/a",
        f"mem {row['peak_mem_gib']:.1f}GiB",
        f"dt {row['step_time_s']:.2f}s",
        f"eta {format_duration(eta_s)}",
    ]
    return " | ".join(parts)
