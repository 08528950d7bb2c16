"""The config mechanism: the schema base, shared field types, YAML loading and ``--set``
overrides, generic over the root schema.

The schemas live beside their owners (``anchorctx/<part>/settings.py``,
``anchorctx/tracking_settings.py``); the root, :class:`~anchorctx.experiment.ExperimentConfig`,
with ``load_config`` and ``config_from_dict``, is :mod:`anchorctx.experiment`. This package
imports no schema and no stage.
"""

from anchorctx.config.core import (
    NAME_MAX,
    ConfigError,
    Device,
    Dtype,
    RunName,
    Seed,
    Strict,
    name_problem,
    path_under,
)
from anchorctx.config.loader import (
    MAX_YAML_BYTES,
    MAX_YAML_NODES,
    apply_overrides,
    check_key,
    dump_config,
    load_yaml,
    read_yaml,
    set_dotted,
    to_yaml,
    validate,
)

__all__ = [
    "MAX_YAML_BYTES",
    "MAX_YAML_NODES",
    "NAME_MAX",
    "ConfigError",
    "Device",
    "Dtype",
    "RunName",
    "Seed",
    "Strict",
    "apply_overrides",
    "check_key",
    "dump_config",
    "load_yaml",
    "name_problem",
    "path_under",
    "read_yaml",
    "set_dotted",
    "to_yaml",
    "validate",
]
