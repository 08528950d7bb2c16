"""``training.kernels``: fused elementwise kernels for the decoder's RMSNorm and SwiGLU.

``torch`` (the default) keeps transformers' modules as they are. ``liger`` puts Liger-Kernel's
fused Triton kernels in their place on the model instance (transformers' source is untouched):
every RMSNorm becomes one kernel forward and one backward instead of the fp32 upcast, mean,
rsqrt, scale and cast that transformers runs as separate kernels, each reading and writing a
[T, hidden] tensor; the MLP's ``silu(gate) * up`` becomes one kernel instead of three over
[T, intermediate]. At 128K tokens these passes are memory-bound traffic of ~1 GB per [T, 4096]
bf16 tensor (docs/benchmarks/2026-11-22-training-step.md measures what fusing them saves). The
arithmetic is the same up to float rounding (the fused kernels keep the fp32 intermediates in
registers), so this is an option, off by default (docs/FIDELITY.md).

Liger-Kernel is an optional dependency for CUDA machines (``pip install liger-kernel``), like
flash-attn; it is not in the CPU lock.
"""

from __future__ import annotations

from anchorctx.training.plan import TrainingError
from anchorctx.training.tiling import decoder_layers

NORMS = ("input_layernorm", "post_attention_layernorm")


def use_kernels(model, kernels: str) -> int:
    """Apply ``training.kernels`` to ``model`` (before DeepSpeed wraps it); returns the modules
    changed."""
    if kernels == "torch":  # the config admits torch and liger
        return 0
    try:
        # Imported here: optional, CUDA only.
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
    except ImportError as err:
        raise TrainingError(
            "training.kernels=liger needs Liger-Kernel on a CUDA machine (pip install "
            f"liger-kernel): {err}"
        ) from err

    def fused_norm(old):
        eps = getattr(old, "variance_epsilon", None) or getattr(old, "eps", None)
        if eps is None or getattr(old, "weight", None) is None:
            raise TrainingError(f"training.kernels=liger: {type(old).__name__} is not an RMSNorm")
        # "llama" casting: normalise in fp32, cast to the input dtype, then scale by the weight,
        # as transformers' LlamaRMSNorm (and Mistral's, Qwen2's) does. The weight Parameter is
        # the model's own object, so loading, ZeRO partitioning and checkpoints see no change.
        new = LigerRMSNorm(old.weight.shape[0], eps=eps, casting_mode="llama", in_place=False)
        new.weight = old.weight
        return new

    def fused_swiglu(self, x):
        # x: [B, T, hidden] -> gate, up: [B, T, intermediate] -> [B, T, hidden]
        return self.down_proj(LigerSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))

    if model.config.get_text_config().hidden_act not in ("silu", "swish"):
        raise TrainingError("training.kernels=liger: the fused SwiGLU needs hidden_act silu")
    decoder = model.get_decoder()
    changed = 0
    if hasattr(decoder, "norm"):
        decoder.norm = fused_norm(decoder.norm)
        changed += 1
    classes: dict[type, type] = {}
    for layer in decoder_layers(model):
        for name in NORMS:
            setattr(layer, name, fused_norm(getattr(layer, name)))
            changed += 1
        mlp = layer.mlp
        # A subclass, not an instance attribute: tiled MLP (training.memory.tiled_mlp) runs the
        # class's forward inside each tile, so the two compose.
        cls = type(mlp)
        if cls not in classes:
            classes[cls] = type(f"Liger{cls.__name__}", (cls,), {"forward": fused_swiglu})
        mlp.__class__ = classes[cls]
        changed += 1
    return changed
