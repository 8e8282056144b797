"""``RedisResponseStore``: the Responses store (``router.response_store``) shared by router
replicas through the router's Redis state backend (``--state``), so a ``previous_response_id``
or a ``GET /v1/responses/{id}`` finds a response whichever replica stored it.

**Keys** (``ns`` = ``kvrelay:{deployment}``, tenant and id percent-encoded):

* ``{ns}:resp:{tenant}:{id}`` – a hash: ``in`` (the input items' JSON), ``out`` (the
  response's JSON), ``exp`` (wall-clock expiry, ms); Redis deletes it ``GRACE_MS`` after.
* ``{ns}:resp:order`` – the kept keys by expiry (one TTL: also by age), ``{ns}:resp:size``
  their sizes, ``{ns}:resp:bytes`` the total: a put drops what expired and then, while the
  total is over ``max_bytes``, the oldest (one script, so replicas never race the count).
* ``{ns}:resp:tenant:{tenant}:order`` – one tenant's kept keys by expiry,
  ``{ns}:resp:owner`` each kept key's tenant order key, ``{ns}:resp:tbytes`` each tenant's
  total: before the global bound, a put drops the tenant's own oldest while it holds more
  than ``max_bytes_per_tenant``.

Expiry is checked against the wall clock (``wall_clock``; keep the hosts NTP-synced), so an
expired response is a miss even before Redis deletes it. Each call is bounded by
``timeout_s``: ``get`` raises ``ResponseStoreUnavailable`` (the caller answers 503: a
``previous_response_id`` has no fallback), ``put`` and ``delete`` report failure.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import quote

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from kvrelay.router.response_store import ResponseStoreUnavailable, StoredResponse

log = logging.getLogger("kvrelay.router")
T = TypeVar("T")

GRACE_MS = 60_000
"""Redis keeps an expired response this long past its expiry (a replica whose clock lags
still sees it expired, never half-deleted)."""

# remove one kept key and its accounting (its tenant's too); returns 1 if it was counted.
# KEYS = item, order, sizes, total, owners, tenant totals, the item's tenant order.
_REMOVE = """
local function remove(k)
  local n = redis.call('HGET', KEYS[3], k)
  local owner = redis.call('HGET', KEYS[5], k)
  redis.call('DEL', k)
  redis.call('ZREM', KEYS[2], k)
  if owner then
    redis.call('ZREM', owner, k)
    redis.call('HDEL', KEYS[5], k)
    if n and redis.call('HINCRBY', KEYS[6], owner, -tonumber(n)) <= 0 then
      redis.call('HDEL', KEYS[6], owner)
    end
  end
  if not n then return 0 end
  redis.call('HDEL', KEYS[3], k)
  redis.call('DECRBY', KEYS[4], n)
  return 1
