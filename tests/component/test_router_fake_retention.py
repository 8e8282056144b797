"""Retention through the router on fake engines (no latency, one ``ManualClock``): identical
conversations each keep their entry, entries the router drops are released on D, D's
releases reach the router (and the next turn recomputes, ``released``), and D's retention
numbers show in ``/stats`` and ``/metrics``."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.component.router_fake import Routed, routed

SYSTEM = "You are a careful agent that fixes failing tests. " * 8
FIRST = "The test test_parse fails on main. Find out why and fix it."


def first_turn() -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST}]


async def chat(c: httpx.AsyncClient, messages: list[dict[str, Any]]) -> httpx.Response:
    resp = await c.post("/v1/chat/completions", json={
        "model": "tiny", "messages": messages, "max_tokens": 16})
    assert resp.status_code == 200, resp.text
    return resp


async def identical_first_turns(r: Routed, n: int) -> list[list[dict[str, Any]]]:
    """``n`` id-free conversations with the same history, their first turns sent at once;
    returns each one's history with its answer and a follow-up question."""
    async with r.client() as c:
        replies = await asyncio.gather(*(chat(c, first_turn()) for _ in range(n)))
    await r.settle()
    answers = {x.json()["choices"][0]["message"]["content"] for x in replies}
    assert len(answers) == 1  # greedy: the same answer n times (the case under test)
    answer = answers.pop()
    return [[*first_turn(), {"role": "assistant", "content": answer},
             {"role": "user", "content": f"Now run the tests. ({i})"}] for i in range(n)]


@pytest.mark.parametrize("num_decode", [1, 2])
async def test_identical_conversations_finishing_together_all_pull(num_decode: int) -> None:
    """8 identical id-free conversations whose first turns finish together: each first
    follow-up pulls an entry of its own (an index keeping one entry per anchor and answer
    lost 6 of 8); no D block is read twice."""
    async with routed(num_prefill=2, num_decode=num_decode) as r:
        histories = await identical_first_turns(r, 8)
        assert len(r.ctx.index) == 8
        async with r.client() as c:
            follow_ups = await asyncio.gather(*(chat(c, h) for h in histories))
        assert [x.headers["x-kvrelay-reason"] for x in follow_ups] == ["pull"] * 8
        pulls = [rec for p in r.cluster.prefill for rec in p.records if rec.plan == "pull"]
        assert len(pulls) == 8
        assert len({(rec.pulled_from_engine, tuple(rec.pulled_block_ids)) for rec in pulls}) == 8
        assert all(not rec.wrong_reuse and not rec.read_freed_blocks for rec in pulls)
        for reply, history in zip(follow_ups, histories, strict=True):
            assert reply.json()["choices"][0]["message"]["content"] == await r.recompute(
                {"model": "tiny", "messages": history, "max_tokens": 16})
