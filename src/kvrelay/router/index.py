"""Where the router keeps retained entries between turns, found by digests (``core.identity``).

``ConversationIndex`` is the contract (``InMemoryIndex`` here, ``index_redis.RedisIndex``
shared by router replicas); every method is async so a networked index fits. An entry lives
at an ``EntryRef``: the request's scope, the anchor of the request that produced it (a
completions entry: of the block holding its end) and the slot of its continuation.
Contracts:

* ``lookup(identity)`` returns the entry the request continues: for each probe, longest
  first, the entry under that anchor whose continuation the request carries (chat: the
  probe's answer digest; completions: the ends the index holds in the probe's block under
  the request's own fine digests, longest first, each checked by one digest,
  ``core.identity.text_end``); failing that, for an explicit id's scope
  (``identity.explicit``), the scope's most recently stored entry (``Found.probe`` is then
  ``None``: the guard proves what still matches); else ``None``. Expired entries are
  returned (the policy reports ``expired``) until purged, at most ``expired_retention_s``
  after expiry. A networked index that cannot answer in time raises ``IndexUnavailable``
  (the turn recomputes, ``state_unavailable``).
* ``put(ref, entry, tenant=...)`` stores the entry beside any others at the ref (several
  entries per ref, at most ``MAX_ENTRIES_PER_REF``, the oldest pushed out first): entries
  with the same anchor and answer hold the same tokens, so N identical conversations whose
  turns finished together each find one. Storing the same entry again (equal but for its
  times, ``released`` and ``release_at_expiry``: the same D request) replaces it.
  ``lookup`` returns the newest entry of a ref that D still holds (a released one only
  when there is no other). An entry a later turn continued without consuming it
  (recompute, direct) stays until that turn commits (``commit`` drops it then, and D
  releases it).
* ``claim(ref, entry)`` is the single-use guarantee: it atomically removes one entry of the
  ref and returns it: ``entry`` (compared by value) when still stored, else another entry of
  the ref D still holds (interchangeable: the caller decides again on what it got), else
  ``None``. Of any number of concurrent claims of N entries at most N succeed, each with a
  different entry. A pull is sent only after a claim; a released entry is never claimed.
* ``announce(ref, ttl_s)`` / ``withdraw(ref)`` / ``announced(identity)``: an entry for
  ``ref`` is on its way (its turn's answer is out, D's report is awaited by the replica
  that served it, at most ``ttl_s``), so a follow-up another replica serves waits for it as
  the serving replica's own does (``commit.ReportDesk``) instead of missing it; chat-family
  refs only (a probe with a continuation). One process's index has nothing to share: its
  desk knows (``InMemoryIndex`` announces nothing).
* ``drop(ref, entry=None)`` (``None``: every entry of the ref), ``drop_scope`` (an explicit
  conversation id), ``drop_node``, ``drop_engine`` remove entries and return how many
  (``drop_engine``: every entry of that engine's group, each rank's of a data-parallel D:
  one restart ends them all, ``core.engine_group``).
* Flushes reach turns under way on other replicas: a networked index's ``drop_scope`` marks
  the scope flushed (for ``FLUSH_MARK_S``), and ``put(..., opened_at_s=t)`` of an entry
  whose scope was flushed after ``t`` (its turn began before the flush, on any replica)
  drops it at once, ordering D to release it, and returns False: an admin's drop through
  one replica reaches a turn another replica is serving (probe 9, N6: it committed there).
  The mark is read in the same step that stores the entry, so a flush either finds the
  entry or is found by it. One process's index has nothing to share: its desk knows its
  own turns under way (``ReportDesk.flush_scope``), so ``InMemoryIndex.put`` returns True.
* Release orders: every entry the index removes but a claimed one (a pull consumes it: P's
  read frees D's blocks; but a claim whose read was spent, ``read_spent`` below, is ordered
  released once its grace is over, as P may never have read it), a released one, one already
  ordered at its expiry (below), and those ``drop_node``/``drop_engine`` remove (D's blocks
  are gone), or ``drop(..., release=False)``, queues a release order for its D request id on
  its D: ``take_releases(node_id, engine_id)`` pops them (at most ``limit``; orders for
  another engine of that D are discarded, but another rank's of a data-parallel D stay for
  that rank's sync: ``core.engine_group``) for the answer to D's next sync; a D that never
  syncs (stock vLLM) has them popped by ``take_release_blocks`` instead, which returns each
  order's D params as a release needs them (``RemoteBlocks.for_release``: what a P request
  needs to have D free the turn, ``router.stock_release``). ``mark_released`` marks the
  entries D said it released (its sync): they are never claimed, and ``lookup`` returns one
  only when its ref has no other, so the turn recomputes with reason ``released``. A release
  of a request with no entry yet (D's sync overtook the turn's commit) is kept (bounded) and
  the entry ``put`` later is stored released.
* Release at expiry: an entry flagged ``release_at_expiry`` (D keeps its blocks past the
  entry's expiry) is ordered released once it expires on the router's clock.
  ``take_releases(node_id, engine_id)`` also returns, once each (within the same
  ``limit``), the D request ids of that node's flagged entries whose ``expires_at_s`` has
  passed and that are not released (``released`` set, ``RELEASING`` included); one for
  another engine of that node is discarded (and never ordered), unless another rank's (it
  stays due). A claimed or removed entry
  is no longer in the index, so it is never ordered so (one removed with release queued its
  order then). An ordered entry stays in the index until purged, so the next turn still
  reports ``expired``; D no longer holds it, so it is never claimed and ``lookup`` returns
  it only when its ref has no other; removing it later (purge, eviction, drop) queues no
  second order. Bounded work: flagged entries are kept per node in expiry order (in memory
  a heap, in Redis a sorted set); a take looks at no more than ``limit`` entries that are
  due, never at every entry (what is left comes with the next sync).
* D asks before it frees a turn itself (pressure, headroom: ``RetentionSync.releasing``).
  ``release_requested(node_id, engine_id, ids)`` marks those entries released
  (``RELEASING``; a release D reports later names the cause) so no claim can take them, and
  returns the ids D may free now: those no P leg is reading. A claim counts as a read of the
  claimed entry's D request id until ``read_done(node_id, request_id)`` (the P leg ended
  and P provably read nothing more), or until ``grace_s`` after ``read_spent(node_id,
  request_id, grace_s)`` (the P leg ended without that proof: an error answer, a timeout;
  ``core.consequences.SPENT_READ_GRACE_S``); a networked index lets one never ended lapse
  after ``READ_TTL_S`` (a router that died mid-pull). Each process also keeps the reads of
  its own P legs (``OpenReads``) and never answers one as free: a shared store's record of
  a read can be lost while the leg is open. A networked index that cannot reach
  its store raises ``IndexUnavailable`` from ``mark_released`` and ``release_requested``:
  neither may be answered as if heard.
* ``shared_state()``: a name every router on the same shared state reads alike (replicas on
  one Redis and namespace), ``None`` for a process's own; D asks any router that names it
  for turns another of them gave (``core.retention_sync.ask_via``).
* ``node_urls(mine)``: publishes this router's node URLs by node id and returns the ids
  another router on the same shared state last published with another URL (id -> that
  URL). Node ids are positions unless configured (``decode-0``, ...): replicas that list
  the same nodes in another order read each other's entries, engines and release orders
  for other nodes (probe 14, K3: "restarted" engines flapping, reports refused, half the
  turns recomputed), and nothing said so.
* ``set_drained(node_id, drained)`` / ``drained_nodes()``: an admin's drains, shared by the
  replicas of a networked index (each adopts them at its next health round: an admin call
  reaches one replica behind a Service, and the others kept placing new conversations on
  the drained node: probe 14, K2); ``drained_nodes`` is ``None`` where nothing is shared,
  the store did not answer or lost them (each replica then writes its own drains again
  instead of undraining every node: probe 15, L2), ``set_drained`` raises
  ``IndexUnavailable`` when the store cannot take it (an admin must not be told a drain
  happened that the next round undoes).
* Bounded: at most ``max_entries`` entries, at most ``max_per_tenant`` per tenant; the least
  recently used goes first.
* ``retained_tokens(now_s)``: tokens each D holds for entries not expired (nor released) at
  ``now_s`` (the retention gauge; a networked index returns what its last ``refresh`` saw).
* ``len(index)`` is the number of entries (exact in memory, last known when networked).
* Bounded work: a lookup never scans what an anchor holds. A chat probe is one dict probe;
  a completions lookup looks into at most ``MAX_TEXT_BLOCKS`` blocks with entries and
  computes at most ``MAX_TEXT_DIGESTS`` digests (each over at most ``TEXT_BLOCK_BYTES``)
  and probes that many refs, however many entries the scope holds: past either it stops
  (a miss, or an explicit id's latest entry). ``on_text_digests(n)`` is told each
  completions lookup's count.

Entries hold block locations and a token fingerprint; refs are digests: no content, no ids.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import msgspec
from msgspec.structs import replace

from kvrelay.core.conversation import ConversationEntry
from kvrelay.core.engine_group import same_group
from kvrelay.core.identity import (
    DIGEST_BYTES,
    Continuation,
    Probe,
    RequestIdentity,
    text_end,
    text_fine_of,
    text_fines,
)
from kvrelay.core.params import RemoteBlocks
from kvrelay.core.retention_sync import MAX_ORDERS, Released

EvictReason = Literal["expired", "capacity", "overflow"]


class IndexUnavailable(RuntimeError):
    """The conversation index could not answer (down, slow): treat the lookup as a miss."""


class EntryRef(msgspec.Struct, frozen=True):
    """Where an entry is stored (all digests)."""

    scope: bytes
    anchor: bytes
    slot: bytes

    def hex(self) -> str:
        return (self.scope + self.anchor + self.slot).hex()


class Found(msgspec.Struct, frozen=True):
    """The entry a request continues, where it is, and the probe that found it (``None``:
    the latest entry of an explicit id's scope)."""

    ref: EntryRef
    entry: ConversationEntry
    probe: Probe | None


@runtime_checkable
class ConversationIndex(Protocol):
    """Retained entries by digest (see the module docstring)."""

    async def lookup(self, identity: RequestIdentity) -> Found | None: ...

    async def put(self, ref: EntryRef, entry: ConversationEntry, *, tenant: str,
                  opened_at_s: float | None = None) -> bool: ...

    async def claim(
        self, ref: EntryRef, entry: ConversationEntry
    ) -> ConversationEntry | None: ...

    async def drop(
        self, ref: EntryRef, entry: ConversationEntry | None = None, *, release: bool = True
    ) -> bool: ...

    async def drop_scope(self, scope: bytes) -> int: ...

    async def drop_node(self, node_id: str) -> int: ...

    async def drop_engine(self, node_id: str, engine_id: str) -> int: ...

    async def mark_released(
        self, node_id: str, engine_id: str, released: Iterable[Released]
    ) -> int: ...

    async def take_releases(
        self, node_id: str, engine_id: str, limit: int = MAX_ORDERS
    ) -> tuple[str, ...]: ...

    async def take_release_blocks(
        self, node_id: str, engine_id: str, limit: int = MAX_ORDERS
    ) -> tuple[RemoteBlocks, ...]: ...

    async def release_requested(
        self, node_id: str, engine_id: str, request_ids: Iterable[str]
    ) -> tuple[str, ...]: ...

    async def read_done(self, node_id: str, request_id: str) -> None: ...

    async def read_spent(self, node_id: str, request_id: str, grace_s: float) -> None: ...

    async def shared_state(self) -> str | None: ...

    async def set_drained(self, node_id: str, drained: bool) -> None: ...

    async def drained_nodes(self) -> frozenset[str] | None: ...

    async def node_urls(self, mine: Mapping[str, str]) -> dict[str, str]: ...

    async def announce(self, ref: EntryRef, ttl_s: float) -> None: ...

    async def withdraw(self, ref: EntryRef) -> None: ...

    async def announced(self, identity: RequestIdentity) -> bool: ...

    def retained_tokens(self, now_s: float) -> Mapping[str, int]: ...

    async def refresh(self, node_ids: list[str]) -> None: ...

    async def aclose(self) -> None: ...

    def __len__(self) -> int: ...


def continuation_of(slot: bytes) -> Continuation:
    """The continuation a slot was made from (``Continuation.slot`` inverted)."""
    return Continuation(slot[:-8], int.from_bytes(slot[-8:], "little"))


TEXT_SLOT_BYTES = 2 * DIGEST_BYTES + 8
"""A completions entry's slot (fine + end digest, end offset); a chat slot is shorter."""

MAX_TEXT_DIGESTS = 256
"""The most digests one completions lookup computes (and refs it probes), whatever the
index holds: the whole lookup's budget (``TEXT_BLOCK_BYTES`` hashed per digest at most)."""

MAX_TEXT_BLOCKS = 4
"""The most blocks with entries one completions lookup looks into, longest first (each costs
its fine digests: at most ``TEXT_BLOCK_BYTES // TEXT_FINE_BYTES``)."""


def is_text_slot(slot: bytes) -> bool:
    return len(slot) == TEXT_SLOT_BYTES


class TextSearch:
    """One completions lookup: the ends to try, longest first, within ``MAX_TEXT_DIGESTS``.

    ``fines(probe)`` computes the request's fine digests of a block (``None`` once the
    budget is spent or ``MAX_TEXT_BLOCKS`` blocks were looked into);
    ``end(probe, fines, end_offset)`` the continuation an entry ending
    there would have (``None``: the request has nothing after it, or the budget is spent).
    ``digests`` counts what was computed.
    """

    def __init__(self, identity: RequestIdentity, budget: int = MAX_TEXT_DIGESTS) -> None:
        self.identity = identity
        self.budget = budget
        self.digests = 0
        self.blocks = 0

    @property
    def spent(self) -> bool:
        return self.digests >= self.budget

    @property
    def blocks_spent(self) -> bool:
        return self.spent or self.blocks >= MAX_TEXT_BLOCKS

    def fines(self, probe: Probe) -> tuple[bytes, ...] | None:
        if self.blocks_spent:
            return None
        out = text_fines(self.identity, probe)
        self.blocks += 1
        self.digests += len(out)
        return out

    def end(
        self, probe: Probe, fines: tuple[bytes, ...], end_offset: int
    ) -> Continuation | None:
        text = self.identity.text
        if self.spent or text is None or probe.offset + end_offset >= len(text):
            return None
        self.digests += 1
        return text_end(self.identity, probe, fines, end_offset)

    def found_probe(self, probe: Probe, continuation: Continuation) -> Probe:
        """The probe a completions hit is reported with: the block's anchor, the entry's
        continuation, and all bytes up to its end covered."""
        end = probe.offset + continuation.num_bytes
        return Probe(probe.anchor, continuation, probe.offset, end)


RELEASING = "releasing"
"""``ConversationEntry.released`` of an entry D asked to free (its cause comes later)."""

READ_TTL_S = 600.0
"""How long a networked index keeps a claimed entry's read in progress when the P leg never
said it ended (a router that died mid-pull): P's read timeout, by default."""

FLUSH_MARK_S = 3600.0
"""How long a networked index's mark of a flushed scope lasts: a turn under way at the flush
that commits within it is dropped as it commits (longer than any turn's stream and report
wait)."""

MAX_QUEUED_RELEASES = 4 * MAX_ORDERS
"""Release orders kept per D until its next sync (the oldest dropped beyond)."""

MAX_ENTRIES_PER_REF = 64
"""Interchangeable entries kept at one ref (same scope, anchor and answer: the same tokens,
e.g. identical conversations whose turns finished together); more push out the oldest."""


@dataclass
class _Item:
    """A stored entry; ``ordered`` once its release at expiry was ordered (D frees it)."""

    ref: EntryRef
    tenant: str
    entry: ConversationEntry
    ordered: bool = False

    @property
    def held(self) -> bool:
        """Whether D still holds the entry's blocks for a P (neither released nor ordered)."""
        return self.entry.released is None and not self.ordered


def _identity(entry: ConversationEntry) -> ConversationEntry:
    """What tells two entries apart: everything but their times, ``released``,
    ``release_at_expiry`` and ``waits_for`` (as ``index_redis.entry_identity``)."""
    return replace(entry, expires_at_s=0.0, created_at_s=0.0, released=None,
                   release_at_expiry=False, waits_for="user")


_Key = tuple[EntryRef, int]
"""An entry's place in memory: its ref and the sequence number of the ``put`` that stored it."""

_Due = tuple[float, int, _Key]
"""A flagged entry's place in its node's expiry heap: (``expires_at_s``, sequence, key)."""


def continues_latest(entry: ConversationEntry, identity: RequestIdentity) -> bool:
    """Whether an explicit id's request that matched no probe may continue ``entry``, the
    scope's latest: only under the context its turn had (``RequestIdentity.context``: another
    model or LoRA adapter computed other KV for the same token ids; an entry of unknown
    context, ``b""``, never)."""
    return bool(entry.context) and entry.context == identity.context


class OpenReads:
    """The reads this process's P legs have open on D's turns: a claim starts one (the
    claimed entry), ``done`` ends it (P answered: it read, or provably not), ``spent`` ends
    it ``grace_s`` later (P may still be reading: an error answer, a timeout, the client
    gone). A spent read's turn has no entry left (the claim took it) and D may still hold
    it, as when P's request failed before reading: ``lapse`` ends the spent reads whose grace
    is over and returns their turns for release orders (D ignores an order for a turn P's
    read freed). Without them such a turn stayed on D until its retention time. Kept in
    process by every index: a shared store's record of a read can be lost (Redis restarted
    without persistence) while this process's P leg is still open."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._open: dict[tuple[str, str], int] = {}
        self._blocks: dict[tuple[str, str], RemoteBlocks] = {}
        self._lapsing: list[tuple[float, str, str]] = []
        """Spent reads by when their grace ends."""

    def __contains__(self, read: tuple[str, str]) -> bool:
        """Whether a P leg of this process reads ``(node_id, request_id)``."""
        return read in self._open

    def start(self, entry: ConversationEntry) -> None:
        read = (entry.decode_node_id, entry.request_id)
        self._open[read] = self._open.get(read, 0) + 1
        self._blocks[read] = entry.blocks

    def done(self, node_id: str, request_id: str) -> None:
        self._end((node_id, request_id))

    def spent(self, node_id: str, request_id: str, grace_s: float) -> None:
        heapq.heappush(self._lapsing, (self._clock() + grace_s, node_id, request_id))

    def lapse(self) -> list[tuple[str, RemoteBlocks]]:
        """End the spent reads whose grace is over; their turns' (D, blocks) to release."""
        now = self._clock()
        out: list[tuple[str, RemoteBlocks]] = []
        while self._lapsing and self._lapsing[0][0] <= now:
            _, node_id, request_id = heapq.heappop(self._lapsing)
            blocks = self._end((node_id, request_id))
            if blocks is not None:
                out.append((node_id, blocks))
        return out

    def _end(self, read: tuple[str, str]) -> RemoteBlocks | None:
        """End one read; the turn's blocks once none is left open."""
        left = self._open.get(read, 0) - 1
        if left > 0:
            self._open[read] = left
            return None
        self._open.pop(read, None)
        return self._blocks.pop(read, None)


class InMemoryIndex:
    """A ``ConversationIndex`` in this process (LRU-capped, expired entries purged
    ``expired_retention_s`` after expiry on ``clock``, the router clock).

    ``on_evict(entry, reason)`` is called for every entry the index removes by itself
    (``expired``, ``capacity`` or ``overflow``), never for explicit ``drop*``/``claim``;
    ``on_text_digests(n)`` after each completions lookup (module docstring, bounded work).
    ``predecessor_grace_s``: this process's index knows none of the reads a router before it
    (a restart) had open, and its P legs may still read until vLLM aborted them (their
    connections closed with that process): for this long after the index is made, D's asks
    for turns it holds no entry of are answered as read (the router passes
    ``core.consequences.SPENT_READ_GRACE_S``; D asked at once freed a turn 0.7 s after the
    old router died mid-pull: probe 9, finding 2).
    A completions entry's end offset is kept per (scope, anchor, fine digest), so a lookup
    tries only the ends that share the request's text up to their fine boundary. Entries
    flagged ``release_at_expiry`` are pushed on their node's expiry heap by ``put``;
    ``take_releases`` pops the due ones, skipping those no longer stored (lazily: a sweep
    drops them from the heaps). No method awaits, so each is atomic on the event loop.
    """

    def __init__(
        self,
        max_entries: int = 100_000,
        *,
        max_per_tenant: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        expired_retention_s: float = 300.0,
        sweep_interval_s: float = 10.0,
        max_per_ref: int = MAX_ENTRIES_PER_REF,
        on_evict: Callable[[ConversationEntry, EvictReason], None] | None = None,
        on_text_digests: Callable[[int], None] | None = None,
        predecessor_grace_s: float = 0.0,
    ) -> None:
        if max_entries < 1 or max_per_ref < 1:
            raise ValueError("max_entries and max_per_ref must be >= 1")
        self._max = max_entries
        self._max_tenant = min(max_per_tenant or max_entries, max_entries)
        self._max_ref = max_per_ref
        self._clock = clock
        self._retention = expired_retention_s
        self._sweep_interval = sweep_interval_s
        self._next_sweep = clock() + sweep_interval_s
        self._on_evict = on_evict
        self._on_text_digests = on_text_digests
        self._seq = 0
        self._items: OrderedDict[_Key, _Item] = OrderedDict()
        self._refs: dict[EntryRef, dict[int, None]] = {}
        self._ends: dict[tuple[bytes, bytes], dict[bytes, dict[int, int]]] = {}
        self._by_tenant: dict[str, OrderedDict[_Key, None]] = {}
        self._by_scope: dict[bytes, dict[_Key, None]] = {}
        self._by_request: dict[tuple[str, str], dict[_Key, None]] = {}
        self._releases: dict[str, OrderedDict[tuple[str, str], RemoteBlocks]] = {}
        self._due: dict[str, list[_Due]] = {}
        self._released_early: OrderedDict[tuple[str, str, str], str] = OrderedDict()
        self._reads = OpenReads(clock)
        self._predecessor_until_s = clock() + predecessor_grace_s
        self._own: set[tuple[str, str]] | None = set() if predecessor_grace_s > 0 else None
        """D requests this index stored or claimed while its predecessor's reads may last."""

    def __len__(self) -> int:
        return len(self._items)

    async def aclose(self) -> None:
        """Nothing to release: the entries live in this process."""

    async def refresh(self, node_ids: list[str]) -> None:
        """Nothing to refresh: ``retained_tokens`` is computed when read."""

    def retained_tokens(self, now_s: float) -> Mapping[str, int]:
        out: dict[str, int] = {}
        for item in self._items.values():
            entry = item.entry
            if not entry.is_expired(now_s) and entry.released is None:
                out[entry.decode_node_id] = out.get(entry.decode_node_id, 0) + entry.num_tokens
        return out

    async def lookup(self, identity: RequestIdentity) -> Found | None:
        self._maybe_sweep()
        search = TextSearch(identity) if identity.text is not None else None
        try:
            for probe in identity.probes:
                if probe.continuation is not None:
                    found = self._found(EntryRef(
                        identity.scope, probe.anchor, probe.continuation.slot()), probe)
                elif search is not None:
                    found = self._text_found(search, probe)
                else:
                    found = None
                if found is not None:
                    return found
                if search is not None and search.blocks_spent:
                    break
        finally:
            if search is not None and self._on_text_digests is not None:
                self._on_text_digests(search.digests)
        if identity.explicit:
            mine = self._by_scope.get(identity.scope)
            if mine:
                key = next(reversed(mine))
                item = self._items[key]
                if continues_latest(item.entry, identity):
                    self._touch(key, item.tenant)
                    return Found(key[0], item.entry, None)
        return None

    def _found(self, ref: EntryRef, probe: Probe) -> Found | None:
        key = self._best(ref)
        if key is None:
            return None
        item = self._items[key]
        self._touch(key, item.tenant)
        return Found(ref, item.entry, probe)

    def _text_found(self, search: TextSearch, probe: Probe) -> Found | None:
        """The newest entry of the longest end in the probe's block the request carries."""
        scope = search.identity.scope
        by_fine = self._ends.get((scope, probe.anchor))
        if not by_fine:
            return None
        fines = search.fines(probe)
        if fines is None:
            return None
        for fine in reversed(fines):
            ends = by_fine.get(fine)
            if not ends:
                continue
            for end_offset in sorted(ends, reverse=True):
                continuation = search.end(probe, fines, end_offset)
                if continuation is None:
                    if search.spent:
                        return None
                    continue
                ref = EntryRef(scope, probe.anchor, continuation.slot())
                found = self._found(ref, search.found_probe(probe, continuation))
                if found is not None:
                    return found
        return None

    async def put(self, ref: EntryRef, entry: ConversationEntry, *, tenant: str,
                  opened_at_s: float | None = None) -> bool:
        self._maybe_sweep()
        self._note_own(entry)
        same = self._member(ref, entry, same_expiry=False)
        if same is not None:
            self._remove(same, release=False)
        early = self._released_early.pop(
            (entry.decode_node_id, entry.decode_engine_id, entry.request_id), None)
        if early is not None and entry.released is None:
            entry = replace(entry, released=early)
        self._seq += 1
        key = (ref, self._seq)
        self._items[key] = _Item(ref, tenant, entry)
        self._refs.setdefault(ref, {})[key[1]] = None
        if len(self._refs[ref]) == 1 and is_text_slot(ref.slot):
            ends = self._ends.setdefault((ref.scope, ref.anchor), {}).setdefault(
                text_fine_of(continuation_of(ref.slot)), {})
            end_offset = continuation_of(ref.slot).num_bytes
            ends[end_offset] = ends.get(end_offset, 0) + 1
        self._by_tenant.setdefault(tenant, OrderedDict())[key] = None
        self._by_scope.setdefault(ref.scope, {})[key] = None
        self._by_request.setdefault((entry.decode_node_id, entry.request_id), {})[key] = None
        if entry.release_at_expiry:
            heapq.heappush(self._due.setdefault(entry.decode_node_id, []),
                           (entry.expires_at_s, key[1], key))
        members = self._refs[ref]
        while len(members) > self._max_ref:
            self._evict((ref, next(iter(members))), "overflow")
        mine = self._by_tenant[tenant]
        while len(mine) > self._max_tenant:
            self._evict(next(iter(mine)), "capacity")
        while len(self._items) > self._max:
            self._evict(next(iter(self._items)), "capacity")
        return True

    async def claim(self, ref: EntryRef, entry: ConversationEntry) -> ConversationEntry | None:
        key = self._member(ref, entry)
        if key is None or not self._items[key].held:
            key = self._best(ref, usable_only=True) if ref in self._refs else None
        if key is None:
            return None
        item = self._remove(key, release=False)
        if item is None:
            return None
        self._reads.start(item.entry)
        self._note_own(item.entry)
        return item.entry

    async def drop(
        self, ref: EntryRef, entry: ConversationEntry | None = None, *, release: bool = True
    ) -> bool:
        if entry is None:
            keys = [(ref, seq) for seq in self._refs.get(ref, ())]
        else:
            key = self._member(ref, entry)
            keys = [] if key is None else [key]
        for key in keys:
            self._remove(key, release=release)
        return bool(keys)

    async def drop_scope(self, scope: bytes) -> int:
        keys = list(self._by_scope.get(scope, ()))
        for key in keys:
            self._remove(key, release=True)
        return len(keys)

    async def drop_node(self, node_id: str) -> int:
        self._due.pop(node_id, None)  # every entry on it leaves
        return self._drop_where(lambda e: e.decode_node_id == node_id)

    async def drop_engine(self, node_id: str, engine_id: str) -> int:
        return self._drop_where(
            lambda e: e.decode_node_id == node_id and same_group(e.decode_engine_id, engine_id)
        )

    async def mark_released(
        self, node_id: str, engine_id: str, released: Iterable[Released]
    ) -> int:
        return sum(self._mark(node_id, engine_id, one.request_id, one.cause)
                   for one in released)

    async def release_requested(
        self, node_id: str, engine_id: str, request_ids: Iterable[str]
    ) -> tuple[str, ...]:
        self._lapse()
        free: list[str] = []
        for request_id in request_ids:
            read = (node_id, request_id)
            self._mark(node_id, engine_id, request_id, RELEASING)
            if read not in self._reads and not self._predecessors(read):
                free.append(request_id)
        return tuple(free)

    def _predecessors(self, read: tuple[str, str]) -> bool:
        """Whether ``read`` may be a turn a router before this one was reading (class
        docstring, ``predecessor_grace_s``): one this index never stored nor claimed, asked
        about within the grace."""
        if self._own is None:
            return False
        if self._clock() >= self._predecessor_until_s:
            self._own = None
            return False
        return read not in self._own and read not in self._by_request

    def _note_own(self, entry: ConversationEntry) -> None:
        if self._own is not None:
            self._own.add((entry.decode_node_id, entry.request_id))

    async def announce(self, ref: EntryRef, ttl_s: float) -> None:
        return None  # this process's ReportDesk knows its pending turns

    async def withdraw(self, ref: EntryRef) -> None:
        return None

    async def announced(self, identity: RequestIdentity) -> bool:
        return False

    async def read_spent(self, node_id: str, request_id: str, grace_s: float) -> None:
        self._reads.spent(node_id, request_id, grace_s)

    async def shared_state(self) -> str | None:
        return None  # this process's own

    async def set_drained(self, node_id: str, drained: bool) -> None:
        """Nothing to share: the node registry keeps this process's drains."""

    async def drained_nodes(self) -> frozenset[str] | None:
        return None  # the node registry's own are all there are

    async def node_urls(self, mine: Mapping[str, str]) -> dict[str, str]:
        return {}  # no other router shares this index

    def _lapse(self) -> None:
        """End the spent reads whose grace is over (``read_spent``) and order their turns
        released (``OpenReads.lapse``)."""
        for node_id, blocks in self._reads.lapse():
            self._queue_release(node_id, blocks)

    async def read_done(self, node_id: str, request_id: str) -> None:
        self._reads.done(node_id, request_id)

    def _queue_release(self, node_id: str, blocks: RemoteBlocks) -> None:
        queue = self._releases.setdefault(node_id, OrderedDict())
        queue[(blocks.engine_id, blocks.request_id)] = blocks.for_release()
        while len(queue) > MAX_QUEUED_RELEASES:
            queue.popitem(last=False)

    def _mark(self, node_id: str, engine_id: str, request_id: str, cause: str) -> int:
        """Mark the entries of D's ``request_id`` released (a cause replaces
        ``RELEASING``); one not stored yet is remembered for ``put``. Returns how many."""
        keys = self._by_request.get((node_id, request_id))
        if not keys:
            self._released_early[(node_id, engine_id, request_id)] = cause
            while len(self._released_early) > MAX_QUEUED_RELEASES:
                self._released_early.popitem(last=False)
            return 0
        marked = 0
        for key in keys:
            item = self._items[key]
            if item.entry.decode_engine_id == engine_id \
                    and item.entry.released in (None, RELEASING):
                item.entry = replace(item.entry, released=cause)
                marked += 1
        return marked

    async def take_releases(
        self, node_id: str, engine_id: str, limit: int = MAX_ORDERS
    ) -> tuple[str, ...]:
        return tuple(blocks.request_id for blocks in self._take(node_id, engine_id, limit))

    async def take_release_blocks(
        self, node_id: str, engine_id: str, limit: int = MAX_ORDERS
    ) -> tuple[RemoteBlocks, ...]:
        return tuple(self._take(node_id, engine_id, limit))

    def _take(self, node_id: str, engine_id: str, limit: int) -> list[RemoteBlocks]:
        self._lapse()
        out: list[RemoteBlocks] = []
        queue = self._releases.get(node_id)
        if queue:
            for key in list(queue):
                if len(out) >= limit:
                    break
                if key[0] == engine_id:
                    out.append(queue.pop(key))
                elif not same_group(key[0], engine_id):
                    del queue[key]  # D restarted: those blocks are gone
            if not queue:
                del self._releases[node_id]
        self._take_due(node_id, engine_id, limit, out)
        return out

    def _take_due(self, node_id: str, engine_id: str, limit: int,
                  out: list[RemoteBlocks]) -> None:
        """Order the release of ``node_id``'s flagged entries that expired (module
        docstring, release at expiry) into ``out`` while it has room (``limit``), looking
        at no more than ``limit`` due heap items; each is marked ``ordered``."""
        due = self._due.get(node_id)
        if not due:
            return
        now = self._clock()
        looked = 0
        ranks = []  # another rank's: its own sync takes them
        while due and len(out) < limit and looked < limit and due[0][0] <= now:
            top = heapq.heappop(due)
            looked += 1
            item = self._items.get(top[2])
            if item is None or not item.held:
                continue  # claimed, removed, released or ordered already
            engine = item.entry.decode_engine_id
            if engine != engine_id and same_group(engine, engine_id):
                ranks.append(top)
                continue
            item.ordered = True
            if engine == engine_id:
                out.append(item.entry.blocks.for_release())
        for top in ranks:
            heapq.heappush(due, top)
        if not due:
            del self._due[node_id]

    def sweep(self) -> int:
        """Purge entries expired more than ``expired_retention_s`` ago; returns the count."""
        now = self._clock()
        self._next_sweep = now + self._sweep_interval
        self._lapse()
        stale = [
            key for key, item in self._items.items()
            if now >= item.entry.expires_at_s + self._retention
        ]
        for key in stale:
            self._evict(key, "expired")
        for node_id, due in list(self._due.items()):
            pending = [one for one in due if self._pending(one[2])]
            if not pending:
                del self._due[node_id]
            elif len(pending) < len(due):
                heapq.heapify(pending)
                self._due[node_id] = pending
        return len(stale)

    def _pending(self, key: _Key) -> bool:
        """Whether the entry at ``key`` may still be ordered released at its expiry."""
        item = self._items.get(key)
        return item is not None and item.held

    def _maybe_sweep(self) -> None:
        if self._clock() >= self._next_sweep:
            self.sweep()

    def _member(
        self, ref: EntryRef, entry: ConversationEntry, *, same_expiry: bool = True
    ) -> _Key | None:
        """The key of ``entry`` at ``ref``, whether D released it or not: the same entry,
        with the same expiry unless ``same_expiry`` is false (``put``: the same D request
        stored again replaces it)."""
        want = _identity(entry)
        for seq in self._refs.get(ref, ()):
            stored = self._items[(ref, seq)].entry
            if _identity(stored) == want and (
                    not same_expiry or stored.expires_at_s == entry.expires_at_s):
                return (ref, seq)
        return None

    def _best(self, ref: EntryRef, *, usable_only: bool = False) -> _Key | None:
        """The newest entry at ``ref`` D still holds (``_Item.held``); else (unless
        ``usable_only``) the newest other one, so the turn learns why it recomputes."""
        members = self._refs.get(ref)
        if not members:
            return None
        newest: _Key | None = None
        for seq in reversed(members):
            key = (ref, seq)
            if self._items[key].held:
                return key
            newest = newest or key
        return None if usable_only else newest

    def _forget_end(self, ref: EntryRef) -> None:
        """A completions ref left the index: its end offset leaves its fine digest's set
        once no other ref there has it."""
        bucket_key = (ref.scope, ref.anchor)
        by_fine = self._ends.get(bucket_key)
        if by_fine is None:
            return
        continuation = continuation_of(ref.slot)
        fine = text_fine_of(continuation)
        ends = by_fine.get(fine)
        if ends is None:
            return
        left = ends.get(continuation.num_bytes, 0) - 1
        if left > 0:
            ends[continuation.num_bytes] = left
            return
        ends.pop(continuation.num_bytes, None)
        if not ends:
            del by_fine[fine]
            if not by_fine:
                del self._ends[bucket_key]

    def _touch(self, key: _Key, tenant: str) -> None:
        self._items.move_to_end(key)
        self._by_tenant[tenant].move_to_end(key)

    def _drop_where(self, match: Callable[[ConversationEntry], bool]) -> int:
        keys = [key for key, item in self._items.items() if match(item.entry)]
        for key in keys:
            self._remove(key, release=False)
        return len(keys)

    def _evict(self, key: _Key, reason: EvictReason) -> None:
        item = self._remove(key, release=True)
        if item is not None and self._on_evict is not None:
            self._on_evict(item.entry, reason)

    def _remove(self, key: _Key, *, release: bool) -> _Item | None:
        item = self._items.pop(key, None)
        if item is None:
            return None
        entry = item.entry
        requests = self._by_request.get((entry.decode_node_id, entry.request_id))
        if requests is not None:
            requests.pop(key, None)
            if not requests:
                del self._by_request[(entry.decode_node_id, entry.request_id)]
        if release and item.held:
            self._queue_release(entry.decode_node_id, entry.blocks)
        ref = key[0]
        members = self._refs.get(ref)
        if members is not None:
            members.pop(key[1], None)
            if not members:
                del self._refs[ref]
                if is_text_slot(ref.slot):
                    self._forget_end(ref)
        mine = self._by_tenant.get(item.tenant)
        if mine is not None:
            mine.pop(key, None)
            if not mine:
                del self._by_tenant[item.tenant]
        scoped = self._by_scope.get(ref.scope)
        if scoped is not None:
            scoped.pop(key, None)
            if not scoped:
                del self._by_scope[ref.scope]
        return item
