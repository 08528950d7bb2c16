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
