"""``RedisIndex``: the ``ConversationIndex`` shared by several router replicas through Redis.

Any replica can serve any turn: entries (D's block locations and a token fingerprint, never
content) live in Redis under digests, so the follow-up finds its entry whichever replica the
load balancer picks, and pulls from the D the entry names.

**Keys** (``ns`` = ``kvrelay:{deployment}``, parts percent-encoded, digests in hex):

* ``{ns}:e:{scope}:{anchor}:{slot}:{member}`` – a hash per entry (``member`` =
  ``entry_identity``: several entries live at one ref): ``json`` (``entry_to_json``), ``id``,
  ``exp`` (wall-clock expiry, s), ``node``, ``engine``, ``tokens``, ``rid`` (D's request
  id), ``rel`` (the cause, once D released it), ``ord`` (once its release at expiry was
  ordered: D frees it, so it is held no more and removing it orders nothing), and the keys
  of the sets it is indexed in (``dx``: its D's due set, when flagged).
* ``{ns}:r:{scope}:{anchor}:{slot}`` – the members of a ref, by when they were stored
  (at most ``MAX_ENTRIES_PER_REF``; the oldest is pushed out and released).
* ``{ns}:b:{scope}:{anchor}`` – the slots under a chat anchor; under a completions block's
  anchor, the fine digests (hex) that block has entries under.
* ``{ns}:f:{scope}:{anchor}:{fine}`` – a hash: the end offsets (in the block) of the
  completions refs under one fine digest, each with how many refs end there.
* ``{ns}:drained`` – a hash of the node ids an admin drained (``set_drained``), read by
  every replica at each health round, and a field ``.`` set from the first drain on: a
  hash without it is one Redis lost (a restart without persistence), which the replicas
  fill again from their own drains rather than undrain every node (probe 15, L2).
* ``{ns}:nodes`` – each node id's URL as the replica that last published it listed it
  (``node_urls``, each health round).
* ``{ns}:s:{scope}`` – the entries of a scope, by when they were stored (``drop_scope``;
  an explicit id's latest entry). ``{ns}:fl:{scope}`` – when ``drop_scope`` last flushed it
  (wall s, PX ``FLUSH_MARK_S``): ``put`` drops an entry whose turn began before it.
* ``{ns}:node:{node_id}`` – a sorted set of a D's entries by expiry (``drop_node``,
  ``drop_engine``, retained tokens).
* ``{ns}:t:{tenant}`` and ``{ns}:all`` – sorted sets by last use (a counter, ``{ns}:seq``,
  so order is exact however fast the calls come): the per-tenant and total caps evict the
  least recently used.
* ``{ns}:q:{node_id}:{request_id}`` – D's request id to its entry's key (``mark_released``;
  ``!engine<TAB>cause`` for a release that came before the entry), and ``...:r`` while a
  claimed entry's P leg reads it (``release_requested``, ``read_done``; PX ``READ_TTL_S``,
  or the grace ``read_spent`` sets).
* ``{ns}:rel:{node_id}`` – the release orders queued for a D (``engine<TAB>request id``):
  every entry the index drops but a claim, a released one, an ordered one (``ord``) and
  ``drop_node``/``drop_engine`` queues one in the same script, so whichever replica D syncs
  with delivers it (``take_releases``); so does the replica whose P leg spent a claimed
  turn's read, once its grace is over (``OpenReads``, ``_QUEUE_ORDER``). A stock D's order
  needs D's params, cut to what a release needs (``RemoteBlocks.for_release``, kept in the
  entry's ``relp`` field): they wait beside the order in ``{ns}:rel:{node_id}:p:{order}``
  (PX as the queue; taken and deleted with it, ``take_release_blocks``), not in the queue
  item, so a replica that predates them reads each item as it always did (an order a replica
  of 2026-12-05's ``engine<TAB>id<TAB>params`` items queued is read the same).
* ``{ns}:due:{node_id}`` – a sorted set of a D's entries flagged ``release_at_expiry``, by
  wall-clock expiry (ms, rounded up), added by ``put`` and left by an entry removed.
  ``take_releases`` pops the due ones (at most its ``limit`` looked at per call, in the
  same script as the queue), skips those gone, released, ordered or of another
  engine, and orders the others once (``ord``).
* ``{ns}:shared`` – a random name set once by the first replica (``shared_state``).
* ``{ns}:p:{scope}:{anchor}:{slot}`` – an entry announced for that ref (``announce``: its
  turn's D report is awaited by the replica that served it), PX the report timeout, deleted
  when the turn settles (``withdraw``); ``announced`` is one ``EXISTS`` over a chat
  request's refs, asked only when its lookup found nothing.

A chat lookup is one round trip (one script probes every anchor in order). A completions
lookup is at most three, each bounded whatever the scope holds: which of the request's
blocks have entries (at most ``MAX_TEXT_BLOCKS``, longest first), the end
offsets under the request's fine digests of those blocks, then the refs of the ends the
request carries (at most ``MAX_TEXT_DIGESTS``, as a chat lookup). Every set member whose
key expired is cleaned lazily (a completions end whose refs all expired stays, at most
``TEXT_FINE_BYTES`` per fine digest, until its hash expires).

**Clocks.** The router's ``expires_at_s`` is on its monotonic clock, meaningless in another
process, so Redis holds wall-clock times, converted on write and read. Replicas agree on
expiry up to their wall-clock skew (keep hosts NTP-synced; ``ttl_safety_margin_s`` must
cover it). Redis expires a key ``expired_retention_s`` after the entry expires, so a
just-expired entry still reports ``expired``.

**Failures.** Every call is bounded by ``timeout_s`` (no retries). ``lookup`` raises
``IndexUnavailable``, and so do what D's sync must know was heard: ``mark_released`` (an
entry D freed but never marked could be pulled once Redis answers again) and
``release_requested`` (whether a P reads a turn is unknown: answering "none dropped" kept D
from asking a replica that can answer); the router fails that sync, and D tells it again or
asks another replica. The others degrade: ``put`` loses the entry, ``claim``/``drop`` return
False, the ``drop_*`` return 0. Each failure calls ``on_error(op)`` and logs at most one line
per ``log_interval_s``. redis-py reconnects once Redis is back.

Needs one Redis (or a Sentinel primary), not Redis Cluster: scripts span hash slots.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar
from urllib.parse import quote

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from kvrelay.core.conversation import ConversationEntry, GapKind
from kvrelay.core.engine_group import engine_group
from kvrelay.core.identity import Probe, RequestIdentity, text_fine_of
from kvrelay.core.params import KVParamsError, RemoteBlocks, parse_remote_blocks
from kvrelay.core.retention_sync import MAX_ORDERS, Released
from kvrelay.router.index import (
    FLUSH_MARK_S,
    MAX_ENTRIES_PER_REF,
    MAX_QUEUED_RELEASES,
    MAX_TEXT_BLOCKS,
    READ_TTL_S,
    EntryRef,
    Found,
    IndexUnavailable,
    OpenReads,
    TextSearch,
    continuation_of,
    continues_latest,
    is_text_slot,
)

log = logging.getLogger("kvrelay.router")

_DRAINS_KEPT = "."
"""The field that says ``{ns}:drained`` was written (not a node id: ``RouterConfig``)."""

T = TypeVar("T")

FORMAT_VERSION = 3
RELEASE_QUEUE_TTL_MS = 600_000
"""A D that has not synced for this long has lost its queue (its orders are moot by then)."""

# Queue one release order (engine TAB request id) on a D's queue, its release params (JSON,
# if any) beside it; the queue bounded and expiring. Prepended to the scripts that queue.
_QUEUE = """
local function queue_order(q, order, params)
  redis.call('RPUSH', q, order)
  if params and params ~= '' then
    redis.call('SET', q .. ':p:' .. order, params, 'PX', @QTTL@)
  end
  while redis.call('LLEN', q) > @MAXQ@ do
    redis.call('DEL', q .. ':p:' .. redis.call('LPOP', q))
  end
  redis.call('PEXPIRE', q, @QTTL@)
