"""A one-line progress bar on stderr: ``[read trace] ######---- 412/980 MB``.

On a terminal the line is redrawn in place (``\\r``); elsewhere (a log file, CI) a line is
printed each time another tenth of the work is done, and at the end. No state outside the
instance; ``close()`` ends the line. ``bench.progress.Progress`` draws its turn counts with
the same ``ProgressLine`` and ``bar``.
"""

from __future__ import annotations

import sys
from typing import TextIO


class ProgressLine:
    """Where a bar is drawn and when: redrawn in place on a terminal, else a line each time
    another tenth of ``total`` is done (and at the end)."""

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_tenth = -1

    def draw(self, text: str, done: float, total: float) -> None:
        if self._tty:
            self.stream.write("\r" + text)
            self.stream.flush()
            return
        tenth = int(10 * done / total) if total else 10
        if tenth != self._last_tenth:
            self._last_tenth = tenth
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()


def bar(label: str, done: float, total: float, width: int) -> str:
    """``[label] ######---- `` for ``done`` of ``total`` (full when there is nothing to do)."""
    frac = min(1.0, done / total) if total else 1.0
    filled = round(frac * width)
    return f"[{label}] {'#' * filled}{'-' * (width - filled)} "


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
        self.width = width
        self.done = 0.0
        self._out = ProgressLine(stream)

    def advance_to(self, done: float) -> None:
        self.done = min(max(done, 0.0), self.total) if self.total else done
        self._out.draw(self.line(), self.done, self.total)

    def line(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        return (bar(self.label, self.done, self.total, self.width)
                + f"{self.done / self.scale:.0f}/{self.total / self.scale:.0f}{unit}")

    def close(self) -> None:
        self._out.close()
