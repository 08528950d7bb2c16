"""A tiny Llama checkpoint on disk (HF format + tokenizer + anchorctx.json), for evaluation tests.

from checkpoints import save_checkpoint
save_checkpoint(run_dir / "checkpoints" / "step-000010", tokenizer_dir, seed=3, step=10)
"""

from __future__ import annotations

import json
from pathlib import Path


def save_checkpoint(
    path: Path, tokenizer_dir: Path, *, seed: int, step: int, positions: int = 2048, pad=False
) -> None:
    """``positions``: the model's max_position_embeddings; ``pad``: the tokenizer's pad id in
    its config too."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=positions,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        **({"pad_token_id": tok.pad_token_id} if pad else {}),
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    (path / "anchorctx.json").write_text(json.dumps({"step": step}))
