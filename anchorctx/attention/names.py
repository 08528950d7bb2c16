"""The attention names the config validates against, importable without torch.

``VARIANTS`` are the attention layouts of docs/ARCHITECTURE.md ("Attention layout");
``ENGINE_NAMES`` are the engines ``training.engine`` / ``attend(engine=...)`` accept, ``auto``
first. Both are the single definition: the layout module and the engine registry check against
them (tests/test_attention_core.py), and the config's literals are built from them.
"""

from __future__ import annotations

VARIANTS: tuple[str, ...] = ("full", "intra_doc", "intra_doc_reset", "anchor")
ENGINE_NAMES: tuple[str, ...] = (
    "auto", "sdpa", "flex", "varlen", "flash_attn", "flex_merge", "flex_copy", "triton",
)  # fmt: skip
