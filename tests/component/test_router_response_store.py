"""The router's opt-in Responses store (``--response-store memory|redis``) in front of fake
vLLM P/D engines: a ``previous_response_id`` chain pulls on every follow-up (the expanded
input is found id-free) and answers what a recompute of the whole input answers; the
response carries the router-minted id, ``store: true`` and the client's
``previous_response_id``; ``GET`` / ``DELETE /v1/responses/{id}`` work; unknown, expired,
deleted and another tenant's ids are the same 404; on Redis, two replicas share it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from kvrelay.client.prometheus import external_kv_tokens, parse_prometheus
from kvrelay.fakevllm import FakeCluster, ManualClock
from kvrelay.fakevllm.server import HttpServer
from kvrelay.router.app import create_app
from kvrelay.router.config import ConfigError, RouterConfig
from kvrelay.router.response_store import StoredResponse
from kvrelay.router.response_store_redis import RedisResponseStore
from kvrelay.router.state import RouterContext
from tests.component.redis_server import RedisServer
from tests.component.router_fake import ENGINE_CONFIG, Routed, routed
from tests.component.test_router_agent_apis import Reply, assert_clean, r_client
from tests.costs import fixed
from tests.ports import free_ports

FIRST = "Tell me everything about the rivers of Europe, in order of length. " * 6
FOLLOW_UPS = ["And Asia?", "Which one is the longest overall?", "Summarize in one line."]
KEYS = ["tenant-a:key-a-123", "tenant-b:key-b-456"]
A = {"Authorization": "Bearer key-a-123"}
B = {"Authorization": "Bearer key-b-456"}
MINTED = re.compile(r"resp_[0-9a-f]{32}")


def body_of(user: str, stream: bool, previous: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "instructions": "Be brief.", "input": user,
                            "max_output_tokens": 24, "stream": stream}
    if previous is not None:
        body["previous_response_id"] = previous
    return body


def final_response(text: str, stream: bool) -> dict[str, Any]:
    if not stream:
        obj: dict[str, Any] = json.loads(text)
        return obj
    events = [json.loads(b.partition("\n")[2][6:]) for b in text.split("\n\n") if b.strip()]
    snapshots = [e["response"] for e in events if "response" in e]
    assert len(snapshots) >= 2  # created ... completed
    ids = {s["id"] for s in snapshots}
    assert len(ids) == 1, ids  # every snapshot carries the router's id
    assert all(s["store"] is True for s in snapshots)
    return snapshots[-1]


async def chain(post: Any, stream: bool, headers: dict[str, str] | None = None
                ) -> tuple[list[httpx.Response], list[dict[str, Any]], list[Any]]:
    """Four turns, each naming the previous response: the HTTP answers, the final response
    objects, and the whole input each turn stands for (for a recompute)."""
    answers: list[httpx.Response] = []
    finals: list[dict[str, Any]] = []
    inputs: list[Any] = []
    history: list[Any] = []
    previous = None
    for i, user in enumerate([FIRST, *FOLLOW_UPS]):
        resp = await post(i, body_of(user, stream, previous), headers)
        assert resp.status_code == 200, resp.text
        response = final_response(resp.text, stream)
        assert_clean(resp.text, [response])
        history.append({"role": "user", "content": user})
        inputs.append(list(history))
        history += response["output"]
        assert MINTED.fullmatch(response["id"]) and response["store"] is True
        assert response["previous_response_id"] == previous
        answers.append(resp)
        finals.append(response)
        previous = response["id"]
    return answers, finals, inputs


async def recompute(r: Routed, items: list[Any]) -> str:
    body = {"model": "tiny", "instructions": "Be brief.", "input": items,
            "max_output_tokens": 24, "store": False}
    async with r_client() as c:
        resp = await c.post(r.reference.url + "/v1/responses", json=body)
    assert resp.status_code == 200, resp.text
    return Reply("responses", resp.text, False).text


async def delete(r: Routed, path: str, headers: dict[str, str]) -> httpx.Response:
    async with r.asgi_client() as c:
        return await c.delete(path, headers=headers)


def text_of(response: dict[str, Any]) -> str:
    return "".join(p["text"] for item in response["output"] if item["type"] == "message"
                   for p in item["content"])


@pytest.mark.parametrize("stream", [False, True])
async def test_a_previous_response_id_chain_pulls_and_matches_a_recompute(stream: bool) -> None:
    async with routed(response_store="memory") as r:
        p, d = r.cluster.prefill[0], r.cluster.decode[0]

        async def post(i: int, body: dict[str, Any], headers: Any) -> httpx.Response:
            resp = await r.post("/v1/responses", body)
            await r.settle()
            return resp

        answers, finals, inputs = await chain(post, stream)
        reasons = [a.headers["x-kvrelay-reason"] for a in answers]
        assert reasons == ["no_entry", "pull", "pull", "pull"]
        reused = [int(a.headers["x-kvrelay-reused-tokens"]) for a in answers]
        assert all(n > 0 for n in reused[1:])
        for response, n in zip(finals, reused, strict=True):
            assert response["usage"]["input_tokens_details"]["cached_tokens"] == n
        assert external_kv_tokens(parse_prometheus(p.metrics_text())) == sum(reused)
        pulls = [rec for rec in p.records if rec.plan == "pull"]
        assert len(pulls) == 3
        assert all(rec.pulled_from_engine == d.engine_id and rec.pulled_matches_prompt
                   and not rec.wrong_reuse for rec in pulls)
        # P and D saw whole-conversation requests: no previous_response_id, store: false,
        # D the router's id as request_id
        sent = [json.loads(x.body) for e in (p, d) for x in e.received
                if x.path == "/v1/responses"]
        assert len(sent) == 8
        assert all("previous_response_id" not in b and b["store"] is False for b in sent)
        d_ids = [json.loads(x.body)["request_id"] for x in d.received
                 if x.path == "/v1/responses"]
        assert d_ids == [f["id"] for f in finals]
        assert [await recompute(r, items) for items in inputs] == [text_of(f) for f in finals]
        for response in finals:
            got = await r.get(f"/v1/responses/{response['id']}")
            assert got.status_code == 200 and got.json() == response


async def test_misses_are_one_404_and_delete_forgets() -> None:
    async with routed(response_store="memory", response_store_ttl_s=100.0,
                      api_keys=KEYS) as r:
        first = await r.post("/v1/responses", body_of(FIRST, False), headers=A)
        assert first.status_code == 200
        rid = first.json()["id"]
        await r.settle()
        assert (await r.get(f"/v1/responses/{rid}", headers=A)).status_code == 200
        async with r.client(headers=A) as c:  # a HEAD asks as a GET does, and deletes nothing
            head = await c.head(f"/v1/responses/{rid}")
            assert (head.status_code, head.content) == (200, b"")
        assert (await r.get(f"/v1/responses/{rid}", headers=A)).status_code == 200
        misses = [
            await r.get(f"/v1/responses/{rid}", headers=B),  # another tenant's
            await r.get("/v1/responses/resp_" + "0" * 32, headers=A),  # unknown
            await r.get("/v1/responses/" + "x" * 300, headers=A),  # never minted
            await r.post("/v1/responses", body_of("more", False, rid), headers=B),
        ]
        deleted = await delete(r, f"/v1/responses/{rid}", A)
        assert deleted.status_code == 200
        assert deleted.json() == {"id": rid, "object": "response", "deleted": True}
        misses += [await r.get(f"/v1/responses/{rid}", headers=A),
                   await delete(r, f"/v1/responses/{rid}", A),
                   await r.post("/v1/responses", body_of("more", False, rid), headers=A)]
        second = await r.post("/v1/responses", body_of(FIRST, False), headers=A)
        await r.settle()
        r.clock.advance(100.0)
        misses += [await r.get(f"/v1/responses/{second.json()['id']}", headers=A),
                   await r.post("/v1/responses", body_of("more", False,
                                                         second.json()["id"]), headers=A)]
        # GET/DELETE: one 404 whatever the miss; previous_response_id: OpenAI's 400
        # previous_response_not_found (clients read the code and re-send the whole input),
        # its message one per id whatever the miss (another tenant's, deleted, expired)
        gets = [m for m in misses if m.request.method != "POST"]
        posts = [m for m in misses if m.request.method == "POST"]
        assert all(m.status_code == 404 for m in gets), [m.text for m in gets]
        assert len({m.json()["error"]["message"] for m in gets}) == 1
        assert all(m.status_code == 400 for m in posts), [m.text for m in posts]
        for m in posts:
            error = m.json()["error"]
            assert (error["code"], error["param"]) == ("previous_response_not_found",
                                                       "previous_response_id")
            asked = json.loads(m.request.content)["previous_response_id"]
            assert error["message"] == f"Previous response with id '{asked}' not found."
        for m in misses:
            assert set(m.json()["error"]) == {"message", "type", "param", "code"}
        no_key = await r.get(f"/v1/responses/{rid}")
        assert no_key.status_code == 401
        # retrieve(..., stream=True): no stream of a stored response, said (the SDK would
        # read no events from a JSON answer and say nothing)
        streamed = await r.get(f"/v1/responses/{second.json()['id']}?stream=true", headers=A)
        assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"
        # GET (HEAD) and DELETE are counted under one endpoint, never an id: three GETs
        # and a DELETE answered 200 above, six misses were GETs or DELETEs (the rest POSTs)
        metrics = (await r.internal_get("/metrics")).text
        done = 'kvrelay_router_requests_total{endpoint="/v1/responses/{id}",status="%s"}'
        assert done % "200" + " 4.0" in metrics
        assert done % "404" + " 6.0" in metrics
        assert done % "401" + " 1.0" in metrics
        assert rid not in metrics


async def test_an_expansion_past_the_body_limit_is_refused_not_sent() -> None:
    """A ``previous_response_id`` expands a small request into the whole stored
    conversation: held to ``--max-body-bytes`` as a body is, so a chain of large turns cannot
    make the router build (and P, D and the store receive) bodies of any size."""
    limit = 20_000
    async with routed(response_store="memory", max_body_bytes=limit) as r:
        big = "word " * 1_400  # ~7 kB a turn
        previous = None
        for _ in range(2):
            resp = await r.post("/v1/responses", body_of(big, False, previous))
            assert resp.status_code == 200, resp.text
            previous = resp.json()["id"]
            await r.settle()
        received = sum(len(e.received) for e in r.cluster.engines)
        refused = await r.post("/v1/responses", body_of(big, False, previous))
        assert refused.status_code == 400, refused.text
        err = refused.json()["error"]
        assert err["param"] == "previous_response_id" and str(limit) in err["message"]
        assert sum(len(e.received) for e in r.cluster.engines) == received  # nothing sent
        # the stored response itself is still there, and a small new turn is served
        assert (await r.get(f"/v1/responses/{previous}")).status_code == 200
        assert (await r.post("/v1/responses", body_of("hi", False))).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_a_response_the_store_could_not_keep_says_store_false(
        stream: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A put that fails (Redis down: ``put`` reports it) leaves the client told ``store:
    false`` in the final response, never holding an id to continue from that was not kept;
    the next put that works keeps its response (``store: true``)."""
    async with routed(response_store="memory") as r:
        store = r.ctx.responses
        assert store is not None
        working = store.put

        async def down(tenant: str, response_id: str, stored: StoredResponse) -> bool:
            return False

        monkeypatch.setattr(store, "put", down)
        resp = await r.post("/v1/responses", body_of(FIRST, stream))
        assert resp.status_code == 200, resp.text
        if stream:
            events = [json.loads(b.partition("\n")[2][6:]) for b in resp.text.split("\n\n")
                      if b.strip()]
            snapshots = [e["response"] for e in events if "response" in e]
            assert snapshots[0]["store"] is True  # response.created: before D answered
            final = snapshots[-1]
            assert events[-1]["type"] in ("response.completed", "response.incomplete")
        else:
            final = resp.json()
        assert final["store"] is False and MINTED.fullmatch(final["id"])
        assert (await r.get(f"/v1/responses/{final['id']}")).status_code == 404
        monkeypatch.setattr(store, "put", working)
        again = await r.post("/v1/responses", body_of(FIRST, stream))
        kept = final_response(again.text, stream)
        assert kept["store"] is True
        assert (await r.get(f"/v1/responses/{kept['id']}")).status_code == 200


