"""``GET /stats``: decision counts and the last N turns, conversation keys hashed.

``snapshot(tenant)`` is the ``decisions`` object of ``/stats``::

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
        """Keep a planned turn among the recent ones."""
        if self._keep:
            self._recent.append(turn)

    def count(self, turn: Turn) -> None:
        """Count a finished turn by what happened."""
        action, reason = turn.effective
        self.by_action[action] += 1
        self.by_reason[reason] += 1
        self.by_action_reason.setdefault(action, Counter())[reason] += 1

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
