"""A fake D running kvrelay's retention syncs with the router as ``core.retention_sync`` says:
it POSTs what it retains (from its own block pool) to every ``kvrelay_retention_url`` its
decode requests carried, at once, again every ``SYNC_INTERVAL_S`` on its clock while it holds
turns, and at once after a release; it applies the router's orders. A tiny in-test server
stands in for the router's endpoint. Stock retention (``kvrelay_retention=False``) syncs
nothing and keeps the global TTL."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from kvrelay.core.retention_sync import (
    RELEASE_CAUSES,
    RETAIN_S_KEY,
    RETAIN_VALUE_KEY,
    RETENTION_PATH,
    RETENTION_URL_KEY,
    RETURN_CURVE_KEY,
    SYNC_INTERVAL_S,
    Released,
    RetentionOrders,
    RetentionSync,
    TurnCurve,
)
from kvrelay.core.return_curve import ReturnCurve
from kvrelay.fakevllm import FakeCluster, FakeEngine, FakeEngineConfig, ManualClock
from kvrelay.fakevllm import sync as sync_module
from kvrelay.fakevllm.model import FakeModel
from kvrelay.fakevllm.retention import CONFIRM_TIMEOUT_S
from tests.component.fake_engine_helpers import (
    BLOCK,
    RouterStandIn,
    cdiv,
    chat,
    client,
    text_of,
    until,
    user,
)

GEN = 16
CONFIG = FakeEngineConfig(report_delay_s=0.0, kv_lease_duration=1e6)


def conversation(i: int) -> list[dict[str, Any]]:
    return user(f"Conversation {i:03d}. " + f"Tell me about river number {i}. " * 19)


@pytest.fixture(scope="module")
def model() -> FakeModel:
    return FakeModel.load()


def turn_blocks(model: FakeModel) -> int:
    return cdiv(len(model.encode_chat(conversation(0))) + GEN - 1, BLOCK)


def cluster(model: FakeModel, clock: ManualClock, config: FakeEngineConfig = CONFIG,
            num_turns: int = 2) -> FakeCluster:
    d_config = replace(config, num_gpu_blocks=1 + num_turns * turn_blocks(model))
    return FakeCluster(1, 1, prefill_config=replace(config, enable_prefix_caching=False),
                       decode_config=d_config, clock=clock, model=model)


async def turn(p: FakeEngine, d: FakeEngine, messages: list[dict[str, Any]],
               **extra: Any) -> Any:
    pr = await chat(p, messages, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    return await chat(d, messages, max_tokens=GEN,
                      kv_transfer_params={**pr["kv_transfer_params"], **extra})


def rid(answer: Any) -> str:
    return str(answer["kv_transfer_params"]["remote_request_id"])


async def test_sync_reports_what_d_retains_from_its_own_pool(model: FakeModel) -> None:
    clock = ManualClock()
    async with RouterStandIn() as router, cluster(model, clock) as c:
        p, d = c.prefill[0], c.decode[0]
        answer = await turn(p, d, conversation(0), **{RETENTION_URL_KEY: router.url})
        first = await router.wait_for(lambda s: s.retained_requests == 1, "the first sync")
        n = len(model.encode_chat(conversation(0)))
        assert first == RetentionSync(
            engine_id=d.engine_id, block_size=BLOCK, bytes_per_block=BLOCK * 1024,
            num_blocks_total=2 * turn_blocks(model),
            num_blocks_free=turn_blocks(model), retained_requests=1,
            retained_blocks=turn_blocks(model), retained_tokens=n + GEN - 1,
            releases_total={"pressure": 0, "router": 0, "expired": 0, "headroom": 0},
            released=(), releasing=())
        assert first.retained_bytes == turn_blocks(model) * BLOCK * 1024
        assert [h.request_id for h in d.held()] == [rid(answer)]
        count = len(router.syncs)
        clock.advance(SYNC_INTERVAL_S)  # the next sync is due on the engine's clock
        await until(lambda: len(router.syncs) > count, "a sync every interval")
        assert router.syncs[-1].retained_requests == 1


async def test_router_orders_release_the_turn_and_the_next_sync_says_so(
        model: FakeModel) -> None:
    clock = ManualClock()
    async with RouterStandIn() as router, cluster(model, clock) as c:
        p, d = c.prefill[0], c.decode[0]
        messages = conversation(0)
        answer = await turn(p, d, messages, **{RETENTION_URL_KEY: router.url})
        await router.wait_for(lambda s: s.retained_requests == 1, "the first sync")
        router.orders.append(RetentionOrders(release=(rid(answer), "unknown-request")))
        clock.advance(SYNC_INTERVAL_S)  # the next sync gets the orders
        told = await router.wait_for(lambda s: bool(s.released), "the sync after the release")
        assert told.released == (Released(request_id=rid(answer), cause="router"),)
        assert told.releases_total["router"] == 1 and told.retained_requests == 0
        assert told.num_blocks_free == told.num_blocks_total
        assert d.held() == []
        async with client() as http:
            info = (await http.get(d.url + "/fake/info")).json()
        assert info["retention"]["turns"] == [] and info["waiting"] == []
        assert info["retention"]["releases_total"]["router"] == 1
        assert info["retention"]["syncs"][router.url]["status"] == 200
        history = [*messages, {"role": "assistant", "content": text_of(answer)},
                   *user("And then?")]
        pr = await chat(p, history, max_tokens=GEN, kv_transfer_params=answer["kv_transfer_params"])
        record = p.record(pr["id"])
        assert record.load_failure == "expired" and record.recomputed_after_failure
        assert text_of(pr) == text_of(await chat(p, history, max_tokens=GEN))
        # Nothing held, nothing left to tell: the syncs stop even as the clock moves on.
        count = len(router.syncs)
        clock.advance(10 * SYNC_INTERVAL_S)
        await asyncio.sleep(0.1)
        assert len(router.syncs) == count


async def test_pressure_asks_the_turns_router_first_and_frees_what_it_drops(
        model: FakeModel) -> None:
    """D asks (``releasing``) at once, frees only what the router answers ``dropped``, and
    tells it in the next sync, sent at once."""
    clock = ManualClock()
    async with RouterStandIn() as router, cluster(model, clock) as c:
        p, d = c.prefill[0], c.decode[0]
        old = await turn(p, d, conversation(0), **{RETENTION_URL_KEY: router.url})
        clock.advance(1)
        await turn(p, d, conversation(1), **{RETENTION_URL_KEY: router.url})
        await turn(p, d, conversation(2), **{RETENTION_URL_KEY: router.url})
        asked = await router.wait_for(lambda s: bool(s.releasing), "D asks to free a turn")
        assert asked.releasing == (rid(old),) and asked.released == ()
        told = await router.wait_for(lambda s: bool(s.released), "the release is told")
        assert told.released == (Released(request_id=rid(old), cause="pressure"),)
        assert told.releasing == () and told.releases_total["pressure"] == 1
        await until(lambda: len(d.held()) == 2, "then D holds the second turn and the third")
        retention = d.state.retention
        assert retention is not None  # a turn without a curve counts as sure to be pulled
        assert retention.released_pull_chance == {**dict.fromkeys(RELEASE_CAUSES, 0.0),
                                                  "pressure": 1.0}


async def test_a_curve_the_router_sends_makes_its_turn_the_first_asked_for(
        model: FakeModel) -> None:
    """Both turns were told the replies' curve (users come back after about a minute); the
    router then sends the tools' curve for the newer turn (its answer was a tool call):
    seconds later, pressure asks for the newer turn, not the older one."""
    clock = ManualClock()
    async with RouterStandIn() as router, cluster(model, clock) as c:
        p, d = c.prefill[0], c.decode[0]
        replies = {RETENTION_URL_KEY: router.url, RETURN_CURVE_KEY: [0.5, 4.0, 1.0]}
        await turn(p, d, conversation(0), **replies)
        clock.advance(1)
        tool = await turn(p, d, conversation(1), **replies)
        tools = ReturnCurve(0.9, 0.0, 1.0)
        router.orders.append(RetentionOrders(curves=(TurnCurve(rid(tool), tools),)))
        clock.advance(SYNC_INTERVAL_S)  # the next sync gets the curve
        await router.wait_for(lambda s: s.retained_requests == 2 and len(router.orders) == 0,
                              "the curve is delivered")
        retention = d.state.retention
        assert retention is not None
        await until(lambda: any(t.request_id == rid(tool) and t.curve == tools
                                for t in retention.turns()), "D took the curve")
        clock.advance(5)
        chosen = next(t for t in retention.turns() if t.request_id == rid(tool))
        await turn(p, d, conversation(2), **replies)
        asked = await router.wait_for(lambda s: bool(s.releasing), "D asks to free a turn")
        assert asked.releasing == (rid(tool),)
        # What D expected to lose by it: the turn's chance of a pull when D chose it.
        await router.wait_for(lambda s: bool(s.released), "the release is told")
        expected = chosen.pull_chance(clock())
        assert 0.0 < expected < 0.9
        assert retention.released_pull_chance["pressure"] == pytest.approx(expected)


async def test_a_router_that_never_answers_holds_up_only_its_own_syncs(
        model: FakeModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """D knows two routers and the first never answers (its POST stays open: a wedged
    replica). Pressure asks the second for its turn, which it drops at once, and the
    waiting request runs, while the first router's sync is still in flight: each URL is
    synced in a lane of its own (one after another, the ask would wait behind it; here,
    with the POST timeout raised, for a minute)."""
    monkeypatch.setattr(sync_module, "POST_TIMEOUT_S", 60.0)
    clock = ManualClock()
    async with RouterStandIn(hang=True) as hung, RouterStandIn() as router, \
            cluster(model, clock) as c:
        p, d = c.prefill[0], c.decode[0]
        await turn(p, d, conversation(5), **{RETENTION_URL_KEY: hung.url,
                                              RETAIN_VALUE_KEY: 10.0})  # released last
        await until(lambda: hung.entered > 0, "D syncs with the hung router")
        old = await turn(p, d, conversation(0), **{RETENTION_URL_KEY: router.url})
        clock.advance(1)
        third = asyncio.create_task(turn(p, d, conversation(1),
                                         **{RETENTION_URL_KEY: router.url}))
        try:
            asked = await router.wait_for(lambda s: bool(s.releasing), "D asks to free a turn")
            await asyncio.wait_for(asyncio.shield(third), timeout=30)
        finally:
            third.cancel()
        assert asked.releasing == (rid(old),)
        assert hung.syncs == [], "the hung router has answered nothing all along"


async def test_an_ask_the_router_leaves_unanswered_keeps_the_turn(model: FakeModel) -> None:
    """A router that never answers ``dropped`` costs D the release, never a stale read: the
    request waits as on stock vLLM; after ``CONFIRM_TIMEOUT_S`` the turns are held again."""
    clock = ManualClock()
    async with RouterStandIn(confirm=False) as router, cluster(model, clock) as c:
        p, d = c.prefill[0], c.decode[0]
        first = [await turn(p, d, conversation(i), **{RETENTION_URL_KEY: router.url})
                 for i in (0, 1)]
        third = asyncio.create_task(turn(p, d, conversation(2),
                                         **{RETENTION_URL_KEY: router.url}))
        await router.wait_for(lambda s: bool(s.releasing), "D asks to free a turn")
        assert d.state.waiting == 1 and len(d.held()) == 2
        retention = d.state.retention
        assert retention is not None and retention.has_pending()
        clock.advance(CONFIRM_TIMEOUT_S)
        await until(lambda: not retention.has_pending(), "the ask is given up")
        assert {h.request_id for h in d.held()} == {rid(r) for r in first}
        assert not third.done() and retention.releases_total["pressure"] == 0
        third.cancel()


async def test_headroom_keeps_a_share_of_the_cache_free_of_retention(model: FakeModel) -> None:
    clock = ManualClock()
    half = replace(CONFIG, retention_headroom=0.5)
    async with RouterStandIn() as router, cluster(model, clock, half) as c:
        p, d = c.prefill[0], c.decode[0]
        old = await turn(p, d, conversation(0), **{RETENTION_URL_KEY: router.url})
        clock.advance(1)
        new = await turn(p, d, conversation(1), **{RETENTION_URL_KEY: router.url})
        told = await router.wait_for(lambda s: bool(s.released), "the release is told")
        assert told.released == (Released(request_id=rid(old), cause="headroom"),)
        assert [h.request_id for h in d.held()] == [rid(new)]


async def test_a_retain_s_deadline_release_is_synced_as_expired(model: FakeModel) -> None:
    clock = ManualClock()
    async with RouterStandIn() as router, cluster(model, clock) as c:
        p, d = c.prefill[0], c.decode[0]
        answer = await turn(p, d, conversation(0), **{RETENTION_URL_KEY: router.url,
                                                     RETAIN_S_KEY: 2.0})
        await router.wait_for(lambda s: s.retained_requests == 1, "the first sync")
        clock.advance(2.0)  # no request comes: the sync loop's tick releases it
        told = await router.wait_for(lambda s: bool(s.released), "the expiry is told")
        assert told.released == (Released(request_id=rid(answer), cause="expired"),)
        assert told.releases_total["expired"] == 1


async def test_only_report_hosts_are_synced_with(model: FakeModel) -> None:
    clock = ManualClock()
    async with RouterStandIn() as router, cluster(model, clock) as c:
        p, d = c.prefill[0], c.decode[0]
        elsewhere = "http://192.0.2.1:9" + RETENTION_PATH
        await turn(p, d, conversation(0), **{RETENTION_URL_KEY: elsewhere})
        await turn(p, d, conversation(1), **{RETENTION_URL_KEY: router.url})
        await router.wait_for(lambda s: s.retained_requests == 2, "the loopback router syncs")
        syncer = d.state.syncer
        assert syncer is not None
        await until(lambda: elsewhere in syncer.outcomes, "the other URL was considered")
        outcome = syncer.outcomes[elsewhere]
        assert outcome.error is not None and "report_hosts" in outcome.error
        assert outcome.count == 0 and outcome.status is None


async def test_stock_retention_syncs_nothing_and_keeps_the_ttl(model: FakeModel) -> None:
    clock = ManualClock()
    stock = replace(CONFIG, kvrelay_retention=False)
    async with RouterStandIn() as router, cluster(model, clock, stock) as c:
        p, d = c.prefill[0], c.decode[0]
        await turn(p, d, conversation(0), **{RETENTION_URL_KEY: router.url, RETAIN_S_KEY: 2.0})
        assert d.state.retention is None and d.state.syncer is None
        (hold,) = d.held()
        assert hold.expires_at - clock() == stock.decoder_kv_blocks_ttl
        clock.advance(3.0)
        assert len(d.held()) == 1
        await asyncio.sleep(0.1)
        assert router.syncs == []