async def test_one_tenant_cannot_push_out_anothers_responses() -> None:
    """``--response-store-max-mb-per-tenant``: a tenant storing more than its share loses
    its own oldest responses, never another tenant's (the global bound alone evicted the
    oldest of all: a flood by one key emptied everyone's conversations)."""
    async with routed(response_store="memory", response_store_max_mb=2,
                      response_store_max_mb_per_tenant=1, api_keys=KEYS) as r:
        a = await r.post("/v1/responses", body_of(FIRST, False), headers=A)
        assert a.status_code == 200 and a.json()["store"] is True
        ids = []
        for i in range(12):  # ~1.8 MB of B's: the whole store's size, twice B's share
            resp = await r.post("/v1/responses", body_of(f"{i} " + "lorem ipsum " * 12_500,
                                                         False), headers=B)
            assert resp.status_code == 200, resp.text
            ids.append(resp.json()["id"])
        assert (await r.get(f"/v1/responses/{a.json()['id']}", headers=A)).status_code == 200
        follow_up = await r.post("/v1/responses", body_of("And?", False, a.json()["id"]),
                                 headers=A)
        assert follow_up.status_code == 200
        b_kept = [(await r.get(f"/v1/responses/{i}", headers=B)).status_code for i in ids]
        assert b_kept[0] == 404 and b_kept[-1] == 200  # B's own oldest went
        assert 3 <= b_kept.count(200) <= 7


