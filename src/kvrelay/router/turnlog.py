"""The turn log on disk: a size-bounded, rotating JSON-lines file of ``TurnLogRecord``\\ s.

``TurnLogWriter(path, max_bytes=..., backups=...)`` appends one line per routed turn
(``core.turnlog``); ``kvrelay tune`` reads the files back. Contracts:

* **Bounded.** The live file never grows past ``max_bytes`` (unless one line alone is longer):
  before a line would cross it, the file rotates ``PATH`` -> ``PATH.1`` -> ... ->
  ``PATH.{backups}`` (the oldest is deleted; ``backups=0`` keeps no history). At most
  ``(backups + 1) * max_bytes`` bytes are ever on disk.
* **Cheap on the event loop.** ``append`` encodes the record and buffers it in memory; the
  buffer goes to the file (one unbuffered ``write`` of at most ``buffer_bytes``, into the page
  cache, no ``fsync``) when it reaches ``buffer_bytes`` or when ``flush_interval_s`` has
  passed since the last flush, at the next ``append``. Call ``flush()`` from a periodic task
  to bound how long a quiet router keeps lines in memory; ``close()`` flushes.
* **Never fails a turn.** A write error (disk full, file removed under us) drops the lines
  it concerned, counts them in ``dropped_records`` and logs at most one warning per
  ``warn_interval_s``; the next flush tries again. Only the constructor raises (``OSError``):
  a path that cannot be opened is a configuration error, reported at startup.
* Single-threaded: call it from the event loop's thread only.

``TurnGaps`` remembers when each conversation's latest turn ended (a bounded LRU keyed by
the hashed key), which the router needs for ``gap_s``: the store forgets expired entries,
and a gap longer than the TTL is exactly what the log must show.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from kvrelay.core.turnlog import TurnLogRecord

log = logging.getLogger("kvrelay.router.turnlog")

DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_BACKUPS = 5
DEFAULT_BUFFER_BYTES = 64 * 1024
DEFAULT_FLUSH_INTERVAL_S = 1.0


class TurnLogWriter:
    """Appends turn log records to ``path`` with size-based rotation (see the module)."""

    def __init__(
        self,
        path: str | Path,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        backups: int = DEFAULT_BACKUPS,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        warn_interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        if backups < 0:
            raise ValueError("backups must be >= 0")
        if buffer_bytes < 1 or flush_interval_s < 0:
            raise ValueError("buffer_bytes must be >= 1 and flush_interval_s >= 0")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.buffer_bytes = min(buffer_bytes, max_bytes)
        self.flush_interval_s = flush_interval_s
        self.warn_interval_s = warn_interval_s
        self._clock = clock
        self._lines: list[bytes] = []
        self._buffered = 0
        self._last_flush = clock()
        self._last_warning: float | None = None
        self._fd: int | None = None
        self._closed = False
        self._size = 0
        self.written_records = 0
        self.dropped_records = 0
        self._open()

    @property
    def closed(self) -> bool:
        return self._closed

    def append(self, record: TurnLogRecord) -> None:
        """Buffer ``record``; write the buffer out if it is full or old (see the module)."""
        if self._closed:
            raise ValueError("append on a closed TurnLogWriter")
        line = record.to_json_line().encode("utf-8")
        self._lines.append(line)
        self._buffered += len(line)
        if (self._buffered >= self.buffer_bytes
                or self._clock() - self._last_flush >= self.flush_interval_s):
            self.flush()

    def flush(self) -> None:
        """Write every buffered line to disk (rotating as needed)."""
        self._last_flush = self._clock()
        lines, self._lines, self._buffered = self._lines, [], 0
        chunk: list[bytes] = []
        size = 0
        for line in lines:
            if self._size + size + len(line) > self.max_bytes and (self._size or size):
                self._write(chunk)
                chunk, size = [], 0
                self._rotate()
            chunk.append(line)
            size += len(line)
        self._write(chunk)

    def close(self) -> None:
        """Flush and close; later ``close`` calls do nothing."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError as exc:
                self._warn(f"turn log {self.path}: close failed: {exc}")
            self._fd = None

    def _open(self) -> int:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        self._fd = fd
        self._size = os.fstat(fd).st_size
        return fd

    def _write(self, chunk: list[bytes]) -> None:
        if not chunk:
            return
        data = b"".join(chunk)
        try:
            fd = self._fd if self._fd is not None else self._open()
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
        except OSError as exc:
            self.dropped_records += len(chunk)
            self._warn(f"turn log {self.path}: write failed, {len(chunk)} records dropped: {exc}")
            return
        self._size += len(data)
        self.written_records += len(chunk)

    def _rotate(self) -> None:
        try:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            if self.backups == 0:
                self.path.unlink(missing_ok=True)
            else:
                for i in range(self.backups - 1, 0, -1):
                    older = self._backup(i)
                    if older.exists():
                        older.replace(self._backup(i + 1))
                if self.path.exists():
                    self.path.replace(self._backup(1))
            self._open()
        except OSError as exc:
            self._warn(f"turn log {self.path}: rotation failed: {exc}")

    def _backup(self, index: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{index}")

    def _warn(self, message: str) -> None:
        now = self._clock()
        if self._last_warning is None or now - self._last_warning >= self.warn_interval_s:
            self._last_warning = now
            log.warning(message)


class TurnGaps:
    """When each conversation's latest turn ended (wall-clock seconds), for ``gap_s``.

    Keys are ``ConversationKey.hashed()``; at most ``max_keys`` are kept, the least recently
    used dropped first (a dropped conversation's next turn logs ``gap_s = None``). Per router
    process: replicas each know the turns they served.
    """

    def __init__(self, max_keys: int = 100_000) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be >= 1")
        self.max_keys = max_keys
        self._ended: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ended)

    def gap_s(self, key: str, now_s: float) -> float | None:
        """Seconds since ``key``'s previous turn ended (clamped at 0), ``None`` if unknown."""
        ended = self._ended.get(key)
        return None if ended is None else max(0.0, now_s - ended)

    def turn_ended(self, key: str, at_s: float) -> None:
        """Record that a turn of ``key`` ended at ``at_s`` (its response's last byte)."""
        self._ended[key] = at_s
        self._ended.move_to_end(key)
        while len(self._ended) > self.max_keys:
            self._ended.popitem(last=False)
