"""The schema base and the field types every settings module shares.

Each component declares its settings beside its own code (``anchorctx/<part>/settings.py``) on
:class:`Strict`; a value that several components accept (a device, a dtype, a run name) has its
type here, once, so the choices and the error message are the same wherever the key appears.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key and the valid ones."""


class Strict(BaseModel):
    """A settings section: an unknown key is an error that names the valid ones, never a silent
    default, and assignments are validated like the file was."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


Device = Literal["auto", "cpu", "cuda"]
"""Where a stage runs: ``auto`` resolves by ``models.loading.resolve_device``."""

Dtype = Literal["bfloat16", "float32", "float16"]
"""A model's weight dtype."""

RunName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+$")]
"""An experiment or arm name: it becomes a directory name."""