async def test_store_false_keeps_nothing_and_the_store_off_refuses() -> None:
    async with routed(response_store="memory") as r:
        resp = await r.post("/v1/responses", {**body_of(FIRST, False), "store": False})
        assert resp.status_code == 200
        response = resp.json()
        assert not response.get("store") and not MINTED.fullmatch(response["id"])
        assert (await r.get(f"/v1/responses/{response['id']}")).status_code == 404
        bad = await r.post("/v1/responses", {**body_of(FIRST, False), "store": "yes"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "store"
    async with routed(response_store="memory") as r:  # no Conversations API either way
        conv = await r.post("/v1/responses", {**body_of(FIRST, False), "conversation": "c1"})
        assert conv.status_code == 400 and "previous_response_id" in conv.text
        assert "keeps no responses" not in conv.text
    async with routed() as r:
        refused = await r.post("/v1/responses", body_of("x", False, "resp_1"))
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "previous_response_not_found"
        assert "store: false" in refused.json()["error"]["message"]
        kept = await r.post("/v1/responses", body_of(FIRST, False))
        assert not kept.json().get("store")
        gone = await r.get(f"/v1/responses/{kept.json()['id']}")
        assert gone.status_code == 404


@contextlib.asynccontextmanager
async def sdk_first_response(r: Routed) -> AsyncIterator[tuple[openai.AsyncOpenAI, Any]]:
    """The openai SDK's client of the router, and the first response of a chain (settled)."""
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="unused", max_retries=0)
    try:
        first = await client.responses.create(model="tiny", input=FIRST, max_output_tokens=16)
        await r.settle()
        yield client, first
    finally:
        await client.close()


async def test_the_openai_sdk_chains_with_previous_response_id() -> None:
    async with routed(response_store="memory") as r, sdk_first_response(r) as (client, first):
        async with await client.responses.create(
                model="tiny", input="More please.", previous_response_id=first.id,
                max_output_tokens=16, stream=True) as stream:
            done = [e async for e in stream if e.type == "response.completed"]
        decision = await r.last_decision()
        assert decision["reason"] == "pull"
        second = done[0].response
        assert second.previous_response_id == first.id
        assert second.usage is not None
        assert second.usage.input_tokens_details.cached_tokens == \
            decision["reused_tokens"] > 0
        fetched = await client.responses.retrieve(second.id)
        assert fetched.output_text == second.output_text
        await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)