end
""".replace("@MAXQ@", str(MAX_QUEUED_RELEASES)).replace("@QTTL@", str(RELEASE_QUEUE_TTL_MS))
# Remove one entry and its index memberships; release == 1 queues a release order for its D
# request id on its D (unless D released it already or it was ordered at its expiry).
# Prepended to the scripts.
_REMOVE = _QUEUE + """
local function remove(k, release)
  local f = redis.call('HMGET', k, 'nx', 'bk', 'slot', 'sx', 'tz', 'az', 'rx', 'mem', 'qx',
                       'rid', 'rel', 'lq', 'engine', 'fk', 'fine', 'end', 'dx', 'ord', 'relp')
  if f[1] then redis.call('ZREM', f[1], k) end
  if f[17] then redis.call('ZREM', f[17], k) end
  if f[7] then
    redis.call('ZREM', f[7], f[8])
    if redis.call('ZCARD', f[7]) == 0 then
      if f[14] then
        if redis.call('HINCRBY', f[14], f[16], -1) <= 0 then redis.call('HDEL', f[14], f[16]) end
        if f[2] and redis.call('HLEN', f[14]) == 0 then redis.call('SREM', f[2], f[15]) end
      elseif f[2] then
        redis.call('SREM', f[2], f[3])
      end
    end
  end
  if f[4] then redis.call('ZREM', f[4], k) end
  if f[5] then redis.call('ZREM', f[5], k) end
  if f[6] then redis.call('ZREM', f[6], k) end
  if f[9] and redis.call('GET', f[9]) == k then redis.call('DEL', f[9]) end
  if release == 1 and f[12] and not f[11] and not f[18] then
    queue_order(f[12], f[13] .. '\\t' .. f[10], f[19])
  end
  return redis.call('DEL', k)
end
-- the newest entry of a ref set D still holds (neither released nor ordered), else (unless
-- usable) the newest other one: {key, json, cause or ''}; members whose key expired are
-- cleaned
local function best(rk, ep, usable)
  local fallback = nil
  for _, m in ipairs(redis.call('ZREVRANGE', rk, 0, -1)) do
    local k = ep .. m
    local v = redis.call('HMGET', k, 'json', 'rel', 'ord')
    if not v[1] then
      redis.call('ZREM', rk, m)
    elseif not v[2] and not v[3] then
      return {k, v[1], ''}
    elseif not fallback then
      fallback = {k, v[1], v[2] or ''}
    end
  end
  if usable then return nil end
  return fallback
end
"""

# lookup: KEYS = ref sets in the order to try, then the scope's key; ARGV[1] = the
# namespace, ARGV[2] = the LRU counter's key, ARGV[3] == '1' for an explicit id (its
# latest entry if no ref has one). Returns {i, key, json, cause} for an entry (i = 0: the
# scope's latest), else {}.
_LOOKUP = _REMOVE + """
local n = #KEYS - 1
local ns = ARGV[1]
local plen = #ns + 3
local function touch(k)
  local v = redis.call('HMGET', k, 'tz', 'az')
  local seq = redis.call('INCR', ARGV[2])
  if v[1] then redis.call('ZADD', v[1], seq, k) end
  if v[2] then redis.call('ZADD', v[2], seq, k) end
end
for i = 1, n do
  local tail = string.sub(KEYS[i], plen + 1)
  local hit = best(KEYS[i], ns .. ':e:' .. tail .. ':', false)
  if hit then
    touch(hit[1])
    return {i, hit[1], hit[2], hit[3]}
  end
end
if ARGV[3] == '1' then
  local latest = redis.call('ZREVRANGE', KEYS[n + 1], 0, 0)[1]
  if latest then
    local v = redis.call('HMGET', latest, 'json', 'rel')
    if v[1] then
      touch(latest)
      return {0, latest, v[1], v[2] or ''}
    end
  end
end
return {}
"""

# completions, step 1: KEYS = the request's block keys, longest first; ARGV[1] = how many at
# most. Returns the (1-based) indexes of those that hold entries.
_TEXT_BLOCKS = """
local out = {}
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    table.insert(out, i)
    if #out >= tonumber(ARGV[1]) then break end
  end
