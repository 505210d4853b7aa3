"""The collective deadline: no rank waits on the others forever.

Every wait on other ranks (an agreement point, a site all-reduce, a device sync that holds an
NCCL all-reduce) runs inside ``Deadline.guard(site)``. A watchdog thread looks at the armed
guard; one that has waited longer than ``timeout_s`` prints which rank waited at which site, runs
the abort hooks (an NCCL communicator abort, so kernels spinning on a stopped peer return), and
aborts the MPI job with ``EXIT_STALL``. mpi4py and CuPy release the GIL while they block, so the
watchdog runs while the main thread waits. Arming a guard is two attribute writes: cheap enough
for every site all-reduce.

Time the process spends stopped (SIGSTOP, a frozen container, a paused machine) is not waiting: the
watchdog sees it as a gap between its own ticks and leaves it out. A signal (Ctrl-C, SIGTERM) that
arrives while the main thread is blocked in a guarded wait cannot reach Python there; with
``watch_signals`` the watchdog is woken instead (``signal.set_wakeup_fd``) and ends the job as the
interrupt would: the message, the abort hooks, ``EXIT_INTERRUPTED`` or ``EXIT_TERMINATED``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from types import TracebackType
from typing import Callable, Iterator

from glm_ep.errors import EXIT_INTERRUPTED, EXIT_STALL, EXIT_TERMINATED

#: ``collective_timeout_s`` of a topology that does not set it: a few minutes, far above the
#: imbalance between ranks at one agreement point (the load agrees once per layer).
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
ABORT_GRACE_S = 0.2  # a failing rank's pause between its last message and MPI_Abort: the launcher
# forwards each rank's stderr on its own schedule, and the abort tears the job down
SUSPENDED_S = 1.0  # a gap between two watchdog ticks this much past the tick: the process was stopped
SIGNAL_GRACE_S = 0.5  # a signal during a guarded wait: the time the main thread gets to take it itself


class Deadline:
    """Bounds the waits of one rank of a ``size``-rank job; ``abort(code)`` ends the whole job."""

    def __init__(self, rank: int, size: int, timeout_s: float, abort: Callable[[int], None]):
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self._abort = abort
        self._hooks: list[Callable[[], None]] = []
        self._armed: tuple[str, float, float] | None = None  # (site, monotonic time it began, _stopped_s then)
        self._watcher: threading.Thread | None = None
        self._stopped_s = 0.0  # time the process spent stopped, as the watchdog's tick gaps show it
        self._last_tick: float | None = None
        self._signal_fd: int | None = None  # the read end of the signal wake-up pipe (watch_signals)
        self._signal: tuple[int, float, tuple[str, float, float]] | None = None  # (signal, seen, armed guard)

    @property
    def tick_s(self) -> float:
        return min(1.0, max(0.05, self.timeout_s / 20))

    def watch_signals(self) -> None:
        """Main thread only (a command's, not a library's): the watchdog hears SIGINT and SIGTERM as they arrive
        and ends the job if the main thread sits in a guarded wait (where Python cannot take them) past
        SIGNAL_GRACE_S. SIGTERM (a scheduler's cancel) is made to raise ``Terminated`` in the main thread."""
        if self._signal_fd is not None:
            return
        if self.size < 2:  # no peer to wait on, nothing to watch: SIGTERM still ends the job as Terminated
            signal.signal(signal.SIGTERM, _raise_terminated)
            return
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, _raise_terminated)
        self._signal_fd = r
        self._start()

    def on_expiry(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` (e.g. an NCCL communicator abort) before the MPI abort."""
        self._hooks.append(hook)

    def guard(self, site: str) -> "Guard":
        """A context manager bounding the wait inside it; ``site`` names it in the message."""
        return Guard(self, site)

    def _arm(self, site: str) -> tuple[str, float, float] | None:
        previous, self._armed = self._armed, (site, time.monotonic(), self._stopped_s)
        self._start()
        return previous

    def _start(self) -> None:
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="glm-ep deadline", daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        while True:
            self._tick(time.monotonic())
            time.sleep(self.tick_s)

    def _tick(self, now: float) -> None:
        """One look at the armed guard at monotonic time ``now``: leave out a gap since the last tick far past the
        tick (the process was stopped), take in signals, expire a wait past ``timeout_s``."""
        if self._last_tick is not None and now - self._last_tick > self.tick_s + SUSPENDED_S:
            self._stopped_s += now - self._last_tick - self.tick_s
        self._last_tick = now
        armed = self._armed
        self._take_signals(now, armed)
        if armed is not None and (waited := self.waited(armed, now)) > self.timeout_s:
            self._expire(armed[0], waited)

    def waited(self, armed: tuple[str, float, float], now: float) -> float:
        """How long the guard ``armed`` has waited at ``now``, the time the process was stopped left out."""
        return now - armed[1] - (self._stopped_s - armed[2])

    def _take_signals(self, now: float, armed: tuple[str, float, float] | None) -> None:
        if self._signal_fd is None:
            return
        try:
            got = os.read(self._signal_fd, 64)
        except BlockingIOError:
            got = b""
        for s in got:
            if s in (signal.SIGINT, signal.SIGTERM) and armed is not None:
                self._signal = (s, now, armed)
        if self._signal is not None:
            s, seen, during = self._signal
            if self._armed is not during:  # the main thread left that wait: the signal is its to take
                self._signal = None
            elif now - seen >= SIGNAL_GRACE_S:
                self._end(f"{'interrupted' if s == signal.SIGINT else 'terminated (SIGTERM)'} while rank "
                          f"{self.rank} waited at '{during[0]}' for the other ranks",
                          EXIT_INTERRUPTED if s == signal.SIGINT else EXIT_TERMINATED)

    def _expire(self, site: str, waited: float) -> None:
        self._end(f"error: rank {self.rank} waited {waited:.1f} s at '{site}' for the other ranks "
                  f"(collective_timeout_s = {self.timeout_s:g}): a rank is stopped, hung or gone", EXIT_STALL)

    def _end(self, what: str, code: int) -> None:
        print(f"[rank {self.rank}] glm-ep: {what}; aborting all {self.size} ranks", file=sys.stderr, flush=True)
        for hook in self._hooks:
            try:
                hook()
            except Exception as e:  # noqa: BLE001 - the MPI abort below must still run
                print(f"[rank {self.rank}] glm-ep: abort hook failed: {e!r}", file=sys.stderr, flush=True)
        time.sleep(ABORT_GRACE_S)  # let the launcher forward the message before the abort
        self._abort(code)
        os._exit(code)  # MPI_Abort does not return; if it ever does, this rank still ends


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread (``Deadline.watch_signals``): the job ends as an interrupt does."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated()


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Inside it, in the main thread (a command's, not a library's): SIGTERM raises ``Terminated``, so the command
    ends as an interrupt does (its message, its cleanup) instead of being killed mid-write; the handler before it
    is restored after. Outside the main thread (where Python takes no handler) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)  # None: set outside Python


class Guard:
    __slots__ = ("deadline", "site", "previous")

    def __init__(self, deadline: Deadline, site: str):
        self.deadline, self.site = deadline, site
        self.previous: tuple[str, float, float] | None = None

    def __enter__(self) -> None:
        if self.deadline.size > 1:  # one rank waits on nobody
            self.previous = self.deadline._arm(self.site)

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.deadline.size > 1:
            self.deadline._armed = self.previous


def guarded(deadline: Deadline | None, site: str) -> AbstractContextManager[None]:
    """``deadline.guard(site)``, or no bound where there is no deadline (a library caller, a test)."""
    return deadline.guard(site) if deadline is not None else nullcontext()
