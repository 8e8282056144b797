"""InMemoryStore: the ConversationStore contract (single-use claims, drops, LRU, TTL purge)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

from kvrelay.core.conversation import ConversationEntry, ConversationKey, entry_from_decode
from kvrelay.core.params import parse_remote_blocks
from kvrelay.router.store import ConversationStore, EvictReason, InMemoryStore

DATA = Path(__file__).parents[1] / "data" / "vllm-0.32.0"
BLOCKS = parse_remote_blocks(
    json.loads((DATA / "chat_turn1.json").read_text())["d1"]["kv_transfer_params"]
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def entry(node: str = "d0", engine: str | None = None, now: float = 100.0) -> ConversationEntry:
    blocks = BLOCKS if engine is None else replace(BLOCKS, engine_id=engine)
    return entry_from_decode(decode_node_id=node, blocks=blocks, prompt_token_ids=[1] * 2025,
                             generated_token_ids=[2] * 32, now_s=now)


def key(i: int | str) -> ConversationKey:
    return ConversationKey("t", f"c{i}")


async def test_protocol_and_basic_ops() -> None:
    store = InMemoryStore()
    assert isinstance(store, ConversationStore)
    e = entry()
    assert await store.get(key(1)) is None
    await store.put(key(1), e)
    assert await store.get(key(1)) is e and len(store) == 1
    assert await store.drop(key(1), entry(now=1.0)) is False  # a different entry
    assert await store.drop(key(1)) is True and len(store) == 0


async def test_claim_is_single_use_even_when_racing() -> None:
    store = InMemoryStore()
    e = entry()
    await store.put(key(1), e)
    results = await asyncio.gather(*(store.claim(key(1), e) for _ in range(10)))
    assert results.count(True) == 1
    assert await store.get(key(1)) is None
    await store.put(key(1), e)
    newer = entry(now=200.0)
    await store.put(key(1), newer)
    assert await store.claim(key(1), e) is False  # replaced: the old entry is gone
    assert await store.claim(key(1), newer) is True


async def test_drop_node_and_engine() -> None:
    store = InMemoryStore()
    await store.put(key(1), entry("d0"))
    await store.put(key(2), entry("d0", engine="new"))
    await store.put(key(3), entry("d1"))
    assert await store.drop_engine("d0", BLOCKS.engine_id) == 1
    assert await store.get(key(2)) is not None
    assert await store.drop_node("d0") == 1
    assert len(store) == 1 and await store.get(key(3)) is not None


async def test_lru_cap_evicts_least_recently_used() -> None:
    evicted: list[EvictReason] = []
    store = InMemoryStore(2, on_evict=lambda e, why: evicted.append(why))
    await store.put(key(1), entry())
    await store.put(key(2), entry())
    await store.get(key(1))  # 2 is now least recently used
    await store.put(key(3), entry())
    assert await store.get(key(2)) is None
    assert await store.get(key(1)) is not None and await store.get(key(3)) is not None
    assert evicted == ["capacity"]


async def test_expired_entries_stay_visible_then_are_purged() -> None:
    clock = Clock()
    evicted: list[EvictReason] = []
    store = InMemoryStore(clock=clock, expired_retention_s=60, sweep_interval_s=1,
                          on_evict=lambda e, why: evicted.append(why))
    e = entry(now=clock.now)  # expires at 100 + 470
    await store.put(key(1), e)
    clock.now = e.expires_at_s + 30  # expired, still visible: the policy says "expired"
    assert await store.get(key(1)) is e
    clock.now = e.expires_at_s + 61
    assert await store.get(key(1)) is None
    assert evicted == ["expired"]
