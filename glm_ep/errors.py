"""The project's exception types and exit codes. Every message names the offending value and what
was expected."""

from __future__ import annotations

import errno
import os
import stat

#: Exit codes of every ``glm-ep`` command (README "Exit codes").
EXIT_OK = 0  # done; for ``run`` with its check: PASS
EXIT_INTERNAL = 1  # an unexpected exception (a bug): traceback printed, the MPI job aborted
EXIT_USER = 2  # a bad config, topology, checkpoint, input or output: one clear message (rank 0's if agreed)
EXIT_FAIL = 3  # ``run``'s check: FAIL (an error over the bound, a non-finite value, ranks disagree); ``generate
# --compare``: HF's own MLPs' logits differ from glm_ep's by more than rounding explains
EXIT_STALL = 4  # a rank waited on the others past ``collective_timeout_s``: the MPI job aborted
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT): 128 + 2
EXIT_TERMINATED = 143  # SIGTERM, a scheduler's cancel: 128 + 15
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


class NumericError(GlmEpError):
    """Finite inputs and checked weights gave NaN or Inf outputs: a site overflowed (huge input values, or weights
    whose products pass bf16's range)."""


class FileAccessError(GlmEpError):
    """The operating system refused a file the job names: a permission, a name too long, a full disk."""


_EXPECTED = {
    errno.EACCES: "expected a path this process may read (or write, for an output)",
    errno.EPERM: "expected a path this process may read (or write, for an output)",
    errno.ENAMETOOLONG: "expected a shorter path",
    errno.ENOSPC: "expected room on the device for what is written",
    errno.EDQUOT: "expected room in the disk quota for what is written",
    errno.EROFS: "expected a writable file system for what is written",
    errno.ENOENT: "expected an existing path",
    errno.ENOTDIR: "expected each folder of the path to be a folder",
    errno.EISDIR: "expected a file, not a folder",
}


_PACKAGE = os.path.dirname(os.path.abspath(__file__))
STDOUT = "<stdout>"  # the file an OSError of a write to stdout names (``glm_ep.dist.ranks.run_guarded`` tags it)


def file_access_error(e: BaseException) -> FileAccessError | None:
    """The user error an ``OSError`` stands for where the system refused one of the job's files for a reason the
    user can mend (the errnos of ``_EXPECTED``): one that names a path outside the package or stdout, or a full disk
    or quota (a write through a file object names no path). None for anything else, a crash: another errno (too
    many open files, an I/O error), or a file of the package's own (a kernel source)."""
    if not isinstance(e, OSError) or e.errno not in _EXPECTED:
        return None
    if e.filename is None:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            return None
    elif e.filename != STDOUT and os.path.abspath(os.fsdecode(e.filename)).startswith(_PACKAGE + os.sep):
        return None
    reason = e.strerror or str(e)
    place = {None: "writing a file: ", STDOUT: "writing to stdout: "}.get(e.filename, f"{e.filename}: ")
    return FileAccessError(f"{place}{reason[:1].lower()}{reason[1:]}; {_EXPECTED[e.errno]}")


#: file types by ``stat`` mode, as an error message names them
PATH_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
              (stat.S_ISCHR, "a character device node"), (stat.S_ISBLK, "a block device node"),
              (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file"))


def path_kind(path: str | os.PathLike) -> str:
    """What ``path`` is once its symbolic links are followed, as an error message says it: "a regular file", "a
    folder", "a FIFO", a device node, "a socket", "a symbolic link loop", "a broken symbolic link" or "not found";
    an OSError for any other refusal (a permission, a name too long: ``file_access_error`` names those). Only
    ``stat`` is called: nothing is opened (opening a FIFO would wait for a writer)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symbolic link loop"
        if e.errno == errno.ENOENT:
            return "a broken symbolic link" if os.path.islink(path) else "not found"
        if e.errno == errno.ENOTDIR:
            return "not found (a part of its path is a file, not a folder)"
        raise
    return next((name for test, name in PATH_KINDS if test(mode)), "not a regular file")


def not_a_file(path: str | os.PathLike, what: str) -> str | None:
    """None where ``path`` is a regular file (or a link to one), else the start of an error message naming ``path``
    as ``what`` and what it is instead: ``'DIR/config.json: config.json is a folder'``."""
    kind = path_kind(path)
    if kind == "a regular file":
        return None
    return f"{os.fspath(path)}: {what} {kind if kind.startswith('not ') else 'is ' + kind}"
