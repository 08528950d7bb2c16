"""The schema base and the field types every settings module shares.

Each component declares its settings beside its own code (``anchorctx/<part>/settings.py``) on
:class:`Strict`; a value that several components accept (a device, a dtype, a run name, a seed)
has its type here, once, so the choices and the error message are the same wherever the key
appears.

Rules every :class:`Strict` section gets without saying so (issue #33, docs/RELIABILITY.md):

- an unknown key is an error naming the valid ones;
- a float is finite (``.inf``, ``.nan`` and ``"inf"`` are refused wherever a float is read,
  inside lists, tuples and mappings too);
- a number is never a boolean (``steps: true`` is refused, not read as 1).
"""

from __future__ import annotations

import os
import re
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key and the valid ones."""


class Strict(BaseModel):
    """A settings section: an unknown key is an error that names the valid ones, never a silent
    default, and assignments are validated like the file was. Floats must be finite and numbers
    are never booleans."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads True as 1 (and 1.0): `training.steps=true` would train one
        # step. A number field takes numbers only.
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and (where := _bool_for_number(field.annotation, value)) is not None:
            raise ValueError(f"{where + ' ' if where else ''}must be a number, not a boolean")
        return value


Device = Literal["auto", "cpu", "cuda"]
"""Where a stage runs: ``auto`` resolves by ``models.loading.resolve_device``."""

Dtype = Literal["bfloat16", "float32", "float16"]
"""A model's weight dtype."""

Seed = Annotated[int, Field(ge=0, lt=2**32)]
"""A random seed: what every generator the project seeds accepts (numpy's legacy one: 0..2**32-1)."""

# ------------------------------------------------------------------------------------ run names
NAME_MAX = 100
"""Longest run name: a directory name plus the lock, task-config and moved-aside suffixes
(``.<name>.lock``, ``<name>.old-<time>-N``) stays far below every filesystem's 255 bytes."""

_NAME_CHARS = re.compile(r"[A-Za-z0-9_.-]+")


def name_problem(value: object) -> str | None:
    """Why ``value`` cannot be a name that becomes one directory under ``run_root`` (the
    experiment's ``name``, a variant's name, ``variant``), or None when it can. The one rule for
    names that become paths: a single path component, never ``.``/``..``, no ``/``, ``\\`` or
    NUL, letters, digits, ``_``, ``-`` and ``.`` only, not hidden (a leading ``.`` is the lock
    and task-config files beside run directories), at most :data:`NAME_MAX` characters."""
    if not isinstance(value, str):
        return f"must be a string, not {type(value).__name__}"
    if not value:
        return "must not be empty"
    if value in (".", ".."):
        return "'.' and '..' are not directory names"
    if any(c in value for c in "/\\\0"):
        return "must be a single directory name (no '/', '\\' or NUL)"
    if len(value) > NAME_MAX:
        return f"is {len(value)} characters long; at most {NAME_MAX}"
    if not _NAME_CHARS.fullmatch(value):
        return "may hold only letters, digits, '_', '-' and '.'"
    if value.startswith("."):
        return "must not start with '.' (hidden names are the lock files beside run directories)"
    return None


def _run_name(value: str) -> str:
    if (problem := name_problem(value)) is not None:
        raise ValueError(problem)  # shown after the key, with the value given
    return value


RunName = Annotated[str, AfterValidator(_run_name)]
"""An experiment or arm name: it becomes a directory name (:func:`name_problem`)."""


def path_under(root: Path, *names: str, key: str = "name") -> Path:
    """``root / names...``, each name checked by :func:`name_problem` and the result checked to
    lie inside ``root`` (lexically: symlinks below ``root`` are the user's to place). Every run
    directory is built here; a name that would leave ``root`` is a :class:`ConfigError` naming
    ``key``."""
    path = Path(root)
    for name in names:
        if (problem := name_problem(name)) is not None:
            raise ConfigError(f"{key}: {problem} (got {name!r})")
        path = path / name
    base = os.path.normpath(os.path.abspath(root))
    full = os.path.normpath(os.path.abspath(path))
    if names and (full == base or os.path.commonpath([base, full]) != base):
        raise ConfigError(f"{key}: {path} is not inside run_root {root}")
    return path


# ------------------------------------------------------------------------------- bool checks
def _arms(annotation: Any) -> tuple[Any, ...]:
    """The alternatives of a union (Annotated unwrapped), or the annotation alone."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        return tuple(a for arm in get_args(annotation) for a in _arms(arm))
    return (annotation,)


def _takes_bool(annotation: Any) -> bool:
    for arm in _arms(annotation):
        if arm is bool or arm is Any:
            return True
        if get_origin(arm) is Literal and any(isinstance(v, bool) for v in get_args(arm)):
            return True
    return False


def _bool_for_number(annotation: Any, value: Any, where: str = "") -> str | None:
    """Where (``""``: the value itself, ``"[1]"``, ``"['x']"``) ``value`` holds a boolean that
    ``annotation`` would read as a number, or None."""
    if isinstance(value, bool):
        numeric = any(arm in (int, float) for arm in _arms(annotation))
        return where if numeric and not _takes_bool(annotation) else None
    for arm in _arms(annotation):
        origin, args = get_origin(arm), get_args(arm)
        found = None
        if origin in (list, set, frozenset, tuple) and args and isinstance(value, list | tuple):
            fixed = origin is tuple and not (len(args) == 2 and args[1] is Ellipsis)
            for i, item in enumerate(value):
                item_type = (args[i] if i < len(args) else None) if fixed else args[0]
                if item_type is not None:
                    found = _bool_for_number(item_type, item, f"{where}[{i}]")
                if found is not None:
                    return found
        elif origin is dict and isinstance(value, dict) and len(args) == 2:
            for k, item in value.items():
                if (found := _bool_for_number(args[1], item, f"{where}[{k!r}]")) is not None:
                    return found
    return None
