"""Configuration: typed schema (schema.py, model_schema.py, fields.py), the loader that fills it
(loader.py) and the checks across keys (checks.py)."""

from tessera.config.loader import build_config, changed_keys, config_digest, flat_dict, load_config
from tessera.config.paths import absolute_path
from tessera.config.schema import (
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    MeshConfig,
    ModelConfig,
    OptimConfig,
    ProfilerConfig,
    RunConfig,
)

__all__ = [
    "CheckpointConfig",
    "Config", "ConfigError", "DataConfig", "MeshConfig", "ModelConfig", "OptimConfig",
    "ProfilerConfig", "RunConfig", "absolute_path", "build_config", "changed_keys", "config_digest", "flat_dict",
    "load_config",
]
