"""The root of Gyre's exception hierarchy; each subsystem derives its own errors from GyreError."""


class GyreError(Exception):
    """Base class for every error Gyre raises on purpose."""


class ConfigError(GyreError, ValueError):
    """A configuration value that cannot run; names the key (dotted path) and the fix."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}")

    def under(self, prefix: str) -> "ConfigError":
        """The same error with its key placed under `prefix` (e.g. `cell_nodes` -> `cluster.cell_nodes`)."""
        return ConfigError(f"{prefix}.{self.key}", self.message)


def require(condition: bool, key: str, message: str) -> None:
    """Raise ConfigError(key, message) unless `condition` holds; keeps __post_init__ checks one line each."""
    if not condition:
        raise ConfigError(key, message)
