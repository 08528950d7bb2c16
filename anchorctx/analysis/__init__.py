"""The paper's Section 2 analysis: how bfloat16 breaks RoPE's relative-position property.

``anchorctx.analysis.rope_precision.run_study(cfg)`` runs the study behind
``anchorctx rope-precision``; ``anchorctx.models.rope.enable_fp32_rope`` is the fp32-RoPE
training option it compares against.
"""
