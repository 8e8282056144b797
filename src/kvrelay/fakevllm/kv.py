"""The fake engine's KV cache: paged blocks with prefix caching, held blocks, in-process "NIXL".

The "KV" of a token is the token id itself, so a block's content is the tuple of token ids
whose KV it holds. Content and hash are separate, as in vLLM: a block is *hashed* by the token
ids of the request that computed it, while its *content* is whatever KV was actually written
(computed, or pulled from another engine). A wrong pull therefore pollutes the prefix cache
exactly like it would in vLLM, and shows in every later output that reuses it.

* ``BlockPool``: vLLM's block pool in miniature. Block 0 is the null block; free blocks sit in
  an LRU queue (freed tail-first), cached blocks stay findable by hash until reallocated, and a
  freed block keeps its stale content (reading it later returns garbage, like real memory).
* ``HoldTable``: blocks kept after a request finished, until read once or expired: P's blocks
  under ``kv_lease_duration``, D's under ``decoder_kv_blocks_ttl`` (bidirectional mode), or
  until kvrelay's retention releases them early (``drop``). It remembers the latest expired
  and released request ids, so a read that comes too late fails cleanly, and which holds a
  reader is reading (``begin_read``): those are never dropped, and an expiry that falls due
  during a read waits for it only when the hold is ``protect_reads``.
* ``KVFabric``: the in-process stand-in for NIXL + the side channel, shared by the engines of
  one process (or one cluster): side-channel address -> engine.

NIXL reads block ids, not requests: like vLLM, a holder does not refuse a second read of params
whose blocks were already read and freed. The reader gets whatever those block ids hold *now*
(the same tokens if nobody reused them yet, other tokens once they were reallocated), and both
sides record it (``KVReadResult.freed``, ``FreedRead``).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, Protocol

from kvrelay.fakevllm.latency import Clock

HoldKind = Literal["prefill_lease", "decode_ttl"]
ReadFailure = Literal["unreachable", "engine_mismatch", "block_mismatch", "expired"]


class KVCacheFull(RuntimeError):
    """A request that needs more blocks than the whole cache has: it could never run (vLLM
    refuses such a cache size at start-up; the fake answers 503). A request that merely
    does not fit *now* waits (``scheduler``)."""


class KVReadError(RuntimeError):
    """A KV read that failed; ``reason`` says why (``expired`` is counted apart, as in vLLM).

    * ``unreachable``: nothing answers on the side channel (engine down, or the
      ``side_channel_unreachable`` fault);
    * ``engine_mismatch``: another engine answers there (the holder restarted: new engine id);
    * ``block_mismatch``: the reader needs more blocks than the params list (vLLM asserts);
    * ``expired``: the holder's lease/TTL ran out before the read (or, for D's blocks, the
      reader saw ``remote_blocks_expiry_time`` pass and declined, as vLLM does).
    """

    def __init__(self, reason: ReadFailure, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason: ReadFailure = reason


def block_hashes(tokens: Sequence[int], block_size: int, num_blocks: int) -> list[int]:
    """Chained hashes of the first ``num_blocks`` full blocks of ``tokens``.

    Python's hash of a tuple of ints is not randomized, so hashes are stable within one
    Python version, which is all an in-process cache needs.
    """
    out: list[int] = []
    parent = 0
    for i in range(num_blocks):
        parent = hash((parent, tuple(tokens[i * block_size : (i + 1) * block_size])))
        out.append(parent)
    return out


class BlockPool:
    """Blocks ``1..num_blocks-1`` of one engine, with reference counts and a prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        if num_blocks < 2 or block_size < 1:
            raise ValueError("need num_blocks >= 2 and block_size >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self._ref: dict[int, int] = {}
        self._content: dict[int, tuple[int, ...]] = {}
        self._hash_of: dict[int, int] = {}
        self._by_hash: dict[int, int] = {}
        self.on_free: Callable[[], None] | None = None
        """Called after ``free`` returned blocks to the pool (the scheduler wakes waiters)."""

    @property
    def num_usable(self) -> int:
        """Blocks a request can get (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out now (unreferenced, cached ones included)."""
        return len(self._free)

    @property
    def holders(self) -> Mapping[int, int]:
        """How many requests (running, or held for a read) reference each block: vLLM's
        ``KVCacheBlock.ref_cnt`` (``core.retention.BlockHolders``; read-only)."""
        return MappingProxyType(self._ref)

    def num_to_allocate(self, hit_blocks: Sequence[int], num_new: int) -> int:
        """Free blocks an admission takes: ``num_new`` fresh ones plus every prefix-cache
        hit nobody references (acquiring it takes it off the free queue), as vLLM's
        ``get_num_blocks_to_allocate`` counts evictable computed blocks."""
        return num_new + sum(1 for b in hit_blocks if self._ref.get(b, 0) == 0)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by running requests or holds, computed as vLLM's
        ``BlockPool.get_usage`` does (``1 - free / usable``: the same float, to the last bit,
        ``tests/e2e/test_contract_pressure.py``)."""
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Cached blocks for the longest prefix of ``hashes``; empty without prefix caching."""
        if not self.prefix_caching:
            return []
        out: list[int] = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def acquire(self, blocks: Sequence[int]) -> None:
        """Take a reference on blocks found by ``match_prefix`` (removes them from the LRU)."""
        for b in blocks:
            count = self._ref.get(b, 0)
            if count == 0:
                self._free.pop(b, None)
            self._ref[b] = count + 1

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks (evicting the least recently freed cached ones)."""
        if n > len(self._free):
            raise KVCacheFull(f"need {n} KV blocks, {len(self._free)} free")
        out: list[int] = []
        for _ in range(n):
            b, _unused = self._free.popitem(last=False)
            h = self._hash_of.pop(b, None)
            if h is not None and self._by_hash.get(h) == b:
                del self._by_hash[h]
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block of a request (vLLM frees tail block first).

        Unreferenced blocks without a hash are reused first (prepended to the free queue),
        cached ones last (appended, LRU), as in vLLM's ``BlockPool.free_blocks``.
        """
        reuse_first: list[int] = []
        for b in reversed(blocks):
            count = self._ref.get(b, 0) - 1
            if count > 0:
                self._ref[b] = count
            elif count == 0:
                del self._ref[b]
                if b in self._hash_of:
                    self._free[b] = None
                else:
                    reuse_first.append(b)
        for b in reversed(reuse_first):
            self._free[b] = None
            self._free.move_to_end(b, last=False)
        if self.on_free is not None and blocks:
            self.on_free()

    def write(self, block: int, content: tuple[int, ...]) -> None:
        self._content[block] = content

    def read(self, block: int) -> tuple[int, ...]:
        """The KV a block holds now; ``()`` for a block never written."""
        return self._content.get(block, ())

    def cache(self, block: int, block_hash: int) -> None:
        """Make a full block findable by ``match_prefix`` (first writer wins, as in vLLM)."""
        if self.prefix_caching and block_hash not in self._by_hash:
            self._by_hash[block_hash] = block
            self._hash_of[block] = block_hash


@dataclass(frozen=True)
class Hold:
    """Blocks of a finished request kept for one remote read."""

    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    expires_at: float
    kind: HoldKind
    protect_reads: bool = False
    """kvrelay's managed retention: the hold does not expire while a P reads it."""


class HoldTable:
    """Held blocks by internal request id, released on read, at expiry (checked lazily) or
    when dropped (kvrelay's retention)."""

    def __init__(self, pool: BlockPool, clock: Clock, remember_expired: int = 10000) -> None:
        self._pool = pool
        self._clock = clock
        self._holds: dict[str, Hold] = {}
        self._deadlines: list[tuple[float, str]] = []
        self._expired: OrderedDict[str, None] = OrderedDict()
        self._released: OrderedDict[str, None] = OrderedDict()
        self._reading: dict[str, int] = {}
        self._remember_expired = remember_expired

    def __len__(self) -> int:
        return len(self._holds)

    def add(self, hold: Hold) -> None:
        self._holds[hold.request_id] = hold
        heapq.heappush(self._deadlines, (hold.expires_at, hold.request_id))

    def get(self, request_id: str) -> Hold | None:
        return self._holds.get(request_id)

    def release(self, request_id: str) -> bool:
        """Free a hold's blocks (after its read); False if it was not held any more."""
        hold = self._holds.pop(request_id, None)
        self._reading.pop(request_id, None)
        if hold is None:
            return False
        self._pool.free(hold.block_ids)
        return True

    def drop(self, request_id: str) -> Hold | None:
        """Release a hold before anyone read it (kvrelay's retention); a later read of it is
        declined (``released``). ``None`` (nothing done) if it is not held or being read."""
        if request_id in self._reading:
            return None
        hold = self._holds.pop(request_id, None)
        if hold is None:
            return None
        self._pool.free(hold.block_ids)
        self._remember(self._released, request_id)
        return hold

    def begin_read(self, request_id: str) -> None:
        """A reader starts reading the hold's blocks (no-op if it is not held)."""
        if request_id in self._holds:
            self._reading[request_id] = self._reading.get(request_id, 0) + 1

    def end_read(self, request_id: str) -> None:
        """A read that began ended without ``release`` (the reader failed or went away)."""
        count = self._reading.get(request_id, 0) - 1
        if count > 0:
            self._reading[request_id] = count
        else:
            self._reading.pop(request_id, None)

    def reading(self, request_id: str) -> bool:
        return request_id in self._reading

    def reap(self) -> list[Hold]:
        """Release every hold whose deadline has passed; returns them. A ``protect_reads``
        hold that is being read waits for the read (it is released by it)."""
        now = self._clock()
        expired: list[Hold] = []
        kept: list[tuple[float, str]] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, request_id = heapq.heappop(self._deadlines)
            hold = self._holds.get(request_id)
            if hold is None or hold.expires_at != deadline:
                continue
            if hold.protect_reads and request_id in self._reading:
                kept.append((deadline, request_id))
                continue
            del self._holds[request_id]
            self._reading.pop(request_id, None)
            self._pool.free(hold.block_ids)
            expired.append(hold)
            self._remember(self._expired, request_id)
        for item in kept:
            heapq.heappush(self._deadlines, item)
        return expired

    def next_deadline(self) -> float | None:
        """The earliest expiry among the holds (``None`` without holds)."""
        while self._deadlines:
            deadline, request_id = self._deadlines[0]
            hold = self._holds.get(request_id)
            if hold is not None and hold.expires_at == deadline:
                return deadline
            heapq.heappop(self._deadlines)
        return None

    def _remember(self, ids: OrderedDict[str, None], request_id: str) -> None:
        ids[request_id] = None
        while len(ids) > self._remember_expired:
            ids.popitem(last=False)

    def expired(self, request_id: str) -> bool:
        """Whether ``request_id``'s hold ran out unread (among the latest expiries)."""
        return request_id in self._expired

    def released(self, request_id: str) -> bool:
        """Whether ``request_id``'s hold was dropped unread (among the latest releases)."""
        return request_id in self._released

    def snapshot(self) -> list[Hold]:
        return list(self._holds.values())


@dataclass(frozen=True)
class KVReadResult:
    """What a read returned: the KV (token ids) of each block, and whether the request no
    longer held those blocks (already read once, or never held): then ``contents`` is
    whatever the block ids hold now."""

    contents: tuple[tuple[int, ...], ...]
    freed: bool


@dataclass(frozen=True)
class FreedRead:
    """A read of blocks that were no longer held for ``request_id``, seen by the holder."""

    request_id: str
    block_ids: tuple[int, ...]
    reader_engine_id: str
    contents: tuple[tuple[int, ...], ...]
    at: float


class KVPeer(Protocol):
    """What an engine offers other engines through the fabric."""

    @property
    def engine_id(self) -> str: ...

    def kv_clock(self) -> float:
        """The holder's clock (for ``remote_blocks_expiry_time`` checks)."""
        ...

    def side_channel_reachable(self) -> bool: ...

    def begin_read(self, request_id: str) -> None:
        """A reader starts a transfer of ``request_id``'s blocks: ``KVReadError("expired")``
        if its hold ran out or was released; else a hold kvrelay manages is not released
        until ``read_kv`` or ``end_read``."""
        ...

    def end_read(self, request_id: str) -> None:
        """A transfer ``begin_read`` started ended without ``read_kv`` (the reader failed)."""
        ...

    def read_kv(self, request_id: str, block_ids: Sequence[int], reader: str) -> KVReadResult:
        """Read ``block_ids`` for ``request_id`` and notify "done" (frees a live hold).

        ``KVReadError("expired")`` if the request's hold ran out or was released; a request
        that is not held (read before, or unknown) is *not* refused: see the module
        docstring.
        """
        ...

    def notify_kv_done(self, request_id: str) -> None:
        """The reader's "done" notification without a read (full local hit, below the
        recompute threshold): frees the request's held blocks."""
        ...


class KVFabric:
    """In-process NIXL: engines register their side-channel address; readers connect to it.

    One fabric per set of engines that can reach each other (``FakeCluster`` makes one;
    pass the same fabric to several clusters to connect them). Addresses are compared
    exactly, so a reader given another host name for the same engine cannot reach it.
    """

    def __init__(self) -> None:
        self._peers: dict[tuple[str, int], KVPeer] = {}

    def register(self, host: str, port: int, peer: KVPeer) -> None:
        current = self._peers.get((host, port))
        if current is not None and current is not peer:
            raise ValueError(f"side channel {host}:{port} is already taken")
        self._peers[(host, port)] = peer

    def unregister(self, host: str, port: int, peer: KVPeer) -> None:
        if self._peers.get((host, port)) is peer:
            del self._peers[(host, port)]

    def is_taken(self, host: str, port: int) -> bool:
        return (host, port) in self._peers

    def connect(self, host: str, port: int, engine_id: str) -> KVPeer:
        """The engine behind a side channel, checked like NIXL's handshake checks it."""
        peer = self._peers.get((host, port))
        if peer is None or not peer.side_channel_reachable():
            raise KVReadError("unreachable", f"side channel {host}:{port} does not answer")
        if peer.engine_id != engine_id:
            raise KVReadError(
                "engine_mismatch",
                f"{host}:{port} is engine {peer.engine_id}, expected {engine_id}",
            )
        return peer
