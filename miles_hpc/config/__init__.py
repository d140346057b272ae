"""Typed run configuration: frozen dataclasses, YAML load, ``key.sub=value`` overrides, validation.

The root of the import graph (``cluster`` and ``data`` import only this package). :mod:`.run` declares the sections
and :class:`RunConfig`; :mod:`.loader` is the strict dict <-> dataclass machinery (errors name the key path and the
file or override the value came from).
"""

from miles_hpc.config.loader import ConfigError, apply_overrides
from miles_hpc.config.loader import dump as dump_config
from miles_hpc.config.loader import to_dict as config_to_dict
from miles_hpc.config.run import (
    AlgoConfig,
    DataConfig,
    FullyAsyncConfig,
    LoraConfig,
    MegatronConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    SlurmConfig,
    StoreConfig,
    SyncConfig,
    TrainConfig,
    config_from_dict,
    config_reference,
    load_config,
)

__all__ = [
    "ConfigError",
    "ModelConfig",
    "DataConfig",
    "RewardConfig",
    "AlgoConfig",
    "RolloutConfig",
    "TrainConfig",
    "SyncConfig",
    "FullyAsyncConfig",
    "MegatronConfig",
    "LoraConfig",
    "StoreConfig",
    "SlurmConfig",
    "RunConfig",
    "load_config",
    "config_from_dict",
    "config_reference",
    "config_to_dict",
    "dump_config",
    "apply_overrides",
]
