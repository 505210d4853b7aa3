"""The collective deadline: no rank waits on the others forever.

Every wait on other ranks (an agreement point, a site all-reduce, a device sync that holds an
NCCL all-reduce) runs inside ``Deadline.guard(site)``. A watchdog thread looks at the armed
guard; one that has waited longer than ``timeout_s`` prints which rank waited at which site, runs
the abort hooks (an NCCL communicator abort, so kernels spinning on a stopped peer return), and
aborts the MPI job with ``EXIT_STALL``. mpi4py and CuPy release the GIL while they block, so the
watchdog runs while the main thread waits. Arming a guard is two attribute writes: cheap enough
for every site all-reduce.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from types import TracebackType
from typing import Callable

from glm_ep.errors import EXIT_STALL

#: ``collective_timeout_s`` of a topology that does not set it: a few minutes, far above the
#: imbalance between ranks at one agreement point (the load agrees once per layer).
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
ABORT_GRACE_S = 0.2  # a failing rank's pause between its last message and MPI_Abort: the launcher
# forwards each rank's stderr on its own schedule, and the abort tears the job down


class Deadline:
    """Bounds the waits of one rank of a ``size``-rank job; ``abort(code)`` ends the whole job."""

    def __init__(self, rank: int, size: int, timeout_s: float, abort: Callable[[int], None]):
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self._abort = abort
        self._hooks: list[Callable[[], None]] = []
        self._armed: tuple[str, float] | None = None  # (site, monotonic time the wait began)
        self._watcher: threading.Thread | None = None

    def on_expiry(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` (e.g. an NCCL communicator abort) before the MPI abort."""
        self._hooks.append(hook)

    def guard(self, site: str) -> "Guard":
        """A context manager bounding the wait inside it; ``site`` names it in the message."""
        return Guard(self, site)

    def _arm(self, site: str) -> tuple[str, float] | None:
        previous, self._armed = self._armed, (site, time.monotonic())
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="glm-ep deadline", daemon=True)
            self._watcher.start()
        return previous

    def _watch(self) -> None:
        while True:
            armed = self._armed
            if armed is not None and time.monotonic() - armed[1] > self.timeout_s:
                self._expire(*armed)
            time.sleep(min(1.0, max(0.05, self.timeout_s / 20)))

    def _expire(self, site: str, since: float) -> None:
        waited = time.monotonic() - since
        print(f"[rank {self.rank}] glm-ep: error: rank {self.rank} waited {waited:.1f} s at '{site}' for the "
              f"other ranks (collective_timeout_s = {self.timeout_s:g}): a rank is stopped, hung or gone; "
              f"aborting all {self.size} ranks", file=sys.stderr, flush=True)
        for hook in self._hooks:
            try:
                hook()
            except Exception as e:  # noqa: BLE001 - the MPI abort below must still run
                print(f"[rank {self.rank}] glm-ep: abort hook failed: {e!r}", file=sys.stderr, flush=True)
        time.sleep(ABORT_GRACE_S)  # let the launcher forward the message before the abort
        self._abort(EXIT_STALL)
        os._exit(EXIT_STALL)  # MPI_Abort does not return; if it ever does, this rank still ends


class Guard:
    __slots__ = ("deadline", "site", "previous")

    def __init__(self, deadline: Deadline, site: str):
        self.deadline, self.site = deadline, site
        self.previous: tuple[str, float] | None = None

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
