"""``GET /stats``: decision counts and the last N turns, conversation keys hashed.

``snapshot(tenant)`` is the ``decisions`` object of ``/stats``::

    {"by_action": {"pull": 3, ...}, "by_reason": {"pull": 3, "no_entry": 1, ...},
     "pull": {"pull": 3}, "recompute": {"no_entry": 1, ...}, "direct": {},
     "recent": [{"at_s", "key", "action", "reason", "reused_tokens", ...}]}

(every action has its ``{reason: count}`` object, empty or not). ``recent`` holds the turns
themselves and renders them when read, so in-flight turns show with ``outcome: null``.
"""

from __future__ import annotations

from collections import Counter, deque

from kvrelay.router.turn import Turn


class RouterStats:
    """Counters by action and by reason, plus a ring of the ``recent`` latest turns."""

    def __init__(self, recent: int = 100) -> None:
        self.by_action: Counter[str] = Counter()
        self.by_reason: Counter[str] = Counter()
        self.by_action_reason: dict[str, Counter[str]] = {
            a: Counter() for a in ("pull", "recompute", "direct")
        }
        self._recent: deque[Turn] = deque(maxlen=max(recent, 1))
        self._keep = recent > 0

    def record(self, turn: Turn) -> None:
        """Count a decided turn and keep it among the recent ones."""
        d = turn.decision
        self.by_action[d.action] += 1
        self.by_reason[d.reason] += 1
        self.by_action_reason[d.action][d.reason] += 1
        if self._keep:
            self._recent.append(turn)

    def snapshot(self, tenant: str | None = None) -> dict[str, object]:
        """Counts, and the recent turns of ``tenant`` (all with ``None``)."""
        out: dict[str, object] = {
            "by_action": dict(self.by_action),
            "by_reason": dict(self.by_reason),
        }
        out.update({a: dict(c) for a, c in self.by_action_reason.items()})
        out["recent"] = [
            t.record() for t in self._recent if tenant is None or t.request.tenant == tenant
        ]
        return out
