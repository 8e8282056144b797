"""Time for the fake engine: a latency model (how long work takes) and clocks (what time it is).

Two different notions of time, kept apart on purpose:

* **Latency** is simulated with ``asyncio.sleep`` (never blocking the event loop; injectable
  as ``Sleep``), so a fake engine behaves like a slow server to real HTTP clients. Every knob
  defaults to zero in ``FAST``, so tests run at the speed of the HTTP stack.
* **Clocks** decide lease and TTL expiry (``kv_lease_duration``, ``decoder_kv_blocks_ttl``).
  They are injectable (default ``time.monotonic``) so a test can expire a 480 s TTL with
  ``ManualClock.advance(481)`` instead of sleeping.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

Clock = Callable[[], float]
#: How the engine waits out simulated latency (default ``asyncio.sleep``; a test may inject a
#: recording sleep to check what was simulated without measuring wall-clock time).
Sleep = Callable[[float], Awaitable[None]]


class ManualClock:
    """A clock that only moves when told to: ``advance(seconds)`` or ``set(t)``.

    Share one instance between the engines of a cluster: in-process "NIXL" compares a holder's
    expiry deadline with the holder's clock, exactly like vLLM compares perf_counter deadlines
    after a clock-offset handshake.
    """

    def __init__(self, start: float = 1000.0) -> None:
        self._now = float(start)

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        """Move forward by ``seconds`` (>= 0) and return the new time."""
        if seconds < 0:
            raise ValueError("a clock does not go backwards")
        self._now += seconds
        return self._now

    def set(self, now: float) -> None:
        if now < self._now:
            raise ValueError("a clock does not go backwards")
        self._now = float(now)


@dataclass(frozen=True)
class LatencyModel:
    """Seconds each step of a request takes. All values are >= 0; 0 means "no sleep".

    * prefill of ``m`` new tokens in a context of ``n`` tokens (``m`` computed locally after
      prefix-cache hits and pulled KV): ``prefill_overhead_s + prefill_s_per_token * m +
      prefill_quadratic_s * m * n``; a full prefill of ``n`` tokens has the quadratic term
      ``prefill_quadratic_s * n**2`` (attention).
    * KV transfer of ``t`` tokens: ``transfer_overhead_s + transfer_s_per_token * t``
      (paid by the reader, before its own prefill; ``t == 0`` costs nothing).
    * decode: ``decode_s_per_token`` for every generated token after the first (the first
      one comes out of the prefill step, as in vLLM).
    * ``request_overhead_s`` once per generation request (tokenization, scheduling).
    * ``max_concurrent_prefills``: prefills (transfer + compute) admitted at once; ``None``
      means unlimited. ``1`` models an engine that runs one prefill batch at a time, so
      prefill queueing shows up in TTFT under load.
    """

    request_overhead_s: float = 0.0
    prefill_overhead_s: float = 0.0
    prefill_s_per_token: float = 0.0
    prefill_quadratic_s: float = 0.0
    transfer_overhead_s: float = 0.0
    transfer_s_per_token: float = 0.0
    decode_s_per_token: float = 0.0
    max_concurrent_prefills: int | None = None

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, float) and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.max_concurrent_prefills is not None and self.max_concurrent_prefills < 1:
            raise ValueError("max_concurrent_prefills must be >= 1 or None")

    def prefill_s(self, computed_tokens: int, context_tokens: int) -> float:
        if computed_tokens <= 0:
            return 0.0
        return (
            self.prefill_overhead_s
            + self.prefill_s_per_token * computed_tokens
            + self.prefill_quadratic_s * computed_tokens * max(context_tokens, computed_tokens)
        )

    def transfer_s(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return self.transfer_overhead_s + self.transfer_s_per_token * tokens


#: Everything instantaneous: component tests and capacity benchmarks.
FAST = LatencyModel()

#: Roughly the real CPU cluster with the ``tiny`` model: prefill 0.05 ms/token plus a
#: quadratic (attention) term reaching 2 s at 16k tokens (so a 16k-token prefill takes about
#: 0.8 + 2.0 s), KV transfer 40 ms + 5 us/token, decode 5 ms/token, one prefill at a time.
CPU = LatencyModel(
    prefill_s_per_token=0.00005,
    prefill_quadratic_s=2.0 / 16384**2,
    transfer_overhead_s=0.040,
    transfer_s_per_token=0.000005,
    decode_s_per_token=0.005,
    max_concurrent_prefills=1,
)

PRESETS: Mapping[str, LatencyModel] = MappingProxyType({"fast": FAST, "cpu": CPU})


def latency_preset(name: str) -> LatencyModel:
    """The preset called ``name`` (``fast`` or ``cpu``); ``ValueError`` for others."""
    try:
        return PRESETS[name]
    except KeyError:
        choices = sorted(PRESETS)
        raise ValueError(f"unknown latency preset {name!r}; choose from {choices}") from None
