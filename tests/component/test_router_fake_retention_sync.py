"""The router and fake engines running kvrelay's retention, syncing for real (no hand-made
syncs): an entry the router evicts is released on D within a sync or two and D's gauge in
the router drops; a turn D released under memory pressure is never pulled, its next turn
recomputes (``released``) with the answer of a recompute; identical conversations still all
pull. Time moves on the shared ``ManualClock``."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import httpx

from kvrelay.core.retention_sync import SYNC_INTERVAL_S
from kvrelay.fakevllm import FakeEngine
from tests.component.router_fake import ENGINE_CONFIG, Routed, routed, until

SYSTEM = "You are a careful agent that fixes failing tests. " * 34
"""~10 tokens a repetition: a conversation's first prompt is ~470 tokens (4 blocks of 128)."""


def conversation(i: int) -> list[dict[str, Any]]:
    # The number leads, so no two conversations share a cached block on D.
    return [{"role": "system", "content": f"Agent {i}. {SYSTEM}"},
            {"role": "user", "content": f"Conversation {i}: the test fails. Find out why."}]


async def chat(c: httpx.AsyncClient, messages: list[dict[str, Any]]) -> httpx.Response:
    resp = await c.post("/v1/chat/completions", json={
        "model": "tiny", "messages": messages, "max_tokens": 16})
    assert resp.status_code == 200, resp.text
    return resp


def follow_up(messages: list[dict[str, Any]], reply: httpx.Response) -> list[dict[str, Any]]:
    return [*messages, {"role": "assistant",
                        "content": reply.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Now run the tests."}]


def retained(d: FakeEngine) -> list[str]:
    retention = d.state.retention
    assert retention is not None
    return [t.request_id for t in retention.turns()]


async def syncs_pass(r: Routed, n: int = 2) -> None:
    """Let D's sync loop run ``n`` intervals on the shared clock."""
    for _ in range(n):
        r.clock.advance(SYNC_INTERVAL_S)
        await asyncio.sleep(0.05)


async def test_an_entry_the_router_evicts_is_released_on_d_and_d_gauge_drops() -> None:
    async with routed(max_entries=1) as r:
        d = r.cluster.decode[0]
        d_id = r.ctx.config.decode[0].node_id
        async with r.client() as c:
            first = await chat(c, conversation(1))
            await r.settle()
            history = follow_up(conversation(1), first)
            found = await r.find({"model": "tiny", "messages": history})
            assert found is not None and found.entry.request_id in retained(d)
            await chat(c, conversation(2))
            await r.settle()
            assert await r.find({"model": "tiny", "messages": history}) is None
            await syncs_pass(r)
            await until(lambda: found.entry.request_id not in retained(d),
                        "D released the evicted entry's turn")
            await syncs_pass(r)
            stats = (await r.stats())["retention"][d_id]
            assert stats["retained_requests"] == len(retained(d)) == 1
            assert stats["releases_total"].get("router") == 1
            reply = await chat(c, history)
        assert reply.headers["x-kvrelay-action"] == "recompute"
        assert reply.json()["choices"][0]["message"]["content"] == await r.recompute(
            {"model": "tiny", "messages": history, "max_tokens": 16})
        assert not any(p.declined_reads for p in [d.state.retention] if p is not None)


async def test_a_turn_d_released_under_pressure_recomputes_released_never_pulls() -> None:
    """D holds two conversations' turns; a third needs the blocks: D releases the oldest
    (pressure) before anyone waits, its sync tells the router, and that conversation's
    next turn recomputes with reason ``released``."""
    prompt_blocks = 4
    config = replace(ENGINE_CONFIG, num_gpu_blocks=1 + 2 * (prompt_blocks + 1))
    async with routed(engine_config=config) as r:
        d = r.cluster.decode[0]
        async with r.client() as c:
            replies = []
            for i in range(3):
                replies.append(await chat(c, conversation(i)))
                await r.settle()
                r.clock.advance(1.0)
            # each turn D holds spans the blocks the config is sized for
            held = [rec.kv_transfer_params for rec in d.records]
            assert [len(k["remote_block_ids"][0]) for k in held if k] == [prompt_blocks] * 3
            await syncs_pass(r)
            history = follow_up(conversation(0), replies[0])
            found = await r.find({"model": "tiny", "messages": history})
            assert found is not None and found.entry.released == "pressure", found
            reply = await chat(c, history)
        assert reply.headers["x-kvrelay-reason"] == "released"
        assert reply.json()["choices"][0]["message"]["content"] == await r.recompute(
            {"model": "tiny", "messages": history, "max_tokens": 16})
        pulls = [rec for rec in r.cluster.prefill[0].records if rec.plan == "pull"]
        assert not pulls
        assert d.state.retention is not None and d.state.retention.declined_reads == 0
