"""A one-line progress bar on stderr: ``[pull] ######---- 12/40 turns  ttft p50 85 ms  2 err``.

On a terminal the line is redrawn in place (``\\r``); elsewhere (a log file, CI) a line is
printed each time another tenth of the work is done, and at the end. No state outside the
instance; ``close()`` ends the line.
"""

from __future__ import annotations

import sys
from typing import TextIO

from kvrelay.bench.metrics import TurnRecord, percentile


class Progress:
    """Counts turns of one mode's run; ``update`` is an ``execute.OnTurn`` callback."""

    def __init__(
        self, label: str, total: int, stream: TextIO | None = None, width: int = 24
    ) -> None:
        self.label = label
        self.total = max(total, 0)
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.done = 0
        self.errors = 0
        self._ttfts: list[float] = []
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_tenth = -1

    def update(self, record: TurnRecord, skipped: int = 0) -> None:
        self.done += 1 + skipped
        if record.succeeded and record.ttft_s is not None:
            self._ttfts.append(record.ttft_s)
        else:
            self.errors += 1
        self._draw()

    def line(self) -> str:
        """The current bar, without line control characters."""
        frac = min(1.0, self.done / self.total) if self.total else 1.0
        filled = round(frac * self.width)
        text = f"[{self.label}] {'#' * filled}{'-' * (self.width - filled)} "
        text += f"{self.done}/{self.total} turns"
        if self._ttfts:
            text += f"  ttft p50 {percentile(self._ttfts, 50) * 1000:.0f} ms"
        if self.errors:
            text += f"  {self.errors} err"
        return text

    def _draw(self) -> None:
        if self._tty:
            self.stream.write("\r" + self.line())
            self.stream.flush()
            return
        tenth = int(10 * self.done / self.total) if self.total else 10
        if tenth != self._last_tenth:
            self._last_tenth = tenth
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()


class WorkProgress:
    """A progress line for work measured in any unit (bytes read, rows, TTLs):
    ``[read trace] ######---- 412/980 MB``. Same drawing rules as ``Progress``;
    ``advance_to(done)`` sets the amount done so far."""

    def __init__(
        self, label: str, total: float, unit: str = "", stream: TextIO | None = None,
        width: int = 24, scale: float = 1.0,
    ) -> None:
        self.label = label
        self.total = max(total, 0.0)
        self.unit = unit
        self.scale = scale
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.done = 0.0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_tenth = -1

    def advance_to(self, done: float) -> None:
        self.done = min(max(done, 0.0), self.total) if self.total else done
        if self._tty:
            self.stream.write("\r" + self.line())
            self.stream.flush()
            return
        tenth = int(10 * self.done / self.total) if self.total else 10
        if tenth != self._last_tenth:
            self._last_tenth = tenth
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def line(self) -> str:
        frac = min(1.0, self.done / self.total) if self.total else 1.0
        filled = round(frac * self.width)
        unit = f" {self.unit}" if self.unit else ""
        return (f"[{self.label}] {'#' * filled}{'-' * (self.width - filled)} "
                f"{self.done / self.scale:.0f}/{self.total / self.scale:.0f}{unit}")

    def close(self) -> None:
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()
