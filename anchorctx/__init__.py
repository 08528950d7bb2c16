"""anchorctx: long-context continual training of RoPE models with AnchorAttention."""

__version__ = "0.1.0"
