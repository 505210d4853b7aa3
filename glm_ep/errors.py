"""The project's exception types. Every message names the offending value and what was expected."""


class GlmEpError(Exception):
    """Base class: a user-facing error that ends the job with a clear message and exit code 2."""


class ConfigError(GlmEpError):
    """A model config, topology or command-line value is missing, malformed or inconsistent."""


class CheckpointError(GlmEpError):
    """A checkpoint file or tensor is missing, truncated, or has the wrong shape or dtype."""


class InputError(GlmEpError):
    """A forward input does not fit the model or the workspace."""
