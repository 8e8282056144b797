"""A one-line progress bar of a benchmark's turns on stderr:
``[pull] ######---- 12/40 turns  ttft p50 85 ms  2 err`` (drawn as ``display.progress``
draws every bar)."""

from __future__ import annotations

from typing import TextIO

from kvrelay.bench.metrics import TurnRecord, percentile
from kvrelay.display.progress import ProgressLine, bar


class Progress:
    """Counts turns of one mode's run; ``update`` is an ``execute.OnTurn`` callback."""

    def __init__(
        self, label: str, total: int, stream: TextIO | None = None, width: int = 24
    ) -> None:
        self.label = label
        self.total = max(total, 0)
        self.width = width
        self.done = 0
        self.errors = 0
        self._ttfts: list[float] = []
        self._out = ProgressLine(stream)

    def update(self, record: TurnRecord, skipped: int = 0) -> None:
        self.done += 1 + skipped
        if record.succeeded and record.ttft_s is not None:
            self._ttfts.append(record.ttft_s)
        else:
            self.errors += 1
        self._out.draw(self.line(), self.done, self.total)

    def line(self) -> str:
        """The current bar, without line control characters."""
        text = bar(self.label, self.done, self.total, self.width)
        text += f"{self.done}/{self.total} turns"
        if self._ttfts:
            text += f"  ttft p50 {percentile(self._ttfts, 50) * 1000:.0f} ms"
        if self.errors:
            text += f"  {self.errors} err"
        return text

    def close(self) -> None:
        self._out.close()