async def test_input_items_list_what_a_response_was_made_from() -> None:
    """``GET /v1/responses/{id}/input_items`` (before: a 404): the whole input the stored
    response stands for (the chain's earlier inputs and outputs, then its own), newest first
    unless ``order=asc``, in pages with ``limit`` and ``after``; easy-form messages typed,
    each item with an id that stays the same; the tenant's own only."""
    async with routed(response_store="memory", api_keys=KEYS) as r:
        first = (await r.post("/v1/responses", body_of(FIRST, False), headers=A)).json()
        await r.settle()
        second = (await r.post("/v1/responses", body_of("And Asia?", False, first["id"]),
                               headers=A)).json()
        await r.settle()
        path = f"/v1/responses/{second['id']}/input_items"
        listed = (await r.get(path + "?order=asc", headers=A)).json()
        assert listed["object"] == "list" and listed["has_more"] is False
        items = listed["data"]
        assert [i["type"] for i in items] == ["message"] * 3
        assert [i["role"] for i in items] == ["user", "assistant", "user"]
        assert items[0]["content"] == [{"type": "input_text", "text": FIRST}]
        assert items[1] == first["output"][0]  # an earlier output, as it was answered
        assert items[2]["content"] == [{"type": "input_text", "text": "And Asia?"}]
        assert (listed["first_id"], listed["last_id"]) == (items[0]["id"], items[2]["id"])
        newest_first = (await r.get(path, headers=A)).json()
        assert newest_first["data"] == items[::-1]  # OpenAI's default order: desc
        pages, after = [], ""
        while True:
            one = (await r.get(f"{path}?order=asc&limit=1{after}", headers=A)).json()
            pages += one["data"]
            if not one["has_more"]:
                break
            after = f"&after={one['last_id']}"
        assert pages == items
        own = (await r.get(f"/v1/responses/{first['id']}/input_items", headers=A)).json()
        assert [i["id"] for i in own["data"]] == [items[0]["id"]]  # an id for the same item
        assert (await r.get(path, headers=B)).status_code == 404  # another tenant's
        bad = [await r.get(path + q, headers=A) for q in ("?limit=0", "?limit=101",
                                                           "?limit=x", "?order=up")]
        assert [b.status_code for b in bad] == [400] * 4
        assert [b.json()["error"]["param"] for b in bad] == ["limit"] * 3 + ["order"]
        assert (await r.get(path + "/more", headers=A)).status_code == 404
        assert (await delete(r, path, A)).status_code == 404  # deletes nothing
        assert (await r.get(f"/v1/responses/{second['id']}", headers=A)).status_code == 200
        metrics = (await r.internal_get("/metrics")).text
        done = ('kvrelay_router_requests_total{endpoint="/v1/responses/{id}/input_items",'
                'status="%s"}')
        assert done % "200" + " 6.0" in metrics and done % "400" + " 4.0" in metrics


