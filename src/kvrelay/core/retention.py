"""The retention policy on D: which retained turns to release, and when.

Pure and shared by kvrelay's connector inside vLLM and by the fake engine, so both release
the same turns for the same state. Time is passed in (D's own monotonic clock).

A retained turn is a finished request whose blocks D keeps so that P can pull them on the
conversation's next turn. Three things end one early:

* **pressure**: D needs blocks for work it has (a waiting request that cannot be allocated,
  or a running one that would be preempted). Releasing retention comes first: live work
  never waits behind KV that may never be read.
* **headroom**: the operator keeps ``headroom`` (a fraction of D's KV cache) free of
  retention; retained blocks above ``(1 - headroom) * num_blocks_total`` are released.
* **deadline**: the turn's own retention time (``kvrelay_retain_s`` clamped to D's TTL).

Under pressure and headroom the least valuable go first (``release_idle``): turns past their
*pull window* (``pull_until_s``: the router's ``kvrelay_pull_window_s`` after the turn was
retained, the time within which its follow-up is likely; ``None``: the whole retention)
first, oldest first; then the others, lowest ``value`` (the router's
``kvrelay_retain_value``, 0 when unset), then oldest. A turn P is reading is never released.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import msgspec


class RetainedTurn(msgspec.Struct, frozen=True):
    """One finished request whose blocks D retains for a P to read."""

    request_id: str
    num_blocks: int
    num_tokens: int
    retained_at_s: float
    deadline_s: float
    value: float = 0.0
    reading: bool = False
    """True while a P is reading the blocks: such a turn is never released."""
    pull_until_s: float | None = None
    """When the turn's pull window ends (its follow-up is unlikely after it); ``None``: at
    its deadline."""

    def idle(self, now_s: float) -> bool:
        """Past its pull window at ``now_s``: the first to go under pressure or headroom."""
        return self.pull_until_s is not None and now_s >= self.pull_until_s


class Release(msgspec.Struct, frozen=True):
    """What to release now, and why (``reason``: ``pressure``, ``headroom``, ``expired`` or
    ``none``). ``num_blocks`` is what the release frees; ``short_blocks`` what is still
    missing after it (0 when the release is enough)."""

    request_ids: tuple[str, ...]
    num_blocks: int
    reason: str
    short_blocks: int = 0


NOTHING = Release(request_ids=(), num_blocks=0, reason="none")


def release_order(turns: Iterable[RetainedTurn]) -> list[RetainedTurn]:
    """Releasable turns, least valuable first: lowest value, then oldest."""
    return sorted((turn for turn in turns if not turn.reading),
                  key=lambda turn: (turn.value, turn.retained_at_s, turn.request_id))


def release_idle(turns: Iterable[RetainedTurn], now_s: float) -> list[RetainedTurn]:
    """Releasable turns in the order D releases them at ``now_s``: those past their pull
    window (``RetainedTurn.idle``) first, oldest first; then the others in
    ``release_order``."""
    turns = list(turns)
    idle = sorted((t for t in turns if not t.reading and t.idle(now_s)),
                  key=lambda turn: (turn.retained_at_s, turn.request_id))
    return idle + release_order(t for t in turns if not t.idle(now_s))


def release_for(turns: Iterable[RetainedTurn], num_blocks: int, reason: str, *,
                now_s: float | None = None) -> Release:
    """The fewest least-valuable turns that free at least ``num_blocks`` blocks (all
    releasable ones when they are not enough), in ``release_idle`` order at ``now_s``
    (``None``: ``release_order``, pull windows ignored)."""
    if num_blocks <= 0:
        return NOTHING
    chosen: list[str] = []
    freed = 0
    ordered = release_order(turns) if now_s is None else release_idle(turns, now_s)
    for turn in ordered:
        if freed >= num_blocks:
            break
        chosen.append(turn.request_id)
        freed += turn.num_blocks
    if not chosen:
        return Release(request_ids=(), num_blocks=0, reason="none", short_blocks=num_blocks)
    return Release(request_ids=tuple(chosen), num_blocks=freed, reason=reason,
                   short_blocks=max(0, num_blocks - freed))


def retention_cap_blocks(num_blocks_total: int, headroom: float) -> int:
    """The most blocks retention may hold when ``headroom`` of the cache stays free of it."""
    if not 0.0 <= headroom <= 1.0:
        raise ValueError(f"headroom is a fraction in [0, 1], got {headroom}")
    return math.floor(num_blocks_total * (1.0 - headroom))


def release_over_headroom(turns: Iterable[RetainedTurn], *, num_blocks_total: int,
                          headroom: float, now_s: float | None = None) -> Release:
    """Release what retention holds above its cap (``retention_cap_blocks``), turns past
    their pull window at ``now_s`` first."""
    turns = list(turns)
    held = sum(turn.num_blocks for turn in turns)
    over = held - retention_cap_blocks(num_blocks_total, headroom)
    return release_for(turns, over, "headroom", now_s=now_s) if over > 0 else NOTHING


def release_under_pressure(turns: Iterable[RetainedTurn], *, num_blocks_free: int,
                           num_blocks_needed: int, now_s: float | None = None) -> Release:
    """Release enough for ``num_blocks_needed`` blocks when ``num_blocks_free`` is short,
    turns past their pull window at ``now_s`` first."""
    short = num_blocks_needed - num_blocks_free
    return release_for(turns, short, "pressure", now_s=now_s) if short > 0 else NOTHING


def release_expired(turns: Iterable[RetainedTurn], now_s: float) -> Release:
    """Turns whose retention time has run out (not those being read)."""
    done = [turn for turn in turns if not turn.reading and now_s >= turn.deadline_s]
    if not done:
        return NOTHING
    return Release(request_ids=tuple(turn.request_id for turn in done),
                   num_blocks=sum(turn.num_blocks for turn in done), reason="expired")
