"""One turn as it moves through the router: a typed object with explicit states.

``handler`` creates a ``Turn`` once the turn is planned and moves it through
``PLANNED -> PREFILLING -> DECODING -> (STREAMING) -> DONE | FAILED``. Only the step that owns
a state changes it. What the turn learned on the way (nodes used, the tokens P reused as P
reported them, retries, time to first byte) is set by that step; ``record()`` is its
``/stats`` view, ``outcome`` why it ended. Nothing here decides anything.

The decision says what the router asked for; ``effective`` says what happened. They differ
in one case: a pull decided from estimates that P's connector refused to load (the prompt
diverged from what D holds, or too little matched): the turn was then a recompute, for the
same reasons the router would have given had it checked the tokens itself, and it is
reported and counted as such.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvrelay.core.policy import TurnDecision
from kvrelay.core.turnlog import TurnLogRecord
from kvrelay.router.commit import PendingTurn
from kvrelay.router.config import NodeConfig
from kvrelay.router.index import Found
from kvrelay.router.request import TurnRequest


class TurnState(enum.Enum):
    PLANNED = "planned"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    STREAMING = "streaming"
    DONE = "done"
    FAILED = "failed"


@dataclass(eq=False, slots=True)
class Turn:
    """A planned turn (module docstring).

    ``found`` is the entry the request continues (claimed already when the decision is a
    pull); ``conversation`` the conversation's tag; ``number`` the turn's number in it.
    ``prompt_tokens`` is P's count once P answered (the estimate before); ``cached_tokens``
    the prompt tokens P did not compute (pulled from D or local prefix hits), as P reported
    them; ``verified_tokens`` the prefix P's connector proved (``None``: not reported).
    ``gap_s`` is the time since the continued turn ended; ``retain_s`` how long D was asked
    to keep this turn (``kvrelay_retain_s``, ``None``: D's TTL); ``pending`` the D request whose
    entry the report desk is settling.
    """

    request: TurnRequest
    decision: TurnDecision
    found: Found | None
    conversation: str
    number: int
    prompt_tokens: int
    prefill_node: NodeConfig | None = None
    decode_node: NodeConfig | None = None
    state: TurnState = TurnState.PLANNED
    cached_tokens: int = 0
    verified_tokens: int | None = None
    refused: str | None = None
    retries: int = 0
    outcome: str | None = None
    ttft_s: float | None = None
    duration_s: float | None = None
    gap_s: float | None = None
    retain_s: float | None = None
    pending: PendingTurn | None = None
    decided_at_s: float = 0.0
    arrived_wall_s: float = field(default_factory=time.time)
    started_s: float = field(default_factory=time.perf_counter)

    @property
    def effective(self) -> tuple[str, str]:
        """``(action, reason)`` as it happened (module docstring)."""
        if self.refused is not None:
            return "recompute", self.refused
        return self.decision.action, self.decision.reason

    @property
    def action(self) -> str:
        return self.effective[0]

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens taken from D's KV: pulled (as P reported) or served from D's prefix
        cache (direct, as planned)."""
        if self.refused is not None:  # carried out as a recompute
            return 0
        if self.decision.action == "direct":
            return self.decision.reused_tokens
        return self.cached_tokens if self.decision.action == "pull" else 0

    @property
    def affinity(self) -> str | None:
        """The D that held this conversation's KV (preferred again: its prefix cache)."""
        return self.found.entry.decode_node_id if self.found is not None else None

    def move(self, state: TurnState) -> None:
        self.state = state

    def finish(self, outcome: str) -> bool:
        """End the turn once (the first outcome wins); True if this call ended it."""
        if self.outcome is not None:
            return False
        self.outcome = outcome
        self.duration_s = time.perf_counter() - self.started_s
        self.state = TurnState.DONE if outcome == "ok" else TurnState.FAILED
        return True

    def headers(self) -> dict[str, str]:
        """``X-KVRelay-Action`` / ``-Reason`` / ``-Reused-Tokens``: what the router did; for
        reason ``released``, ``X-KVRelay-Released-Cause``: why D freed the entry's blocks
        (``pressure``, ``headroom``, ``router``; ``releasing`` while D's ask is answered
        but its release not yet told)."""
        action, reason = self.effective
        out = {
            "X-KVRelay-Action": action,
            "X-KVRelay-Reason": reason,
            "X-KVRelay-Reused-Tokens": str(self.reused_tokens),
        }
        cause = self.found.entry.released if self.found is not None else None
        if reason == "released" and cause:
            out["X-KVRelay-Released-Cause"] = cause
        return out

    def log_record(self, retained_tokens: int | None) -> TurnLogRecord:
        """The turn log's record of this turn (no content: the conversation's tag)."""
        action, reason = self.effective
        prompt = max(self.prompt_tokens, 0)
        reused = min(self.reused_tokens, prompt)
        output = retained_tokens - prompt + 1 if retained_tokens is not None else None
        return TurnLogRecord(
            key=self.conversation, at_s=self.arrived_wall_s, gap_s=self.gap_s,
            prompt_tokens=prompt, reused_tokens=reused, new_tokens=prompt - reused,
            output_tokens=output if output is not None and output >= 0 else None,
            action=action, reason=reason,
            decode_node=self.decode_node.node_id if self.decode_node else None,
            retained_tokens=retained_tokens, duration_s=self.duration_s, ttft_s=self.ttft_s,
        )

    def record(self) -> dict[str, object]:
        """The ``/stats`` view of the turn (keys hashed, no content)."""
        d = self.decision
        action, reason = self.effective
        return {
            "at_s": self.decided_at_s,
            "key": self.conversation,
            "turn": self.number,
            "tenant": self.request.tenant,
            "action": action,
            "reason": reason,
            "decided": f"{d.action}/{d.reason}",
            "exact": d.exact,
            "verified_tokens": (
                self.verified_tokens if self.verified_tokens is not None else d.verified_tokens
            ),
            "reused_tokens": self.reused_tokens,
            "prompt_tokens": self.prompt_tokens,
            "predicted_transfer_s": d.predicted_transfer_s,
            "predicted_prefill_s": d.predicted_prefill_s,
            "endpoint": self.request.endpoint,
            "stream": self.request.stream,
            "prefill_node": self.prefill_node.node_id if self.prefill_node else None,
            "decode_node": self.decode_node.node_id if self.decode_node else None,
            "retries": self.retries,
            "state": self.state.value,
            "outcome": self.outcome,
        }
