"""The gaps between turns the router has seen, per scope and kind, for ``core.retention_time``.

Each gap (a turn's arrival minus the creation of the entry it continues, as ``plan``
measures it, expired and released entries included) is counted under the kind of gap it was
(``GapKind``: after a tool call or after a reply, the continued entry's ``waits_for``), three
times: under the request's explicit conversation scope (an id), its tenant, and all traffic.
``histograms(req, kind)`` returns that kind's, narrowest first, for ``plan_retention`` to
take the first with enough samples. At most ``max_scopes`` conversation scopes are kept, the
least recently used forgotten first (tenants are few; their count is bounded by the
configured keys).
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from kvrelay.core.conversation import GapKind
from kvrelay.core.retention_time import GapHistogram
from kvrelay.router.request import TurnRequest

DEFAULT_MAX_SCOPES = 10_000


class _ByKind(msgspec.Struct, frozen=True):
    """One scope's histograms: gaps after a tool call, gaps after a reply."""

    tool: GapHistogram = GapHistogram()
    user: GapHistogram = GapHistogram()

    def observe(self, kind: GapKind, gap_s: float, decay: float) -> _ByKind:
        if kind == "tool":
            return _ByKind(self.tool.observe(gap_s, decay=decay), self.user)
        return _ByKind(self.tool, self.user.observe(gap_s, decay=decay))

    def of(self, kind: GapKind) -> GapHistogram:
        return self.tool if kind == "tool" else self.user


class RetainTimes:
    """Gap histograms by scope and kind (module docstring); mutated only from the event
    loop."""

    def __init__(self, *, decay: float = 0.998, max_scopes: int = DEFAULT_MAX_SCOPES) -> None:
        if not 0.0 < decay <= 1.0 or max_scopes < 1:
            raise ValueError("decay must be in (0, 1] and max_scopes >= 1")
        self._decay = decay
        self._max = max_scopes
        self._scopes: OrderedDict[bytes, _ByKind] = OrderedDict()
        self._tenants: dict[str, _ByKind] = {}
        self._all = _ByKind()

    def observe(self, req: TurnRequest, gap_s: float, kind: GapKind = "user") -> None:
        decay = self._decay
        self._all = self._all.observe(kind, gap_s, decay)
        tenant = self._tenants.get(req.tenant, _ByKind())
        self._tenants[req.tenant] = tenant.observe(kind, gap_s, decay)
        if req.identity.explicit:
            scope = req.identity.scope
            mine = self._scopes.pop(scope, _ByKind())
            self._scopes[scope] = mine.observe(kind, gap_s, decay)
            while len(self._scopes) > self._max:
                self._scopes.popitem(last=False)

    def histograms(self, req: TurnRequest, kind: GapKind = "user") -> list[GapHistogram | None]:
        """``kind``'s histograms: the request's conversation scope's (``None`` without an
        id), its tenant's, all traffic's."""
        scoped = self._scopes.get(req.identity.scope) if req.identity.explicit else None
        tenant = self._tenants.get(req.tenant)
        return [s.of(kind) if s is not None else None for s in (scoped, tenant, self._all)]