end
return out
"""

# completions, step 2: KEYS = fine keys; returns the end offsets stored under each.
_TEXT_ENDS = """
local out = {}
for i = 1, #KEYS do table.insert(out, redis.call('HKEYS', KEYS[i])) end
return out
"""

# put: KEYS = entry, node set, bucket, scope set, tenant lru, total lru, LRU counter, ref set,
# request key (D's request id -> entry key), D's release queue, a completions entry's fine key
# (else its bucket again), D's due set. ARGV = json, id, exp (wall s), node, engine, tokens,
# ttl ms, slot, member, tenant cap, total cap, node-set score (exp ms), D request id, per-ref
# cap, fine digest (hex) and end offset ('' for chat), due-set score (exp ms rounded up; ''
# unless flagged release_at_expiry), the release params (JSON, ``for_release``); KEYS[13] =
# the scope's flush mark, ARGV[19] = when the turn began (wall s; '' for none). Returns
# {evicted for capacity, total size, pushed out of the ref, 1 if dropped for a flush since
# the turn began (released like any drop) else 0}.
_PUT = _REMOVE + """
if redis.call('EXISTS', KEYS[1]) == 1 then remove(KEYS[1], 0) end
redis.call('HSET', KEYS[1], 'json', ARGV[1], 'id', ARGV[2], 'exp', ARGV[3], 'node', ARGV[4],
           'engine', ARGV[5], 'tokens', ARGV[6], 'nx', KEYS[2], 'bk', KEYS[3], 'slot', ARGV[8],
           'sx', KEYS[4], 'tz', KEYS[5], 'az', KEYS[6], 'rx', KEYS[8], 'mem', ARGV[9],
           'qx', KEYS[9], 'rid', ARGV[13], 'lq', KEYS[10], 'relp', ARGV[18])
redis.call('PEXPIRE', KEYS[1], ARGV[7])
local prior = redis.call('GET', KEYS[9])
if prior and string.sub(prior, 1, 1) == '!' then
  local tab = string.find(prior, '\t', 1, true)
  if tab and string.sub(prior, 2, tab - 1) == ARGV[5] then
    redis.call('HSET', KEYS[1], 'rel', string.sub(prior, tab + 1))
  end
end
redis.call('ZADD', KEYS[2], ARGV[12], KEYS[1])
if ARGV[17] ~= '' then
  redis.call('HSET', KEYS[1], 'dx', KEYS[12])
  redis.call('ZADD', KEYS[12], ARGV[17], KEYS[1])
end
if ARGV[16] ~= '' then
  redis.call('HSET', KEYS[1], 'fk', KEYS[11], 'fine', ARGV[15], 'end', ARGV[16])
  if redis.call('ZCARD', KEYS[8]) == 0 then redis.call('HINCRBY', KEYS[11], ARGV[16], 1) end
  redis.call('SADD', KEYS[3], ARGV[15])
else
  redis.call('SADD', KEYS[3], ARGV[8])
end
local seq = redis.call('INCR', KEYS[7])
redis.call('ZADD', KEYS[4], seq, KEYS[1])
redis.call('ZADD', KEYS[5], seq, KEYS[1])
redis.call('ZADD', KEYS[6], seq, KEYS[1])
redis.call('ZADD', KEYS[8], seq, ARGV[9])
redis.call('SET', KEYS[9], KEYS[1], 'PX', ARGV[7])
for _, i in ipairs({2, 3, 4, 5, 6, 8, 11, 12}) do
  if redis.call('PTTL', KEYS[i]) < tonumber(ARGV[7]) then
    redis.call('PEXPIRE', KEYS[i], ARGV[7])
  end
