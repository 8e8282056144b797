"""kvrelay's managed retention on a fake D: each retained turn accounted, released early.

Stock vLLM keeps every finished D turn for one global TTL (``decoder_kv_blocks_ttl``) and
frees it only when P's read completes or the TTL runs out. kvrelay's connector accounts each
retained turn and releases it earlier; this is the fake's version of that accounting, driven
by the same pure policy (``kvrelay.core.retention``) and the same wire contract
(``kvrelay.core.retention_sync``) as the real connector:

* **deadline**: the decode request's ``kvrelay_retain_s``, clamped to the TTL
  (``clamp_retain_s``); ``expire`` releases turns past it (cause ``expired``);
* **pressure**: ``relieve`` releases the least valuable turns when a waiting or running
  request cannot get blocks, before anyone waits or is preempted (cause ``pressure``);
* **headroom**: ``trim`` keeps ``headroom`` of the cache free of retention after each new
  turn (cause ``pressure``: the contract's causes say why D needed the blocks, and headroom
  is D's own need);
* **router**: ``obey`` applies a ``RetentionOrders`` answer (cause ``router``).

A turn a P is reading is never released (``HoldTable.drop`` refuses it). A released turn's
hold is gone and remembered, so a later read is declined like an expired lease. Each release
is queued for every known sync URL (``pending``) until a sync to it succeeds; ``urgent`` says
a release happened, or a new URL came, since the last sync round (the syncer sends at once).
"""

from __future__ import annotations

from collections import OrderedDict

from msgspec.structs import replace

from kvrelay.core.retention import (
    Release,
    RetainedTurn,
    release_expired,
    release_over_headroom,
    release_under_pressure,
)
from kvrelay.core.retention_sync import (
    MAX_RELEASED_PER_SYNC,
    MAX_SYNC_URLS,
    RELEASE_CAUSES,
    ReleaseCause,
    Released,
    RetentionOrders,
    RetentionSync,
)
from kvrelay.fakevllm.kv import BlockPool, HoldTable


