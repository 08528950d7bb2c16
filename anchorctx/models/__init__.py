"""Model-level machinery shared by training and evaluation (decoding engines)."""
