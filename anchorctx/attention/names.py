"""The attention names the config validates against, importable without torch.

``VARIANTS`` are the attention layouts of docs/ARCHITECTURE.md ("Attention layout").
``ENGINE_CLASSES`` is the engine registry: each engine's name and where its class lives, in the
order error messages list them. The engines package imports exactly these classes (and checks
each class's ``name``), and ``ENGINE_NAMES`` (what ``training.engine`` / ``attend(engine=...)``
accept, ``auto`` first) is derived from it, so the config's literals follow without importing
torch.

Adding an engine: write its module under ``anchorctx/attention/engines/`` with an
:class:`~anchorctx.attention.engines.base.Engine` subclass that declares its ``name``,
``capabilities``, its places in ``auto``'s preference (``auto = AutoRanks(...)``) and, to be
ranked by the cost rule, a ``cost`` method; then add one line to ``ENGINE_CLASSES`` below.
No other code lists engines: describe the new one in ``attend``'s docstring (``api.py``) and in
docs/ARCHITECTURE.md, and update the orders tests/test_attention_registry.py pins if it ranks.
"""

from __future__ import annotations

VARIANTS: tuple[str, ...] = ("full", "intra_doc", "intra_doc_reset", "anchor")

_ENGINES = "anchorctx.attention.engines"
ENGINE_CLASSES: dict[str, str] = {
    "sdpa": f"{_ENGINES}.sdpa:SdpaEngine",
    "flex": f"{_ENGINES}.flex:FlexEngine",
    "varlen": f"{_ENGINES}.varlen:VarlenEngine",
    "flash_attn": f"{_ENGINES}.varlen:FlashAttnEngine",
    "flex_merge": f"{_ENGINES}.merge:FlexMergeEngine",
    "flex_copy": f"{_ENGINES}.copy:FlexCopyEngine",
    "triton": f"{_ENGINES}.triton_doc:TritonEngine",
    "fa4": f"{_ENGINES}.flash4:Fa4Engine",
    "flex_flash": f"{_ENGINES}.flex:FlexFlashEngine",
}
ENGINE_NAMES: tuple[str, ...] = ("auto", *ENGINE_CLASSES)
