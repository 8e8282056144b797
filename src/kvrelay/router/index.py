"""Where the router keeps retained entries between turns, found by digests (``core.identity``).

``ConversationIndex`` is the contract (``InMemoryIndex`` here, ``index_redis.RedisIndex``
shared by router replicas); every method is async so a networked index fits. An entry lives
at an ``EntryRef``: the request's scope, the anchor of the request that produced it and the
slot of its continuation. Contracts:

* ``lookup(identity)`` returns the entry the request continues: for each probe, longest
  first, the entry under that anchor whose continuation the request carries (chat: the
  probe's answer digest; completions: ``core.identity.text_matches`` on the request's text);
  failing that, for an explicit id's scope (``identity.explicit``), the scope's most
  recently stored entry (``Found.probe`` is then ``None``: the guard proves what still
  matches); else ``None``. Expired entries are returned (the policy reports ``expired``)
  until purged, at most ``expired_retention_s`` after expiry. A networked index that cannot
  answer in time raises ``IndexUnavailable`` (the turn recomputes, ``state_unavailable``).
* ``put(ref, entry, tenant=...)`` stores the entry (replacing one at the same ref). An
  entry a later turn continued without consuming it (recompute, direct) stays: D holds its
  blocks until the TTL, and a retried or forked request may still continue it.
* ``claim(ref, entry)`` is the single-use guarantee: it atomically removes ``entry`` and
  returns True only if ``entry`` (compared by value) was still stored there; of any number
  of concurrent claims of one entry exactly one succeeds. A pull is sent only after a claim.
* ``drop(ref, entry=None)``, ``drop_scope`` (an explicit conversation id), ``drop_node``,
  ``drop_engine`` remove entries and return how many.
* Bounded: at most ``max_entries`` entries, at most ``max_per_tenant`` per tenant; the least
  recently used goes first.
* ``retained_tokens(now_s)``: tokens each D holds for entries not expired at ``now_s``
  (the retention gauge; a networked index returns what its last ``refresh`` saw).
* ``len(index)`` is the number of entries (exact in memory, last known when networked).

Entries hold block locations and a token fingerprint; refs are digests: no content, no ids.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import msgspec

from kvrelay.core.conversation import ConversationEntry
from kvrelay.core.identity import Continuation, Probe, RequestIdentity, text_matches

EvictReason = Literal["expired", "capacity"]


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

    async def put(self, ref: EntryRef, entry: ConversationEntry, *, tenant: str) -> None: ...

    async def claim(self, ref: EntryRef, entry: ConversationEntry) -> bool: ...

    async def drop(self, ref: EntryRef, entry: ConversationEntry | None = None) -> bool: ...

    async def drop_scope(self, scope: bytes) -> int: ...

    async def drop_node(self, node_id: str) -> int: ...

    async def drop_engine(self, node_id: str, engine_id: str) -> int: ...

    def retained_tokens(self, now_s: float) -> Mapping[str, int]: ...

    async def refresh(self, node_ids: list[str]) -> None: ...

    async def aclose(self) -> None: ...

    def __len__(self) -> int: ...


def continuation_of(slot: bytes) -> Continuation:
    """The continuation a slot was made from (``Continuation.slot`` inverted)."""
    return Continuation(slot[:-8], int.from_bytes(slot[-8:], "little"))


def find_in_bucket(
    identity: RequestIdentity, probe: Probe, slots: Mapping[bytes, object]
) -> bytes | None:
    """The slot of the bucket a probe's request continues (newest first for text)."""
    if probe.continuation is not None:
        slot = probe.continuation.slot()
        return slot if slot in slots else None
    for slot in reversed(list(slots)):
        if text_matches(identity, probe, continuation_of(slot)):
            return slot
    return None


@dataclass
class _Item:
    tenant: str
    entry: ConversationEntry


