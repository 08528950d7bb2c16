"""Errors of the attention core. Messages name the bad input and what to use instead."""

from __future__ import annotations


class AttentionError(ValueError):
    """An attention call cannot run as asked (engine, device, dtype, gradient or shape)."""


class LayoutError(AttentionError):
    """A packed-row layout (segment lengths, document ids, variant) is invalid."""
