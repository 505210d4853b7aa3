"""Progress of a long step, shown by one rank: a tqdm bar on a terminal, plain lines in a log.

tqdm redraws its bar with carriage returns: a terminal shows one changing line, but a log (stderr
redirected to a file, a batch system's capture) keeps every frame, one long line of ``\\r`` spam.
Where the stream is not a terminal, the same tqdm meter (count, percentage, elapsed, left, rate)
goes out as a plain log line at most every ``LINE_INTERVAL_S``. Either way nothing shows for a step
shorter than the delay (a bar for a moment's work is noise).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

from tqdm import tqdm

BAR_DELAY_S = 2.0  # a terminal's bar appears once the step has taken this long
LINE_INTERVAL_S = 30.0  # a log's lines: the first after this long, then at most one per interval
LINE_FORMAT = ("{desc}: {percentage:3.0f}% ({n_fmt} of {total_fmt} {unit}) "
               "[{elapsed} elapsed, {remaining} left, {rate_fmt}]")


class _LogLines:
    """A file for tqdm that turns each frame it writes into one log line (no carriage returns; a frame of the
    same count as the last, such as the one tqdm writes again at its close, is not repeated)."""

    def __init__(self, log: logging.Logger):
        self._log, self._last = log, ""

    def write(self, text: str) -> None:
        line = text.replace("\r", "").strip()
        count = line.partition(" [")[0]
        if line and count != self._last:
            self._log.info("%s", line)
            self._last = count

    def flush(self) -> None:
        pass


def progress(total: int, desc: str, unit: str = "it", enabled: bool = True, log: logging.Logger | None = None,
             stream: TextIO | None = None, delay_s: float | None = None, interval_s: float = LINE_INTERVAL_S,
             **tqdm_args: Any) -> tqdm:
    """A tqdm over ``total`` ``unit``s: a bar on ``stream`` (stderr by default) where it is a terminal, else plain
    lines through ``log`` every ``interval_s``; a silent one where not ``enabled`` (the ranks that do not report).
    ``delay_s``: nothing shows before (default ``BAR_DELAY_S`` for a bar, ``interval_s`` for lines)."""
    if not enabled:
        return tqdm(total=total, disable=True)
    stream = stream if stream is not None else sys.stderr
    if stream.isatty():
        return tqdm(total=total, desc=desc, unit=unit, file=stream, dynamic_ncols=True,
                    delay=BAR_DELAY_S if delay_s is None else delay_s, **tqdm_args)
    return tqdm(total=total, desc=desc, unit=unit, file=_LogLines(log or logging.getLogger(__name__)),
                bar_format=LINE_FORMAT, mininterval=interval_s, maxinterval=max(interval_s, 1.0),
                delay=interval_s if delay_s is None else delay_s, **tqdm_args)
