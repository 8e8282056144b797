"""``max_in_flight``: beyond it the router answers 429 at once (``Retry-After``, OpenAI error
body) instead of queueing; streams hold their slot until they end."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvrelay.client.sse import sse_events
from kvrelay.router.asgi import BodyBudget
from kvrelay.router.errors import ClientError
from tests.component.router_fake import PermitSleep, Routed, routed, until

MESSAGES = [{"role": "user", "content": "Explain tides to a sailor in three sentences."}]


def body(stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "stream": stream, **extra}


def rejected(r: Routed) -> float:
    value: float = r.ctx.metrics.rejected.labels("overload")._value.get()
    return value


async def test_requests_beyond_the_limit_get_429_until_others_finish() -> None:
    async with routed(max_in_flight=2) as r:
        d = r.cluster.decode[0]
        d.faults.hang = True
        async with r.client() as c:
            held = [asyncio.create_task(c.post("/v1/chat/completions", json=body(
                conversation_id=f"c{i}"))) for i in range(2)]
            await until(lambda: d.faults.num_hung == 2, "two requests held by D")
            for path in ("/v1/chat/completions", "/v1/completions"):
                resp = await c.post(path, json=body())
                assert resp.status_code == 429
                assert resp.headers["retry-after"] == "1"
                err = resp.json()["error"]
                assert (err["code"], err["type"]) == (429, "RateLimitError")
            # count_tokens costs P a prompt's rendering: it takes a slot too (probe 12, G1)
            resp = await c.post("/v1/messages/count_tokens", json={
                "model": "tiny", "messages": MESSAGES})
            assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
            assert resp.json()["error"]["type"] == "rate_limit_error"
            assert rejected(r) == 3
            # other endpoints are not limited
            assert (await c.get("/stats")).status_code == 200
            assert (await c.get("/health")).status_code == 200
            metrics = (await c.get("/metrics")).text
            assert "kvrelay_router_in_flight 2.0" in metrics
            assert 'kvrelay_router_rejected_requests_total{reason="overload"} 3.0' in metrics

            d.faults.hang = False
            assert [t.status_code for t in await asyncio.gather(*held)] == [200, 200]
            # (a scrape-time gauge: its value is read by rendering, not from ._value)
            assert "kvrelay_router_in_flight 0.0" in (await c.get("/metrics")).text
            results = await asyncio.gather(*(c.post("/v1/chat/completions", json=body())
                                             for _ in range(2)))
            assert [x.status_code for x in results] == [200, 200]
            counted = await c.post("/v1/messages/count_tokens", json={
                "model": "tiny", "messages": MESSAGES})
            assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
            assert rejected(r) == 3
            assert r.ctx.admission.in_flight == 0


async def test_a_stream_holds_its_slot_until_it_ends() -> None:
    gate = PermitSleep()
    async with routed(max_in_flight=1, sleep=gate) as r:
        r.cluster.decode[0].faults.slow_stream_s = 0.01  # every token waits for a permit
        async with r.client() as c, c.stream(
            "POST", "/v1/chat/completions", json=body(stream=True)
        ) as stream:
            assert stream.status_code == 200  # headers are out, tokens are not
            await until(lambda: gate.waiting > 0, "the stream is waiting for a token")
            resp = await c.post("/v1/chat/completions", json=body())
            assert resp.status_code == 429
            gate.grant(100)
            text = (await stream.aread()).decode()
            assert sse_events(text)[-1] == "[DONE]"
        async with r.client() as c:
            resp = await c.post("/v1/chat/completions", json=body())
        assert resp.status_code == 200
        assert rejected(r) == 1


async def test_default_limit_is_1024() -> None:
    async with routed() as r:
        assert r.ctx.config.max_in_flight == 1024
        async with r.client() as c:
            resp = await c.post("/v1/chat/completions", json=body())
        assert resp.status_code == 200


async def test_auth_comes_first_and_each_tenant_has_its_share() -> None:
    """Unauthenticated requests never take a slot; one tenant cannot take all of them."""
    keys = ["tenant-a:key-a", "tenant-b:key-b"]
    a = {"Authorization": "Bearer key-a"}
    b = {"Authorization": "Bearer key-b"}
    async with routed(max_in_flight=3, max_in_flight_per_tenant=1, api_keys=keys) as r:
        d = r.cluster.decode[0]
        d.faults.hang = True
        async with r.client() as c:
            held_a = asyncio.create_task(c.post("/v1/chat/completions", json=body(),
                                                headers=a))
            await until(lambda: d.faults.num_hung == 1, "tenant a's request held by D")
            for _ in range(5):  # far more than the free slots: all 401, none 429
                resp = await c.post("/v1/chat/completions", json=body())
                assert resp.status_code == 401
            resp = await c.post("/v1/chat/completions", json=body(), headers=a)
            assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
            assert resp.json()["error"]["type"] == "RateLimitError"
            held_b = asyncio.create_task(c.post("/v1/chat/completions", json=body(),
                                                headers=b))
            await until(lambda: d.faults.num_hung == 2, "tenant b served meanwhile")
            assert rejected(r) == 1
            assert "kvrelay_router_in_flight 2.0" in (await c.get("/metrics")).text
            d.faults.hang = False
            assert [t.status_code for t in await asyncio.gather(held_a, held_b)] == [200, 200]
            resp = await c.post("/v1/chat/completions", json=body(), headers=a)
            assert resp.status_code == 200
        assert r.ctx.admission.in_flight == 0


async def test_a_body_still_arriving_holds_no_slot_only_its_bytes() -> None:
    """Clients that send a head and part of a body, then nothing (or a trickle), hold no
    in-flight slot: with the one slot there is, another request is served meanwhile. What
    they sent is held in the body budget (``max_in_flight`` full bodies) until they go."""
    async with routed(max_in_flight=1, max_body_bytes=4096) as r:
        host, port = r.url.removeprefix("http://").split(":")
        stalled = []
        for _ in range(3):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                         b"content-type: application/json\r\ncontent-length: 100\r\n\r\n"
                         b'{"mo')
            await writer.drain()
            stalled.append((reader, writer))
        budget = r.ctx.admission.bodies
        assert budget.limit_bytes == 4096
        await until(lambda: budget.held_bytes == 12, "the three partial bodies are held")
        async with r.client() as c:
            resp = await c.post("/v1/chat/completions", json=body())
        assert resp.status_code == 200 and rejected(r) == 0
        for _, writer in stalled:
            writer.close()
        await until(lambda: budget.held_bytes == 0, "the partial bodies are let go")
        assert r.ctx.admission.in_flight == 0


def test_the_body_budget_refuses_what_it_cannot_hold() -> None:
    budget = BodyBudget(10)
    budget.take(6)
    with pytest.raises(ClientError) as refused:
        budget.take(5)
    assert refused.value.status == 503 and refused.value.headers["Retry-After"] == "1"
    assert budget.held_bytes == 6
    budget.give(6)
    budget.take(10)
    assert budget.held_bytes == 10
