"""Lazy package exports (PEP 562), one implementation for every package ``__init__`` that uses it.

A package whose ``__init__`` re-exports heavy modules (torch, numpy, pyarrow, transformers)
would load them whenever a light submodule of it is imported (``anchorctx.packing.settings`` by
the config, ``anchorctx.demo.commands`` by ``anchorctx --help``). With
``__getattr__, __dir__ = lazy.exports(__name__, {"name": "module", ...})`` the names keep their
public home and load on first use. Imports nothing of anchorctx: any module may use it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def exports(
    package: str, table: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package``: ``table`` maps each
    public name to the module that defines it."""

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(table[name]), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        module = sys.modules[package]
        return sorted({*vars(module), *getattr(module, "__all__", ())})

    return __getattr__, __dir__
