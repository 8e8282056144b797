"""The opt-in Responses store (``--response-store memory|redis``): what a ``store: true``
response leaves behind so that a later ``previous_response_id`` (and ``GET`` / ``DELETE
/v1/responses/{id}``) can find it.

**It holds content.** A ``StoredResponse`` is the conversation's whole input (every item,
the previous responses' expanded in) and the response as the client got it (its output
items). Nothing else in the router keeps content; the store is off by default
(docs/security.md).

**Keys.** A response is kept under ``(tenant, response id)``: another tenant's id is simply
absent, so unknown, expired and foreign ids are the same miss (``None``), answered with the
same 404. Ids are minted by the router (``new_response_id``: ``resp_`` + 128 random bits),
never taken from a client.

**Bounds.** Each response expires ``ttl_s`` after it was stored; the store holds at most
``max_bytes`` of JSON, the oldest evicted first, and one tenant at most
``max_bytes_per_tenant`` (``None``: ``max_bytes``), its own oldest evicted first: so one
tenant's traffic can push out only its own responses once its share is below the whole
(``--response-store-max-mb-per-tenant``). ``InMemoryResponseStore`` is one process's;
``response_store_redis.RedisResponseStore`` is shared by router replicas.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import msgspec

RESPONSE_ID_PREFIX = "resp_"
RESPONSE_ID_BITS = 128
MAX_RESPONSE_ID_CHARS = 256
"""A longer id cannot be one the router minted: it is a miss without a lookup."""


def new_response_id() -> str:
    """A fresh response id: ``resp_`` + 128 random bits in hex."""
    return RESPONSE_ID_PREFIX + secrets.token_hex(RESPONSE_ID_BITS // 8)


class StoredResponse(msgspec.Struct, frozen=True):
    """One kept response: ``input_json``, the JSON array of the input items it answered (the
    expanded conversation), and ``response_json``, the response object as the client got it
    (``output``, ``usage``, ``id`` ...)."""

    input_json: bytes
    response_json: bytes

    @property
    def num_bytes(self) -> int:
        return len(self.input_json) + len(self.response_json)


class ResponseStoreUnavailable(Exception):
    """The store could not answer (Redis down or slow): not a miss."""


class ResponseStore(Protocol):
    """Responses kept per tenant (module docstring). ``get`` raises
    ``ResponseStoreUnavailable`` when it cannot answer; ``put`` returns whether the response
    was kept; ``delete`` whether there was one to delete."""

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None: ...

    async def put(self, tenant: str, response_id: str, stored: StoredResponse) -> bool: ...

    async def delete(self, tenant: str, response_id: str) -> bool: ...

    async def aclose(self) -> None: ...


class _Kept(msgspec.Struct):
    expires_at_s: float
    stored: StoredResponse


class InMemoryResponseStore:
    """The ``ResponseStore`` of one router process: insertion order is expiry order (one
    TTL for all), so expired responses and, past ``max_bytes``, the oldest ones leave from the
    front. ``clock`` is the router clock."""

    def __init__(
        self, *, ttl_s: float, max_bytes: int, clock: Callable[[], float],
        max_bytes_per_tenant: int | None = None,
        on_evict: Callable[[str], None] | None = None,
    ) -> None:
        if ttl_s <= 0 or max_bytes < 1 or (max_bytes_per_tenant or 1) < 1:
            raise ValueError("ttl_s must be positive and max_bytes(_per_tenant) >= 1")
        self._ttl_s = ttl_s
        self._max_bytes = max_bytes
        self._tenant_max = min(max_bytes_per_tenant or max_bytes, max_bytes)
        self._clock = clock
        self._on_evict = on_evict
        self._items: OrderedDict[tuple[str, str], _Kept] = OrderedDict()
        # each tenant's ids in the same (age) order, and its bytes
        self._by_tenant: dict[str, OrderedDict[str, None]] = {}
        self._tenant_bytes: dict[str, int] = {}
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        self._expire(self._clock())
        kept = self._items.get((tenant, response_id))
        return kept.stored if kept is not None else None

    async def put(self, tenant: str, response_id: str, stored: StoredResponse) -> bool:
        now = self._clock()
        self._expire(now)
        self._remove((tenant, response_id))
        if stored.num_bytes > self._tenant_max:
            return False
        self._items[(tenant, response_id)] = _Kept(now + self._ttl_s, stored)
        self._by_tenant.setdefault(tenant, OrderedDict())[response_id] = None
        self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + stored.num_bytes
        self._bytes += stored.num_bytes
        while self._tenant_bytes[tenant] > self._tenant_max:
            self._evict((tenant, next(iter(self._by_tenant[tenant]))))
        while self._bytes > self._max_bytes:
            self._evict(next(iter(self._items)))
        return True

    async def delete(self, tenant: str, response_id: str) -> bool:
        self._expire(self._clock())
        return self._remove((tenant, response_id))

    async def aclose(self) -> None:
        self._items.clear()
        self._by_tenant.clear()
        self._tenant_bytes.clear()
        self._bytes = 0

    def _evict(self, key: tuple[str, str]) -> None:
        self._remove(key)
        if self._on_evict is not None:
            self._on_evict("capacity")

    def _remove(self, key: tuple[str, str]) -> bool:
        kept = self._items.pop(key, None)
        if kept is None:
            return False
        tenant, response_id = key
        self._bytes -= kept.stored.num_bytes
        self._tenant_bytes[tenant] -= kept.stored.num_bytes
        ids = self._by_tenant[tenant]
        del ids[response_id]
        if not ids:
            del self._by_tenant[tenant], self._tenant_bytes[tenant]
        return True

    def _expire(self, now_s: float) -> None:
        while self._items:
            key, kept = next(iter(self._items.items()))
            if kept.expires_at_s > now_s:
                return
            self._remove(key)
            if self._on_evict is not None:
                self._on_evict("expired")
