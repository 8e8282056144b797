"""The ``ConversationIndex`` contract, run against ``InMemoryIndex`` and ``RedisIndex`` (a real
redis-server), plus what only the Redis index has: key layout, Redis-side TTLs, claims raced
from two replicas' indexes, one-round-trip lookups, and falling back (then recovering) when
Redis is down or slow."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as aioredis
from msgspec.structs import replace

from kvrelay.core.conversation import ConversationEntry
from kvrelay.core.identity import chat_identity, scope_of
from kvrelay.core.retention_sync import Released
from kvrelay.router.index import (
    MAX_TEXT_BLOCKS,
    MAX_TEXT_DIGESTS,
    ConversationIndex,
    IndexUnavailable,
    InMemoryIndex,
)
from kvrelay.router.index_redis import RedisIndex
from tests.component.redis_server import RedisServer
from tests.unit.index_entries import (
    assistant,
    chat,
    stored_at,
    text,
    text_stored_at,
    user,
)
from tests.unit.index_entries import (
    entry as make_entry,
)

EPOCH = 1.7e9
SYSTEM = user("You are a careful agent. " * 20)
FIRST = user("Fix the failing test in repo X.")
TURN1 = chat(SYSTEM, FIRST)


def follow(answer: str, scope: bytes | None = None) -> object:
    messages = (SYSTEM, FIRST, assistant(answer), user("go on"))
    return chat(*messages) if scope is None else chat(*messages, scope=scope)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def entry(node: str = "d0", engine: str | None = None, now: float = 100.0,
          request: str | None = None) -> ConversationEntry:
    e = make_entry(node, engine, now)
    if request is not None:
        e = replace(e, blocks=replace(e.blocks, request_id=request))
    return e


def redis_index(server: RedisServer, clock: Callable[[], float], **kw: object) -> RedisIndex:
    """An index whose wall clock moves with ``clock`` (so tests can jump past expiry)."""
    defaults: dict[str, object] = {"timeout_s": 5.0, "wall_clock": lambda: EPOCH + clock()}
    return RedisIndex.from_url(server.url, clock=clock, **{**defaults, **kw})  # type: ignore[arg-type]


@pytest.fixture(params=["memory", "redis"])
async def made(request: pytest.FixtureRequest) -> AsyncIterator[tuple[ConversationIndex, Clock]]:
    clock = Clock()
    if request.param == "memory":
        yield InMemoryIndex(clock=clock, expired_retention_s=300.0, max_per_tenant=3), clock
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    index = redis_index(server, clock, expired_retention_s=300.0, max_per_tenant=3)
    try:
        yield index, clock
    finally:
        await index.aclose()


# -- the contract, both indexes --------------------------------------------------------------


async def test_lookup_put_replace_drop(made: tuple[ConversationIndex, Clock]) -> None:
    index, _ = made
    assert isinstance(index, ConversationIndex)
    ref, e = stored_at(TURN1, "a"), entry()
    assert await index.lookup(follow("a")) is None  # type: ignore[arg-type]
    await index.put(ref, e, tenant="t")
    found = await index.lookup(follow("a"))  # type: ignore[arg-type]
    assert found is not None and found.entry == e and found.ref == ref
    newer = entry(now=101.0, request="r2")
    await index.put(ref, newer, tenant="t")  # an interchangeable one: both kept, newest first
    found = await index.lookup(follow("a"))  # type: ignore[arg-type]
    assert found is not None and found.entry == newer and len(index) == 2
    assert await index.drop(ref, newer) is True
    assert await index.drop(ref, newer) is False  # not stored any more
    found = await index.lookup(follow("a"))  # type: ignore[arg-type]
    assert found is not None and found.entry == e
    assert await index.drop(ref, e) is True
    assert await index.lookup(follow("a")) is None  # type: ignore[arg-type]
    await index.put(ref, e, tenant="t")
    assert await index.drop(ref) is True and await index.drop(ref) is False


async def test_a_shared_prefix_finds_only_the_conversation_it_continues(
    made: tuple[ConversationIndex, Clock]
) -> None:
    index, _ = made
    entries = {f"answer {i}": entry(request=f"r{i}") for i in range(3)}
    for answer, e in entries.items():
        await index.put(stored_at(TURN1, answer), e, tenant="t")
    for answer, e in entries.items():
        found = await index.lookup(follow(answer))  # type: ignore[arg-type]
        assert found is not None and found.entry == e
    assert await index.lookup(chat(SYSTEM, user("other task"))) is None
    assert await index.lookup(chat(SYSTEM, FIRST)) is None


async def test_scopes_and_tenants_never_collide(made: tuple[ConversationIndex, Clock]) -> None:
    index, _ = made
    alpha, beta = scope_of("alpha", "c1"), scope_of("beta", "c1")
    a, b = entry(request="a"), entry(request="b")
    await index.put(stored_at(chat(SYSTEM, FIRST, scope=alpha), "x"), a, tenant="alpha")
    await index.put(stored_at(chat(SYSTEM, FIRST, scope=beta), "x"), b, tenant="beta")
    found_a = await index.lookup(follow("x", alpha))  # type: ignore[arg-type]
    found_b = await index.lookup(follow("x", beta))  # type: ignore[arg-type]
    assert found_a is not None and found_a.entry == a
    assert found_b is not None and found_b.entry == b
    assert await index.drop_scope(alpha) == 1
    assert await index.lookup(follow("x", alpha)) is None  # type: ignore[arg-type]
    assert await index.lookup(follow("x", beta)) is not None  # type: ignore[arg-type]


async def test_completions_by_text(made: tuple[ConversationIndex, Clock]) -> None:
    index, _ = made
    prompt = "Once upon a time " * 200
    e = entry()
    await index.put(text_stored_at(text(prompt), " a river."), e, tenant="t")
    found = await index.lookup(text(prompt + " a river." + " More?"))
    assert found is not None and found.entry == e
    assert await index.lookup(text(prompt + " a mountain." + " More?")) is None


async def test_claim_is_single_use(made: tuple[ConversationIndex, Clock]) -> None:
    index, _ = made
    ref, e = stored_at(TURN1, "a"), entry()
    await index.put(ref, e, tenant="t")
    results = await asyncio.gather(*(index.claim(ref, e) for _ in range(10)))
    assert results.count(e) == 1 and results.count(None) == 9
    assert await index.lookup(follow("a")) is None  # type: ignore[arg-type]
    await index.put(ref, e, tenant="t")
    newer = entry(now=200.0)  # the same D request stored again (later): it replaces e
    await index.put(ref, newer, tenant="t")
    found = await index.lookup(follow("a"))  # type: ignore[arg-type]
    assert found is not None and found.entry.expires_at_s == pytest.approx(newer.expires_at_s)
    got = await index.claim(ref, e)  # e is gone: what the ref holds instead
    assert got is not None and got.expires_at_s == pytest.approx(newer.expires_at_s)
    assert await index.claim(ref, e) is None
    assert await index.lookup(follow("a")) is None  # type: ignore[arg-type]
    await index.put(ref, e, tenant="t")
    assert await index.claim(stored_at(TURN1, "b"), e) is None


async def test_identical_entries_are_each_claimed_once(
    made: tuple[ConversationIndex, Clock],
) -> None:
    """N interchangeable entries at one ref (identical conversations): N concurrent claims
    of the one entry every lookup returns each take a different one; a released entry is
    never taken."""
    index, _ = made
    ref = stored_at(TURN1, "same")
    stored = [entry(request=f"r{i}") for i in range(8)]
    for i, e in enumerate(stored):  # (a tenant each: the fixture caps tenants at 3)
        await index.put(ref, e, tenant=f"t{i}")
    seen = await index.lookup(follow("same"))  # type: ignore[arg-type]
    assert seen is not None and seen.entry == stored[-1]
    await index.mark_released("d0", stored[0].decode_engine_id,
                              [Released("r0", "pressure")])
    claimed = await asyncio.gather(*(index.claim(ref, seen.entry) for _ in range(9)))
    taken = sorted(c.request_id for c in claimed if c is not None)
    assert taken == sorted(f"r{i}" for i in range(1, 8)) and claimed.count(None) == 2
    last = await index.lookup(follow("same"))  # type: ignore[arg-type]
    assert last is not None and last.entry.released == "pressure"
    assert last.entry.request_id == "r0"


async def test_drop_node_and_engine(made: tuple[ConversationIndex, Clock]) -> None:
    index, _ = made
    refs = [stored_at(TURN1, str(i)) for i in range(4)]
    await index.put(refs[0], entry("d0", "A", request="1"), tenant="t")
    await index.put(refs[1], entry("d0", "B", request="2"), tenant="u")
    await index.put(refs[2], entry("d1", "A", request="3"), tenant="v")
    await index.put(refs[3], entry("d0", "A", request="4"), tenant="w")
    await index.put(refs[3], entry("d1", "A", request="4b"), tenant="w")  # kept beside it
    assert await index.drop_engine("d0", "A") == 2
    found = await index.lookup(follow("3"))  # type: ignore[arg-type]
    assert found is not None and found.entry.request_id == "4b"
    assert await index.lookup(follow("0")) is None  # type: ignore[arg-type]
    assert await index.lookup(follow("1")) is not None  # type: ignore[arg-type]
    assert await index.drop_node("d0") == 1
    assert await index.lookup(follow("1")) is None  # type: ignore[arg-type]
    assert await index.drop_node("d0") == 0 and await index.drop_node("nobody") == 0
    assert await index.drop_node("d1") == 2


async def test_drop_engine_drops_every_rank_of_its_group(
    made: tuple[ConversationIndex, Clock],
) -> None:
    """A data-parallel D restarted: the first stale entry met drops the old group's entries
    on every rank (probe 16: only that rank's went, 4 of 8 with two ranks), not the new
    group's or another D's."""
    index, _ = made
    engines = [("d0", "G_dp0"), ("d0", "G_dp1"), ("d0", "G_dp2"), ("d0", "H_dp0"),
               ("d1", "G_dp1")]
    for i, (node, engine) in enumerate(engines):
        await index.put(stored_at(TURN1, str(i)), entry(node, engine, request=str(i)),
                        tenant=f"t{i}")
    assert await index.drop_engine("d0", "G_dp1") == 3
    left = [await index.lookup(follow(str(i))) for i in range(5)]  # type: ignore[arg-type]
    assert [found is not None for found in left] == [False, False, False, True, True]


async def test_the_tenant_cap_evicts_its_least_recently_used(
    made: tuple[ConversationIndex, Clock]
) -> None:
    index, _ = made
    for i in range(3):
        await index.put(stored_at(TURN1, f"a{i}"), entry(request=f"a{i}"), tenant="a")
    await index.lookup(follow("a0"))  # type: ignore[arg-type]  # a1 is now least recent
    await index.put(stored_at(TURN1, "b0"), entry(request="b0"), tenant="b")
    await index.put(stored_at(TURN1, "a3"), entry(request="a3"), tenant="a")
    assert await index.lookup(follow("a1")) is None  # type: ignore[arg-type]
    for kept in ("a0", "a2", "a3", "b0"):
        assert await index.lookup(follow(kept)) is not None, kept  # type: ignore[arg-type]


async def test_expired_entries_stay_visible_for_the_retention(
    made: tuple[ConversationIndex, Clock]
) -> None:
    index, clock = made
    e = entry()  # expires at 570 on the router clock
    await index.put(stored_at(TURN1, "a"), e, tenant="t")
    clock.now = 600.0
    found = await index.lookup(follow("a"))  # type: ignore[arg-type]
    assert found is not None and found.entry.is_expired(clock.now)
    clock.now = e.expires_at_s + 300.0 + 1.0
    assert await index.lookup(follow("a")) is None  # type: ignore[arg-type]


async def test_retained_tokens_per_node(made: tuple[ConversationIndex, Clock]) -> None:
    index, clock = made
    await index.put(stored_at(TURN1, "a"), entry("d0", request="a"), tenant="t")
    await index.put(stored_at(TURN1, "b"), entry("d1", request="b"), tenant="t")
    await index.refresh(["d0", "d1"])
    assert index.retained_tokens(clock()) == {"d0": 2056, "d1": 2056}
    await index.claim(stored_at(TURN1, "a"), entry("d0", request="a"))
    await index.refresh(["d0", "d1"])
    assert index.retained_tokens(clock()) == {"d1": 2056}
    clock.now = 600.0  # expired: D has freed it
    await index.refresh(["d0", "d1"])
    assert index.retained_tokens(clock()) == {}


# -- Redis only ------------------------------------------------------------------------------


async def test_keys_are_namespaced_and_hold_no_content(redis_server: RedisServer) -> None:
    clock = Clock()
    blue = redis_index(redis_server, clock, deployment="blue")
    green = redis_index(redis_server, clock, deployment="green")
    raw = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        secret = scope_of("acme corp", "user-secret-conversation")
        turn = chat(SYSTEM, FIRST, scope=secret)
        await blue.put(stored_at(turn, "a"), entry(), tenant="acme corp")
        assert await green.lookup(follow("a", secret)) is None  # type: ignore[arg-type]
        assert await blue.lookup(follow("a", secret)) is not None  # type: ignore[arg-type]
        keys = sorted(await raw.keys("*"))
        assert keys and all(k.startswith("kvrelay:blue:") for k in keys)
        assert all("secret" not in k and "careful" not in k for k in keys)
        assert "kvrelay:blue:t:acme%20corp" in keys
        for key in keys:
            if await raw.type(key) == "hash":
                stored = await raw.hget(key, "json")
                assert stored is not None and "secret" not in stored
                assert "careful agent" not in stored
    finally:
        await raw.aclose()
        await blue.aclose()
        await green.aclose()


async def test_a_flush_through_one_replica_drops_what_the_other_commits_after_it(
    redis_server: RedisServer,
) -> None:
    """``drop_scope`` marks the scope flushed in Redis: another replica's ``put`` of an entry
    whose turn began before the flush drops it (False, D ordered to release it); one whose
    turn began after the flush, or another scope's, is kept (True)."""
    clock = Clock()
    one, other = redis_index(redis_server, clock), redis_index(redis_server, clock)
    try:
        scope = scope_of("t", "forget-me")
        turn = chat(SYSTEM, FIRST, scope=scope)
        opened_s = clock.now
        clock.now += 1.0
        assert await one.drop_scope(scope) == 0
        clock.now += 1.0
        ref, e = stored_at(turn, "a"), entry(request="under-way")
        assert await other.put(ref, e, tenant="t", opened_at_s=opened_s) is False
        assert await other.lookup(follow("a", scope)) is None  # type: ignore[arg-type]
        assert [b.request_id for b in await other.take_release_blocks("d0", e.decode_engine_id)] \
            == ["under-way"]
        later = entry(request="after")
        assert await other.put(ref, later, tenant="t", opened_at_s=clock.now) is True
        assert await other.put(stored_at(TURN1, "b"), entry(request="elsewhere"), tenant="t",
                               opened_at_s=opened_s) is True
        found = await one.lookup(follow("a", scope))  # type: ignore[arg-type]
        assert found is not None and found.entry == later
    finally:
        await one.aclose()
        await other.aclose()


async def test_a_chat_lookup_is_one_round_trip(redis_server: RedisServer) -> None:
    clock = Clock()
    index = redis_index(redis_server, clock)
    try:
        await index.put(stored_at(TURN1, "a"), entry(), tenant="t")
        await index.lookup(follow("z"))  # type: ignore[arg-type]  # loads the script once
        client = index._client
        sent: list[object] = []
        real = client.execute_command

        async def counted(*args: object, **kw: object) -> object:
            sent.append(args[0])
            return await real(*args, **kw)

        client.execute_command = counted  # type: ignore[method-assign]
        long_history = chat(SYSTEM, FIRST, *(m for i in range(10) for m in (
            assistant(f"x{i}"), user(f"y{i}"))))
        assert await index.lookup(long_history) is None  # 10 probes, none found
        assert await index.lookup(follow("a")) is not None  # type: ignore[arg-type]
        assert len(sent) == 2, sent
    finally:
        await index.aclose()


async def test_redis_purges_after_expiry_plus_retention(redis_server: RedisServer) -> None:
    clock = Clock()
    index = redis_index(redis_server, clock, expired_retention_s=2.0)
    raw = aioredis.Redis.from_url(redis_server.url)
    try:
        e = entry()
        ref = stored_at(TURN1, "a")
        await index.put(ref, e, tenant="t")
        pttl = await raw.pttl(index.entry_key(ref, e))
        # remaining TTL on the router clock (470 s) + retention (2 s), in ms
        assert 470_000 < pttl <= 472_000
        clock.now = e.expires_at_s + 1.0  # 1 s of retention left: Redis keeps it 1 s more
        other = stored_at(TURN1, "b")
        await index.put(other, e, tenant="t")
        for _ in range(3000):
            if not await raw.exists(index.entry_key(other, e)):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("Redis never purged the entry")
        assert await index.lookup(follow("b")) is None  # type: ignore[arg-type]
    finally:
        await raw.aclose()
        await index.aclose()


async def test_concurrent_claims_from_two_replicas(redis_server: RedisServer) -> None:
    clock = Clock()
    one, two = redis_index(redis_server, clock), redis_index(redis_server, clock)
    ref = stored_at(TURN1, "race")
    try:
        for i in range(200):
            e = entry(request=f"r{i}")
            await one.put(ref, e, tenant="t")
            seen_one = await one.lookup(follow("race"))  # type: ignore[arg-type]
            seen_two = await two.lookup(follow("race"))  # type: ignore[arg-type]
            assert seen_one is not None and seen_two is not None
            assert seen_one.entry == seen_two.entry == e
            won = await asyncio.gather(
                one.claim(ref, seen_one.entry), two.claim(ref, seen_two.entry),
                one.claim(ref, seen_one.entry), two.claim(ref, seen_two.entry),
            )
            assert won.count(e) == 1 and won.count(None) == 3, (i, won)
            assert await two.lookup(follow("race")) is None  # type: ignore[arg-type]
    finally:
        await one.aclose()
        await two.aclose()


async def test_redis_down_falls_back_then_recovers(redis_server: RedisServer) -> None:
    clock = Clock()
    errors: list[str] = []
    index = redis_index(redis_server, clock, timeout_s=0.5, on_error=errors.append)
    ref = stored_at(TURN1, "a")
    try:
        e = entry()
        await index.put(ref, e, tenant="t")
        assert await index.lookup(follow("a")) is not None  # type: ignore[arg-type]
        redis_server.stop()
        with pytest.raises(IndexUnavailable):
            await index.lookup(follow("a"))  # type: ignore[arg-type]
        await index.put(stored_at(TURN1, "b"), e, tenant="t")  # lost, no exception
        assert await index.claim(ref, e) is None
        assert await index.drop(ref) is False and await index.drop(ref, e) is False
        assert await index.drop_node("d0") == 0 and await index.drop_engine("d0", "x") == 0
        assert {"get", "put", "claim", "drop", "drop_node", "drop_engine"} <= set(errors)
        redis_server.start()  # same port, empty (no persistence)
        for _ in range(500):
            try:
                assert await index.lookup(follow("a")) is None  # type: ignore[arg-type]
                break
            except IndexUnavailable:
                await asyncio.sleep(0.01)
        else:
            raise AssertionError("the index never recovered")
        await index.put(ref, e, tenant="t")
        found = await index.lookup(follow("a"))  # type: ignore[arg-type]
        assert found is not None and await index.claim(ref, found.entry) == found.entry
    finally:
        await index.aclose()


async def test_slow_redis_times_out_then_recovers(redis_server: RedisServer) -> None:
    clock = Clock()
    errors: list[str] = []
    index = redis_index(redis_server, clock, timeout_s=0.05, on_error=errors.append)
    writer = redis_index(redis_server, clock)  # a patient one, for the setup
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        e = entry()
        await writer.put(stored_at(TURN1, "a"), e, tenant="t")
        await admin.execute_command("CLIENT", "PAUSE", "3000", "ALL")  # Redis stalls 3 s
        with pytest.raises(IndexUnavailable):
            await index.lookup(follow("a"))  # type: ignore[arg-type]
        assert "get" in errors
        await admin.execute_command("CLIENT", "UNPAUSE")
        for _ in range(500):
            try:
                found = await index.lookup(follow("a"))  # type: ignore[arg-type]
                assert found is not None and found.entry == e
                break
            except IndexUnavailable:
                await asyncio.sleep(0.01)
        else:
            raise AssertionError("the index never recovered")
    finally:
        await admin.aclose()
        await writer.aclose()
        await index.aclose()


async def test_an_explicit_id_continues_its_latest_entry_when_the_history_was_edited(
    made: tuple[ConversationIndex, Clock]
) -> None:
    index, _ = made
    scope = scope_of("t", "conv-1")
    turn1 = chat(SYSTEM, FIRST, scope=scope)
    older = replace(entry(request="older"), context=turn1.context)
    await index.put(stored_at(turn1, "a1"), older, tenant="t")
    turn2 = chat(SYSTEM, FIRST, assistant("a1"), user("u2"), scope=scope)
    newer = replace(entry(request="newer"), context=turn2.context)
    await index.put(stored_at(turn2, "a2"), newer, tenant="t")
    edited = chat(SYSTEM, user("edited task"), assistant("a1"), user("u2"),
                  assistant("a2"), user("u3"), scope=scope, explicit=True)
    found = await index.lookup(edited)
    assert found is not None and found.entry == newer and found.probe is None
    # another model or LoRA adapter (its context): the latest entry's KV is not its KV
    adapter = chat_identity(scope, b'{"model":"m-lora"}', [
        SYSTEM, FIRST, assistant("a1"), user("u2"), assistant("a2"), user("u3")],
        explicit=True)
    assert adapter.context != edited.context
    assert await index.lookup(adapter) is None
    matched = await index.lookup(chat(SYSTEM, FIRST, assistant("a1"), user("u2"),
                                      assistant("a2"), user("u3"), scope=scope,
                                      explicit=True))
    assert matched is not None and matched.probe is not None
    unscoped = chat(SYSTEM, user("edited task"), assistant("a2"), user("u3"))
    assert await index.lookup(unscoped) is None  # never without an id: that would steal
    # an entry of unknown context (stored before entries had one) is never continued so
    await index.put(stored_at(turn2, "a2-old"), entry(request="unknown"), tenant="t")
    assert await index.lookup(edited) is None


async def test_release_orders_follow_every_drop_but_claims_and_lost_blocks(
    made: tuple[ConversationIndex, Clock],
) -> None:
    """Dropped entries D may still hold are queued for release on their D; claimed ones (P
    reads them), released ones and those of a D that went down or restarted are not;
    orders for another engine of that D are discarded when taken."""
    index, _ = made
    scope = scope_of("t", "conv")
    refs = [stored_at(chat(SYSTEM, FIRST, scope=scope), str(i)) for i in range(6)]
    stored = [entry("d0", "A", request=f"r{i}") for i in range(6)]
    for i, (ref, e) in enumerate(zip(refs, stored, strict=True)):
        await index.put(ref, e, tenant=f"t{i}")
    assert await index.claim(refs[0], stored[0]) == stored[0]
    assert await index.drop(refs[1], stored[1]) is True
    assert await index.drop(refs[2], stored[2], release=False) is True
    await index.mark_released("d0", "A", [Released("r3", "pressure")])
    assert await index.drop(refs[3]) is True
    assert await index.mark_released("d0", "B", [Released("r4", "pressure")]) == 0
    assert await index.take_releases("d0", "A") == ("r1",)
    assert await index.drop_scope(scope) == 2  # r4, r5: an admin's flush
    # A stock D never syncs: its orders come with the params a P request needs.
    assert await index.take_release_blocks("d0", "A") == (stored[4].blocks.for_release(),
                                                          stored[5].blocks.for_release())
    assert await index.take_releases("d1", "A") == ()
    assert await index.take_releases("d0", "B") == ()  # D restarted: the orders are moot
    assert await index.take_releases("d0", "A") == ()
    await index.put(refs[0], stored[0], tenant="t")
    assert await index.drop_engine("d0", "A") == 1 and await index.drop_node("d0") == 0
    assert await index.take_releases("d0", "A") == ()


async def test_queued_orders_read_the_same_by_replicas_of_every_format(
    redis_server: RedisServer,
) -> None:
    """Rolling upgrades: a queued order stays ``engine<TAB>request id``, what every replica
    reads as D's request id, and a stock D's params wait beside it (taken and deleted with
    it); an order a replica of the ``engine<TAB>id<TAB>params`` format queued is read too."""
    import json

    clock = Clock()
    index = redis_index(redis_server, clock)
    raw = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        stored = [entry("d0", "A", request=f"r{i}") for i in range(2)]
        refs = [stored_at(chat(SYSTEM, FIRST, scope=scope_of("t", f"c{i}")), str(i))
                for i in range(2)]
        for ref, e in zip(refs, stored, strict=True):
            await index.put(ref, e, tenant="t")
            assert await index.drop(ref, e) is True
        queue = index.release_queue("d0")
        assert await raw.lrange(queue, 0, -1) == ["A\tr0", "A\tr1"]
        params = json.loads(await raw.get(f"{queue}:p:A\tr0") or "null")
        assert params == json.loads(json.dumps(stored[0].blocks.for_release().to_json()))
        older = replace(stored[0].blocks, request_id="r9").for_release()
        await raw.rpush(queue, "A\tr9\t" + json.dumps(older.to_json()))
        assert await index.take_release_blocks("d0", "A") == (
            stored[0].blocks.for_release(), stored[1].blocks.for_release(), older)
        assert await raw.keys(f"{queue}*") == []
    finally:
        await raw.aclose()
        await index.aclose()


async def test_a_release_that_overtakes_the_commit_is_not_lost(
    made: tuple[ConversationIndex, Clock],
) -> None:
    """D's sync names a request whose entry is not stored yet: the entry is stored
    released (never claimed); a release by another engine of that D does not count."""
    index, _ = made
    ref = stored_at(TURN1, "early")
    await index.mark_released("d0", "A", [Released("early", "pressure"),
                                          Released("other", "pressure")])
    await index.mark_released("d0", "B", [Released("other-engine", "expired")])
    await index.put(ref, entry("d0", "A", request="early"), tenant="t")
    await index.put(ref, entry("d0", "A", request="other-engine"), tenant="u")
    assert (await index.claim(ref, entry("d0", "A", request="early")) or entry()
            ).request_id == "other-engine"
    found = await index.lookup(follow("early"))  # type: ignore[arg-type]
    assert found is not None and found.entry.released == "pressure"
    assert await index.claim(ref, found.entry) is None


async def test_d_may_free_what_it_asks_for_unless_a_p_leg_reads_it(
    made: tuple[ConversationIndex, Clock],
) -> None:
    """``releasing``: the entries are marked released at once (no claim takes them); the
    answer leaves out a request a claimed P leg is still reading, until its read is done."""
    index, _ = made
    ref, pulled = stored_at(TURN1, "ask"), stored_at(TURN1, "read")
    await index.put(ref, entry("d0", "A", request="idle"), tenant="t")
    await index.put(pulled, entry("d0", "A", request="busy"), tenant="u")
    claimed = await index.claim(pulled, entry("d0", "A", request="busy"))
    assert claimed is not None
    free = await index.release_requested("d0", "A", ["idle", "busy", "gone"])
    assert sorted(free) == ["gone", "idle"]
    assert await index.claim(ref, entry("d0", "A", request="idle")) is None
    found = await index.lookup(follow("ask"))  # type: ignore[arg-type]
    assert found is not None and found.entry.released == "releasing"
    await index.mark_released("d0", "A", [Released("idle", "headroom")])
    found = await index.lookup(follow("ask"))  # type: ignore[arg-type]
    assert found is not None and found.entry.released == "headroom"
    await index.read_done("d0", "busy")
    assert await index.release_requested("d0", "A", ["busy"]) == ("busy",)
    await index.put(pulled, entry("d0", "A", request="gone"), tenant="u")  # came late
    assert await index.claim(pulled, entry("d0", "A", request="gone")) is None


async def test_a_spent_read_ends_after_its_grace(made: tuple[ConversationIndex, Clock]) -> None:
    """A P leg that ended without proof (an error answer, a timeout) keeps the read for
    ``grace_s`` more, then D may free the turn (a read kept open for good made D's asks
    under pressure wait for D's TTL: probe 6, finding 2). Redis times the grace on its own
    clock, the memory index on the router's: both move here."""
    index, clock = made
    ref, done = stored_at(TURN1, "spent"), stored_at(TURN1, "done")
    await index.put(ref, entry("d0", "A", request="spent"), tenant="t")
    await index.put(done, entry("d0", "A", request="done"), tenant="t")
    assert await index.claim(ref, entry("d0", "A", request="spent")) is not None
    assert await index.claim(done, entry("d0", "A", request="done")) is not None
    await index.read_spent("d0", "spent", 0.5)
    await index.read_done("d0", "done")  # P answered: it read them (D freed them) or not
    assert await index.release_requested("d0", "A", ["spent"]) == ()
    assert await index.take_releases("d0", "A") == ()
    clock.now += 0.6
    assert await until_free(index, "spent") == ("spent",)
    # no entry is left for the turn (the claim took it) and P may never have read it (its
    # request failed first): it is ordered released, or D kept it its whole retention time
    # (probe 8a, finding 3); a read that ended with P's answer is not
    assert await index.take_releases("d0", "A") == ("spent",)
    assert await index.take_releases("d0", "A") == ()


async def test_a_read_this_process_has_open_survives_the_shared_state_losing_it(
    redis_server: RedisServer,
) -> None:
    """Redis restarted without persistence (here: FLUSHALL) while this replica's P leg reads
    a claimed turn: Redis no longer knows of the read, but the replica does, and never lets
    D free the turn before the leg ends (it did: D freed blocks P was about to read; on real
    vLLM P loads what reused them: probe 8a, finding 2)."""
    clock = Clock()
    index = redis_index(redis_server, clock)
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        ref = stored_at(TURN1, "read")
        await index.put(ref, entry("d0", "A", request="read"), tenant="t")
        assert await index.claim(ref, entry("d0", "A", request="read")) is not None
        await admin.flushall()
        assert await index.release_requested("d0", "A", ["read"]) == ()
        await index.read_done("d0", "read")
        assert await index.release_requested("d0", "A", ["read"]) == ("read",)
    finally:
        await admin.aclose()
        await index.aclose()


async def until_free(index: ConversationIndex, request_id: str) -> tuple[str, ...]:
    """``release_requested`` until it frees ``request_id`` (a Redis key's PX runs on Redis's
    own clock, not the test's), at most 2 s."""
    for _ in range(200):
        free = await index.release_requested("d0", "A", [request_id])
        if free:
            return free
        await asyncio.sleep(0.01)
    return ()


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_completions_lookup_work_does_not_grow_with_the_entries_of_a_block(
    request: pytest.FixtureRequest, kind: str,
) -> None:
    """Issue #23, finding 4: prompts under 1 KiB all share block 0's anchor; a lookup's
    digests (``on_text_digests``) are the same with 10 entries there as with 2,000, and it
    still finds its own."""
    story = "Once upon a time, in a lighthouse by the sea, the keeper wrote: "
    work: list[int] = []
    for num_entries in (10, 2_000):
        counts: list[int] = []
        index: ConversationIndex
        if kind == "memory":
            index = InMemoryIndex(on_text_digests=counts.append)
        else:
            server: RedisServer = request.getfixturevalue("redis_server")
            index = redis_index(server, Clock(), deployment=f"n{num_entries}",
                                on_text_digests=counts.append)
        try:
            other = make_entry()
            for i in range(num_entries):
                await index.put(text_stored_at(text(f"{i:05d} {story}"), f" entry {i}."),
                                replace(other, turn=i + 1), tenant="t")
            mine = make_entry(node="d1")
            await index.put(text_stored_at(text(story), " calm sea."), mine, tenant="t")
            found = await index.lookup(text(story + " calm sea. Next day:"))
            assert found is not None and found.entry == mine
            work.append(counts[-1])
        finally:
            await index.aclose()
    assert work[0] == work[1] <= MAX_TEXT_DIGESTS


async def test_completions_keys_leave_with_their_entries(redis_server: RedisServer) -> None:
    index = redis_index(redis_server, Clock())
    raw = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        refs = [text_stored_at(text(f"{i} " + "Once upon a time " * 80), f" answer {i}.")
                for i in range(3)]
        for ref in refs:
            await index.put(ref, entry(), tenant="t")
        assert len(await raw.keys("kvrelay:default:f:*")) == 3
        assert len(await raw.keys("kvrelay:default:b:*")) == 3  # block 1 of each
        for ref in refs:
            assert await index.drop(ref)
        assert await raw.keys("kvrelay:default:f:*") == []
        assert await raw.keys("kvrelay:default:b:*") == []
    finally:
        await raw.aclose()
        await index.aclose()


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_a_completions_lookup_looks_into_at_most_max_text_blocks(
    request: pytest.FixtureRequest, kind: str,
) -> None:
    """Entries in each of 55 blocks of a long prompt, none of which it carries: both indexes
    look into the same ``MAX_TEXT_BLOCKS`` blocks, longest first, and compute the same
    digests; an entry it carries in a block past them is not reached."""
    counts: list[int] = []
    index: ConversationIndex
    if kind == "memory":
        index = InMemoryIndex(on_text_digests=counts.append)
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        index = redis_index(server, Clock(), on_text_digests=counts.append)
    try:
        prompt = "".join(f"line {i:06d} of the log\n" for i in range(2500))  # 56 blocks + 156
        for j in range(1, 56):
            head = prompt[: j * 1024 + 100]
            await index.put(text_stored_at(text(head), " (edited)"), make_entry(turn=j),
                            tenant="t")
        assert await index.lookup(text(prompt)) is None
        assert counts[-1] == MAX_TEXT_BLOCKS * (1024 // 64 + 1)
        await index.put(text_stored_at(text(prompt[:1024]), prompt[1024:1100]),
                        make_entry(node="d1"), tenant="t")
        assert await index.lookup(text(prompt)) is None  # block 1: past the 4 longest
        found = await index.lookup(text(prompt[:3000]))  # blocks 2, 1 (and 0) with entries
        assert found is not None and found.entry.decode_node_id == "d1"
    finally:
        await index.aclose()


# -- release at expiry (both indexes) ---------------------------------------------------------


def flagged(node: str = "d0", engine: str = "A", request: str = "f",
            expires_at_s: float = 130.0) -> ConversationEntry:
    """An entry whose retention the router shortened after D answered: it expires (router
    clock) at ``expires_at_s``, long before D's own deadline."""
    return replace(entry(node, engine, request=request), expires_at_s=expires_at_s,
                   release_at_expiry=True)


async def test_a_flagged_entry_is_ordered_released_once_when_it_expires(
    made: tuple[ConversationIndex, Clock],
) -> None:
    """Not before its expiry, once after; the entry stays (the next turn sees it
    ``expired``) but is never claimed, and dropping it later orders nothing more."""
    index, clock = made
    ref = stored_at(TURN1, "tool call")
    e = flagged()
    await index.put(ref, e, tenant="t")
    clock.now = 129.0
    assert await index.take_releases("d0", "A") == ()
    clock.now = 131.0
    assert await index.take_releases("d1", "A") == ()  # another D
    assert await index.take_release_blocks("d0", "A") == (e.blocks.for_release(),)
    assert await index.take_releases("d0", "A") == ()
    found = await index.lookup(follow("tool call"))  # type: ignore[arg-type]
    assert found is not None and found.entry.request_id == "f"
    assert found.entry.is_expired(clock.now) and found.entry.released is None
    assert await index.claim(ref, found.entry) is None  # D frees it: never pulled
    assert await index.drop(ref, found.entry) is True  # the expired turn drops it, release=True
    assert await index.take_releases("d0", "A") == ()


async def test_an_order_at_expiry_for_another_engine_is_discarded(
    made: tuple[ConversationIndex, Clock],
) -> None:
    """D restarted (a new engine id): its old engine's blocks are gone; the order is
    discarded, never delivered to the old engine later, and dropping the entry orders
    nothing either."""
    index, clock = made
    ref = stored_at(TURN1, "old engine")
    await index.put(ref, flagged(engine="A"), tenant="t")
    clock.now = 131.0
    assert await index.take_releases("d0", "B") == ()
    assert await index.take_releases("d0", "A") == ()
    assert await index.drop(ref) is True
    assert await index.take_releases("d0", "A") == ()


async def test_orders_for_another_rank_of_a_data_parallel_d_wait_for_that_rank(
    made: tuple[ConversationIndex, Clock],
) -> None:
    """A D run data parallel behind one URL syncs once per rank, each with its own engine id
    (``G_dp0``, ``G_dp1``: ``core.engine_group``). A rank's take leaves the other rank's
    orders, queued and due, for that rank; an order of another group (D restarted) is
    still discarded. Before, rank 1's sync discarded every order of rank 0's."""
    index, clock = made
    scope = scope_of("t", "dp")
    refs = [stored_at(chat(SYSTEM, FIRST, scope=scope), str(i)) for i in range(3)]
    stored = [entry("d0", engine, request=f"r{i}")
              for i, engine in enumerate(["G_dp0", "G_dp1", "OLD_dp0"])]
    for i, (ref, e) in enumerate(zip(refs, stored, strict=True)):
        await index.put(ref, e, tenant=f"t{i}")
        assert await index.drop(ref, e) is True
    due = [stored_at(TURN1, f"due {rank}") for rank in (0, 1)]
    for rank, ref in enumerate(due):
        await index.put(ref, flagged(engine=f"G_dp{rank}", request=f"f{rank}"), tenant="t")
    clock.now = 131.0
    assert await index.take_releases("d0", "G_dp1") == ("r1", "f1")
    assert await index.take_releases("d0", "G_dp1") == ()
    assert await index.take_releases("d0", "G_dp0") == ("r0", "f0")
    assert await index.take_releases("d0", "OLD_dp0") == ()  # discarded by G's takes
    assert await index.take_releases("d0", "G_dp0") == ()


async def test_a_flagged_entry_stored_again_replaces_the_unflagged_one(
    made: tuple[ConversationIndex, Clock],
) -> None:
    index, clock = made
    ref = stored_at(TURN1, "again")
    await index.put(ref, entry("d0", "A", request="f"), tenant="t")
    await index.put(ref, flagged(), tenant="t")  # the same D request: not part of identity
    assert len(index) == 1
    clock.now = 131.0
    assert await index.take_releases("d0", "A") == ("f",)


async def test_an_evicted_ordered_entry_orders_nothing_more(
    made: tuple[ConversationIndex, Clock],
) -> None:
    """The tenant cap (3 in the fixture) pushes out the ordered entry: no second order; the
    unordered ones it pushes out are ordered as before."""
    index, clock = made
    await index.put(stored_at(TURN1, "f"), flagged(), tenant="t")
    clock.now = 131.0
    assert await index.take_releases("d0", "A") == ("f",)
    for i in range(3):
        await index.put(stored_at(TURN1, f"n{i}"), entry("d0", "A", request=f"n{i}"),
                        tenant="t")
    assert await index.lookup(follow("f")) is None  # type: ignore[arg-type]
    assert await index.take_releases("d0", "A") == ()
    await index.put(stored_at(TURN1, "n3"), entry("d0", "A", request="n3"), tenant="t")
    assert await index.take_releases("d0", "A") == ("n0",)


async def test_claimed_released_or_dropped_flagged_entries_are_not_ordered_at_expiry(
    made: tuple[ConversationIndex, Clock],
) -> None:
    """A claimed entry (P reads it), one D released or asked to free, and one dropped
    (its order queued then) get no order at expiry."""
    index, clock = made
    refs = {name: stored_at(TURN1, name) for name in ("claimed", "released", "asked",
                                                      "dropped", "kept")}
    for i, name in enumerate(refs):
        await index.put(refs[name], flagged(request=name), tenant=f"t{i}")
    assert await index.claim(refs["claimed"], flagged(request="claimed")) is not None
    await index.mark_released("d0", "A", [Released("released", "pressure")])
    assert await index.release_requested("d0", "A", ["asked"]) == ("asked",)
    assert await index.drop(refs["dropped"], flagged(request="dropped")) is True
    assert await index.take_releases("d0", "A") == ("dropped",)
    clock.now = 131.0
    assert await index.take_releases("d0", "A") == ("kept",)
    assert await index.take_releases("d0", "A") == ()
    assert await index.drop(refs["released"]) is True and await index.drop(refs["asked"])
    assert await index.take_releases("d0", "A") == ()


async def test_an_unflagged_expired_entry_is_not_ordered_at_expiry(
    made: tuple[ConversationIndex, Clock],
) -> None:
    """D frees it at its own deadline; the index orders it only when it drops it."""
    index, clock = made
    ref = stored_at(TURN1, "plain")
    e = replace(entry("d0", "A", request="plain"), expires_at_s=130.0)
    await index.put(ref, e, tenant="t")
    clock.now = 131.0
    assert await index.take_releases("d0", "A") == ()
    found = await index.lookup(follow("plain"))  # type: ignore[arg-type]
    assert found is not None and found.entry.is_expired(clock.now)
    assert await index.drop(ref, found.entry) is True
    assert await index.take_releases("d0", "A") == ("plain",)


async def test_orders_at_expiry_come_in_expiry_order_within_the_limit(
    made: tuple[ConversationIndex, Clock],
) -> None:
    """Queued orders first; a take looks at no more than ``limit`` due entries (released
    ones count), so the rest comes with the next sync; one not due yet waits."""
    index, clock = made
    expiries = {"r3": 133.0, "r1": 131.0, "late": 300.0, "r2": 132.0, "gone": 120.0,
                "gone2": 121.0, "gone3": 122.0}
    for i, (name, at) in enumerate(expiries.items()):
        await index.put(stored_at(TURN1, name), flagged(request=name, expires_at_s=at),
                        tenant=f"t{i}")
    await index.mark_released("d0", "A", [Released(g, "pressure")
                                          for g in ("gone", "gone2", "gone3")])
    await index.put(stored_at(TURN1, "q"), entry("d0", "A", request="q"), tenant="q")
    assert await index.drop(stored_at(TURN1, "q")) is True
    clock.now = 140.0
    assert await index.take_releases("d0", "A", limit=2) == ("q",)  # gone: looked at
    assert await index.take_releases("d0", "A", limit=2) == ("r1",)  # gone2, gone3, r1
    assert await index.take_releases("d0", "A", limit=2) == ("r2", "r3")
    assert await index.take_releases("d0", "A", limit=2) == ()
    clock.now = 301.0
    assert await index.take_releases("d0", "A", limit=2) == ("late",)


async def test_drop_node_or_engine_leaves_nothing_to_order_at_expiry(
    made: tuple[ConversationIndex, Clock],
) -> None:
    index, clock = made
    await index.put(stored_at(TURN1, "a"), flagged("d0", "A", "a"), tenant="t")
    await index.put(stored_at(TURN1, "b"), flagged("d1", "A", "b"), tenant="u")
    assert await index.drop_node("d0") == 1 and await index.drop_engine("d1", "A") == 1
    clock.now = 131.0
    assert await index.take_releases("d0", "A") == ()
    assert await index.take_releases("d1", "A") == ()


async def test_the_due_set_expires_and_leaves_with_its_entries(
    redis_server: RedisServer,
) -> None:
    """Redis: a flagged entry is in its D's due set (PX like the entry), an unflagged one
    is not; removing or ordering an entry takes it out."""
    clock = Clock()
    index = redis_index(redis_server, clock, deployment="due")
    raw = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        due = index.due_set("d0")
        assert due == "kvrelay:due:due:d0"
        await index.put(stored_at(TURN1, "plain"), entry("d0", "A", request="p"), tenant="t")
        assert await raw.exists(due) == 0
        a, b = flagged(request="a"), flagged(request="b", expires_at_s=150.0)
        await index.put(stored_at(TURN1, "a"), a, tenant="t")
        await index.put(stored_at(TURN1, "b"), b, tenant="t")
        key_a = index.entry_key(stored_at(TURN1, "a"), a)
        assert await raw.zscore(due, key_a) == pytest.approx((EPOCH + 130.0) * 1000)
        assert 0 < await raw.pttl(due) <= 50_000 + 300_000  # expiry + retention, in ms
        assert await raw.pttl(due) >= await raw.pttl(key_a)
        assert await index.drop(stored_at(TURN1, "a"), a) is True
        assert await raw.zcard(due) == 1
        clock.now = 151.0
        assert await index.take_releases("d0", "A") == ("a", "b")  # a: queued by the drop
        assert await raw.exists(due) == 0
        assert await raw.hget(index.entry_key(stored_at(TURN1, "b"), b), "ord") == "1"
    finally:
        await raw.aclose()
        await index.aclose()
