"""One routed turn as the turn log records it: sizes, timing and the decision, never content.

The router appends one ``TurnLogRecord`` per routed turn to its turn log (``kvrelay route
--turn-log PATH``, written by ``kvrelay.router.turnlog.TurnLogWriter``); ``kvrelay tune``
reads the log back to answer what TTL, threshold and D memory the deployment needs.

What a record holds, and why:

* ``key``: the conversation's keyed tag (``core.conversation.conversation_tag``, never the
  client's id), ``None`` for a turn without a
  conversation id. It groups a conversation's turns; it is not a secret (see ``hashed``).
* ``at_s``: the router's wall clock (Unix seconds) when the turn arrived; wall clock so logs
  of several replicas and restarts line up.
* ``gap_s``: seconds from the end of the conversation's previous turn (its response's last
  byte) to ``at_s``; ``None`` for a first turn or when the router no longer knows the previous
  turn. This is the quantity a TTL is compared with (D's TTL starts when a turn ends).
* ``prompt_tokens``, ``reused_tokens`` (taken from D's retained KV, as P reported them),
  ``new_tokens`` (= prompt - reused, computed by P), ``output_tokens`` (generated; ``None``
  when unknown, e.g. a stream cut short).
* ``action`` / ``reason``: the turn policy's decision (``core.policy``).
* ``decode_node``: the router's id of the D that served the turn and retains its KV.
* ``retained_tokens``: tokens D retains after the turn (its ``remote_num_tokens``), ``None``
  when nothing is retained (no KV came back, the turn failed).
* ``duration_s``: arrival to the end of the response; ``ttft_s``: arrival to the first
  streamed chunk (``None`` when not streamed).

Encoding: one compact JSON object per line with ``"v": 1`` and the field names above;
``from_json_line`` accepts exactly what ``to_json_line`` writes (unknown keys are ignored, so
later versions may add fields) and raises ``TurnLogFormatError`` for anything else.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

from kvrelay.core.conversation import ConversationKey

TURN_LOG_VERSION = 1


class TurnLogFormatError(ValueError):
    """A turn log line that is not a valid record."""


@dataclass(frozen=True)
class TurnLogRecord:
    """One routed turn (see the module docstring for every field's meaning)."""

    key: str | None
    at_s: float
    gap_s: float | None
    prompt_tokens: int
    reused_tokens: int
    new_tokens: int
    output_tokens: int | None
    action: str
    reason: str
    decode_node: str | None
    retained_tokens: int | None
    duration_s: float | None = None
    ttft_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "reused_tokens", "new_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} cannot be negative")
        if self.reused_tokens > self.prompt_tokens:
            raise ValueError("reused_tokens cannot exceed prompt_tokens")
        if self.new_tokens != self.prompt_tokens - self.reused_tokens:
            raise ValueError("new_tokens must equal prompt_tokens - reused_tokens")
        for name in ("output_tokens", "retained_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} cannot be negative")
        if not math.isfinite(self.at_s):
            raise ValueError("at_s must be finite")
        for name in ("gap_s", "duration_s", "ttft_s"):
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value < 0):
                raise ValueError(f"{name} must be a finite number >= 0")
        if not self.action or not self.reason:
            raise ValueError("action and reason must be non-empty")

    @classmethod
    def for_turn(
        cls,
        *,
        key: ConversationKey | None,
        tag_key: bytes,
        at_s: float,
        gap_s: float | None,
        prompt_tokens: int,
        reused_tokens: int,
        output_tokens: int | None,
        action: str,
        reason: str,
        decode_node: str | None,
        retained_tokens: int | None,
        duration_s: float | None = None,
        ttft_s: float | None = None,
    ) -> TurnLogRecord:
        """The record of a turn of conversation ``key`` (tagged here under ``tag_key``, so
        no raw id is ever stored); ``new_tokens`` is derived."""
        return cls(
            key=key.hashed(tag_key) if key is not None else None,
            at_s=at_s,
            gap_s=gap_s,
            prompt_tokens=prompt_tokens,
            reused_tokens=reused_tokens,
            new_tokens=prompt_tokens - reused_tokens,
            output_tokens=output_tokens,
            action=action,
            reason=reason,
            decode_node=decode_node,
            retained_tokens=retained_tokens,
            duration_s=duration_s,
            ttft_s=ttft_s,
        )

    def to_json_line(self) -> str:
        """The record as one JSON line, ``\\n`` included."""
        body: dict[str, Any] = {"v": TURN_LOG_VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            body[f.name] = round(value, 6) if isinstance(value, float) else value
        return json.dumps(body, separators=(",", ":"), allow_nan=False) + "\n"

    @classmethod
    def from_json_line(cls, line: str | bytes) -> TurnLogRecord:
        """Parse one line written by ``to_json_line``."""
        try:
            data = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TurnLogFormatError(f"not JSON: {exc}") from exc
        return cls.from_json(data)

    @classmethod
    def from_json(cls, data: object) -> TurnLogRecord:
        if not isinstance(data, dict):
            raise TurnLogFormatError("a turn log record must be a JSON object")
        if data.get("v") != TURN_LOG_VERSION:
            raise TurnLogFormatError(
                f"unsupported turn log version {data.get('v')!r} (expected {TURN_LOG_VERSION})"
            )
        try:
            return cls(
                key=_opt(data, "key", str),
                at_s=_num(data, "at_s"),
                gap_s=_opt_num(data, "gap_s"),
                prompt_tokens=_int(data, "prompt_tokens"),
                reused_tokens=_int(data, "reused_tokens"),
                new_tokens=_int(data, "new_tokens"),
                output_tokens=_opt_int(data, "output_tokens"),
                action=_req(data, "action", str),
                reason=_req(data, "reason", str),
                decode_node=_opt(data, "decode_node", str),
                retained_tokens=_opt_int(data, "retained_tokens"),
                duration_s=_opt_num(data, "duration_s"),
                ttft_s=_opt_num(data, "ttft_s"),
            )
        except ValueError as exc:
            if isinstance(exc, TurnLogFormatError):
                raise
            raise TurnLogFormatError(str(exc)) from exc


def _req(data: dict[str, Any], name: str, kind: type[str]) -> str:
    value = data.get(name)
    if not isinstance(value, kind):
        raise TurnLogFormatError(f"{name!r} must be a {kind.__name__}, got {value!r}")
    return value


def _opt(data: dict[str, Any], name: str, kind: type[str]) -> str | None:
    return None if data.get(name) is None else _req(data, name, kind)


def _int(data: dict[str, Any], name: str) -> int:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TurnLogFormatError(f"{name!r} must be an integer, got {value!r}")
    return value


def _opt_int(data: dict[str, Any], name: str) -> int | None:
    return None if data.get(name) is None else _int(data, name)


def _num(data: dict[str, Any], name: str) -> float:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TurnLogFormatError(f"{name!r} must be a number, got {value!r}")
    return float(value)


def _opt_num(data: dict[str, Any], name: str) -> float | None:
    return None if data.get(name) is None else _num(data, name)
