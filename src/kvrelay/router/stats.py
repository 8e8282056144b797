"""``GET /stats``: decision counts and the last N decisions, conversation keys hashed.

``snapshot()`` is the ``decisions`` object of ``/stats``::

    {"by_action": {"pull": 3, ...}, "by_reason": {"pull": 3, "no_entry": 1, ...},
     "pull": {"pull": 3}, "recompute": {"no_entry": 1, ...}, "direct": {},
     "recent": [{"at_s", "key", "action", "reason", "verified_tokens", "reused_tokens", ...}]}

(every action has its ``{reason: count}`` object, empty or not). A record is created when a
turn is decided and completed in place as the turn proceeds (nodes used, reused tokens as P
reported them, retries, outcome), so in-flight turns show with ``outcome: null``.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any

from kvrelay.core.conversation import ConversationKey
from kvrelay.core.policy import TurnDecision


class RouterStats:
    """Counters by action and by reason, plus a ring of the ``recent`` latest decisions."""

    def __init__(self, recent: int = 100) -> None:
        self.by_action: Counter[str] = Counter()
        self.by_reason: Counter[str] = Counter()
        self.by_action_reason: dict[str, Counter[str]] = {
            a: Counter() for a in ("pull", "recompute", "direct")
        }
        self._recent: deque[dict[str, Any]] = deque(maxlen=max(recent, 0) or None)
        self._keep = recent > 0

    def record(
        self,
        *,
        at_s: float,
        key: ConversationKey | None,
        decision: TurnDecision,
        endpoint: str,
        stream: bool,
        prompt_tokens: int,
    ) -> dict[str, Any]:
        """Count a decision; returns its record for the caller to complete."""
        self.by_action[decision.action] += 1
        self.by_reason[decision.reason] += 1
        self.by_action_reason.setdefault(decision.action, Counter())[decision.reason] += 1
        rec: dict[str, Any] = {
            "at_s": at_s,
            "key": key.hashed() if key is not None else None,
            "action": decision.action,
            "reason": decision.reason,
            "verified_tokens": decision.verified_tokens,
            "reused_tokens": decision.reused_tokens,
            "prompt_tokens": prompt_tokens,
            "predicted_transfer_s": decision.predicted_transfer_s,
            "predicted_prefill_s": decision.predicted_prefill_s,
            "endpoint": endpoint,
            "stream": stream,
            "prefill_node": None,
            "decode_node": None,
            "retries": 0,
            "outcome": None,
        }
        if self._keep:
            self._recent.append(rec)
        return rec

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "by_action": dict(self.by_action),
            "by_reason": dict(self.by_reason),
        }
        out.update({a: dict(c) for a, c in self.by_action_reason.items()})
        out["recent"] = [dict(r) for r in self._recent]
        return out
