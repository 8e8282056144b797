"""``RedisStore``: the ``ConversationStore`` shared by several router replicas through Redis.

Any replica can serve any turn: the entry (D's block locations and a token fingerprint,
never content) lives in Redis, so the follow-up pulls whichever replica the load balancer
picks. The entry names the D holding the KV, so every replica sends the pull to that node.

**Keys** (``ns`` = ``kvrelay:{deployment}``; deployment, tenant and node ids percent-encoded):

* ``{ns}:{tenant}:conv:{digest}`` – a hash per conversation; ``digest`` is a 128-bit
  BLAKE2b of (tenant, conversation id), so raw ids never reach Redis (not a secret: a
  guessable id stays guessable). Fields: ``json`` (``entry_to_json``), ``id`` (digest of the
  entry without its times), ``exp`` (wall-clock expiry), ``node``, ``engine``, ``idx``.
* ``{ns}:node:{node_id}`` (``idx``) – a set of the conversation keys whose entry the node
  holds: the index of ``drop_node`` / ``drop_engine``. Claims, drops and puts unindex at
  once; members whose key Redis expired go lazily (``drop_*``, and a 3-member sample on every
  ``put``); the set itself expires with its longest-lived entry.

**Clocks.** The router's ``expires_at_s`` is on its monotonic clock, meaningless in another
process, so Redis holds wall-clock times: written as ``local + (wall_clock() - clock())``,
read back the other way. Replicas therefore agree on expiry up to their wall-clock skew
(keep hosts NTP-synced; the ``ttl_safety_margin_s`` must cover the skew). Redis purges a
key ``PEXPIRE`` = remaining TTL + ``expired_retention_s`` after the write, so ``get`` still
returns a just-expired entry (the policy says ``expired``); past retention on the router
clock ``get`` returns None even if Redis still holds the key.

**Failures.** Every call is bounded by ``timeout_s`` (and socket timeouts, no retries).
``get`` raises ``StoreUnavailable``; the other methods degrade as the protocol says. Each
failure calls ``on_error(op)`` (the router counts ``kvrelay_router_state_errors_total{op}``)
and logs at most one line per ``log_interval_s``. redis-py reconnects once Redis is back.

Needs one Redis (or a Sentinel primary), not Redis Cluster: scripts span hash slots.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
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

from kvrelay.core.conversation import ConversationEntry, ConversationKey
from kvrelay.core.fingerprint import TokenFingerprint
from kvrelay.core.params import RemoteBlocks
from kvrelay.router.store import StoreUnavailable

log = logging.getLogger("kvrelay.router")

T = TypeVar("T")

FORMAT_VERSION = 1

# put: replace the hash (unindexing it from its previous node), set its TTL, index it under
# its node, extend the index's TTL, clean a sample of stale index members.
# Returns {index size, previous index or '', its size}.
_PUT = """
local old = redis.call('HGET', KEYS[1], 'idx')
local old_size = 0
if old and old ~= KEYS[2] then
  redis.call('SREM', old, KEYS[1])
  old_size = redis.call('SCARD', old)
else
  old = ''
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'json', ARGV[1], 'id', ARGV[2], 'exp', ARGV[3],
           'node', ARGV[4], 'engine', ARGV[5], 'idx', KEYS[2])
redis.call('PEXPIRE', KEYS[1], ARGV[6])
redis.call('SADD', KEYS[2], KEYS[1])
if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[6]) then
  redis.call('PEXPIRE', KEYS[2], ARGV[6])
end
for _, m in ipairs(redis.call('SRANDMEMBER', KEYS[2], 3)) do
  if redis.call('HGET', m, 'node') ~= ARGV[4] then redis.call('SREM', KEYS[2], m) end
