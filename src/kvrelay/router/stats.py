"""``GET /stats``: decision counts and the last N turns, conversation keys hashed.

``snapshot(tenant)`` is the ``decisions`` object of ``/stats``, of one tenant's turns (every
tenant's for the admin key or an open router)::

    {"by_action": {"pull": 3, ...}, "by_reason": {"pull": 3, "no_entry": 1, ...},
     "pull": {"pull": 3}, "recompute": {"no_entry": 1, ...}, "direct": {},
     "recent": [{"at_s", "key", "action", "reason", "reused_tokens", ...}]}

(every action has its ``{reason: count}`` object, empty or not). ``recent`` holds the turns
themselves and renders them when read, so in-flight turns show with ``outcome: null``; the
counts are of finished turns, by what happened (``Turn.effective``).
"""

from __future__ import annotations

from collections import Counter, deque

from kvrelay.router.turn import Turn

_ACTIONS = ("pull", "recompute", "direct")


class RouterStats:
    """Counters by tenant, action and reason, plus a ring of the ``recent`` latest turns.

    Counts are kept per tenant so that a tenant's ``/stats`` shows its own traffic only
    (docs/security.md); ``snapshot(None)`` adds every tenant's up."""

    def __init__(self, recent: int = 100) -> None:
        self._counts: dict[str, Counter[tuple[str, str]]] = {}
        self._recent: deque[Turn] = deque(maxlen=max(recent, 1))
        self._keep = recent > 0

    def record(self, turn: Turn) -> None:
        """Keep a planned turn among the recent ones."""
        if self._keep:
            self._recent.append(turn)

    def count(self, turn: Turn) -> None:
        """Count a finished turn by what happened, under its tenant."""
        self._counts.setdefault(turn.request.tenant, Counter())[turn.effective] += 1

    def snapshot(self, tenant: str | None = None) -> dict[str, object]:
        """Counts and recent turns of ``tenant`` (every tenant's with ``None``)."""
        counts: Counter[tuple[str, str]] = Counter()
        for who, mine in self._counts.items():
            if tenant is None or who == tenant:
                counts.update(mine)
        by_action: Counter[str] = Counter()
        by_reason: Counter[str] = Counter()
        by_action_reason: dict[str, Counter[str]] = {a: Counter() for a in _ACTIONS}
        for (action, reason), n in counts.items():
            by_action[action] += n
            by_reason[reason] += n
            by_action_reason.setdefault(action, Counter())[reason] += n
        out: dict[str, object] = {"by_action": dict(by_action), "by_reason": dict(by_reason)}
        out.update({a: dict(c) for a, c in by_action_reason.items()})
        out["recent"] = [
            t.record() for t in self._recent if tenant is None or t.request.tenant == tenant
        ]
        return out
