"""YAML loading and ``--set a.b=value`` overrides, over any :class:`~pydantic.BaseModel` root.

Overrides are applied to the raw mapping *before* validation, and every key is checked against
the schema first, so a typo is an error that names the valid keys, never a silent default. Every
error is one :class:`ConfigError` line (the CLI prints it as is). Nothing here knows the
experiment's sections: the root schema is an argument (``anchorctx.experiment`` passes its own).
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from anchorctx.config.core import ConfigError
from anchorctx.io import atomic_write_text

Model = TypeVar("Model", bound=BaseModel)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML config file.

    Relative paths inside the file stay relative to the working directory (like every CLI).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    return raw


def apply_overrides(
    schema: type[BaseModel], raw: dict[str, Any], overrides: list[str] | None
) -> dict[str, Any]:
    """A copy of ``raw`` with every ``a.b=value`` override set (values parsed as YAML), each key
    checked against ``schema`` first."""
    raw = copy.deepcopy(raw)
    for item in overrides or []:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like a.b=value")
        check_key(schema, key.strip())
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as err:
            raise ConfigError(
                f"override {item!r}: invalid YAML value ({_first_line(err)})"
            ) from None
        set_dotted(raw, key.strip(), value, what=f"override {key.strip()!r}")
    return raw


def validate(schema: type[Model], raw: dict[str, Any], source: str) -> Model:
    """``schema`` validated from ``raw``; a failure is one ConfigError line naming ``source``."""
    try:
        return schema.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(f"{source}: " + _explain(schema, err)) from None


def check_key(schema: type[BaseModel], dotted: str) -> None:
    """Reject an override whose key does not exist in the schema (dict-valued leaves excepted)."""
    model: type[BaseModel] | None = schema
    for part in dotted.split("."):
        if model is None:  # inside a free-form mapping (e.g. data.mixture, variant overrides)
            return
        if part.isdigit():  # list index into a list of models, e.g. data.sources.0.path
            continue
        field = model.model_fields.get(part)
        if field is None:
            raise ConfigError(_unknown_key_message(schema, dotted))
        model = _sub_model(field.annotation)


def set_dotted(raw: dict[str, Any], dotted: str, value: Any, what: str = "") -> None:
    """Set ``a.b.c`` in a raw mapping, creating mappings on the way; a digit indexes a list."""
    node: Any = raw
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            index = _list_index(node, part, ".".join(parts[:i]), what or repr(dotted))
            if last:
                node[index] = value
            else:
                node = node[index]
            continue
        if last:
            node[part] = value
            return
        if not isinstance(node.get(part), dict | list):
            node[part] = {}
        node = node[part]


def to_yaml(cfg: BaseModel) -> str:
    """The resolved config as YAML, keys in schema order."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def dump_config(cfg: BaseModel, path: Path) -> None:
    """Write the resolved config atomically (``config.yaml`` beside every run's outputs)."""
    atomic_write_text(path, to_yaml(cfg))


def _first_line(err: Exception) -> str:
    return " ".join(str(err).split())


def _explain(schema: type[BaseModel], err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(_unknown_key_message(schema, loc))
        else:
            lines.append(f"{loc or '<root>'}: {e['msg']} (got {_short(e.get('input'))})")
    return "; ".join(lines)  # one line: CLI errors are single lines


def _short(value: Any, limit: int = 120) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _model_at(schema: type[BaseModel], dotted: str) -> tuple[type[BaseModel] | None, str]:
    """Walk the model classes along a dotted key; return the parent model of the last part."""
    model: type[BaseModel] | None = schema
    parts = dotted.split(".")
    for part in parts[:-1]:
        if model is None:
            return None, parts[-1]
        field = model.model_fields.get(part)
        if field is None:
            return model, part
        model = _sub_model(field.annotation)
    return model, parts[-1]


def _sub_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _unknown_key_message(schema: type[BaseModel], dotted: str) -> str:
    model, last = _model_at(schema, dotted)
    if model is None:
        return f"unknown key {dotted!r}"
    valid = sorted(model.model_fields)
    near = difflib.get_close_matches(last, valid, n=1)
    hint = f" Did you mean {near[0]!r}?" if near else ""
    return f"unknown key {dotted!r}.{hint} Valid keys here: {', '.join(valid)}"


def _list_index(node: list, part: str, where: str, what: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(
            f"{what}: {where} is a list of {len(node)} entr{'y' if len(node) == 1 else 'ies'}; "
            f"{part!r} is not an index into it (use 0..{len(node) - 1})"
        )
    return int(part)