class InMemoryIndex:
    """A ``ConversationIndex`` in this process (LRU-capped, expired entries purged
    ``expired_retention_s`` after expiry on ``clock``, the router clock).

    ``on_evict(entry, reason)`` is called for every entry the index removes by itself
    (``expired`` or ``capacity``), never for explicit ``drop*``/``claim``/supersedes. No
    method awaits, so each is atomic on the event loop.
    """

    def __init__(
        self,
        max_entries: int = 100_000,
        *,
        max_per_tenant: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        expired_retention_s: float = 300.0,
        sweep_interval_s: float = 10.0,
        on_evict: Callable[[ConversationEntry, EvictReason], None] | None = None,
    ) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self._max = max_entries
        self._max_tenant = min(max_per_tenant or max_entries, max_entries)
        self._clock = clock
        self._retention = expired_retention_s
        self._sweep_interval = sweep_interval_s
        self._next_sweep = clock() + sweep_interval_s
        self._on_evict = on_evict
        self._items: OrderedDict[EntryRef, _Item] = OrderedDict()
        self._buckets: dict[tuple[bytes, bytes], dict[bytes, None]] = {}
        self._by_tenant: dict[str, OrderedDict[EntryRef, None]] = {}
        self._by_scope: dict[bytes, dict[EntryRef, None]] = {}

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
            if not entry.is_expired(now_s):
                out[entry.decode_node_id] = out.get(entry.decode_node_id, 0) + entry.num_tokens
        return out

    async def lookup(self, identity: RequestIdentity) -> Found | None:
        self._maybe_sweep()
        for probe in identity.probes:
            bucket = self._buckets.get((identity.scope, probe.anchor))
            if not bucket:
                continue
            slot = find_in_bucket(identity, probe, bucket)
            if slot is None:
                continue
            ref = EntryRef(identity.scope, probe.anchor, slot)
            item = self._items[ref]
            self._touch(ref, item.tenant)
            return Found(ref, item.entry, probe)
        if identity.explicit:
            mine = self._by_scope.get(identity.scope)
            if mine:
                ref = next(reversed(mine))
                item = self._items[ref]
                self._touch(ref, item.tenant)
                return Found(ref, item.entry, None)
        return None

    async def put(self, ref: EntryRef, entry: ConversationEntry, *, tenant: str) -> None:
        self._maybe_sweep()
        self._remove(ref)
        self._items[ref] = _Item(tenant, entry)
        self._buckets.setdefault((ref.scope, ref.anchor), {})[ref.slot] = None
        self._by_tenant.setdefault(tenant, OrderedDict())[ref] = None
        self._by_scope.setdefault(ref.scope, {})[ref] = None
        mine = self._by_tenant[tenant]
        while len(mine) > self._max_tenant:
            self._evict(next(iter(mine)), "capacity")
        while len(self._items) > self._max:
            self._evict(next(iter(self._items)), "capacity")

    async def claim(self, ref: EntryRef, entry: ConversationEntry) -> bool:
        item = self._items.get(ref)
        if item is None or item.entry != entry:
            return False
        self._remove(ref)
        return True

    async def drop(self, ref: EntryRef, entry: ConversationEntry | None = None) -> bool:
        item = self._items.get(ref)
        if item is None or (entry is not None and item.entry != entry):
            return False
        self._remove(ref)
        return True

    async def drop_scope(self, scope: bytes) -> int:
        refs = list(self._by_scope.get(scope, ()))
        for ref in refs:
            self._remove(ref)
        return len(refs)

    async def drop_node(self, node_id: str) -> int:
        return self._drop_where(lambda _, e: e.decode_node_id == node_id)

    async def drop_engine(self, node_id: str, engine_id: str) -> int:
        return self._drop_where(
            lambda _, e: e.decode_node_id == node_id and e.decode_engine_id == engine_id
        )

    def sweep(self) -> int:
        """Purge entries expired more than ``expired_retention_s`` ago; returns the count."""
        now = self._clock()
        self._next_sweep = now + self._sweep_interval
        stale = [
            ref for ref, item in self._items.items()
            if now >= item.entry.expires_at_s + self._retention
        ]
        for ref in stale:
            self._evict(ref, "expired")
        return len(stale)

    def _maybe_sweep(self) -> None:
        if self._clock() >= self._next_sweep:
            self.sweep()

    def _touch(self, ref: EntryRef, tenant: str) -> None:
        self._items.move_to_end(ref)
        self._by_tenant[tenant].move_to_end(ref)

    def _drop_where(self, match: Callable[[EntryRef, ConversationEntry], bool]) -> int:
        refs = [ref for ref, item in self._items.items() if match(ref, item.entry)]
        for ref in refs:
            self._remove(ref)
        return len(refs)

    def _evict(self, ref: EntryRef, reason: EvictReason) -> None:
        item = self._remove(ref)
        if item is not None and self._on_evict is not None:
            self._on_evict(item.entry, reason)

    def _remove(self, ref: EntryRef) -> _Item | None:
        item = self._items.pop(ref, None)
        if item is None:
            return None
        key = (ref.scope, ref.anchor)
        bucket = self._buckets.get(key)
        if bucket is not None:
            bucket.pop(ref.slot, None)
            if not bucket:
                del self._buckets[key]
        mine = self._by_tenant.get(item.tenant)
        if mine is not None:
            mine.pop(ref, None)
            if not mine:
                del self._by_tenant[item.tenant]
        scoped = self._by_scope.get(ref.scope)
        if scoped is not None:
            scoped.pop(ref, None)
            if not scoped:
                del self._by_scope[ref.scope]
        return item