class Retention:
    """The retained turns of one D engine incarnation and the releases to tell routers."""

    def __init__(self, pool: BlockPool, holds: HoldTable, *, headroom: float,
                 bytes_per_block: int) -> None:
        if not 0.0 <= headroom <= 1.0:
            raise ValueError(f"retention headroom is a fraction in [0, 1], got {headroom}")
        self._pool = pool
        self._holds = holds
        self.headroom = headroom
        self.bytes_per_block = bytes_per_block
        self._turns: dict[str, RetainedTurn] = {}
        self._pending: OrderedDict[str, list[Released]] = OrderedDict()
        self.releases_total: dict[str, int] = dict.fromkeys(RELEASE_CAUSES, 0)
        self.declined_reads = 0
        self.urgent = False

    # -- what D holds -----------------------------------------------------------------------

    def retain(self, turn: RetainedTurn) -> None:
        """A finished D turn whose blocks are held (``HoldTable``) for a P to read."""
        self._turns[turn.request_id] = turn

    def forget(self, request_id: str) -> None:
        """The turn's hold ended without a release: P read it, or the engine dropped it."""
        self._turns.pop(request_id, None)

    def turns(self) -> list[RetainedTurn]:
        """Retained turns, each with ``reading`` as the hold table has it now."""
        out: list[RetainedTurn] = []
        for request_id, turn in list(self._turns.items()):
            if self._holds.get(request_id) is None:
                del self._turns[request_id]  # read (or expired while read) meanwhile
                continue
            reading = self._holds.reading(request_id)
            out.append(turn if turn.reading == reading else replace(turn, reading=reading))
        return out

    @property
    def num_blocks(self) -> int:
        return sum(turn.num_blocks for turn in self.turns())

    def holds_any(self) -> bool:
        return bool(self.turns())

    # -- releases ---------------------------------------------------------------------------

    def expire(self, now_s: float) -> Release:
        """Release the turns whose deadline has passed."""
        return self._apply(release_expired(self.turns(), now_s), "expired")

    def relieve(self, num_blocks_needed: int) -> Release:
        """Release enough turns for ``num_blocks_needed`` free blocks, least valuable first."""
        release = release_under_pressure(
            self.turns(), num_blocks_free=self._pool.num_free,
            num_blocks_needed=num_blocks_needed)
        return self._apply(release, "pressure")

    def trim(self) -> Release:
        """Release what retention holds above its share of the cache (``headroom``)."""
        release = release_over_headroom(
            self.turns(), num_blocks_total=self._pool.num_usable, headroom=self.headroom)
        return self._apply(release, "pressure")

    def obey(self, orders: RetentionOrders) -> Release:
        """The router's orders: release each named turn that is held and not being read;
        unknown or busy ones are ignored (the next sync says what D holds)."""
        known = {turn.request_id: turn for turn in self.turns()}
        chosen = [known[rid] for rid in dict.fromkeys(orders.release)
                  if rid in known and not known[rid].reading]
        if not chosen:
            return Release(request_ids=(), num_blocks=0, reason="none")
        release = Release(request_ids=tuple(turn.request_id for turn in chosen),
                          num_blocks=sum(turn.num_blocks for turn in chosen), reason="router")
        return self._apply(release, "router")

    def _apply(self, release: Release, cause: ReleaseCause) -> Release:
        """Drop the holds ``release`` names; returns what was actually released."""
        done: list[str] = []
        freed = 0
        for request_id in release.request_ids:
            hold = self._holds.drop(request_id)
            if hold is None:
                continue
            turn = self._turns.pop(request_id, None)
            freed += turn.num_blocks if turn is not None else len(hold.block_ids)
            done.append(request_id)
            self.releases_total[cause] += 1
            self._tell(Released(request_id=request_id, cause=cause))
        if not done:
            return Release(request_ids=(), num_blocks=0, reason="none",
                           short_blocks=release.short_blocks)
        self.urgent = True
        return Release(request_ids=tuple(done), num_blocks=freed, reason=release.reason,
                       short_blocks=release.short_blocks)

    # -- sync -------------------------------------------------------------------------------

    def add_url(self, url: str) -> None:
        """A retention URL a decode request carried; the ``MAX_SYNC_URLS`` most recent are
        synced with, a new one at once. Releases before a URL was known are not told to it."""
        if url in self._pending:
            self._pending.move_to_end(url)
            return
        self._pending[url] = []
        self.urgent = True
        while len(self._pending) > MAX_SYNC_URLS:
            self._pending.popitem(last=False)

    @property
    def urls(self) -> list[str]:
        return list(self._pending)

    def pending(self, url: str) -> tuple[Released, ...]:
        return tuple(self._pending.get(url, ()))

    def has_news(self) -> bool:
        """Whether a sync is due on the interval: turns held, or releases not yet told."""
        return self.holds_any() or any(self._pending.values())

    def told(self, url: str, released: tuple[Released, ...]) -> None:
        """A sync carrying ``released`` reached ``url``: those need not be sent again."""
        queue = self._pending.get(url)
        if queue is not None:
            sent = set(released)
            self._pending[url] = [item for item in queue if item not in sent]

    def sync_body(self, engine_id: str, url: str) -> RetentionSync:
        turns = self.turns()
        return RetentionSync(
            engine_id=engine_id,
            block_size=self._pool.block_size,
            bytes_per_block=self.bytes_per_block,
            num_blocks_total=self._pool.num_usable,
            num_blocks_free=self._pool.num_free,
            retained_requests=len(turns),
            retained_blocks=min(sum(t.num_blocks for t in turns), self._pool.num_usable),
            retained_tokens=sum(t.num_tokens for t in turns),
            releases_total=dict(self.releases_total),
            released=self.pending(url),
        )

    def _tell(self, released: Released) -> None:
        for queue in self._pending.values():
            queue.append(released)
            del queue[:-MAX_RELEASED_PER_SYNC]

