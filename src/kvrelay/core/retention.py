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

Under pressure and headroom the least valuable go first (``release_order``): the lowest
chance of still being pulled at that moment (``RetainedTurn.pull_chance``: the router's
``kvrelay_return_curve`` for how turns that end this way come back, evaluated at the turn's
age, ``core.return_curve``; 1 without one), then the lowest ``value`` (the router's
``kvrelay_retain_value``, 0 when unset), then oldest. Without curves that is stock-like:
oldest first; of the turns so taken, one that the others cover without it stays
(``release_for``). A turn P is reading is never released.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import msgspec

from kvrelay.core.return_curve import ReturnCurve


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
    curve: ReturnCurve | None = None
    """How turns that end as this one did come back (the router's, ``kvrelay_return_curve``,
    or its later ``RetentionOrders.curves``); ``None``: unknown."""

    def pull_chance(self, now_s: float) -> float:
        """The chance, at ``now_s``, that the turn is still pulled before its deadline
        (``ReturnCurve.pull_chance`` at its age); 1 without a curve."""
        if self.curve is None:
            return 1.0
        return self.curve.pull_chance(now_s - self.retained_at_s,
                                      self.deadline_s - self.retained_at_s)


class Release(msgspec.Struct, frozen=True):
    """What to release now, and why (``reason``: ``pressure``, ``headroom``, ``expired`` or
    ``none``). ``num_blocks`` is what the release frees; ``short_blocks`` what is still
    missing after it (0 when the release is enough)."""

    request_ids: tuple[str, ...]
    num_blocks: int
    reason: str
    short_blocks: int = 0


NOTHING = Release(request_ids=(), num_blocks=0, reason="none")


def release_order(turns: Iterable[RetainedTurn], now_s: float) -> list[RetainedTurn]:
    """Releasable turns in the order D releases them at ``now_s``, least valuable first:
    lowest ``pull_chance``, then lowest value, then oldest."""
    return sorted((turn for turn in turns if not turn.reading),
                  key=lambda turn: (turn.pull_chance(now_s), turn.value, turn.retained_at_s,
                                    turn.request_id))


def release_for(turns: Iterable[RetainedTurn], num_blocks: int, reason: str, *,
                now_s: float) -> Release:
    """Least-valuable turns that free at least ``num_blocks`` blocks (all releasable ones
    when they are not enough): the turns in ``release_order`` at ``now_s`` until enough are
    freed, then without any of them (the most valuable first) that the others cover: a
    large turn taken last can make the small ones taken before it unnecessary, and a turn
    released without need is a pull lost for nothing (the blocks it would free beyond the
    shortfall serve no one yet; a later shortfall chooses again, with what it knows then)."""
    if num_blocks <= 0:
        return NOTHING
    chosen: list[RetainedTurn] = []
    freed = 0
    for turn in release_order(turns, now_s):
        if freed >= num_blocks:
            break
        chosen.append(turn)
        freed += turn.num_blocks
    if not chosen:
        return Release(request_ids=(), num_blocks=0, reason="none", short_blocks=num_blocks)
    for turn in reversed(chosen[:-1]):
        if freed - turn.num_blocks >= num_blocks:
            chosen.remove(turn)
            freed -= turn.num_blocks
    return Release(request_ids=tuple(turn.request_id for turn in chosen), num_blocks=freed,
                   reason=reason, short_blocks=max(0, num_blocks - freed))


def retention_cap_blocks(num_blocks_total: int, headroom: float) -> int:
    """The most blocks retention may hold when ``headroom`` of the cache stays free of it."""
    if not 0.0 <= headroom <= 1.0:
        raise ValueError(f"headroom is a fraction in [0, 1], got {headroom}")
    return math.floor(num_blocks_total * (1.0 - headroom))


def release_over_headroom(turns: Iterable[RetainedTurn], *, num_blocks_total: int,
                          headroom: float, now_s: float) -> Release:
    """Release what retention holds above its cap (``retention_cap_blocks``), in
    ``release_order`` at ``now_s``."""
    turns = list(turns)
    held = sum(turn.num_blocks for turn in turns)
    over = held - retention_cap_blocks(num_blocks_total, headroom)
    return release_for(turns, over, "headroom", now_s=now_s) if over > 0 else NOTHING


def release_under_pressure(turns: Iterable[RetainedTurn], *, num_blocks_free: int,
                           num_blocks_needed: int, now_s: float) -> Release:
    """Release enough for ``num_blocks_needed`` blocks when ``num_blocks_free`` is short,
    in ``release_order`` at ``now_s``."""
    short = num_blocks_needed - num_blocks_free
    return release_for(turns, short, "pressure", now_s=now_s) if short > 0 else NOTHING


def release_expired(turns: Iterable[RetainedTurn], now_s: float) -> Release:
    """Turns whose retention time has run out (not those being read)."""
    done = [turn for turn in turns if not turn.reading and now_s >= turn.deadline_s]
    if not done:
        return NOTHING
    return Release(request_ids=tuple(turn.request_id for turn in done),
                   num_blocks=sum(turn.num_blocks for turn in done), reason="expired")
