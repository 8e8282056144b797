"""The ``ConversationStore`` contract, run against ``InMemoryStore`` and ``RedisStore`` (a real
redis-server), plus what only the Redis store has: key layout, Redis-side TTLs, claims raced
from two replicas' stores, and falling back (then recovering) when Redis is down or slow."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from kvrelay.router.store import ConversationStore, InMemoryStore, StoreUnavailable
from kvrelay.router.store_redis import RedisStore

from kvrelay.core.conversation import ConversationEntry, ConversationKey, entry_from_decode
from kvrelay.core.params import parse_remote_blocks
from tests.component.redis_server import RedisServer

DATA = Path(__file__).parents[1] / "data" / "vllm-0.32.0"
BLOCKS = parse_remote_blocks(
    json.loads((DATA / "chat_turn1.json").read_text())["d1"]["kv_transfer_params"]
)
EPOCH = 1.7e9


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def entry(node: str = "d0", engine: str | None = None, now: float = 100.0,
          request: str | None = None) -> ConversationEntry:
    blocks = BLOCKS if engine is None else replace(BLOCKS, engine_id=engine)
    if request is not None:
        blocks = replace(blocks, request_id=request)
    return entry_from_decode(decode_node_id=node, blocks=blocks, prompt_token_ids=[1] * 2025,
                             generated_token_ids=[2] * 32, now_s=now)


def key(i: int | str, tenant: str = "t") -> ConversationKey:
    return ConversationKey(tenant, f"c{i}")


def redis_store(server: RedisServer, clock: Callable[[], float], **kw: object) -> RedisStore:
    """A store whose wall clock moves with ``clock`` (so tests can jump past expiry)."""
    defaults: dict[str, object] = {"timeout_s": 5.0, "wall_clock": lambda: EPOCH + clock()}
    return RedisStore.from_url(server.url, clock=clock, **{**defaults, **kw})  # type: ignore[arg-type]


@pytest.fixture(params=["memory", "redis"])
async def made(request: pytest.FixtureRequest) -> AsyncIterator[tuple[ConversationStore, Clock]]:
    clock = Clock()
    if request.param == "memory":
        yield InMemoryStore(clock=clock, expired_retention_s=300.0), clock
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    store = redis_store(server, clock, expired_retention_s=300.0)
    try:
        yield store, clock
    finally:
        await store.aclose()


# -- the contract, both stores ---------------------------------------------------------------


async def test_get_put_replace_drop(made: tuple[ConversationStore, Clock]) -> None:
    store, _ = made
    assert isinstance(store, ConversationStore)
    e = entry()
    assert await store.get(key(1)) is None
    await store.put(key(1), e)
    assert await store.get(key(1)) == e and len(store) == 1
    newer = entry(now=101.0, request="r2")
    await store.put(key(1), newer)  # the newest turn wins
    assert await store.get(key(1)) == newer
    assert await store.drop(key(1), e) is False  # not the stored one any more
    assert await store.drop(key(1), newer) is True
    assert await store.get(key(1)) is None
    await store.put(key(1), e)
    assert await store.drop(key(1)) is True and await store.drop(key(1)) is False
    assert await store.get(key(1)) is None


async def test_tenants_never_collide(made: tuple[ConversationStore, Clock]) -> None:
    store, _ = made
    a, b = entry(request="a"), entry(request="b")
    await store.put(key(1, "alpha"), a)
    await store.put(key(1, "beta"), b)
    assert await store.get(key(1, "alpha")) == a
    assert await store.get(key(1, "beta")) == b


async def test_claim_is_single_use(made: tuple[ConversationStore, Clock]) -> None:
    store, _ = made
    e = entry()
    await store.put(key(1), e)
    results = await asyncio.gather(*(store.claim(key(1), e) for _ in range(10)))
    assert results.count(True) == 1
    assert await store.get(key(1)) is None
    await store.put(key(1), e)
    newer = entry(now=200.0)  # same blocks, other times: another entry
    await store.put(key(1), newer)
    assert await store.claim(key(1), e) is False
    got = await store.get(key(1))
    assert got is not None and await store.claim(key(1), got) is True
    assert await store.claim(key(2), e) is False


async def test_drop_node_and_engine(made: tuple[ConversationStore, Clock]) -> None:
    store, _ = made
    await store.put(key(1), entry("d0", "A", request="1"))
    await store.put(key(2), entry("d0", "B", request="2"))
    await store.put(key(3), entry("d1", "A", request="3"))
    await store.put(key(4), entry("d0", "A", request="4"))
    await store.put(key(4), entry("d1", "A", request="4b"))  # moved to d1
    assert len(store) == 4
    assert await store.drop_engine("d0", "A") == 1
    assert await store.get(key(1)) is None and await store.get(key(2)) is not None
    assert await store.drop_node("d0") == 1
    assert await store.get(key(2)) is None
    assert await store.get(key(3)) is not None and await store.get(key(4)) is not None
    assert await store.drop_node("d0") == 0 and await store.drop_node("nobody") == 0
    assert await store.drop_node("d1") == 2 and len(store) == 0


async def test_expired_entries_stay_visible_for_the_retention(
    made: tuple[ConversationStore, Clock]
) -> None:
    store, clock = made
    e = entry()  # expires at 570 on the router clock
    await store.put(key(1), e)
    clock.now = 600.0
    got = await store.get(key(1))
    assert got == e and got is not None and got.is_expired(clock.now)
    clock.now = e.expires_at_s + 300.0 + 1.0
    assert await store.get(key(1)) is None


# -- Redis only ------------------------------------------------------------------------------


async def test_keys_are_namespaced_hashed_and_per_tenant(redis_server: RedisServer) -> None:
    clock = Clock()
    blue = redis_store(redis_server, clock, deployment="blue")
    green = redis_store(redis_server, clock, deployment="green")
    raw = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        secret = ConversationKey("acme corp", "user-secret-conversation")
        await blue.put(secret, entry())
        assert await green.get(secret) is None  # another deployment sees nothing
        keys = sorted(await raw.keys("*"))
        assert keys == [blue.key_for(secret), blue.node_index("d0")]
        assert keys[0].startswith("kvrelay:blue:acme%20corp:conv:")
        assert all("secret" not in k for k in keys)
        stored = await raw.hget(keys[0], "json")
        assert stored is not None and "secret" not in stored
    finally:
        await raw.aclose()
        await blue.aclose()
        await green.aclose()


async def test_redis_purges_after_expiry_plus_retention(redis_server: RedisServer) -> None:
    clock = Clock()
    store = redis_store(redis_server, clock, expired_retention_s=2.0)
    raw = aioredis.Redis.from_url(redis_server.url)
    try:
        e = entry()
        await store.put(key(1), e)
        pttl = await raw.pttl(store.key_for(key(1)))
        # remaining TTL on the router clock (470 s) + retention (2 s), in ms
        assert 470_000 < pttl <= 472_000
        clock.now = e.expires_at_s + 1.0  # 1 s of retention left: Redis keeps it 1 s more
        await store.put(key(2), e)
        for _ in range(3000):
            if not await raw.exists(store.key_for(key(2))):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("Redis never purged the entry")
        assert await store.get(key(2)) is None
    finally:
        await raw.aclose()
        await store.aclose()


async def test_concurrent_claims_from_two_replicas(redis_server: RedisServer) -> None:
    clock = Clock()
    one, two = redis_store(redis_server, clock), redis_store(redis_server, clock)
    try:
        for i in range(200):
            e = entry(request=f"r{i}")
            await one.put(key("race"), e)
            seen_one, seen_two = await one.get(key("race")), await two.get(key("race"))
            assert seen_one == seen_two == e
            assert seen_one is not None and seen_two is not None
            won = await asyncio.gather(
                one.claim(key("race"), seen_one), two.claim(key("race"), seen_two),
                one.claim(key("race"), seen_one), two.claim(key("race"), seen_two),
            )
            assert won.count(True) == 1, (i, won)
            assert await two.get(key("race")) is None
    finally:
        await one.aclose()
        await two.aclose()


async def test_redis_down_falls_back_then_recovers(redis_server: RedisServer) -> None:
    clock = Clock()
    errors: list[str] = []
    store = redis_store(redis_server, clock, timeout_s=0.5, on_error=errors.append)
    try:
        e = entry()
        await store.put(key(1), e)
        assert await store.get(key(1)) == e
        redis_server.stop()
        with pytest.raises(StoreUnavailable):
            await store.get(key(1))
        await store.put(key(2), e)  # lost, no exception
        assert await store.claim(key(1), e) is False
        assert await store.drop(key(1)) is False and await store.drop(key(1), e) is False
        assert await store.drop_node("d0") == 0 and await store.drop_engine("d0", "x") == 0
        assert {"get", "put", "claim", "drop", "drop_node", "drop_engine"} <= set(errors)
        redis_server.start()  # same port, empty (no persistence)
        for _ in range(500):
            try:
                assert await store.get(key(1)) is None
                break
            except StoreUnavailable:
                await asyncio.sleep(0.01)
        else:
            raise AssertionError("the store never recovered")
        await store.put(key(1), e)
        got = await store.get(key(1))
        assert got == e and got is not None and await store.claim(key(1), got) is True
    finally:
        await store.aclose()


async def test_slow_redis_times_out_then_recovers(redis_server: RedisServer) -> None:
    clock = Clock()
    errors: list[str] = []
    store = redis_store(redis_server, clock, timeout_s=0.05, on_error=errors.append)
    writer = redis_store(redis_server, clock)  # a patient one, for the setup
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        e = entry()
        await writer.put(key(1), e)
        await admin.execute_command("CLIENT", "PAUSE", "3000", "ALL")  # Redis stalls 3 s
        with pytest.raises(StoreUnavailable):
            await store.get(key(1))
        assert "get" in errors
        await admin.execute_command("CLIENT", "UNPAUSE")
        for _ in range(500):
            try:
                assert await store.get(key(1)) == e
                break
            except StoreUnavailable:
                await asyncio.sleep(0.01)
        else:
            raise AssertionError("the store never recovered")
    finally:
        await admin.aclose()
        await writer.aclose()
        await store.aclose()
