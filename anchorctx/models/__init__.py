"""The model layer shared by every stage: loading models and tokenizers, the anchor-token rule,
device resolution (:mod:`~anchorctx.models.loading`), the float32-RoPE option
(:mod:`~anchorctx.models.rope`), the checkpoint layout (:mod:`~anchorctx.models.checkpoints`) and
the static-KV-cache decoding engine (:mod:`~anchorctx.models.decoding`). It imports no stage.
"""
