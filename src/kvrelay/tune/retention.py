"""From turns to retentions: what each turn leaves pinned on D, and what its follow-up needs.

Model (docs/tune.md, "The model"):

* Every turn, when it ends, leaves its KV on one D: ``prompt + output`` tokens (a turn log
  gives D's exact ``retained_tokens``; nothing for a failed turn).
* The conversation's next turn arrives ``gap_s`` later (from the end of the turn: that is when
  D's TTL starts). Traces have arrival times only, so a turn ends
  ``output_tokens * decode_s_per_token`` after it arrives (default 0: the gap is the
  inter-arrival time, which overstates gaps slightly). A turn log records gaps as measured.
* The follow-up can reuse ``usable_tokens`` of the retained KV: the common prefix of the two
  prompts (by ``hash_ids`` when both turns have them; whole blocks, or the whole retained
  prompt + output when every full block of the earlier prompt matches), at most the
  follow-up's prompt minus its last token (which P must compute), as the router's policy does.
  A turn log's pulls give the reused tokens; its ``prefix_mismatch`` turns reuse nothing.
* D assignment: a turn log says which D held each turn; for traces conversations are
  assigned round robin over ``num_decode`` D's in order of their first turn (the router keeps
  a conversation on its D unless that D is clearly busier).

One ``Retention`` row per turn; ``gap_s`` is infinite for a conversation's last turn.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable
from dataclasses import dataclass

from kvrelay.tune.trace import TraceOrderError, TraceTurn


@dataclass(frozen=True)
class Retentions:
    """Columns, one row per turn (see the module docstring). Times are seconds."""

    start_s: array[float]
    tokens: array[int]
    decode: array[int]
    gap_s: array[float]
    usable_tokens: array[int]
    decode_names: tuple[str, ...]
    first_at_s: float
    last_at_s: float
    num_conversations: int

    @property
    def num_turns(self) -> int:
        return len(self.start_s)


@dataclass(slots=True)
class _Last:
    """A conversation's latest turn, until its follow-up (or the end) emits its row."""

    end_s: float
    at_s: float
    input_tokens: int
    retained: int
    hash_ids: list[int] | None
    decode: int


class RetentionBuilder:
    """Feed turns (each conversation's in time order) with ``add``, then ``finish``."""

    def __init__(
        self,
        *,
        num_decode: int = 1,
        decode_s_per_token: float = 0.0,
        block_tokens: int = 16,
    ) -> None:
        if num_decode < 1:
            raise ValueError("num_decode must be >= 1")
        if decode_s_per_token < 0 or block_tokens < 1:
            raise ValueError("decode_s_per_token must be >= 0 and block_tokens >= 1")
        self.num_decode = num_decode
        self.decode_s_per_token = decode_s_per_token
        self.block_tokens = block_tokens
        self._start = array("d")
        self._tokens = array("q")
        self._decode = array("q")
        self._gap = array("d")
        self._usable = array("q")
        self._names: dict[str, int] = {}
        self._last: dict[object, _Last] = {}
        self._first_at = math.inf
        self._last_at = -math.inf
        self._conversations = 0

    def add(self, turn: TraceTurn) -> None:
        at = turn.at_s
        if at < self._first_at:
            self._first_at = at
        if at > self._last_at:
            self._last_at = at
        prev = self._last.get(turn.conversation)
        if prev is None:
            self._conversations += 1
            decode = self._decode_index(turn, self._conversations - 1)
        else:
            decode = self._decode_index(turn, None) if turn.decode_node else prev.decode
            if at < prev.at_s:
                raise TraceOrderError(
                    f"a turn of conversation {turn.conversation!r} arrives at {at} before the "
                    f"previous one ({prev.at_s})"
                )
            gap = turn.gap_s if turn.gap_s is not None else max(0.0, at - prev.end_s)
            self._emit(prev, gap, self._usable_for(prev, turn))
        duration = turn.duration_s
        if duration is None:
            duration = turn.output_tokens * self.decode_s_per_token
        retained = turn.retained_tokens
        if retained is None:
            retained = turn.input_tokens + turn.output_tokens
        self._last[turn.conversation] = _Last(
            at + duration, at, turn.input_tokens, retained, turn.hash_ids, decode
        )

    def finish(self) -> Retentions:
        """The retention rows (the last turn of every conversation is followed by nothing)."""
        for prev in self._last.values():
            self._emit(prev, math.inf, 0)
        self._last.clear()
        names = [""] * len(self._names)
        for name, index in self._names.items():
            names[index] = name
        if not names:
            names = [f"decode-{i}" for i in range(self.num_decode)]
        empty = self._start == array("d")
        return Retentions(
            start_s=self._start, tokens=self._tokens, decode=self._decode, gap_s=self._gap,
            usable_tokens=self._usable, decode_names=tuple(names),
            first_at_s=0.0 if empty else self._first_at,
            last_at_s=0.0 if empty else self._last_at,
            num_conversations=self._conversations,
        )

    def add_all(self, turns: Iterable[TraceTurn]) -> RetentionBuilder:
        for turn in turns:
            self.add(turn)
        return self

    def _decode_index(self, turn: TraceTurn, ordinal: int | None) -> int:
        if turn.decode_node is not None:
            return self._names.setdefault(turn.decode_node, len(self._names))
        return (ordinal or 0) % self.num_decode

    def _emit(self, prev: _Last, gap: float, usable: int) -> None:
        self._start.append(prev.end_s)
        self._tokens.append(prev.retained)
        self._decode.append(prev.decode)
        self._gap.append(gap)
        self._usable.append(usable)

    def _usable_for(self, prev: _Last, turn: TraceTurn) -> int:
        """Tokens of ``prev``'s retained KV that ``turn`` can reuse (module docstring)."""
        retained = prev.retained
        cap = turn.input_tokens - 1
        if retained <= 0 or cap <= 0 or turn.prefix_mismatch:
            return 0
        if turn.reused_tokens:
            return min(turn.reused_tokens, cap)
        prev_ids = prev.hash_ids
        ids = turn.hash_ids
        if prev_ids is None or ids is None:
            return min(retained, cap)
        full = min(prev.input_tokens // self.block_tokens, len(prev_ids))
        if ids[:full] == prev_ids[:full]:
            return min(retained, cap)
        common = 0
        for a, b in zip(prev_ids, ids, strict=False):
            if a != b:
                break
            common += 1
        return min(common * self.block_tokens, retained, cap)
