"""The config mechanism: the schema base, shared field types, YAML loading and ``--set``
overrides, generic over the root schema.

The schemas live beside their owners (``anchorctx/<part>/settings.py``,
``anchorctx/tracking_settings.py``); the root, :class:`~anchorctx.experiment.ExperimentConfig`,
with ``load_config`` and ``config_from_dict``, is :mod:`anchorctx.experiment`. This package
imports no schema and no stage.
"""

from anchorctx.config.core import ConfigError, Device, Dtype, RunName, Strict
from anchorctx.config.loader import (
    apply_overrides,
    check_key,
    dump_config,
    read_yaml,
    set_dotted,
    to_yaml,
    validate,
)

__all__ = [
    "ConfigError",
    "Device",
    "Dtype",
    "RunName",
    "Strict",
    "apply_overrides",
    "check_key",
    "dump_config",
    "read_yaml",
    "set_dotted",
    "to_yaml",
    "validate",
]
