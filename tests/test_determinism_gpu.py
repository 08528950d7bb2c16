"""GPU check of every engine's declared deterministic backward (``pytest -m gpu``).

Under torch's deterministic mode (``training.deterministic``), each engine that declares a
deterministic backward on CUDA runs forward and backward twice on the same bf16 inputs, and
both runs' output and gradients must be bit-identical. The rows are long enough (16K tokens,
GQA) that kernels splitting the key axis over thread blocks would do so, and heavy-tailed
documents in chunks, so the anchor's column and the document tiles both carry work. SDPA on
document-masked rows gets 4K: under the deterministic mode it runs them in its math kernel,
whose [T, T] scores per head would not fit at 16K (32 GiB for 32 heads).
"""

from __future__ import annotations

import random

import pytest
import torch

from anchorctx.attention import VARIANTS, attend, build_layout
from anchorctx.attention.engines import ENGINES
from anchorctx.training.determinism import deterministic_mode

pytestmark = pytest.mark.gpu

T = 16384
T_DENSE = 4096  # sdpa with a mask (see above)
DECLARED = [
    name
    for name, engine in ENGINES.items()
    if "cuda" in engine.capabilities.deterministic_backward and engine.available()[0]
]


def _layout(variant: str, t: int):
    rng = random.Random(0)
    lens = []
    while sum(lens) < t:
        lens.append(min(t - sum(lens), max(1, int(rng.lognormvariate(6.5, 1.3)))))
    docs = [rng.randrange(max(1, len(lens) // 2)) for _ in lens]
    return build_layout(lens, variant, seg_doc=docs, device="cuda")


def _once(engine: str, layout, q, k, v, grad) -> list[torch.Tensor]:
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = attend(*leaves, layout, engine=engine)
    out.backward(grad)
    return [out.detach(), *(x.grad for x in leaves)]


@pytest.mark.parametrize("engine", DECLARED)
@pytest.mark.parametrize("variant", VARIANTS)
def test_declared_deterministic_backward_is_bit_identical(engine, variant):
    t = T_DENSE if engine == "sdpa" and variant != "full" else T
    layout = _layout(variant, t)
    g = torch.Generator(device="cuda").manual_seed(0)

    def make(heads):
        return torch.randn(1, heads, t, 128, device="cuda", generator=g, dtype=torch.bfloat16)

    q, k, v, grad = make(32), make(8), make(8), make(32)
    with deterministic_mode(True, seed=0):
        try:
            first = _once(engine, layout, q, k, v, grad)
        except Exception as err:  # a variant the engine does not run is not this test's concern
            if "does not support variant" in str(err):
                pytest.skip(str(err))
            raise
        second = _once(engine, layout, q, k, v, grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), first, second, strict=True):
        assert torch.equal(a, b), f"{engine} {variant}: {name} differs between two runs"


def test_fused_kernels_backward_is_bit_identical():
    """``training.kernels: liger`` under the deterministic mode: Liger-Kernel's RMSNorm (its
    weight gradient summed from per-block partials) and SwiGLU give bit-identical gradients in
    two runs, at gpu-small's width (hidden 1024) on 16K tokens."""
    pytest.importorskip("liger_kernel")
    from transformers import LlamaConfig, LlamaForCausalLM

    from anchorctx.training.kernels import use_kernels

    config = LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_attention_heads=16,
        num_key_value_heads=8,
        num_hidden_layers=2,
        vocab_size=1024,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    assert use_kernels(model, "liger") > 0
    ids = torch.randint(0, config.vocab_size, (1, T), device="cuda")

    def grads() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    with deterministic_mode(True, seed=0):
        first, second = grads(), grads()
    names = [n for n, _ in model.named_parameters()]
    for name, a, b in zip(names, first, second, strict=True):
        assert torch.equal(a, b), f"liger: the gradient of {name} differs between two runs"
