"""The gaps between turns the router has seen, per scope and kind, for ``core.retention_time``.

Each gap (a turn's arrival minus the creation of the entry it continues, as ``plan``
measures it, expired and released entries included) is counted under the kind of gap it was
(``GapKind``: after a tool call or after a reply, the continued entry's ``waits_for``), three
times: under the request's explicit conversation scope (an id), its tenant, and all traffic.
Each turn whose entry was committed counts as ended under its own kind the same three times
(``ended``), so that each histogram also knows the share of turns that came back.
``histograms(req, kind)`` returns that kind's, narrowest first, for ``plan_retention`` to
take the first with enough samples. At most ``max_scopes`` conversation scopes are kept, the
least recently used forgotten first (tenants are few; their count is bounded by the
configured keys).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import msgspec

from kvrelay.core.conversation import GapKind
from kvrelay.core.identity import RequestIdentity
from kvrelay.core.retention_time import GapHistogram
from kvrelay.router.request import TurnRequest

DEFAULT_MAX_SCOPES = 10_000


class _ByKind(msgspec.Struct, frozen=True):
    """One scope's histograms: gaps after a tool call, gaps after a reply."""

    tool: GapHistogram = GapHistogram()
    user: GapHistogram = GapHistogram()

    def with_(self, kind: GapKind, change: Callable[[GapHistogram], GapHistogram]) -> _ByKind:
        if kind == "tool":
            return _ByKind(change(self.tool), self.user)
        return _ByKind(self.tool, change(self.user))

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
        """A turn came back ``gap_s`` after the turn it continues ended ``kind``'s way."""
        decay = self._decay
        self._update(req.identity, req.tenant, kind,
                     lambda h: h.observe(gap_s, decay=decay))

    def ended(self, identity: RequestIdentity, tenant: str, kind: GapKind) -> None:
        """A turn ended ``kind``'s way (its entry was committed): one more that may come
        back (``GapHistogram.return_share``)."""
        decay = self._decay
        self._update(identity, tenant, kind, lambda h: h.end(decay=decay))

    def _update(self, identity: RequestIdentity, tenant: str, kind: GapKind,
                change: Callable[[GapHistogram], GapHistogram]) -> None:
        self._all = self._all.with_(kind, change)
        self._tenants[tenant] = self._tenants.get(tenant, _ByKind()).with_(kind, change)
        if identity.explicit:
            scope = identity.scope
            mine = self._scopes.pop(scope, _ByKind())
            self._scopes[scope] = mine.with_(kind, change)
            while len(self._scopes) > self._max:
                self._scopes.popitem(last=False)

    def histograms(self, req: TurnRequest, kind: GapKind = "user") -> list[GapHistogram | None]:
        """``kind``'s histograms: the request's conversation scope's (``None`` without an
        id), its tenant's, all traffic's."""
        scoped = self._scopes.get(req.identity.scope) if req.identity.explicit else None
        tenant = self._tenants.get(req.tenant)
        return [s.of(kind) if s is not None else None for s in (scoped, tenant, self._all)]
