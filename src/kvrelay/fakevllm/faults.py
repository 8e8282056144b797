"""Fault knobs of one fake engine, settable at runtime from a test or over HTTP.

From a test: ``engine.faults.error_status = 503``; over HTTP: ``POST /fake/faults`` with a
JSON object of the same names, e.g. ``{"hang": true}``; ``{"clear": true}`` resets them all.
Two faults are *actions* rather than knobs and live on the engine: ``await engine.crash()``
and ``await engine.restart()`` (over HTTP: ``{"crash": true}`` / ``{"restart": true}``).

Knobs apply to the generation endpoints (``/v1/completions``, ``/v1/chat/completions``);
``/tokenize``, ``/v1/models`` and ``/metrics`` keep answering (in vLLM they do not go through
the engine core), and ``/health`` follows ``unhealthy`` and ``health_hang``. Faults survive
``restart()``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from types import MappingProxyType

#: Knob name -> accepted JSON types, for ``POST /fake/faults``.
_KNOB_TYPES: Mapping[str, tuple[type, ...]] = MappingProxyType({
    "error_status": (int, type(None)),
    "error_count": (int, type(None)),
    "hang": (bool,),
    "slow_stream_s": (int, float),
    "side_channel_unreachable": (bool,),
    "die_after_tokens": (int, type(None)),
    "unhealthy": (bool,),
    "health_hang": (bool,),
})


class Faults:
    """The fault knobs; all off after construction or ``clear()``.

    * ``error_status``: generation requests answer this HTTP status (e.g. 500, 503) with
      vLLM's error body, before any work is done.
    * ``error_count``: with ``error_status``, how many requests fail before the knob clears
      itself; ``None`` fails every request until cleared.
    * ``hang``: generation requests are accepted but get no response bytes until ``hang`` is
      set back to False (then they proceed normally).
    * ``slow_stream_s``: extra seconds before every generated token (streamed or not).
    * ``side_channel_unreachable``: other engines cannot reach this engine's NIXL side
      channel, so their KV reads from it fail (as a failed transfer on the reader).
    * ``die_after_tokens``: after generating ``k`` tokens of a request that has more to
      generate, the engine resets the connection (streaming: after ``k`` token chunks were
      sent, without the final chunk or ``[DONE]``, or ``k`` Responses / Messages deltas
      without their closing events; non-streaming: no response at all). The
      engine itself lives on: the request is aborted, so no KV is held for it, and a D-side
      report (if asked for) says ``kv_transfer_params: null``, as vLLM's abort path does.
    * ``unhealthy``: ``/health`` answers 503.
    * ``health_hang``: ``/health`` gets no answer until it is set back to False (an engine
      whose API server is too busy to answer, e.g. rendering a huge prompt); generation
      requests are served as usual.
    """

    def __init__(self) -> None:
        self.error_status: int | None = None
        self.error_count: int | None = None
        self.slow_stream_s: float = 0.0
        self.side_channel_unreachable: bool = False
        self.die_after_tokens: int | None = None
        self.unhealthy: bool = False
        self._hang = False
        self._released = asyncio.Event()
        self._released.set()
        self._num_hung = 0
        self._health_hang = False
        self._health_released = asyncio.Event()
        self._health_released.set()

    def cut_after(self, total: int) -> int | None:
        """How many of a request's ``total`` tokens to send before ``die_after_tokens`` cuts
        the connection; ``None`` when it does not apply (off, or no more than ``k``)."""
        die = self.die_after_tokens
        return die if die is not None and die < total else None

    @property
    def num_hung(self) -> int:
        """Generation requests currently held by ``hang`` (lets a test wait for arrival)."""
        return self._num_hung

    @property
    def hang(self) -> bool:
        return self._hang

    @hang.setter
    def hang(self, value: bool) -> None:
        self._hang = bool(value)
        if self._hang:
            self._released.clear()
        else:
            self._released.set()

    @property
    def health_hang(self) -> bool:
        return self._health_hang

    @health_hang.setter
    def health_hang(self, value: bool) -> None:
        self._health_hang = bool(value)
        if self._health_hang:
            self._health_released.clear()
        else:
            self._health_released.set()

    async def wait_while_health_hung(self) -> None:
        """Return at once unless ``health_hang`` is set; then wait until it is cleared."""
        if self._health_hang:
            await self._health_released.wait()

    async def wait_while_hung(self) -> None:
        """Return at once unless ``hang`` is set; then wait until it is cleared."""
        if self._hang:
            self._num_hung += 1
            try:
                await self._released.wait()
            finally:
                self._num_hung -= 1

    def take_error(self) -> int | None:
        """The status to fail this request with, consuming one of ``error_count``; or None."""
        status = self.error_status
        if status is None:
            return None
        if self.error_count is not None:
            self.error_count -= 1
            if self.error_count <= 0:
                self.error_status = None
                self.error_count = None
        return status

    def clear(self) -> None:
        """Turn every knob off (releases hung requests)."""
        self.error_status = None
        self.error_count = None
        self.slow_stream_s = 0.0
        self.side_channel_unreachable = False
        self.die_after_tokens = None
        self.unhealthy = False
        self.hang = False
        self.health_hang = False

    def update(self, changes: Mapping[str, object]) -> None:
        """Set knobs from a JSON object; ``ValueError`` on an unknown name or a wrong type.

        Validates everything before changing anything, so a bad request changes nothing.
        """
        for name, value in changes.items():
            types = _KNOB_TYPES.get(name)
            if types is None:
                raise ValueError(f"unknown fault {name!r}; known: {sorted(_KNOB_TYPES)}")
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                raise ValueError(f"fault {name!r} has the wrong type: {value!r}")
            if name == "error_status" and isinstance(value, int) and not 400 <= value <= 599:
                raise ValueError("error_status must be an HTTP error status (400..599)")
            if name == "slow_stream_s" and isinstance(value, int | float) and value < 0:
                raise ValueError("slow_stream_s must be >= 0")
            if name in ("error_count", "die_after_tokens") and isinstance(value, int) and value < 0:
                raise ValueError(f"{name} must be >= 0")
        for name, value in changes.items():
            if name == "slow_stream_s":
                value = float(value)  # type: ignore[arg-type]
            setattr(self, name, value)

    def to_json(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in _KNOB_TYPES}
