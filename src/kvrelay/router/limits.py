"""Admission: the in-flight cap (global and per tenant), draining, and the open turns.

Generation requests count as in flight from admission (after authentication and once their
body has arrived, so neither an unauthenticated flood nor a client that sends a head and then
stalls takes a slot: what bodies still arriving hold is bounded by ``bodies``, a
``BodyBudget`` of ``max_in_flight`` full bodies) until their response, streams included, has
been sent.
Beyond ``max_in_flight``, or beyond a tenant's share (``max_in_flight_per_tenant``), the
router answers 429 with ``Retry-After`` at once instead of queueing. While draining
(SIGTERM, see ``router.server``) new requests get 503, except ``/metrics`` and the internal
listener. ``cut_all`` ends the turns still open at the drain deadline (each answers what it
can: a stream gets an error event and ``[DONE]``).
"""

from __future__ import annotations

from collections import Counter

from kvrelay.router.asgi import BodyBudget, DisconnectWatch
from kvrelay.router.errors import ClientError
from kvrelay.router.metrics import RouterMetrics


class Admission:
    """Shared by the handlers and the server: what is in flight, whether we drain."""

    def __init__(self, max_in_flight: int, per_tenant: int, metrics: RouterMetrics, *,
                 max_body_bytes: int) -> None:
        self.max_in_flight = max_in_flight
        self.bodies = BodyBudget(max_in_flight * max_body_bytes)
        self.per_tenant = per_tenant
        self.draining = False
        self.in_flight = 0
        self._by_tenant: Counter[str] = Counter()
        self._metrics = metrics
        self._open: set[DisconnectWatch] = set()
        metrics.in_flight.set_function(lambda: float(self.in_flight))

    def admit(self, tenant: str) -> None:
        """Take a slot for ``tenant`` or raise ``ClientError`` (503 draining, 429 full)."""
        if self.draining:
            self._metrics.rejected.labels("draining").inc()
            raise ClientError("The router is shutting down", status=503,
                              headers={"Connection": "close"})
        if self.in_flight >= self.max_in_flight or self._by_tenant[tenant] >= self.per_tenant:
            self._metrics.rejected.labels("overload").inc()
            limit = min(self.max_in_flight, self.per_tenant)
            raise ClientError(
                f"Too many requests in flight (limit {limit}); retry later", status=429,
                headers={"Retry-After": "1"},
            )
        self.in_flight += 1
        self._by_tenant[tenant] += 1

    def release(self, tenant: str) -> None:
        self.in_flight -= 1
        left = self._by_tenant[tenant] - 1
        if left > 0:
            self._by_tenant[tenant] = left
        else:
            del self._by_tenant[tenant]

    def opened(self, watch: DisconnectWatch) -> None:
        self._open.add(watch)

    def closed(self, watch: DisconnectWatch) -> None:
        self._open.discard(watch)

    def cut_all(self) -> int:
        """Cut every open turn (drain deadline); returns how many."""
        watches = list(self._open)
        for watch in watches:
            watch.cut()
        return len(watches)
