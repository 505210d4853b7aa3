"""MPI plumbing: rank-prefixed logging, errors agreed across ranks, bounded waits, abort-on-failure.

Logging: every rank's lines carry ``[rank r]``; ranks other than 0 print only warnings and errors
unless ``-v``, so a line every rank would print alike appears once, and a line that differs by
rank is gathered to rank 0 and printed there (``Ranks.allgather``).

A failure that every rank can see at the same point (a bad config, a missing tensor on one
rank's shard) is *agreed*: each rank runs the step, the ranks exchange their error messages,
and every rank raises the same ``AgreedError`` and exits non-zero on its own; rank 0 alone prints
it, whole (one line per rank where the ranks' messages differ). Anything that
escapes an agreement point (an exception on one rank in the middle of a collective) aborts the
whole MPI job, so the other ranks never hang; so does a wait on the other ranks that outlives
the collective deadline (``glm_ep.dist.deadline``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from typing import Any, Callable, TypeVar

from glm_ep.dist.deadline import ABORT_GRACE_S, DEFAULT_COLLECTIVE_TIMEOUT_S, Deadline, Guard, Terminated
from glm_ep.errors import (EXIT_BROKEN_PIPE, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_TERMINATED, EXIT_USER, STDOUT,
                           GlmEpError, file_access_error)

T = TypeVar("T")


class AgreedError(GlmEpError):
    """An error every rank knows about (raised on all ranks by ``Ranks.agree``); ``internal``: it began as a
    crash (not a user error) on some rank."""

    def __init__(self, message: str, internal: bool = False):
        super().__init__(message)
        self.internal = internal


def mpi_world() -> Any:
    from glm_ep.dist.mpi_lib import import_mpi  # a clear MpiUnavailable where no libmpi is installed

    return import_mpi().COMM_WORLD


class QuietRank(logging.Filter):
    """Passes only warnings and errors: the filter of every rank but 0 (without ``-v``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


def setup_logging(rank: int, verbose: bool = False) -> None:
    """``[rank r]``-prefixed lines on stderr; ranks other than 0 print only warnings and errors
    unless ``verbose``. Python warnings (NumPy's overflow on a huge input, say) go the same way."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    logging.captureWarnings(True)
    if rank != 0 and not verbose:
        for handler in logging.getLogger().handlers:
            handler.addFilter(QuietRank())


def _shown(value: str) -> str:
    """A value as ``check_same`` prints it: a hex digest by its first 12 digits, any other text whole up to 200
    characters (two ranks' values may differ only at their end)."""
    if len(value) >= 32 and all(c in "0123456789abcdef" for c in value):
        return value[:12]
    return value if len(value) <= 200 else value[:200] + "..."


class Ranks:
    """The MPI job as the runtime uses it: an mpi4py communicator and the deadline that bounds
    every wait on the other ranks (``deadline.timeout_s`` is the topology's ``collective_timeout_s``)."""

    def __init__(self, comm: Any, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.deadline = Deadline(self.rank, self.size, timeout_s, comm.Abort)

    def guard(self, site: str) -> Guard:
        return self.deadline.guard(site)

    def allgather(self, site: str, value: T) -> list[T]:
        with self.guard(site):
            return self.comm.allgather(value)

    def agree(self, site: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on every rank; if it raised on any rank, raise on all of them: the same ``AgreedError``
        for a ``GlmEpError``. Any other exception (a crash) is shared first, so no rank waits on one that has
        stopped: the rank it happened on then raises it as it was (traceback and all), the others an
        ``AgreedError`` that names it (``internal``). That holds where ``fn`` itself does not talk to the other
        ranks; where it does (``make_comm``'s gathers), a crash before its own collective pairs the share with
        it, and the job ends as it did before: by the CLI's abort, or at the collective deadline."""
        result, msg, crash = None, None, None
        try:
            result = fn()
        except AgreedError:
            raise
        except GlmEpError as e:
            msg = str(e)
        except MemoryError as e:  # CuPy's OutOfMemoryError too: a resource the user can add, not a crash
            msg = out_of_memory(e, site)
        except Exception as e:  # noqa: BLE001 - reported to every rank below, then raised here as it was
            if (refused := file_access_error(e)) is not None:  # a file the OS refused: the user's to mend
                msg = str(refused)
            else:
                crash, msg = e, f"internal error: {type(e).__name__}: {e}"
        msgs = self.allgather(site, (msg, crash is not None))
        if crash is not None:
            raise crash
        failed = [(r, m) for r, (m, _) in enumerate(msgs) if m is not None]
        internal = any(c for _, c in msgs)
        if failed:
            distinct = {m for _, m in failed}
            if len(distinct) == 1:
                ranks = ",".join(str(r) for r, _ in failed)
                raise AgreedError(f"{failed[0][1]} (on rank {ranks})" if len(failed) < len(msgs) else failed[0][1],
                                  internal)
            raise AgreedError("the ranks failed differently:\n" + "\n".join(f"  rank {r}: {m}" for r, m in failed),
                              internal)
        return result  # type: ignore[return-value]

    def check_same(self, site: str, what: str, values: dict[str, str],
                   expected: str = "every rank to read the same files with the same settings") -> None:
        """Refuse to go on unless every rank holds the same ``values`` (name -> a hex digest or a value's text),
        naming the keys that differ with each rank's value (a digest by its first 12 digits)."""
        every = self.allgather(site, values)
        differ = [name for name in values if len({d.get(name) for d in every}) > 1]
        if differ:
            per_rank = "\n".join(f"  rank {r}: " + ", ".join(f"{n} {_shown(d.get(n, '-'))}" for n in differ)
                                  for r, d in enumerate(every))
            raise AgreedError(f"ranks hold different {what} (differing: {', '.join(differ)}); expected "
                              f"{expected}:\n{per_rank}")


def out_of_memory(e: MemoryError, site: str | None = None) -> str:
    """The error line of a MemoryError (an allocation the host or the device refused), at ``site``."""
    at = f" at '{site}'" if site else ""
    return (f"out of memory{at}: {str(e) or type(e).__name__}; expected more free memory per rank (more ranks or "
            "nodes, fewer ranks per node, another process's memory freed; for run's check: --check sampled)")


class _TaggedStdout:
    """``sys.stdout`` while a command runs: a write or flush the system refuses (a full disk, /dev/full) raises its
    OSError naming ``STDOUT`` as the file, so the error says what could not be written (a file object's own
    OSError names no path, and a failed flush drops its buffer: nothing later can tell it was stdout)."""

    def __init__(self, stream: Any):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            raise _tagged(e) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            raise _tagged(e) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _tagged(e: OSError) -> OSError:
    if e.filename is None and not isinstance(e, BrokenPipeError):  # a closed reader stays a BrokenPipeError
        e.filename = STDOUT
    return e


def _stdout_to_devnull() -> None:
    """After stdout failed (a closed reader, a full disk): the exit's own flush of what is buffered must not fail
    the same way."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _with_tagged_stdout(main: Callable[[], int]) -> int:
    real = sys.stdout
    sys.stdout = _TaggedStdout(real)
    try:
        code = main()
        sys.stdout.flush()  # here, not at the exit, where a failure would only be reported by the interpreter
        return code
    finally:
        sys.stdout = real


def run_guarded(main: Callable[[], int], comm: Any | None) -> int:
    """Run ``main``; map errors to a clear message and an exit code, aborting MPI when needed."""
    rank = comm.Get_rank() if comm is not None else 0
    size = comm.Get_size() if comm is not None else 1
    who = f"[rank {rank}] " if size > 1 else ""  # which rank, where there are several
    try:
        return _with_tagged_stdout(main)
    except AgreedError as e:  # every rank holds the same message: rank 0 prints it, every rank exits
        if rank == 0:
            print(f"glm-ep: error: {e}", file=sys.stderr, flush=True)
        return EXIT_INTERNAL if e.internal else EXIT_USER
    except GlmEpError as e:
        msg, code = f"{who}glm-ep: error: {e}", EXIT_USER
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM where the command watches signals (deadline.Terminated)
        terminated = isinstance(e, Terminated)
        msg = f"{who}glm-ep: {'terminated (SIGTERM)' if terminated else 'interrupted'}"
        code = EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    except MemoryError as e:
        msg, code = f"{who}glm-ep: error: {out_of_memory(e)}", EXIT_USER
    except BrokenPipeError:  # stdout closed by its reader (``| head``): quiet, as a shell tool would be
        _stdout_to_devnull()
        msg, code = "", EXIT_BROKEN_PIPE
    except BaseException as e:  # noqa: BLE001 - a crash on one rank must not leave the others hanging
        if (refused := file_access_error(e)) is not None:
            if isinstance(e, OSError) and e.filename == STDOUT:
                _stdout_to_devnull()
            msg, code = f"{who}glm-ep: error: {refused}", EXIT_USER
        else:
            msg, code = f"{who}glm-ep: internal error:\n{traceback.format_exc().rstrip()}", EXIT_INTERNAL
    if size > 1:
        msg = "\n".join(m for m in (msg, f"[rank {rank}] glm-ep: aborting all {size} ranks") if m)
    if msg:
        # ONE write: the launcher forwards a rank's stderr on its own schedule, and the abort below
        # tears the job down; a message split over writes has lost its second half that way
        try:
            sys.stderr.write(msg + "\n")
            sys.stderr.flush()
        except OSError:  # stderr itself refused (2>/dev/full): the exit code still says it
            pass
    if size > 1:
        time.sleep(ABORT_GRACE_S)  # let the launcher forward the message before the abort
        comm.Abort(code)
    return code
