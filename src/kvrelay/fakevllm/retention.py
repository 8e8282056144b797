"""kvrelay's managed retention on a fake D: each retained turn accounted, released early.

Stock vLLM keeps every finished D turn for one global TTL (``decoder_kv_blocks_ttl``) and
frees it only when P's read completes or the TTL runs out. kvrelay's connector accounts each
retained turn and releases it earlier; this is the fake's version of that accounting, driven
by the same pure policy (``kvrelay.core.retention``) and the same wire contract and release
handshake (``kvrelay.core.retention_sync``) as the real connector
(``kvrelay.vllm_plugin.retention``):

* **deadline**: the decode request's ``kvrelay_retain_s``, clamped to the TTL
  (``clamp_retain_s``), is the turn's own expiry, stamped in the params D returns (so P
  declines reads near it); ``expire`` frees turns past it (cause ``expired``);
* **return curve**: ``kvrelay_return_curve`` (``core.return_curve.decode_curve``) says how
  such turns come back (``RetainedTurn.curve``); under pressure and headroom the turns
  least likely still to be pulled are picked first (``core.retention.release_order``);
* **pressure**: when a waiting or running request cannot get blocks, ``relieve`` picks the
  least valuable turns, enough for the allocation (counting only the blocks no other
  request references: the pool's ``holders``, vLLM's ``ref_cnt``), and *asks* the router
  each turn came from (``releasing`` in its next sync, sent at once); the turn stays held
  until that router answers it in ``dropped`` (``obey``), then it is freed (cause
  ``pressure``). Meanwhile the scheduler waits for those blocks instead of preempting
  (``has_pending``: vLLM's ``has_pending_block_frees``). A router that does not answer
  within ``CONFIRM_TIMEOUT_S`` gets its turns back (held again) and is not asked again for
  ``ASK_BACKOFF_S``; a turn that came without a retention URL is never asked. Either way D
  then waits or preempts as stock vLLM does: it never frees a turn a router may still send
  a P to read;
* **headroom**: ``trim`` asks the same way for what retention holds above ``1 - headroom``
  of the cache, after each new turn (cause ``headroom``);
* **router orders** (``RetentionOrders.release``): the router dropped the entry already, so
  the turn is freed at once (cause ``router``); ``RetentionOrders.curves`` replace turns'
  curves (the router read their answers: a tool call's follow-up comes within the tools'
  run time or not at all).

A turn a P is reading is never freed (the fake can tell; vLLM cannot, which is why the
handshake exists). A freed turn's hold is gone and remembered, so a later read is declined
like an expired lease. Each release is queued for every known sync URL until a sync to it
succeeds; ``urgent`` says a sync is due at once (a release, an ask, a new URL).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from msgspec.structs import replace

from kvrelay.core.retention import (
    NOTHING,
    Release,
    RetainedTurn,
    blocks_freed,
    holders_after,
    release_expired,
    release_over_headroom,
    release_under_pressure,
)
from kvrelay.core.retention_sync import (
    MAX_RELEASED_PER_SYNC,
    MAX_SHARED_MEMORY,
    MAX_SYNC_URLS,
    RELEASE_CAUSES,
    Lane,
    ReleaseCause,
    Released,
    RetentionOrders,
    RetentionSync,
    ask_via,
)
from kvrelay.fakevllm.kv import BlockPool, HoldTable
from kvrelay.fakevllm.latency import Clock

_CauseOf = Callable[[str], ReleaseCause]
"""Why a freed id was freed."""

CONFIRM_TIMEOUT_S = 2.0
"""How long D waits for a router to answer a ``releasing`` id (as kvrelay's connector)."""
ASK_BACKOFF_S = 30.0
"""How long a router that let an ask time out is not asked again (as kvrelay's connector)."""


@dataclass
class _Held:
    turn: RetainedTurn
    url: str | None
    asked: ReleaseCause | None = None
    asked_at_s: float = 0.0
    asked_chance: float = 0.0
    """The turn's chance of a pull when D asked for it (``RetainedTurn.pull_chance``)."""


class Retention:
    """The retained turns of one D engine incarnation and the releases to tell routers."""

    def __init__(self, pool: BlockPool, holds: HoldTable, clock: Clock, *, headroom: float,
                 bytes_per_block: int) -> None:
        if not 0.0 <= headroom <= 1.0:
            raise ValueError(f"retention headroom is a fraction in [0, 1], got {headroom}")
        self._pool = pool
        self._holds = holds
        self._clock = clock
        self.headroom = headroom
        self.bytes_per_block = bytes_per_block
        self._held: dict[str, _Held] = {}
        self._pending: OrderedDict[str, list[Released]] = OrderedDict()
        self._backoff_until_s: dict[str, float] = {}
        self._answered: dict[str, bool] = {}
        """Whether each router's last sync was answered (``ask_via``)."""
        self._shared_of: OrderedDict[str, str] = OrderedDict()
        """The shared state each router's answers named (kept beyond ``MAX_SYNC_URLS``)."""
        self.releases_total: dict[str, int] = dict.fromkeys(RELEASE_CAUSES, 0)
        self.released_pull_chance: dict[str, float] = dict.fromkeys(RELEASE_CAUSES, 0.0)
        """Per cause D chose the turns for (``pressure``, ``headroom``), the sum of their
        chances of a pull when D asked for them: the follow-ups D expected to lose."""
        self.declined_reads = 0
        self.urgent = False

    # -- what D holds -----------------------------------------------------------------------

    def retain(self, turn: RetainedTurn, url: str | None) -> None:
        """A finished D turn whose blocks are held (``HoldTable``) for a P to read; ``url``:
        the retention URL its request carried (the router to ask before freeing it)."""
        self._held[turn.request_id] = _Held(turn, url)

    def _live(self) -> dict[str, _Held]:
        """The turns still held, each with ``reading`` as the hold table has it now."""
        for request_id in [rid for rid in self._held if self._holds.get(rid) is None]:
            del self._held[request_id]  # P read it (or it expired while read) meanwhile
        for held in self._held.values():
            reading = self._holds.reading(held.turn.request_id)
            if held.turn.reading != reading:
                held.turn = replace(held.turn, reading=reading)
        return self._held

    def turns(self) -> list[RetainedTurn]:
        return [held.turn for held in self._live().values()]

    def holds_any(self) -> bool:
        return bool(self._live())

    def has_pending(self) -> bool:
        """Blocks are on their way: a router was asked and has not answered yet."""
        return any(held.asked is not None for held in self._live().values())

    def releasing(self, url: str) -> tuple[str, ...]:
        """The ids D asks ``url``'s router to let it free: of the turns it gave, and of those
        whose own router does not answer and that ``url``'s answers for (``ask_via``)."""
        live = self._live()
        via = self._routes(held.url for held in live.values() if held.asked is not None)
        return tuple(rid for rid, held in live.items()
                     if held.asked is not None and held.url is not None
                     and via[held.url] == url)

    def _routes(self, urls: Iterable[str | None]) -> dict[str, str | None]:
        """Where each of these turn URLs is asked (``ask_via``), the lanes read once."""
        lanes = [Lane(u, self._answered.get(u), self._shared_of.get(u)) for u in self._pending]
        return {url: ask_via(url, lanes, self._shared_of.get(url))
                for url in set(urls) if url is not None}

    def answered(self, url: str, shared: str | None) -> None:
        """``url``'s router answered a sync; its answer named ``shared`` (or nothing)."""
        self._answered[url] = True
        if shared is not None:
            self._shared_of[url] = shared
            self._shared_of.move_to_end(url)
            while len(self._shared_of) > MAX_SHARED_MEMORY:
                self._shared_of.popitem(last=False)

    def unanswered(self, url: str) -> None:
        """A sync to ``url`` failed: its turns are asked of a router answering for it, at
        the next round (at once if any is asked for)."""
        if self._answered.get(url) is not False and self.releasing(url):
            self.urgent = True
        self._answered[url] = False

    # -- releases ---------------------------------------------------------------------------

    def expire(self, now_s: float) -> Release:
        """Free the turns whose deadline has passed (no ask: P declines reads near it)."""
        return self._free(release_expired(self.turns(), now_s).request_ids,
                          lambda rid: "expired")

    def relieve(self, num_blocks_needed: int) -> Release:
        """Ask for enough turns to give ``num_blocks_needed`` free blocks, least valuable
        first; blocks already asked for count as on their way."""
        live = self._live()
        now = self._clock()
        asked = [h.turn for h in live.values() if h.asked is not None]
        holders = self._pool.holders
        release = release_under_pressure(
            self._askable(now),
            num_blocks_free=self._pool.num_free + blocks_freed(asked, holders),
            num_blocks_needed=num_blocks_needed, now_s=now,
            holders=holders_after(holders, asked))
        self._ask(release.request_ids, "pressure", now)
        return release

    def trim(self) -> Release:
        """Ask for what retention holds above its share of the cache (``headroom``)."""
        if self.headroom <= 0.0:
            return NOTHING
        now = self._clock()
        live = self._live()
        held = [h.turn for h in live.values() if h.asked is None]
        asked = [h.turn for h in live.values() if h.asked is not None]
        over = release_over_headroom(held, num_blocks_total=self._pool.num_usable,
                                     headroom=self.headroom, now_s=now,
                                     holders=holders_after(self._pool.holders, asked))
        askable = {turn.request_id for turn in self._askable(now)}
        chosen = tuple(rid for rid in over.request_ids if rid in askable)
        self._ask(chosen, "headroom", now)
        return Release(request_ids=chosen, num_blocks=over.num_blocks, reason=over.reason)

    def obey(self, url: str, orders: RetentionOrders, asked_for: Iterable[str] = ()) -> Release:
        """``url``'s answer: free what it orders released (entries it dropped), and what D
        asked it for (``asked_for``: the sync's ``releasing``, the turns it gave and those it
        answers for) that it answers ``dropped``; take the return curves it sends. Unknown,
        busy or unasked ids are ignored (the next sync says what D holds)."""
        live = self._live()
        for told in orders.turn_curves:
            held = live.get(told.request_id)
            if held is not None:
                held.turn = replace(held.turn, curve=told.curve)
        ordered = self._free([rid for rid in dict.fromkeys(orders.release) if rid in live],
                             lambda rid: "router")
        sent = set(asked_for)
        confirmed = [rid for rid in dict.fromkeys(orders.dropped)
                     if rid in live and live[rid].asked is not None
                     and (live[rid].url == url or rid in sent)]
        asked = {rid: live[rid].asked for rid in confirmed}
        gave = {rid: live[rid].url for rid in confirmed}
        done = self._free(confirmed, lambda rid: asked[rid] or "pressure")
        self._backoff_until_s.pop(url, None)
        for turn_url in set(gave.values()):
            if turn_url is not None:
                self._backoff_until_s.pop(turn_url, None)
        return Release(request_ids=ordered.request_ids + done.request_ids,
                       num_blocks=ordered.num_blocks + done.num_blocks,
                       reason="router" if ordered.request_ids else done.reason)

    def time_out(self, now_s: float) -> list[str]:
        """Asks older than ``CONFIRM_TIMEOUT_S`` are given up: the turns are held again and
        their routers are not asked for ``ASK_BACKOFF_S``."""
        late = [rid for rid, held in self._live().items()
                if held.asked is not None and now_s - held.asked_at_s >= CONFIRM_TIMEOUT_S]
        for rid in late:
            held = self._held[rid]
            held.asked = None
            if held.url is not None:
                self._backoff_until_s[held.url] = now_s + ASK_BACKOFF_S
        return late

    def _askable(self, now_s: float) -> list[RetainedTurn]:
        """Held turns some router D syncs with can answer for (``ask_via``), not backed off."""
        live = self._live()
        via = self._routes(h.url for h in live.values() if h.asked is None)
        return [h.turn for h in live.values()
                if h.asked is None and not h.turn.reading and h.url is not None
                and self._backoff_until_s.get(h.url, float("-inf")) <= now_s
                and via[h.url] is not None]

    def _ask(self, request_ids: Iterable[str], cause: ReleaseCause, now_s: float) -> None:
        for rid in request_ids:
            held = self._held[rid]
            held.asked, held.asked_at_s = cause, now_s
            held.asked_chance = held.turn.pull_chance(now_s)
            self.urgent = True

    def _free(self, request_ids: Iterable[str], cause_of: _CauseOf) -> Release:
        """Drop the holds named (never one being read); returns what was freed."""
        done: list[str] = []
        freed = 0
        for rid in request_ids:
            hold = self._holds.drop(rid)
            if hold is None:
                continue
            held = self._held.pop(rid, None)
            cause = cause_of(rid)
            freed += held.turn.num_blocks if held is not None else len(hold.block_ids)
            done.append(rid)
            self.releases_total[cause] += 1
            if held is not None and held.asked == cause:
                self.released_pull_chance[cause] += held.asked_chance
            self._tell(Released(request_id=rid, cause=cause))
        if not done:
            return NOTHING
        self.urgent = True
        return Release(request_ids=tuple(done), num_blocks=freed, reason="released")

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
            releasing=self.releasing(url)[:MAX_RELEASED_PER_SYNC],
        )

    def _tell(self, released: Released) -> None:
        for queue in self._pending.values():
            queue.append(released)
            del queue[:-MAX_RELEASED_PER_SYNC]