end
return {redis.call('SCARD', KEYS[2]), old, old_size}
"""

# claim / conditional drop: delete only if the stored entry is the expected one.
_CLAIM = """
local cur = redis.call('HMGET', KEYS[1], 'id', 'exp')
if not cur[1] or cur[1] ~= ARGV[1] then return 0 end
if math.abs(tonumber(cur[2]) - tonumber(ARGV[2])) > tonumber(ARGV[3]) then return 0 end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], KEYS[1])
return 1
"""

# unconditional drop: returns how many keys were deleted.
_DROP = """
local idx = redis.call('HGET', KEYS[1], 'idx')
if idx then redis.call('SREM', idx, KEYS[1]) end
return redis.call('DEL', KEYS[1])
"""

# drop_node / drop_engine (ARGV[2] == '': any engine). Returns {dropped, index size}.
_DROP_NODE = """
local n = 0
for _, m in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local cur = redis.call('HMGET', m, 'node', 'engine')
  if cur[1] ~= ARGV[1] then
    redis.call('SREM', KEYS[1], m)
  elseif ARGV[2] == '' or cur[2] == ARGV[2] then
    redis.call('DEL', m)
    redis.call('SREM', KEYS[1], m)
    n = n + 1
  end
end
return {n, redis.call('SCARD', KEYS[1])}
"""


#: ``RemoteBlocks`` fields stored as plain JSON scalars, with their types.
_BLOCK_SCALARS: dict[str, type] = {
    "engine_id": str, "request_id": str, "host": str, "port": int, "num_tokens": int,
    "tp_size": int, "dcp_size": int, "pp_size": int, "transfer_mode": str,
}


class EntryFormatError(ValueError):
    """A stored entry that is not valid ``entry_to_json`` output."""



def _body(entry: ConversationEntry) -> dict[str, Any]:
    """Everything of the entry but its (clock-dependent) times, as JSON values."""
    b, fp = entry.blocks, entry.fingerprint
    return {
        "v": FORMAT_VERSION,
        "decode_node_id": entry.decode_node_id,
        "turn": entry.turn,
        "block_size": entry.block_size,
        "blocks": {
            "direction": b.direction,
            "block_ids": [list(group) for group in b.block_ids],
            **{name: getattr(b, name) for name in _BLOCK_SCALARS},
            "remote_expiry_perf_counter_s": b.remote_expiry_perf_counter_s,
            "prefill_cached_tokens": b.prefill_cached_tokens,
        },
        "fingerprint": {
            "num_tokens": fp.num_tokens,
            "chunk_tokens": fp.chunk_tokens,
            "chunk_digests": base64.b64encode(fp.chunk_digests).decode("ascii"),
            "tail_digest": base64.b64encode(fp.tail_digest).decode("ascii"),
        },
    }


def entry_identity(entry: ConversationEntry) -> str:
    """Digest of the entry without its times: what ``claim`` compares exactly."""
    canonical = json.dumps(_body(entry), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode("utf-8"), digest_size=16).hexdigest()


def entry_to_json(entry: ConversationEntry, *, wall_offset_s: float) -> str:
    """The entry as JSON, its times moved to the wall clock (``local + wall_offset_s``)."""
    doc = _body(entry)
    doc["expires_wall_s"] = entry.expires_at_s + wall_offset_s
    doc["created_wall_s"] = entry.created_at_s + wall_offset_s
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def entry_from_json(text: str | bytes, *, wall_offset_s: float) -> ConversationEntry:
    """Inverse of ``entry_to_json`` (times back on the local clock: ``wall - wall_offset_s``);
    ``EntryFormatError`` for anything else."""
    try:
        doc = json.loads(text)
        if doc["v"] != FORMAT_VERSION:
            raise EntryFormatError(f"unsupported entry format {doc['v']!r}")
        b, fp = doc["blocks"], doc["fingerprint"]
        if b["direction"] != "decode_to_prefill":
            raise EntryFormatError("an entry holds decode_to_prefill blocks only")
        blocks = RemoteBlocks(
            direction="decode_to_prefill",
            block_ids=tuple(tuple(_typed(i, int) for i in group) for group in b["block_ids"]),
            **{name: _typed(b[name], kind) for name, kind in _BLOCK_SCALARS.items()},
            remote_expiry_perf_counter_s=_opt(b["remote_expiry_perf_counter_s"], float),
            prefill_cached_tokens=_opt(b["prefill_cached_tokens"], int),
        )
        fingerprint = TokenFingerprint(
            num_tokens=_typed(fp["num_tokens"], int),
            chunk_tokens=_typed(fp["chunk_tokens"], int),
            chunk_digests=base64.b64decode(_typed(fp["chunk_digests"], str), validate=True),
            tail_digest=base64.b64decode(_typed(fp["tail_digest"], str), validate=True),
        )
        return ConversationEntry(
            decode_node_id=_typed(doc["decode_node_id"], str),
            blocks=blocks,
            fingerprint=fingerprint,
            expires_at_s=float(_typed(doc["expires_wall_s"], float)) - wall_offset_s,
            created_at_s=float(_typed(doc["created_wall_s"], float)) - wall_offset_s,
            turn=_typed(doc["turn"], int),
            block_size=_opt(doc["block_size"], int),
        )
    except EntryFormatError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise EntryFormatError(f"malformed conversation entry: {exc}") from exc


def _typed(value: Any, kind: type[T]) -> T:
    ok = isinstance(value, int | float) if kind is float else isinstance(value, kind)
    if not ok or (kind is not bool and isinstance(value, bool)):
        raise EntryFormatError(f"expected {kind.__name__}, got {value!r}")
    return value  # type: ignore[no-any-return]


def _opt(value: Any, kind: type[T]) -> T | None:
    return None if value is None else _typed(value, kind)


class RedisStore:
    """A ``ConversationStore`` in Redis, shared by router replicas (see the module docstring).

    ``clock`` is the router clock of this replica, ``wall_clock`` the clock shared between
    hosts (tests pass one that moves with their manual clock). ``len()`` is the last known
    number of entries indexed under the nodes this replica has written to or dropped from
    (all replicas' entries, stale index members included until cleaned); 0 before that.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        deployment: str = "default",
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        timeout_s: float = 0.05,
        expired_retention_s: float = 300.0,
        claim_tolerance_s: float = 0.05,
        on_error: Callable[[str], None] | None = None,
        log_interval_s: float = 10.0,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self._client = client
        self._ns = f"kvrelay:{quote(deployment, safe='')}"
        self._clock = clock
        self._wall = wall_clock
        self._timeout = timeout_s
        self._retention = expired_retention_s
        self._tolerance = claim_tolerance_s
        self._on_error = on_error
        self._log_interval = log_interval_s
        self._next_log = 0.0
        self._failures_unlogged = 0
        self._failing = False
        self._counts: dict[str, int] = {}
        self._put = client.register_script(_PUT)
        self._claim = client.register_script(_CLAIM)
        self._drop = client.register_script(_DROP)
        self._drop_node = client.register_script(_DROP_NODE)

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 0.05, **kwargs: Any) -> RedisStore:
        """A store on ``redis://host:port/db`` whose connections time out after
        ``timeout_s`` and never retry (the caller's fallback is a recompute)."""
        client = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
        )
        return cls(client, timeout_s=timeout_s, **kwargs)

    async def aclose(self) -> None:
        await self._client.aclose()

    def __len__(self) -> int:
        return sum(self._counts.values())

    def key_for(self, key: ConversationKey) -> str:
        """The Redis key of a conversation (no raw id in it)."""
        h = hashlib.blake2b(digest_size=16, person=b"kvrelay-redis")
        for part in (key.tenant, key.conversation_id):
            raw = part.encode("utf-8")
            h.update(len(raw).to_bytes(4, "little"))
            h.update(raw)
        return f"{self._ns}:{quote(key.tenant, safe='')}:conv:{h.hexdigest()}"

    def node_index(self, node_id: str) -> str:
        return f"{self._ns}:node:{quote(node_id, safe='')}"

    async def get(self, key: ConversationKey) -> ConversationEntry | None:
        raw = await self._call("get", self._client.hget(self.key_for(key), "json"))
        if raw is None:
            return None
        try:
            entry = entry_from_json(raw, wall_offset_s=self._offset())
        except EntryFormatError as exc:
            self._failed("decode", exc, outage=False)
            return None
        if self._clock() >= entry.expires_at_s + self._retention:
            return None  # purged on the router clock; Redis drops the key on its own
        return entry

    async def put(self, key: ConversationKey, entry: ConversationEntry) -> None:
        offset = self._offset()
        ttl_ms = math.ceil((entry.expires_at_s - self._clock() + self._retention) * 1000)
        rkey, index = self.key_for(key), self.node_index(entry.decode_node_id)
        if ttl_ms <= 0:  # already past retention: the newest turn still replaces the old
            await self._quiet("put", self._drop(keys=[rkey]), 0)
            return
        result = await self._quiet("put", self._put(
            keys=[rkey, index],
            args=[entry_to_json(entry, wall_offset_s=offset), entry_identity(entry),
                  repr(entry.expires_at_s + offset), entry.decode_node_id,
                  entry.decode_engine_id, ttl_ms],
        ), None)
        if result is not None:
            size, old_index, old_size = result
            self._counts[index] = int(size)
            if old_index:
                self._counts[str(old_index)] = int(old_size)

    async def claim(self, key: ConversationKey, entry: ConversationEntry) -> bool:
        return await self._compare_delete("claim", key, entry)

    async def drop(self, key: ConversationKey, entry: ConversationEntry | None = None) -> bool:
        if entry is not None:
            return await self._compare_delete("drop", key, entry)
        removed = await self._quiet("drop", self._drop(keys=[self.key_for(key)]), 0)
        return bool(removed)

    async def drop_node(self, node_id: str) -> int:
        return await self._drop_where("drop_node", node_id, "")

    async def drop_engine(self, node_id: str, engine_id: str) -> int:
        return await self._drop_where("drop_engine", node_id, engine_id)

    def _offset(self) -> float:
        """Add to a router-clock time to get the wall-clock time."""
        return self._wall() - self._clock()

    async def _compare_delete(
        self, op: str, key: ConversationKey, entry: ConversationEntry
    ) -> bool:
        expires_wall = entry.expires_at_s + self._offset()
        done = await self._quiet(op, self._claim(
            keys=[self.key_for(key), self.node_index(entry.decode_node_id)],
            args=[entry_identity(entry), repr(expires_wall), repr(self._tolerance)],
        ), 0)
        return bool(done)

    async def _drop_where(self, op: str, node_id: str, engine_id: str) -> int:
        index = self.node_index(node_id)
        result = await self._quiet(op, self._drop_node(keys=[index], args=[node_id, engine_id]),
                                   None)
        if result is None:
            return 0
        dropped, size = (int(x) for x in result)
        self._counts[index] = size
        return dropped

    async def _call(self, op: str, call: Awaitable[T]) -> T:
        """Await one Redis call within the timeout; ``StoreUnavailable`` if it fails."""
        try:
            result = await asyncio.wait_for(call, self._timeout)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self._failed(op, exc)
            raise StoreUnavailable(f"redis {op} failed: {exc!r}") from exc
        if self._failing:
            self._failing = False
            log.warning("conversation state: Redis answers again (%s)", op)
        return result

    async def _quiet(self, op: str, call: Awaitable[Any], default: T) -> Any:
        """Like ``_call`` but returns ``default`` on failure."""
        try:
            return await self._call(op, call)
        except StoreUnavailable:
            return default

    def _failed(self, op: str, exc: BaseException, *, outage: bool = True) -> None:
        self._failing = self._failing or outage
        self._failures_unlogged += 1
        if self._on_error is not None:
            self._on_error(op)
        now = time.monotonic()
        if now >= self._next_log:
            log.warning(
                "conversation state: Redis %s failed (%s); turns recompute meanwhile "
                "(%d failure(s) since the last such line)",
                op, type(exc).__name__ if str(exc) == "" else exc, self._failures_unlogged,
            )
            self._failures_unlogged = 0
            self._next_log = now + self._log_interval
