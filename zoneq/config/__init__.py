"""zoneq's configuration: a TOML file validated into frozen models.

``load_config()`` returns a ``Config`` or raises ``ConfigError`` naming the dotted key at
fault; ``check_config()`` returns every fault as a line of text instead.
"""

from zoneq.config.loader import (
    InvalidConfig,
    Problem,
    check_config,
    default_config_text,
    load_config,
    loads_config,
    validate_config,
)
from zoneq.config.model import (
    Config,
    RoutingConfig,
    ServerConfig,
    StorageConfig,
    ZoneConfig,
)

__all__ = [
    "Config",
    "InvalidConfig",
    "Problem",
    "RoutingConfig",
    "ServerConfig",
    "StorageConfig",
    "ZoneConfig",
    "check_config",
    "default_config_text",
    "load_config",
    "loads_config",
    "validate_config",
]