async def test_the_openai_sdk_lists_input_items() -> None:
    async with routed(response_store="memory") as r, sdk_first_response(r) as (client, first):
        second = await client.responses.create(
            model="tiny", input="More please.", previous_response_id=first.id,
            max_output_tokens=16)
        items = [item async for item in client.responses.input_items.list(
            second.id, limit=1, order="asc")]  # the SDK pages with after
        assert [item.type for item in items] == ["message"] * 3
        assert items[1].id == first.output[0].id


def test_a_redis_response_store_needs_the_state_backend() -> None:
    with pytest.raises(ConfigError, match="state"):
        RouterConfig.from_urls(["http://p"], ["http://d"], response_store="redis")
    with pytest.raises(ConfigError, match="response_store"):
        RouterConfig.from_urls(["http://p"], ["http://d"], response_store="disk")


@contextlib.asynccontextmanager
async def two_replicas(redis: RedisServer, clock: ManualClock
                       ) -> AsyncIterator[tuple[FakeCluster, list[RouterContext], list[str]]]:
    async with FakeCluster(1, 1, ENGINE_CONFIG, clock=clock) as cluster:
        servers, ctxs, urls = [], [], []
        try:
            for _ in range(2):
                port, internal_port = free_ports(2)
                config = RouterConfig.from_urls(
                    cluster.prefill_urls, cluster.decode_urls,
                    block_size=ENGINE_CONFIG.block_size, port=port, internal_port=internal_port,
                    health_interval_s=3600.0, report_wait_s=5.0, state=redis.url,
                    state_timeout_ms=2000.0, response_store="redis", **fixed())
                store = RedisResponseStore.from_url(redis.url, ttl_s=100.0, max_bytes=1 << 20,
                                                    wall_clock=clock, timeout_s=2.0)
                app = create_app(config, clock=clock, response_store=store)
                for served, at in ((app.public, port),
                                   (app.internal, config.listen_internal_port)):
                    server = HttpServer(served, "127.0.0.1", at)
                    await server.start()
                    servers.append(server)
                ctxs.append(app.ctx)
                urls.append(f"http://127.0.0.1:{port}")
            yield cluster, ctxs, urls
        finally:
            for server in servers:
                await server.stop()
            for ctx in ctxs:
                await ctx.upstream.aclose()
                await ctx.index.aclose()
                assert ctx.responses is not None
                await ctx.responses.aclose()


