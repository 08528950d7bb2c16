"""YAML loading and ``--set a.b=value`` overrides, over any :class:`~pydantic.BaseModel` root.

Overrides are applied to the raw mapping *before* validation, and every key is checked against
the schema first, so a typo is an error that names the valid keys, never a silent default. Every
error is one :class:`ConfigError` line (the CLI prints it as is). Nothing here knows the
experiment's sections: the root schema is an argument (``anchorctx.experiment`` passes its own).
"""

from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from anchorctx.config.core import ConfigError
from anchorctx.io import atomic_write_text

Model = TypeVar("Model", bound=BaseModel)


MAX_YAML_BYTES = 1 << 20
"""Largest config file read (configs are a few KB; a larger one is a mistake or an attack)."""

MAX_YAML_NODES = 100_000
"""Most values a YAML document may expand to, every use of an alias counted in full (the
shipped configs hold under 1000). A "billion laughs" document (aliases of aliases) is refused
while it is still a few hundred composed nodes, before anything is built from it."""


class YamlLimitError(yaml.YAMLError):
    """A YAML document over a bound (:data:`MAX_YAML_NODES`, a duplicate key, nesting)."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.message, self.line = message, line

    def __str__(self) -> str:
        return self.message if self.line is None else f"line {self.line}: {self.message}"


def load_yaml(text: str, max_nodes: int = MAX_YAML_NODES) -> Any:
    """``yaml.safe_load`` with bounds: aliases may not expand the document beyond ``max_nodes``
    values, an alias may not contain itself, and a mapping may not repeat a key (YAML requires
    keys to be unique; PyYAML silently keeps the last). Raises :class:`yaml.YAMLError`
    (:class:`YamlLimitError` for the bounds)."""
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise YamlLimitError("nested too deeply") from None
        if node is None:
            return None
        _check_nodes(node, max_nodes)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_nodes(root: yaml.Node, limit: int) -> None:
    """Count ``root``'s values with every alias expanded (memoised per node, so the count costs
    one visit per composed node however far aliases would expand), refuse cycles and duplicate
    mapping keys."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node, key: str) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in open_nodes:
            raise YamlLimitError(f"{key or 'the document'}: an alias contains itself", _line(node))
        open_nodes.add(id(node))
        total = 1
        if isinstance(node, yaml.SequenceNode):
            for i, child in enumerate(node.value):
                total += size(child, f"{key}.{i}" if key else str(i))
                if total > limit:
                    break
        elif isinstance(node, yaml.MappingNode):
            seen: dict[tuple[str, str], int | None] = {}
            for key_node, value_node in node.value:
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != _MERGE:
                    ident = (key_node.tag, key_node.value)
                    name = f"{key}.{key_node.value}" if key else str(key_node.value)
                    if ident in seen:
                        first = seen[ident]
                        also = f" (first at line {first})" if first is not None else ""
                        raise YamlLimitError(f"duplicate key {name!r}{also}", _line(key_node))
                    seen[ident] = _line(key_node)
                else:
                    name = f"{key}.<key>" if key else "<key>"
                total += size(key_node, name) + size(value_node, name)
                if total > limit:
                    break
        open_nodes.discard(id(node))
        if total > limit:
            raise YamlLimitError(
                f"{key or 'the document'} expands to more than {limit} values "
                "(YAML aliases of aliases?); refused",
                _line(node),
            )
        sizes[id(node)] = total
        return total

    try:
        size(root, "")
    except RecursionError:
        raise YamlLimitError("nested too deeply") from None


_MERGE = "tag:yaml.org,2002:merge"


def _line(node: yaml.Node) -> int | None:
    mark = getattr(node, "start_mark", None)
    return mark.line + 1 if mark is not None else None


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML config file, read within bounds (:func:`load_yaml`):
    every failure is one :class:`ConfigError` line naming the file.

    Relative paths inside the file stay relative to the working directory (like every CLI).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    size = path.stat().st_size
    if size > MAX_YAML_BYTES:
        raise ConfigError(f"{path}: {size} bytes; a config file is at most {MAX_YAML_BYTES}")
    try:
        raw = load_yaml(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except YamlLimitError as err:
        raise ConfigError(f"{path}: {err}") from None
    except (yaml.YAMLError, ValueError) as err:  # ValueError: e.g. an int of 5000 digits
        raise ConfigError(f"{path}: invalid YAML: {_first_line(err)}") from None
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
            value = load_yaml(text) if text.strip() else None
        except (yaml.YAMLError, ValueError) as err:
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
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            lines.append(_unknown_key_message(schema, loc))
        elif isinstance(e.get("input"), dict) and e["type"] == "value_error":
            # A section's own check ("hidden_size=... must be ..."): name the full key.
            lines.append(_section_message(schema, loc, msg))
        else:
            lines.append(f"{loc or '<root>'}: {msg} (got {_short(e.get('input'))})")
    return "; ".join(lines)  # one line: CLI errors are single lines


def _section_message(schema: type[BaseModel], loc: str, msg: str) -> str:
    """A model validator's message under its section's key: ``model.tiny`` and
    ``hidden_size=130 must be ...`` give ``model.tiny.hidden_size=130 must be ...``."""
    first = re.match(r"[A-Za-z_][A-Za-z0-9_]*", msg)
    model, _ = _model_at(schema, f"{loc}.x" if loc else "x")
    if first and model is not None and first.group() in model.model_fields:
        return f"{loc}.{msg}" if loc else msg
    return f"{loc}: {msg}" if loc else msg


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
