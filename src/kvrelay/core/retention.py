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

**Shared blocks.** Turns share blocks on D through vLLM's prefix cache: the system prompt
and tools every conversation of an agent starts with, a conversation's turn and the one
before it. Releasing a turn frees only the blocks no other request holds; a block several
retained turns share is freed once all of them go. With D's holder counts (``BlockHolders``:
vLLM's ``KVCacheBlock.ref_cnt``) and the turns' ``block_ids``, a release counts exactly what
it frees (``blocks_freed``); without them, every block of a turn counts, as if unshared.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Protocol

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
    block_ids: tuple[int, ...] = ()
    """D's blocks the turn holds, when known (one KV cache group): with ``BlockHolders`` a
    release counts only the blocks it frees (module docstring, "Shared blocks")."""

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

class BlockHolders(Protocol):
    """How many requests hold each of D's blocks now (vLLM's ``KVCacheBlock.ref_cnt``): a
    ``dict`` of block id -> count, or a view that reads D's pool only for the blocks asked
    about (a release looks at a few turns, not every block D holds)."""

    def get(self, block_id: int, default: int, /) -> int: ...


class _Freeing:
    """Turns taken for release one by one, and the blocks they free together."""

    def __init__(self, holders: BlockHolders | None) -> None:
        self._holders = holders
        self._taken: Counter[int] = Counter()
        self.num_blocks = 0

    def take(self, turn: RetainedTurn) -> None:
        if self._holders is None or not turn.block_ids:
            self.num_blocks += turn.num_blocks
            return
        for block_id in set(turn.block_ids):
            self._taken[block_id] += 1
            if self._taken[block_id] == max(1, self._holders.get(block_id, 1)):
                self.num_blocks += 1


def blocks_freed(turns: Iterable[RetainedTurn], holders: BlockHolders | None = None) -> int:
    """Blocks D gets back when ``turns`` are released together: a block once every request
    holding it (``holders``) is among them; each turn's every block without ``holders`` or
    its ``block_ids``."""
    freeing = _Freeing(holders)
    for turn in turns:
        freeing.take(turn)
    return freeing.num_blocks


class _HoldersAfter:
    def __init__(self, holders: BlockHolders, gone: Mapping[int, int]) -> None:
        self._holders = holders
        self._gone = gone

    def get(self, block_id: int, default: int, /) -> int:
        return self._holders.get(block_id, default) - self._gone.get(block_id, 0)


def holders_after(holders: BlockHolders, turns: Iterable[RetainedTurn]) -> BlockHolders:
    """``holders`` once ``turns`` (on their way to being freed) let go of their blocks."""
    gone: Counter[int] = Counter()
    for turn in turns:
        gone.update(set(turn.block_ids))
    return _HoldersAfter(holders, gone)


def release_order(turns: Iterable[RetainedTurn], now_s: float) -> list[RetainedTurn]:
    """Releasable turns in the order D releases them at ``now_s``, least valuable first:
    lowest ``pull_chance``, then lowest value, then oldest."""
    return sorted((turn for turn in turns if not turn.reading),
                  key=lambda turn: (turn.pull_chance(now_s), turn.value, turn.retained_at_s,
                                    turn.request_id))


def release_for(turns: Iterable[RetainedTurn], num_blocks: int, reason: str, *,
                now_s: float, holders: BlockHolders | None = None) -> Release:
    """Least-valuable turns that free at least ``num_blocks`` blocks (all releasable ones
    when they are not enough): the turns in ``release_order`` at ``now_s`` until enough are
    freed, then without any of them (the most valuable first) that the others cover: a
    large turn taken last can make the small ones taken before it unnecessary, and a turn
    released without need is a pull lost for nothing (the blocks it would free beyond the
    shortfall serve no one yet; a later shortfall chooses again, with what it knows then).
    Blocks are counted as ``blocks_freed`` counts them (``holders``: shared blocks)."""
    if num_blocks <= 0:
        return NOTHING
    chosen: list[RetainedTurn] = []
    freeing = _Freeing(holders)
    for turn in release_order(turns, now_s):
        if freeing.num_blocks >= num_blocks:
            break
        chosen.append(turn)
        freeing.take(turn)
    freed = freeing.num_blocks
    if not chosen:
        return Release(request_ids=(), num_blocks=0, reason="none", short_blocks=num_blocks)
    for turn in reversed(chosen[:-1]):
        rest = [other for other in chosen if other is not turn]
        without = blocks_freed(rest, holders)
        if without >= num_blocks:
            chosen, freed = rest, without
    return Release(request_ids=tuple(turn.request_id for turn in chosen), num_blocks=freed,
                   reason=reason, short_blocks=max(0, num_blocks - freed))


def retention_cap_blocks(num_blocks_total: int, headroom: float) -> int:
    """The most blocks retention may hold when ``headroom`` of the cache stays free of it."""
    if not 0.0 <= headroom <= 1.0:
        raise ValueError(f"headroom is a fraction in [0, 1], got {headroom}")
    return math.floor(num_blocks_total * (1.0 - headroom))


def release_over_headroom(turns: Iterable[RetainedTurn], *, num_blocks_total: int,
                          headroom: float, now_s: float,
                          holders: BlockHolders | None = None) -> Release:
    """Release what retention holds above its cap (``retention_cap_blocks``), in
    ``release_order`` at ``now_s``: what releasing every turn would free (``blocks_freed``;
    a block a live request shares is not retention's)."""
    turns = list(turns)
    cap = retention_cap_blocks(num_blocks_total, headroom)
    if sum(turn.num_blocks for turn in turns) <= cap:
        return NOTHING  # what releasing all would free is no more (checked every step)
    over = blocks_freed(turns, holders) - cap
    return release_for(turns, over, "headroom", now_s=now_s, holders=holders) \
        if over > 0 else NOTHING


def release_under_pressure(turns: Iterable[RetainedTurn], *, num_blocks_free: int,
                           num_blocks_needed: int, now_s: float,
                           holders: BlockHolders | None = None) -> Release:
    """Release enough for ``num_blocks_needed`` blocks when ``num_blocks_free`` is short,
    in ``release_order`` at ``now_s`` (``holders``: shared blocks)."""
    short = num_blocks_needed - num_blocks_free
    return release_for(turns, short, "pressure", now_s=now_s, holders=holders) \
        if short > 0 else NOTHING


def release_expired(turns: Iterable[RetainedTurn], now_s: float) -> Release:
    """Turns whose retention time has run out (not those being read)."""
    done = [turn for turn in turns if not turn.reading and now_s >= turn.deadline_s]
    if not done:
        return NOTHING
    return Release(request_ids=tuple(turn.request_id for turn in done),
                   num_blocks=sum(turn.num_blocks for turn in done), reason="expired")