async def test_two_replicas_on_redis_share_the_store_and_the_chain_pulls(
    redis_server: RedisServer,
) -> None:
    """Turns alternate between the replicas, each naming the previous response (stored by the
    other one). Each replica first serves one unrelated turn: a replica that has not yet seen
    P's answer cannot know P proves pulls for this API (``router.plan`` step 3)."""
    clock = ManualClock(1_000_000.0)
    async with two_replicas(redis_server, clock) as (cluster, ctxs, urls), \
            httpx.AsyncClient(timeout=60.0, trust_env=False) as c:
        async def settle() -> None:
            await cluster.drain_reports()
            for _ in range(2000):
                if all(len(x.desk) == 0 for x in ctxs):
                    return
                await asyncio.sleep(0.005)

        for url in urls:
            warm = await c.post(url + "/v1/responses", json={
                **body_of("warm up " * 30, False), "store": False})
            assert warm.status_code == 200
        await settle()

        async def post(i: int, body: dict[str, Any], headers: Any) -> httpx.Response:
            resp = await c.post(urls[i % 2] + "/v1/responses", json=body)
            await settle()
            return resp

        answers, finals, _ = await chain(post, stream=True)
        assert [a.headers["x-kvrelay-reason"] for a in answers] == \
            ["no_entry", "pull", "pull", "pull"]
        last = finals[-1]["id"]
        for url in urls:
            got = await c.get(f"{url}/v1/responses/{last}")
            assert got.status_code == 200 and got.json() == finals[-1]
        assert (await c.delete(f"{urls[0]}/v1/responses/{last}")).status_code == 200
        assert (await c.get(f"{urls[1]}/v1/responses/{last}")).status_code == 404
        clock.advance(100.0)
        expired = await c.get(f"{urls[1]}/v1/responses/{finals[0]['id']}")
        assert expired.status_code == 404


async def test_the_redis_store_bounds_each_tenants_share(redis_server: RedisServer) -> None:
    """As the memory store: one tenant past its share evicts only its own oldest; the global
    bound the oldest of all; deletes and expiry give the share back."""
    clock = ManualClock(1_000_000.0)
    evicted: list[str] = []
    store = RedisResponseStore.from_url(redis_server.url, ttl_s=10.0, max_bytes=400,
                                        max_bytes_per_tenant=250, wall_clock=clock,
                                        timeout_s=2.0, deployment="shares",
                                        on_evict=evicted.append)
    try:
        item = StoredResponse(b"[" + b"1," * 49 + b"1]", b'{"output":[]}')  # 114 bytes
        assert await store.put("a", "a1", item)
        for i in range(5):  # b floods: its share holds two
            clock.advance(0.1)
            assert await store.put("b", f"b{i}", item)
        assert await store.get("a", "a1") == item
        kept = [await store.get("b", f"b{i}") is not None for i in range(5)]
        assert kept == [False, False, False, True, True] and evicted == ["capacity"] * 3
        assert not await store.put("b", "big", StoredResponse(b"x" * 251, b"{}"))
        clock.advance(0.1)
        assert await store.put("c", "c1", item)  # 4 x 114 > 400: the oldest of all (a1)
        assert await store.get("a", "a1") is None and len(evicted) == 4
        assert await store.delete("b", "b3")
        clock.advance(0.1)
        assert await store.put("b", "b5", item)  # b holds two again: nothing evicted
        assert len(evicted) == 4 and await store.get("b", "b4") == item
        clock.advance(10.0)  # all expired: the next put drops them and their shares
        assert await store.put("b", "b6", item) and await store.put("b", "b7", item)
        assert len(evicted) == 4
        client = store._client
        tbytes = await client.hgetall("kvrelay:shares:resp:tbytes")
        assert {k.decode(): int(v) for k, v in tbytes.items()} == {
            "kvrelay:shares:resp:tenant:b:order": 2 * item.num_bytes}
        assert int(await client.get("kvrelay:shares:resp:bytes")) == 2 * item.num_bytes
    finally:
        await store.aclose()


async def test_the_redis_store_bounds_its_bytes_oldest_first(redis_server: RedisServer) -> None:
    clock = ManualClock(1_000_000.0)
    store = RedisResponseStore.from_url(redis_server.url, ttl_s=10.0, max_bytes=250,
                                        wall_clock=clock, timeout_s=2.0)
    try:
        item = StoredResponse(b"[" + b"1," * 49 + b"1]", b'{"output":[]}')  # 114 bytes
        assert await store.put("t", "r1", item)
        assert await store.put("t", "r2", item)
        assert await store.get("t", "r1") == item
        assert await store.put("t", "r3", item)  # 342 > 250: r1 goes
        assert await store.get("t", "r1") is None
        assert await store.get("t", "r2") == item and await store.get("t", "r3") == item
        assert await store.get("u", "r2") is None  # another tenant
        assert not await store.put("t", "big", StoredResponse(b"x" * 300, b"{}"))
        clock.advance(10.0)
        assert await store.get("t", "r3") is None  # expired, before Redis deletes it
        assert await store.put("t", "r4", item)
        assert await store.get("t", "r4") == item
        assert not await store.delete("t", "r3")
        assert await store.delete("t", "r4") and not await store.delete("t", "r4")
    finally:
        await store.aclose()
