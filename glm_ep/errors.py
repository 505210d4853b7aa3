"""The project's exception types and exit codes. Every message names the offending value and what
was expected."""

#: Exit codes of every ``glm-ep`` command (README "Exit codes").
EXIT_OK = 0  # done; for ``run`` with its check: PASS
EXIT_INTERNAL = 1  # an unexpected exception (a bug): traceback printed, the MPI job aborted
EXIT_USER = 2  # a bad config, topology, checkpoint, input or output: one clear message (rank 0's if agreed)
EXIT_FAIL = 3  # ``run``'s check: FAIL (an error over the bound, a non-finite value, ranks disagree)
EXIT_STALL = 4  # a rank waited on the others past ``collective_timeout_s``: the MPI job aborted
EXIT_BROKEN_PIPE = 141  # stdout closed by its reader (``glm-ep footprint | head``): quiet, 128 + SIGPIPE


class GlmEpError(Exception):
    """Base class: a user-facing error that ends the job with a clear message and ``EXIT_USER``."""


class ConfigError(GlmEpError):
    """A model config, topology or command-line value is missing, malformed or inconsistent."""


class CheckpointError(GlmEpError):
    """A checkpoint file or tensor is missing, truncated, non-finite, or has the wrong shape or dtype."""


class InputError(GlmEpError):
    """A job's input or output file is unusable: wrong shape, non-finite rows, an output path that
    cannot be written or is not a regular file."""
