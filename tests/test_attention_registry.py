"""The engine registry and the orders ``auto`` derives from it, on CPU.

The orders and per-layout choices below are pinned: they are what ``auto`` chose when the
orders were hand-written tuples, and a new engine or a changed rank must not move them
unnoticed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from anchorctx.attention import VARIANTS, engines, names
from anchorctx.attention.engines import (
    ENGINE_NAMES,
    ENGINES,
    AutoRanks,
    _instance,
    auto_order,
    base,
    cost,
    preference,
)
from anchorctx.attention.layout import VARIANTS as LAYOUT_VARIANTS
from anchorctx.attention.layout import build_layout


def test_names_are_the_registry():
    assert ENGINE_NAMES is names.ENGINE_NAMES
    assert ENGINE_NAMES == ("auto", *ENGINES) == ("auto", *names.ENGINE_CLASSES)
    assert all(engine.name == name for name, engine in ENGINES.items())
    pinned = (
        *("auto", "sdpa", "flex", "varlen", "flash_attn", "flex_merge", "flex_copy", "triton"),
        *("fa4", "flex_flash"),
    )
    assert pinned == ENGINE_NAMES
    assert VARIANTS is names.VARIANTS is LAYOUT_VARIANTS
    assert base.Capabilities(frozenset(), frozenset(), None).variants == frozenset(VARIANTS)


def test_a_misnamed_engine_class_is_refused():
    with pytest.raises(ImportError, match="registered as 'sdpa' but is named 'flex'"):
        _instance("sdpa", "anchorctx.attention.engines.flex:FlexEngine")


def test_names_import_without_torch():
    """The config reads names.py: loaded on its own, it imports nothing heavy."""
    path = Path(names.__file__)
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('names', {str(path)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "print(','.join(module.ENGINE_NAMES))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ",".join(ENGINE_NAMES)


def test_auto_preferences_are_pinned():
    assert preference("full") == ("fa4", "sdpa", "varlen", "flash_attn", "flex")
    assert preference("mixed") == ("fa4", "varlen", "flash_attn", "flex", "flex_merge", "sdpa")
    masked = ("fa4", "flex", "triton", "flex_merge", "varlen", "flash_attn", "sdpa")
    assert preference("masked") == masked
    assert preference("other") == ("sdpa",)
    assert ENGINES["flex_copy"].auto == AutoRanks()  # runs when named only
    assert ENGINES["flex_flash"].auto == AutoRanks()  # not measured yet
    # Every engine auto ranks by cost has a cost model; sdpa has none and comes last.
    unpriced = [n for n in preference("masked") if ENGINES[n].cost(cost.TileCounts(8, 2)) is None]
    assert unpriced == ["sdpa"]


def _rows(*spec: tuple[list[int], str]):
    return [build_layout(lens, variant) for lens, variant in spec]


# FlashAttention-4 first wherever documents span more than a few tiles; on tiny documents the
# gathered anchor (λ₄ per query tile) puts it behind triton and the merge.
RANKED_ANCHOR = ("fa4", "triton", "flex_merge", "flex", "varlen", "flash_attn", "sdpa")
FIXED_ANCHOR = ("fa4", "triton", "flex_merge", "varlen", "flash_attn", "flex", "sdpa")
SHORT_DOCS = ("triton", "flex_merge", "fa4", "varlen", "flash_attn", "flex", "sdpa")
INTRA = ("fa4", "flex", "triton", "flex_merge", "varlen", "flash_attn", "sdpa")
MIXED = ("fa4", "varlen", "flash_attn", "flex", "flex_merge", "sdpa")

CASES = {
    "fixed 2K, anchor": (_rows(([2048] * 64, "anchor")), FIXED_ANCHOR),
    "fixed 2K, intra_doc": (_rows(([2048] * 64, "intra_doc")), INTRA),
    "fixed 2K, intra_doc_reset": (_rows(([2048] * 64, "intra_doc_reset")), INTRA),
    "books, anchor": (_rows(([300] * 40 + [96 * 1024] + [400] * 40, "anchor")), RANKED_ANCHOR),
    "tiny, anchor": (_rows(([300] * 437, "anchor")), SHORT_DOCS),
    "one document, anchor": (_rows(([32768], "anchor")), RANKED_ANCHOR),
    "short row, anchor": (_rows(([40, 60], "anchor")), SHORT_DOCS),
    "4K, anchor": (_rows(([4096] * 32, "anchor")), RANKED_ANCHOR),
    "16K, anchor": (_rows(([16384] * 8, "anchor")), RANKED_ANCHOR),
    "anchor + intra_doc": (
        _rows(([2048] * 16, "anchor"), ([4096] * 8, "intra_doc")),
        RANKED_ANCHOR,
    ),
    "full": (_rows(([4096], "full")), ("fa4", "sdpa", "varlen", "flash_attn", "flex")),
    "full + anchor": (_rows(([4096], "full"), ([1024] * 4, "anchor")), MIXED),
    "full + intra_doc": (_rows(([4096], "full"), ([1024] * 4, "intra_doc")), MIXED),
}


@pytest.mark.parametrize("case", CASES)
def test_auto_order_per_layout_is_pinned(case):
    rows, want = CASES[case]
    assert auto_order("cuda", rows) == want
    assert auto_order("cpu", rows) == ("sdpa",)


def test_costs_are_pinned():
    fixed = _rows(([2048] * 64, "anchor"))
    want = {"flex": 15441.92, "triton": 9216.0, "flex_merge": 9932.8, "varlen": 13235.2}
    want["fa4"] = 8053.76  # 0.65 · 8704 + 2.34 · 1024
    for name, value in {**want, "flash_attn": want["varlen"]}.items():
        assert engines.estimate(name, fixed) == pytest.approx(value)
    assert cost.TileCounts.of(fixed) == cost.TileCounts(u=8704, n_q=1024)
    assert engines.estimate("flex", _rows(([2048] * 64, "intra_doc"))) == 8704
    with pytest.raises(ValueError, match="no cost model for engine 'flex_copy'"):
        engines.estimate("flex_copy", fixed)
    with pytest.raises(ValueError, match="no cost model for engine 'nope'"):
        engines.estimate("nope", fixed)
