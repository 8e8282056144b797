"""The gaps between turns the router has seen, per scope, for ``core.retention_time``.

Each gap (a turn's arrival minus the creation of the entry it continues, as ``plan``
measures it, expired and released entries included) is counted three times: under the
request's explicit conversation scope (an id), its tenant, and all traffic.
``histograms(req)`` returns them narrowest first, for ``decide_retain_s`` to take the
narrowest one with enough samples. At most ``max_scopes`` conversation scopes are kept,
the least recently used forgotten first (tenants are few; their count is bounded by the
configured keys).
"""

from __future__ import annotations

from collections import OrderedDict

from kvrelay.core.retention_time import GapHistogram
from kvrelay.router.request import TurnRequest

DEFAULT_MAX_SCOPES = 10_000


class RetainTimes:
    """Gap histograms by scope (module docstring); mutated only from the event loop."""

    def __init__(self, *, decay: float = 0.998, max_scopes: int = DEFAULT_MAX_SCOPES) -> None:
        if not 0.0 < decay <= 1.0 or max_scopes < 1:
            raise ValueError("decay must be in (0, 1] and max_scopes >= 1")
        self._decay = decay
        self._max = max_scopes
        self._scopes: OrderedDict[bytes, GapHistogram] = OrderedDict()
        self._tenants: dict[str, GapHistogram] = {}
        self._all = GapHistogram()

    def observe(self, req: TurnRequest, gap_s: float) -> None:
        decay = self._decay
        self._all = self._all.observe(gap_s, decay=decay)
        tenant = self._tenants.get(req.tenant, GapHistogram())
        self._tenants[req.tenant] = tenant.observe(gap_s, decay=decay)
        if req.identity.explicit:
            scope = req.identity.scope
            mine = self._scopes.pop(scope, GapHistogram())
            self._scopes[scope] = mine.observe(gap_s, decay=decay)
            while len(self._scopes) > self._max:
                self._scopes.popitem(last=False)

    def histograms(self, req: TurnRequest) -> list[GapHistogram | None]:
        """The request's conversation scope's (``None`` without an id), its tenant's, all."""
        scoped = self._scopes.get(req.identity.scope) if req.identity.explicit else None
        return [scoped, self._tenants.get(req.tenant), self._all]