end
"""

# ARGV = in, out, exp ms, size, pexpire ms, max bytes, now ms, max bytes per tenant.
# Returns {kept (1/0), evicted for capacity}.
_PUT = _REMOVE + """
remove(KEYS[1])
for _, k in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[7])) do remove(k) end
if tonumber(ARGV[4]) > tonumber(ARGV[8]) then return {0, 0} end
redis.call('HSET', KEYS[1], 'in', ARGV[1], 'out', ARGV[2], 'exp', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('ZADD', KEYS[2], ARGV[3], KEYS[1])
redis.call('HSET', KEYS[3], KEYS[1], ARGV[4])
redis.call('HSET', KEYS[5], KEYS[1], KEYS[7])
redis.call('ZADD', KEYS[7], ARGV[3], KEYS[1])
local mine = redis.call('HINCRBY', KEYS[6], KEYS[7], ARGV[4])
redis.call('INCRBY', KEYS[4], ARGV[4])
local evicted = 0
while mine > tonumber(ARGV[8]) do
  local old = redis.call('ZRANGE', KEYS[7], 0, 0)[1]
  if not old or old == KEYS[1] then break end
  evicted = evicted + remove(old)
  mine = tonumber(redis.call('HGET', KEYS[6], KEYS[7]) or '0')
end
local total = tonumber(redis.call('GET', KEYS[4]) or '0')
while total > tonumber(ARGV[6]) do
  local old = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not old or old == KEYS[1] then break end
  evicted = evicted + remove(old)
  total = tonumber(redis.call('GET', KEYS[4]) or '0')
end
return {1, evicted}
"""

# KEYS = item, order, sizes, total; ARGV = now ms. Returns 1 if a live response was deleted.
_DELETE = _REMOVE + """
local exp = redis.call('HGET', KEYS[1], 'exp')
if not exp then
  remove(KEYS[1])
  return 0
end
remove(KEYS[1])
if tonumber(exp) <= tonumber(ARGV[1]) then return 0 end
return 1
"""


class RedisResponseStore:
    """A ``ResponseStore`` in Redis (module docstring)."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        ttl_s: float,
        max_bytes: int,
        max_bytes_per_tenant: int | None = None,
        deployment: str = "default",
        wall_clock: Callable[[], float] = time.time,
        timeout_s: float = 1.0,
        on_error: Callable[[str], None] | None = None,
        on_evict: Callable[[str], None] | None = None,
    ) -> None:
        if ttl_s <= 0 or max_bytes < 1 or timeout_s <= 0 or (max_bytes_per_tenant or 1) < 1:
            raise ValueError("ttl_s and timeout_s must be positive and max_bytes(_per_tenant)"
                             " >= 1")
        self._client = client
        self._ns = f"kvrelay:{quote(deployment, safe='')}:resp"
        self._ttl_ms = math.ceil(ttl_s * 1000)
        self._max_bytes = max_bytes
        self._tenant_max = min(max_bytes_per_tenant or max_bytes, max_bytes)
        self._wall = wall_clock
        self._timeout_s = timeout_s
        self._on_error = on_error
        self._on_evict = on_evict
        self._put = client.register_script(_PUT)
        self._delete = client.register_script(_DELETE)

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 1.0, **kwargs: Any) -> RedisResponseStore:
        """A store on ``redis://host:port/db``; connections time out after ``timeout_s`` and
        never retry."""
        client = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        return cls(client, timeout_s=timeout_s, **kwargs)

    def key(self, tenant: str, response_id: str) -> str:
        return f"{self._ns}:{quote(tenant, safe='')}:{quote(response_id, safe='')}"

    def _keys(self, tenant: str, response_id: str) -> list[str]:
        return [self.key(tenant, response_id), f"{self._ns}:order", f"{self._ns}:size",
                f"{self._ns}:bytes", f"{self._ns}:owner", f"{self._ns}:tbytes",
                f"{self._ns}:tenant:{quote(tenant, safe='')}:order"]

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        try:
            got = await self._call("response_get", self._client.hmget(
                self.key(tenant, response_id), "in", "out", "exp"))
        except (TimeoutError, RedisError, OSError) as exc:
            raise ResponseStoreUnavailable(f"redis get failed: {exc!r}") from exc
        raw_in, raw_out, exp = got
        if raw_in is None or raw_out is None or exp is None:
            return None
        if int(exp) <= self._now_ms():
            return None
        return StoredResponse(_bytes(raw_in), _bytes(raw_out))

    async def put(self, tenant: str, response_id: str, stored: StoredResponse) -> bool:
        now_ms = self._now_ms()
        try:
            kept, evicted = await self._call("response_put", self._put(
                keys=self._keys(tenant, response_id),
                args=[stored.input_json, stored.response_json, now_ms + self._ttl_ms,
                      stored.num_bytes, self._ttl_ms + GRACE_MS, self._max_bytes, now_ms,
                      self._tenant_max]))
        except (TimeoutError, RedisError, OSError):
            return False
        if self._on_evict is not None:
            for _ in range(int(evicted)):
                self._on_evict("capacity")
        return bool(int(kept))

    async def delete(self, tenant: str, response_id: str) -> bool:
        try:
            deleted = await self._call("response_delete", self._delete(
                keys=self._keys(tenant, response_id), args=[self._now_ms()]))
        except (TimeoutError, RedisError, OSError) as exc:
            raise ResponseStoreUnavailable(f"redis delete failed: {exc!r}") from exc
        return bool(int(deleted))

    async def aclose(self) -> None:
        await self._client.aclose()

    def _now_ms(self) -> int:
        return math.floor(self._wall() * 1000)

    async def _call(self, op: str, call: Awaitable[T]) -> T:
        try:
            return await asyncio.wait_for(call, self._timeout_s)
        except (TimeoutError, RedisError, OSError) as exc:
            if self._on_error is not None:
                self._on_error(op)
            log.warning("response store: Redis %s failed (%s)", op,
                        type(exc).__name__ if str(exc) == "" else exc)
            raise


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode("utf-8")