end
local prefix = string.sub(KEYS[1], 1, #KEYS[1] - #ARGV[9])
local overflow = 0
while redis.call('ZCARD', KEYS[8]) > tonumber(ARGV[14]) do
  local old = redis.call('ZRANGE', KEYS[8], 0, 0)[1]
  redis.call('ZREM', KEYS[8], old)
  overflow = overflow + remove(prefix .. old, 1)
end
local evicted = 0
while redis.call('ZCARD', KEYS[5]) > tonumber(ARGV[10]) do
  local old = redis.call('ZPOPMIN', KEYS[5])[1]
  evicted = evicted + remove(old, 1)
end
while redis.call('ZCARD', KEYS[6]) > tonumber(ARGV[11]) do
  local old = redis.call('ZPOPMIN', KEYS[6])[1]
  evicted = evicted + remove(old, 1)
end
local flushed = 0
if ARGV[19] ~= '' then
  local mark = redis.call('GET', KEYS[13])
  if mark and tonumber(mark) > tonumber(ARGV[19]) then flushed = remove(KEYS[1], 1) end
end
return {evicted, redis.call('ZCARD', KEYS[6]), overflow, flushed}
"""

# queue one release order: KEYS = D's release queue; ARGV = the order (engine TAB request
# id), its release params (JSON), as remove() queues them.
_QUEUE_ORDER = _QUEUE + """
queue_order(KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# claim: KEYS = the entry's key, its ref set; ARGV = id, exp (wall s), tolerance, the entry
# key prefix of the ref, how long the read it starts may last (ms; '{request key}:r').
# Removes the entry if it is still the expected one and D holds it (neither released nor
# ordered), else another entry of the ref D holds, and marks its read in progress; returns
# {key, json, '1' if it was the expected one else '0'} of what it removed, or {}.
_CLAIM = _REMOVE + """
local function reading(k)
  local q = redis.call('HGET', k, 'qx')
  if q then redis.call('SET', q .. ':r', '1', 'PX', ARGV[5]) end
end
local cur = redis.call('HMGET', KEYS[1], 'id', 'exp', 'rel', 'json', 'ord')
if cur[1] and cur[1] == ARGV[1] and not cur[3] and not cur[5]
    and math.abs(tonumber(cur[2]) - tonumber(ARGV[2])) <= tonumber(ARGV[3]) then
  reading(KEYS[1])
  remove(KEYS[1], 0)
  return {KEYS[1], cur[4], '1'}
end
local hit = best(KEYS[2], ARGV[4], true)
if hit then
  reading(hit[1])
  remove(hit[1], 0)
  return {hit[1], hit[2], '0'}
end
return {}
"""

# conditional drop: KEYS = the entry's key; ARGV = id, exp, tolerance, release (1/0).
_DROP_ONE = _REMOVE + """
local cur = redis.call('HMGET', KEYS[1], 'id', 'exp')
if not cur[1] or cur[1] ~= ARGV[1] then return 0 end
if math.abs(tonumber(cur[2]) - tonumber(ARGV[2])) > tonumber(ARGV[3]) then return 0 end
return remove(KEYS[1], tonumber(ARGV[4]))
"""

# every entry of a ref: KEYS = the ref set; ARGV = the entry key prefix, release (1/0).
_DROP_REF = _REMOVE + """
local n = 0
for _, m in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  n = n + remove(ARGV[1] .. m, tonumber(ARGV[2]))
end
redis.call('DEL', KEYS[1])
return n
"""

# an engine id's group (core.engine_group): the id without a data-parallel rank's _dp<rank>
_GROUP = """
local function group(e)
  local g, r = string.match(e, '^(.+)_dp(%d+)$')
  if g and #r <= 6 then return g end
  return e
end
"""

# drop every member of a sorted set of entries whose node/engine match (ARGV[1] node or '',
# ARGV[2] an engine group or '': every rank's of it), releasing each when ARGV[3] == '1';
# members whose key expired are cleaned.
_DROP_SET = _REMOVE + _GROUP + """
local n = 0
for _, m in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local cur = redis.call('HMGET', m, 'node', 'engine')
  if not cur[1] then
    redis.call('ZREM', KEYS[1], m)
  elseif (ARGV[1] == '' or cur[1] == ARGV[1])
      and (ARGV[2] == '' or group(cur[2] or '') == ARGV[2]) then
    n = n + remove(m, tonumber(ARGV[3]))
  end
end
return n
"""

# retained tokens of the live entries D still holds, per node set in KEYS (expiry > ARGV[1]
# ms; members expired before ARGV[2] are cleaned).
_RETAINED = """
local out = {}
for i = 1, #KEYS do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', ARGV[2])
  local total = 0
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[i], ARGV[1], '+inf')) do
    local v = redis.call('HMGET', m, 'tokens', 'rel')
    if not v[2] then total = total + (tonumber(v[1]) or 0) end
  end
  table.insert(out, total)
end
return out
"""

# D released these: KEYS = request keys, ARGV[1] = D's engine id, ARGV[1 + i] = the cause of
# KEYS[i]. Marks each entry (of that engine) released; returns how many. A request with no
# entry yet (D's sync came before the turn committed) gets a marker ('!engine<TAB>cause')
# that put turns into a released entry.
_MARK_RELEASED = """
local n = 0
for i = 1, #KEYS do
  local k = redis.call('GET', KEYS[i])
  if k and string.sub(k, 1, 1) ~= '!' then
    local v = redis.call('HMGET', k, 'engine', 'rel')
    if v[1] == ARGV[1] and (not v[2] or v[2] == 'releasing') then
      redis.call('HSET', k, 'rel', ARGV[i + 1])
      n = n + 1
    end
  else
    redis.call('SET', KEYS[i], '!' .. ARGV[1] .. '\t' .. ARGV[i + 1], 'PX', @QTTL@)
  end
end
return n
""".replace("@QTTL@", str(RELEASE_QUEUE_TTL_MS))

# D asks to free these: KEYS = request keys, ARGV[1] = D's engine id. Marks them released
# ('releasing', as _MARK_RELEASED) and returns the (1-based) indexes no read is running for.
_RELEASE_REQUESTED = """
local out = {}
for i = 1, #KEYS do
  local k = redis.call('GET', KEYS[i])
  if not k or string.sub(k, 1, 1) == '!' then
    redis.call('SET', KEYS[i], '!' .. ARGV[1] .. '\treleasing', 'PX', @QTTL@)
  else
    local v = redis.call('HMGET', k, 'engine', 'rel')
    if v[1] == ARGV[1] and not v[2] then redis.call('HSET', k, 'rel', 'releasing') end
  end
  if redis.call('EXISTS', KEYS[i] .. ':r') == 0 then table.insert(out, i) end
end
return out
""".replace("@QTTL@", str(RELEASE_QUEUE_TTL_MS))

# the release orders for D: KEYS = D's queue, D's due set; ARGV = D's engine id, how many
# at most (queued orders taken, due entries looked at, ids returned), now (wall ms), the
# engine's group (core.engine_group). The queued orders first, then the flagged entries that
# expired (score <= now): each is taken out of the due set, and one D still holds (not
# gone, released or ordered) is marked ordered and, for D's engine, returned. Orders for
# another engine (D restarted: those blocks are gone) are discarded; another rank's of a
# data-parallel D (same group) stay, queued again or due, for that rank's sync.
_TAKE_RELEASES = _GROUP + """
local out = {}
local items = redis.call('LPOP', KEYS[1], tonumber(ARGV[2]))
local p = ARGV[1] .. '\\t'
for _, it in ipairs(items or {}) do
  local pk = KEYS[1] .. ':p:' .. it
  if string.sub(it, 1, #p) == p then
    local params = redis.call('GET', pk)
    table.insert(out, string.sub(it, #p + 1) .. (params and ('\\t' .. params) or ''))
    redis.call('DEL', pk)
  elseif group(string.match(it, '^([^\\t]*)')) == ARGV[4] then
    redis.call('RPUSH', KEYS[1], it)
  else
    redis.call('DEL', pk)
  end
end
local room = tonumber(ARGV[2]) - #out
if room <= 0 then return out end
local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[3], 'LIMIT', 0, ARGV[2])
for _, k in ipairs(due) do
  if room <= 0 then break end
  local v = redis.call('HMGET', k, 'rid', 'engine', 'rel', 'ord', 'relp')
  if not (v[2] and v[2] ~= ARGV[1] and group(v[2]) == ARGV[4]) then
    redis.call('ZREM', KEYS[2], k)
    if v[1] and not v[3] and not v[4] then
      redis.call('HSET', k, 'ord', '1')
      if v[2] == ARGV[1] then
        table.insert(out, v[1] .. '\\t' .. (v[5] or ''))
        room = room - 1
      end
    end
  end
end
return out
"""


class EntryFormatError(ValueError):
    """A stored entry that is not valid ``entry_to_json`` output."""


def _body(entry: ConversationEntry) -> dict[str, Any]:
    """Everything of the entry but its (clock-dependent) times, ``released`` (kept beside
    the JSON), ``release_at_expiry`` and ``waits_for`` (how long the router keeps it, like
    its times), as JSON values: what ``entry_identity`` digests. ``context`` (hex) only when
    known, so an entry without it is what it was before the field existed."""
    body: dict[str, Any] = {
        "v": FORMAT_VERSION,
        "node": entry.decode_node_id,
        "turn": entry.turn,
        "conversation": entry.conversation,
        "num_bytes": entry.num_bytes,
        "block_size": entry.block_size,
        "params": entry.blocks.to_json(),
    }
    if entry.context:
        body["context"] = entry.context.hex()
    return body


def entry_identity(entry: ConversationEntry) -> str:
    """Digest of the entry without its times, ``released`` and ``release_at_expiry``: what
    ``claim`` compares exactly (the same D request stored again has the same identity)."""
    canonical = json.dumps(_body(entry), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode("utf-8"), digest_size=16).hexdigest()


def entry_to_json(entry: ConversationEntry, *, wall_offset_s: float) -> str:
    """The entry as JSON, its times moved to the wall clock (``local + wall_offset_s``).
    ``release_at_expiry`` and ``waits_for`` are written only when not their defaults, so
    such an entry's JSON is what it was before the fields existed (same
    ``FORMAT_VERSION``)."""
    doc = _body(entry)
    doc["expires_wall_s"] = entry.expires_at_s + wall_offset_s
    doc["created_wall_s"] = entry.created_at_s + wall_offset_s
    if entry.release_at_expiry:
        doc["release_at_expiry"] = True
    if entry.waits_for != "user":
        doc["waits_for"] = entry.waits_for
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def entry_from_json(
    text: str | bytes, *, wall_offset_s: float, released: str | None = None
) -> ConversationEntry:
    """Inverse of ``entry_to_json`` (times back on the local clock; ``released``: the cause
    stored beside the JSON once D released the entry; an absent ``release_at_expiry`` is
    false, an absent ``waits_for`` ``user``, an absent ``context`` unknown);
    ``EntryFormatError`` for anything else."""
    try:
        doc = json.loads(text)
        if doc["v"] != FORMAT_VERSION:
            raise EntryFormatError(f"unsupported entry format {doc['v']!r}")
        blocks = parse_remote_blocks(doc["params"])
        block_size = doc["block_size"]
        return ConversationEntry(
            decode_node_id=_typed(doc["node"], str),
            blocks=blocks,
            expires_at_s=float(_typed(doc["expires_wall_s"], float)) - wall_offset_s,
            created_at_s=float(_typed(doc["created_wall_s"], float)) - wall_offset_s,
            turn=_typed(doc["turn"], int),
            conversation=_typed(doc["conversation"], str),
            num_bytes=_typed(doc["num_bytes"], int),
            block_size=None if block_size is None else _typed(block_size, int),
            released=released or None,
            release_at_expiry=_typed(doc.get("release_at_expiry", False), bool),
            waits_for=_waits_for(doc.get("waits_for", "user")),
            context=bytes.fromhex(_typed(doc.get("context", ""), str)),
        )
    except EntryFormatError:
        raise
    except (ValueError, KeyError, TypeError, KVParamsError) as exc:
        raise EntryFormatError(f"malformed conversation entry: {exc}") from exc


def _waits_for(value: Any) -> GapKind:
    if value == "tool":
        return "tool"
    if value == "user":
        return "user"
    raise EntryFormatError(f"waits_for is 'tool' or 'user', got {value!r}")


def _typed(value: Any, kind: type[T]) -> T:
    ok = isinstance(value, int | float) if kind is float else isinstance(value, kind)
    if not ok or (kind is not bool and isinstance(value, bool)):
        raise EntryFormatError(f"expected {kind.__name__}, got {value!r}")
    return value  # type: ignore[no-any-return]


class RedisIndex:
    """A ``ConversationIndex`` in Redis, shared by router replicas (module docstring).

    ``clock`` is this replica's router clock, ``wall_clock`` the clock shared between hosts
    (tests pass one that moves with their manual clock). ``len()`` and ``retained_tokens``
    are the last values this replica saw (``refresh`` updates the latter). ``on_evict``
    counts what the caps pushed out (``capacity``, ``overflow``) by reason.
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
        max_entries: int = 100_000,
        max_per_tenant: int | None = None,
        max_per_ref: int = MAX_ENTRIES_PER_REF,
        claim_tolerance_s: float = 0.05,
        on_error: Callable[[str], None] | None = None,
        on_evict: Callable[[str, int], None] | None = None,
        on_text_digests: Callable[[int], None] | None = None,
        log_interval_s: float = 10.0,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        if max_per_ref < 1:
            raise ValueError("max_per_ref must be >= 1")
        self._client = client
        self._ns = f"kvrelay:{quote(deployment, safe='')}"
        self._shared: str | None = None
        self._clock = clock
        self._reads = OpenReads(clock)
        self._wall = wall_clock
        self._timeout = timeout_s
        self._retention = expired_retention_s
        self._max = max_entries
        self._max_tenant = min(max_per_tenant or max_entries, max_entries)
        self._max_ref = max_per_ref
        self._tolerance = claim_tolerance_s
        self._on_error = on_error
        self._on_evict = on_evict
        self._on_text_digests = on_text_digests
        self._log_interval = log_interval_s
        self._next_log = 0.0
        self._failures_unlogged = 0
        self._failing = False
        self._size = 0
        self._nodes_seen: set[str] = set()
        self._retained: dict[str, int] = {}
        self._lookup = client.register_script(_LOOKUP)
        self._text_blocks = client.register_script(_TEXT_BLOCKS)
        self._text_ends = client.register_script(_TEXT_ENDS)
        self._put = client.register_script(_PUT)
        self._claim = client.register_script(_CLAIM)
        self._queue_order = client.register_script(_QUEUE_ORDER)
        self._drop_one = client.register_script(_DROP_ONE)
        self._drop_ref = client.register_script(_DROP_REF)
        self._drop_set = client.register_script(_DROP_SET)
        self._retained_script = client.register_script(_RETAINED)
        self._mark_released = client.register_script(_MARK_RELEASED)
        self._take_releases = client.register_script(_TAKE_RELEASES)
        self._release_requested = client.register_script(_RELEASE_REQUESTED)

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 0.05, **kwargs: Any) -> RedisIndex:
        """An index on ``redis://host:port/db`` whose connections time out after
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
        return self._size

    # -- keys -------------------------------------------------------------------------------

    def _ref_tail(self, ref: EntryRef) -> str:
        return f"{ref.scope.hex()}:{ref.anchor.hex()}:{ref.slot.hex()}"

    def entry_key(self, ref: EntryRef, entry: ConversationEntry) -> str:
        return f"{self._entry_prefix(ref)}{entry_identity(entry)}"

    def _entry_prefix(self, ref: EntryRef) -> str:
        return f"{self._ns}:e:{self._ref_tail(ref)}:"

    def ref_key(self, ref: EntryRef) -> str:
        return f"{self._ns}:r:{self._ref_tail(ref)}"

    def pending_key(self, ref: EntryRef) -> str:
        """An entry for ``ref`` is on its way (``announce``)."""
        return f"{self._ns}:p:{self._ref_tail(ref)}"

    def _scope_key(self, scope: bytes) -> str:
        return f"{self._ns}:s:{scope.hex()}"

    def _flush_key(self, scope: bytes) -> str:
        """When ``drop_scope`` last flushed ``scope`` (wall s; ``FLUSH_MARK_S``)."""
        return f"{self._ns}:fl:{scope.hex()}"

    def _ref_of(self, key: str) -> EntryRef | None:
        """The ref an entry key names (``entry_key`` inverted)."""
        parts = key.rsplit(":", 4)
        try:
            return EntryRef(*(bytes.fromhex(p) for p in parts[1:4]))
        except ValueError:
            return None

    def _bucket(self, scope: bytes, anchor: bytes) -> str:
        return f"{self._ns}:b:{scope.hex()}:{anchor.hex()}"

    def _fine_key(self, scope: bytes, anchor: bytes, fine: bytes) -> str:
        return f"{self._ns}:f:{scope.hex()}:{anchor.hex()}:{fine.hex()}"

    def node_set(self, node_id: str) -> str:
        return f"{self._ns}:node:{quote(node_id, safe='')}"

    def _request_key(self, node_id: str, request_id: str) -> str:
        return f"{self._ns}:q:{quote(node_id, safe='')}:{quote(request_id, safe='')}"

    def release_queue(self, node_id: str) -> str:
        return f"{self._ns}:rel:{quote(node_id, safe='')}"

    def due_set(self, node_id: str) -> str:
        """D's entries flagged ``release_at_expiry``, by wall-clock expiry (ms)."""
        return f"{self._ns}:due:{quote(node_id, safe='')}"

    def _tenant_lru(self, tenant: str) -> str:
        return f"{self._ns}:t:{quote(tenant, safe='')}"

    # -- the contract -----------------------------------------------------------------------

    async def lookup(self, identity: RequestIdentity) -> Found | None:
        if not identity.probes and not identity.explicit:
            return None
        if identity.text is not None:
            return await self._text_lookup(identity)
        refs: list[tuple[EntryRef, Probe]] = []
        for probe in identity.probes:
            if probe.continuation is not None:
                refs.append((EntryRef(identity.scope, probe.anchor, probe.continuation.slot()),
                             probe))
        return await self._lookup_refs(identity, refs)

    async def _lookup_refs(
        self, identity: RequestIdentity, refs: list[tuple[EntryRef, Probe]]
    ) -> Found | None:
        """The newest entry of the first ref that has one (else an explicit id's latest)."""
        if not refs and not identity.explicit:
            return None
        result = await self._call("get", self._lookup(
            keys=[*(self.ref_key(ref) for ref, _ in refs), self._scope_key(identity.scope)],
            args=[self._ns, f"{self._ns}:seq", "1" if identity.explicit else "0"],
        ))
        if not result:
            return None
        offset = self._offset()
        entry = self._decode(result[2], offset, result[3])
        if entry is None:
            return None
        if int(result[0]) == 0:
            latest = self._ref_of(result[1])
            if latest is None or not continues_latest(entry, identity):
                return None
            return Found(latest, entry, None)
        ref, probe = refs[int(result[0]) - 1]
        return Found(ref, entry, probe)

    async def _text_lookup(self, identity: RequestIdentity) -> Found | None:
        """A completions lookup in at most three bounded round trips (module docstring)."""
        search = TextSearch(identity)
        try:
            refs = await self._text_refs(identity, search)
        finally:
            if self._on_text_digests is not None:
                self._on_text_digests(search.digests)
        return await self._lookup_refs(identity, refs)

    async def _text_refs(
        self, identity: RequestIdentity, search: TextSearch
    ) -> list[tuple[EntryRef, Probe]]:
        """The refs of the ends the request carries, longest first, within the budget."""
        probes = identity.probes
        held = await self._call("get", self._text_blocks(
            keys=[self._bucket(identity.scope, p.anchor) for p in probes],
            args=[MAX_TEXT_BLOCKS]))
        blocks: list[tuple[Probe, tuple[bytes, ...]]] = []
        for i in held or ():
            fines = search.fines(probes[int(i) - 1])
            if fines is None:
                break
            blocks.append((probes[int(i) - 1], fines))
        if not blocks:
            return []
        keys = [self._fine_key(identity.scope, probe.anchor, fine)
                for probe, fines in blocks for fine in reversed(fines)]
        ends = iter(await self._call("get", self._text_ends(keys=keys, args=[])))
        refs: list[tuple[EntryRef, Probe]] = []
        for probe, fines in blocks:
            for _ in fines:
                for end_offset in sorted((int(e) for e in next(ends)), reverse=True):
                    continuation = search.end(probe, fines, end_offset)
                    if continuation is not None:
                        refs.append((EntryRef(identity.scope, probe.anchor,
                                              continuation.slot()),
                                     search.found_probe(probe, continuation)))
                    elif search.spent:
                        return refs
        return refs

    async def put(self, ref: EntryRef, entry: ConversationEntry, *, tenant: str,
                  opened_at_s: float | None = None) -> bool:
        offset = self._offset()
        ttl_ms = math.ceil((entry.expires_at_s - self._clock() + self._retention) * 1000)
        if ttl_ms <= 0:
            return True
        expires_wall = entry.expires_at_s + offset
        node = entry.decode_node_id
        member = entry_identity(entry)
        fine_key, fine, end = self._bucket(ref.scope, ref.anchor), "", ""
        if is_text_slot(ref.slot):
            continuation = continuation_of(ref.slot)
            fine_digest = text_fine_of(continuation)
            fine_key = self._fine_key(ref.scope, ref.anchor, fine_digest)
            fine, end = fine_digest.hex(), str(continuation.num_bytes)
        result = await self._quiet("put", self._put(
            keys=[self._entry_prefix(ref) + member, self.node_set(node),
                  self._bucket(ref.scope, ref.anchor), self._scope_key(ref.scope),
                  self._tenant_lru(tenant), f"{self._ns}:all", f"{self._ns}:seq",
                  self.ref_key(ref), self._request_key(node, entry.request_id),
                  self.release_queue(node), fine_key, self.due_set(node),
                  self._flush_key(ref.scope)],
            args=[entry_to_json(entry, wall_offset_s=offset), member,
                  repr(expires_wall), node, entry.decode_engine_id, entry.num_tokens, ttl_ms,
                  ref.slot.hex(), member, self._max_tenant, self._max,
                  math.floor(expires_wall * 1000), entry.request_id, self._max_ref,
                  fine, end,
                  math.ceil(expires_wall * 1000) if entry.release_at_expiry else "",
                  json.dumps(entry.blocks.for_release().to_json(), separators=(",", ":")),
                  "" if opened_at_s is None else repr(opened_at_s + offset)],
        ), None)
        self._nodes_seen.add(node)
        if result is None:
            return True
        self._size = int(result[1])
        if self._on_evict is not None:
            for reason, count in (("capacity", int(result[0])), ("overflow", int(result[2]))):
                if count:
                    self._on_evict(reason, count)
        return not int(result[3])

    async def claim(self, ref: EntryRef, entry: ConversationEntry) -> ConversationEntry | None:
        expires_wall = entry.expires_at_s + self._offset()
        result = await self._quiet("claim", self._claim(
            keys=[self.entry_key(ref, entry), self.ref_key(ref)],
            args=[entry_identity(entry), repr(expires_wall), repr(self._tolerance),
                  self._entry_prefix(ref), math.ceil(READ_TTL_S * 1000)],
        ), None)
        if not result:
            return None
        claimed = entry
        if result[2] != "1":
            try:
                claimed = entry_from_json(result[1], wall_offset_s=self._offset())
            except EntryFormatError as exc:
                self._failed("decode", exc, outage=False)
                return None
        self._reads.start(claimed)
        return claimed

    async def drop(
        self, ref: EntryRef, entry: ConversationEntry | None = None, *, release: bool = True
    ) -> bool:
        flag = 1 if release else 0
        if entry is None:
            return bool(await self._quiet("drop", self._drop_ref(
                keys=[self.ref_key(ref)], args=[self._entry_prefix(ref), flag]), 0))
        expires_wall = entry.expires_at_s + self._offset()
        return bool(await self._quiet("drop", self._drop_one(
            keys=[self.entry_key(ref, entry)],
            args=[entry_identity(entry), repr(expires_wall), repr(self._tolerance), flag],
        ), 0))

    async def drop_scope(self, scope: bytes) -> int:
        key = self._scope_key(scope)
        await self._quiet("drop", self._client.set(
            self._flush_key(scope), repr(self._wall()), px=math.ceil(FLUSH_MARK_S * 1000)), None)
        return int(await self._quiet("drop", self._drop_set(keys=[key], args=["", "", 1]), 0))

    async def drop_node(self, node_id: str) -> int:
        return int(await self._quiet("drop_node", self._drop_set(
            keys=[self.node_set(node_id)], args=[node_id, "", 0]), 0))

    async def drop_engine(self, node_id: str, engine_id: str) -> int:
        return int(await self._quiet("drop_engine", self._drop_set(
            keys=[self.node_set(node_id)], args=[node_id, engine_group(engine_id), 0]), 0))

    async def mark_released(
        self, node_id: str, engine_id: str, released: Iterable[Released]
    ) -> int:
        items = list(released)
        if not items:
            return 0
        return int(await self._call("release", self._mark_released(
            keys=[self._request_key(node_id, r.request_id) for r in items],
            args=[engine_id, *(r.cause for r in items)],
        )))

    async def release_requested(
        self, node_id: str, engine_id: str, request_ids: Iterable[str]
    ) -> tuple[str, ...]:
        ids = list(request_ids)
        if not ids:
            return ()
        result = await self._call("release", self._release_requested(
            keys=[self._request_key(node_id, i) for i in ids], args=[engine_id]))
        await self._queue_lapsed()
        # this process's own reads as well: Redis's record of one may be lost (a restart
        # without persistence) while its P leg is still open
        return tuple(ids[int(i) - 1] for i in result or ()
                     if (node_id, ids[int(i) - 1]) not in self._reads)

    async def announce(self, ref: EntryRef, ttl_s: float) -> None:
        if self._failing:  # Redis is not answering: no replica could read it; don't wait
            return
        await self._quiet("announce", self._client.set(
            self.pending_key(ref), "1", px=max(1, math.ceil(ttl_s * 1000))), None)

    async def withdraw(self, ref: EntryRef) -> None:
        await self._quiet("announce", self._client.delete(self.pending_key(ref)), None)

    async def announced(self, identity: RequestIdentity) -> bool:
        keys = [self.pending_key(EntryRef(identity.scope, p.anchor, p.continuation.slot()))
                for p in identity.probes if p.continuation is not None]
        if not keys or identity.text is not None:
            return False
        return bool(await self._quiet("announced", self._client.exists(*keys), 0))

    async def read_done(self, node_id: str, request_id: str) -> None:
        self._reads.done(node_id, request_id)
        await self._quiet("release", self._client.delete(
            self._request_key(node_id, request_id) + ":r"), None)

    async def node_urls(self, mine: Mapping[str, str]) -> dict[str, str]:
        key = f"{self._ns}:nodes"
        seen = await self._quiet("nodes", self._client.hgetall(key), None)
        await self._quiet("nodes", self._client.hset(
            key, items=[part for pair in mine.items() for part in pair]), None)
        theirs = {str(k): str(v) for k, v in (seen or {}).items()}
        return {k: v for k, v in theirs.items() if k in mine and mine[k] != v}

    async def set_drained(self, node_id: str, drained: bool) -> None:
        key = f"{self._ns}:drained"
        await self._call("drain", self._client.hset(key, _DRAINS_KEPT, "1"))
        if drained:
            await self._call("drain", self._client.hset(key, node_id, "1"))
        else:
            await self._call("drain", self._client.hdel(key, node_id))

    async def drained_nodes(self) -> frozenset[str] | None:
        fields = await self._quiet("drain", self._client.hkeys(f"{self._ns}:drained"), None)
        if not fields:  # Redis down, or it lost them (a restart): the replicas' own hold
            return None
        return frozenset(str(f) for f in fields) - {_DRAINS_KEPT}

    async def shared_state(self) -> str | None:
        """A random name the first replica on this Redis and namespace stored
        (``{ns}:shared``, kept for good); every replica reads the same, another Redis or
        namespace another. ``None`` while Redis does not answer."""
        if self._shared is None:
            key = f"{self._ns}:shared"
            await self._quiet("shared", self._client.set(key, secrets.token_hex(16), nx=True),
                              None)
            value = await self._quiet("shared", self._client.get(key), None)
            if value:
                self._shared = value.decode() if isinstance(value, bytes) else str(value)
        return self._shared

    async def read_spent(self, node_id: str, request_id: str, grace_s: float) -> None:
        self._reads.spent(node_id, request_id, grace_s)
        await self._quiet("release", self._client.pexpire(
            self._request_key(node_id, request_id) + ":r", max(1, math.ceil(grace_s * 1000))),
            None)

    async def take_releases(
        self, node_id: str, engine_id: str, limit: int = MAX_ORDERS
    ) -> tuple[str, ...]:
        return tuple(order.partition("\t")[0]
                     for order in await self._take(node_id, engine_id, limit))

    async def take_release_blocks(
        self, node_id: str, engine_id: str, limit: int = MAX_ORDERS
    ) -> tuple[RemoteBlocks, ...]:
        """The orders' release params (``RemoteBlocks.for_release``), queued with them; an
        order without them (an entry stored by a replica older than this method) or with
        params this one cannot read is dropped (D keeps that turn its TTL, as before)."""
        out: list[RemoteBlocks] = []
        for order in await self._take(node_id, engine_id, limit):
            doc = order.partition("\t")[2]
            try:
                out.append(parse_remote_blocks(json.loads(doc)))
            except (ValueError, KeyError, TypeError, KVParamsError):
                log.warning("release order for D %s without readable params: dropped", node_id)
        return tuple(out)

    async def _take(self, node_id: str, engine_id: str, limit: int) -> list[str]:
        """Queued and due orders for D's engine: ``request id<TAB>release params`` each
        (the id alone for an entry a replica older than the params stored)."""
        await self._queue_lapsed()
        result = await self._quiet("release", self._take_releases(
            keys=[self.release_queue(node_id), self.due_set(node_id)],
            args=[engine_id, limit, self._now_ms(), engine_group(engine_id)]), None)
        return [str(order) for order in result or ()]

    async def _queue_lapsed(self) -> None:
        """Queue release orders for this process's spent reads whose grace is over
        (``OpenReads.lapse``), in the shared queue of their D: any replica D syncs with
        delivers them. One Redis does not take is lost (D keeps that turn its time)."""
        for node_id, blocks in self._reads.lapse():
            await self._quiet("release", self._queue_order(
                keys=[self.release_queue(node_id)],
                args=[f"{blocks.engine_id}\t{blocks.request_id}",
                      json.dumps(blocks.for_release().to_json(), separators=(",", ":"))]),
                None)

    def retained_tokens(self, now_s: float) -> Mapping[str, int]:
        return dict(self._retained)

    async def refresh(self, node_ids: list[str]) -> None:
        """Recompute the retained tokens of ``node_ids`` (the health loop calls this)."""
        now_ms = self._now_ms()
        keys = [self.node_set(n) for n in node_ids]
        result = await self._quiet("refresh", self._retained_script(
            keys=keys, args=[now_ms, now_ms - math.floor(self._retention * 1000)]), None)
        if result is not None:
            self._retained = {n: int(t) for n, t in zip(node_ids, result, strict=True) if t}
        size = await self._quiet("refresh", self._client.zcard(f"{self._ns}:all"), None)
        if size is not None:
            self._size = int(size)

    # -- internals --------------------------------------------------------------------------

    def _offset(self) -> float:
        """Add to a router-clock time to get the wall-clock time."""
        return self._wall() - self._clock()

    def _now_ms(self) -> int:
        return math.floor(self._wall() * 1000)

    def _decode(self, raw: str, offset: float, released: str = "") -> ConversationEntry | None:
        try:
            entry = entry_from_json(raw, wall_offset_s=offset, released=released or None)
        except EntryFormatError as exc:
            self._failed("decode", exc, outage=False)
            return None
        if self._clock() >= entry.expires_at_s + self._retention:
            return None
        return entry

    async def _call(self, op: str, call: Awaitable[T]) -> T:
        """Await one Redis call within the timeout; ``IndexUnavailable`` if it fails."""
        try:
            result = await asyncio.wait_for(call, self._timeout)
        except (TimeoutError, RedisError, OSError) as exc:
            self._failed(op, exc)
            raise IndexUnavailable(f"redis {op} failed: {exc!r}") from exc
        if self._failing:
            self._failing = False
            log.warning("conversation index: Redis answers again (%s)", op)
        return result

    async def _quiet(self, op: str, call: Awaitable[Any], default: T) -> Any:
        """Like ``_call`` but returns ``default`` on failure."""
        try:
            return await self._call(op, call)
        except IndexUnavailable:
            return default

    def _failed(self, op: str, exc: BaseException, *, outage: bool = True) -> None:
        self._failing = self._failing or outage
        self._failures_unlogged += 1
        if self._on_error is not None:
            self._on_error(op)
        now = time.monotonic()
        if now >= self._next_log:
            log.warning(
                "conversation index: Redis %s failed (%s); turns recompute meanwhile "
                "(%d failure(s) since the last such line)",
                op, type(exc).__name__ if str(exc) == "" else exc, self._failures_unlogged,
            )
            self._failures_unlogged = 0
            self._next_log = now + self._log_interval
