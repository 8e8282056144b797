"""Where the router keeps one ``ConversationEntry`` per conversation between turns.

``ConversationStore`` is the contract (``InMemoryStore`` here, ``store_redis.RedisStore``
shared by router replicas); every method is async so a networked store fits. Contracts:

* ``get`` returns the entry even after it expired (the policy reports ``expired``) until the
  store purges it, at most ``expired_retention_s`` after expiry.
* ``put`` replaces the conversation's entry (the newest turn wins).
* ``claim(key, entry)`` is the single-use guarantee: it atomically removes ``entry`` and
  returns True only if ``entry`` (compared by value) was still the stored one; of any
  number of concurrent claims of one entry, exactly one succeeds. A pull is sent only after
  a successful claim.
* ``drop(key, entry=None)`` removes the entry (only if it is still ``entry``, when given).
* ``drop_node`` / ``drop_engine`` remove every entry held by a node / by one engine
  incarnation of a node, returning how many were removed.
* A networked store that cannot answer in time raises ``StoreUnavailable`` from ``get``
  only (the turn then recomputes with reason ``state_unavailable``); every other method
  degrades safely instead of raising: ``put`` loses the entry, ``claim`` and ``drop``
  return False, ``drop_node`` / ``drop_engine`` return 0.
* ``len(store)`` is the number of live entries, exact in memory, last known for a
  networked store.
* ``aclose()`` releases connections when the app shuts down.

Entries hold block locations and a token fingerprint only, never conversation content.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Literal, Protocol, runtime_checkable

from kvrelay.core.conversation import ConversationEntry, ConversationKey

EvictReason = Literal["expired", "capacity"]


class StoreUnavailable(RuntimeError):
    """The conversation store could not answer (down, slow): treat the lookup as a miss."""


@runtime_checkable
class ConversationStore(Protocol):
    """Conversation key -> latest retained-KV entry (see the module docstring)."""

    async def get(self, key: ConversationKey) -> ConversationEntry | None: ...

    async def put(self, key: ConversationKey, entry: ConversationEntry) -> None: ...

    async def claim(self, key: ConversationKey, entry: ConversationEntry) -> bool: ...

    async def drop(self, key: ConversationKey, entry: ConversationEntry | None = None) -> bool: ...

    async def drop_node(self, node_id: str) -> int: ...

    async def drop_engine(self, node_id: str, engine_id: str) -> int: ...

    async def aclose(self) -> None: ...

    def __len__(self) -> int: ...


class InMemoryStore:
    """A ``ConversationStore`` in this process: LRU-capped at ``max_entries``, entries purged
    ``expired_retention_s`` after their expiry on ``clock`` (the router's clock).

    ``on_evict(entry, reason)`` is called for every entry the store removes by itself
    (``expired`` or ``capacity``), never for explicit ``drop*``/``claim``. All methods run
    without awaiting, so each is atomic on the event loop.
    """

    def __init__(
        self,
        max_entries: int = 100_000,
        *,
        clock: Callable[[], float] = time.monotonic,
        expired_retention_s: float = 300.0,
        sweep_interval_s: float = 10.0,
        on_evict: Callable[[ConversationEntry, EvictReason], None] | None = None,
    ) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self._entries: OrderedDict[ConversationKey, ConversationEntry] = OrderedDict()
        self._max = max_entries
        self._clock = clock
        self._retention = expired_retention_s
        self._sweep_interval = sweep_interval_s
        self._next_sweep = clock() + sweep_interval_s
        self._on_evict = on_evict

    def __len__(self) -> int:
        return len(self._entries)

    async def aclose(self) -> None:
        """Nothing to release: the entries live in this process."""

    async def get(self, key: ConversationKey) -> ConversationEntry | None:
        self._maybe_sweep()
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    async def put(self, key: ConversationKey, entry: ConversationEntry) -> None:
        self._maybe_sweep()
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self._max:
            _, old = self._entries.popitem(last=False)
            self._evicted(old, "capacity")

    async def claim(self, key: ConversationKey, entry: ConversationEntry) -> bool:
        current = self._entries.get(key)
        if current is None or current != entry:
            return False
        del self._entries[key]
        return True

    async def drop(self, key: ConversationKey, entry: ConversationEntry | None = None) -> bool:
        current = self._entries.get(key)
        if current is None or (entry is not None and current != entry):
            return False
        del self._entries[key]
        return True

    async def drop_node(self, node_id: str) -> int:
        return self._drop_where(lambda e: e.decode_node_id == node_id)

    async def drop_engine(self, node_id: str, engine_id: str) -> int:
        return self._drop_where(
            lambda e: e.decode_node_id == node_id and e.decode_engine_id == engine_id
        )

    def sweep(self) -> int:
        """Purge entries expired more than ``expired_retention_s`` ago; returns the count."""
        now = self._clock()
        self._next_sweep = now + self._sweep_interval
        stale = [k for k, e in self._entries.items() if now >= e.expires_at_s + self._retention]
        for k in stale:
            self._evicted(self._entries.pop(k), "expired")
        return len(stale)

    def _maybe_sweep(self) -> None:
        if self._clock() >= self._next_sweep:
            self.sweep()

    def _drop_where(self, match: Callable[[ConversationEntry], bool]) -> int:
        keys = [k for k, e in self._entries.items() if match(e)]
        for k in keys:
            del self._entries[k]
        return len(keys)

    def _evicted(self, entry: ConversationEntry, reason: EvictReason) -> None:
        if self._on_evict is not None:
            self._on_evict(entry, reason)
