"""Project exceptions. Every user-facing failure raises a subclass of `SsdJaxError`
whose message names the problem and the offending value."""


class SsdJaxError(Exception):
    """Base class of every ssd_jax exception."""


class ConfigError(SsdJaxError, ValueError):
    """A model configuration is missing, malformed or unsupported."""


class CheckpointError(SsdJaxError, ValueError):
    """Weights are missing, corrupt or do not match the configuration."""


class InputError(SsdJaxError, ValueError):
    """An argument passed to a public function is invalid."""
