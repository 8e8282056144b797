"""API keys, tenant isolation, admin endpoints and what logs and ``/stats`` reveal."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import httpx
import pytest

from kvrelay.client.sse import sse_events
from kvrelay.core.conversation import ConversationEntry
from kvrelay.router.config import ConfigError, build_config
from tests.component.router_fake import STOCK_CONFIG, PermitSleep, Routed, routed
from tests.component.router_rig import Chat, lookup, stream_text

FIRST = "Describe the water cycle for a curious ten year old, step by step. " * 5
KEYS = ["tenant-a:key-a-123", "tenant-b:key-b-456", "bare-key-789"]
A = {"Authorization": "Bearer key-a-123"}
B = {"Authorization": "Bearer key-b-456"}
ADMIN = {"Authorization": "Bearer admin-key-0"}
LONG = "a question that is long enough to pull " + "y" * 60


def conversation(r: Routed, conversation_id: str | None, **kw: Any) -> Chat:
    return Chat(r, conversation_id, model="tiny", **kw)


def assert_error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    return dict(err)


def request(messages: list[dict[str, Any]], conversation_id: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": 8,
                            "stream": True}
    if conversation_id is not None:
        body["conversation_id"] = conversation_id
    return body


async def chat(r: Routed, headers: dict[str, str], messages: list[dict[str, Any]],
               conversation_id: str | None = "shared") -> httpx.Response:
    async with r.client() as c:
        resp = await c.post("/v1/chat/completions", headers=headers,
                            json=request(messages, conversation_id))
    assert resp.status_code == 200, resp.text
    return resp


async def entry_of(r: Routed, tenant: str, messages: list[dict[str, Any]],
                   conversation_id: str | None) -> ConversationEntry | None:
    """The entry a follow-up of ``messages`` by ``tenant`` would continue."""
    follow_up = [*messages, {"role": "user", "content": "(probe)"}]
    found = await lookup(r.ctx, request(follow_up, conversation_id), tenant=tenant)
    return found.entry if found is not None else None


@pytest.mark.parametrize("conversation_id", ["shared", None])
async def test_tenants_cannot_address_each_others_conversations(
    conversation_id: str | None,
) -> None:
    """Whether B sends A's conversation id or no id at all, with A's exact history, it
    never finds, consumes or learns about A's entry."""
    async with routed(api_keys=KEYS) as r:
        a_msgs: list[dict[str, Any]] = [{"role": "user", "content": FIRST}]
        resp = await chat(r, A, a_msgs, conversation_id)
        a_msgs.append({"role": "assistant", "content": stream_text(sse_events(resp.text))})
        await r.settle()
        entry_a = await entry_of(r, "tenant-a", a_msgs, conversation_id)
        assert entry_a is not None
        assert await entry_of(r, "tenant-b", a_msgs, conversation_id) is None

        # B sends A's history (and A's id, if any): nothing of A's is used
        b_msgs = [*a_msgs, {"role": "user", "content": "And then?"}]
        resp = await chat(r, B, b_msgs, conversation_id)
        assert resp.headers["x-kvrelay-reason"] == "no_entry"
        assert resp.headers["x-kvrelay-reused-tokens"] == "0"
        await r.settle()
        assert await entry_of(r, "tenant-a", a_msgs, conversation_id) == entry_a  # untouched
        b_msgs.append({"role": "assistant", "content": stream_text(sse_events(resp.text))})
        assert await entry_of(r, "tenant-b", b_msgs, conversation_id) is not None
        # B's new entry is B's: A, sending the same history, still finds only its own
        assert await entry_of(r, "tenant-a", b_msgs, conversation_id) == entry_a

        # A's next turn still pulls its own entry, all of it
        resp = await chat(r, A, [*a_msgs, {"role": "user", "content": "Tell me more."}],
                          conversation_id)
        assert (resp.headers["x-kvrelay-action"], resp.headers["x-kvrelay-reason"]) == (
            "pull", "pull")
        assert int(resp.headers["x-kvrelay-reused-tokens"]) == entry_a.num_tokens

        # /stats: each tenant sees only its own decisions, the admin-less router none to B
        async with r.client() as c:
            stats_a = (await c.get("/stats", headers=A)).json()
            stats_b = (await c.get("/stats", headers=B)).json()
            assert_error(await c.get("/stats"), 401)
        assert {d["tenant"] for d in stats_a["decisions"]["recent"]} == {"tenant-a"}
        assert len(stats_a["decisions"]["recent"]) == 2
        assert [d["reason"] for d in stats_b["decisions"]["recent"]] == ["no_entry"]
        a_keys = {d["key"] for d in stats_a["decisions"]["recent"]}
        assert len(a_keys) == 1  # one conversation, and B's is not it
        assert stats_b["decisions"]["recent"][0]["key"] not in a_keys
        for stats in (stats_a, stats_b):
            assert "shared" not in str(stats)


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer wrong"}, {"Authorization": "key-a-123"},
    {"Authorization": "Basic key-a-123"}, {"Authorization": "Bearer "},
    {"Authorization": "Bearer key-a-1234"}, {"Authorization": "Bearer admin-key-0"},
    {"x-api-key": "wrong"}, {"x-api-key": " "}, {"x-api-key": "admin-key-0"},
])
async def test_requests_without_a_valid_key_get_401(headers: dict[str, str]) -> None:
    async with routed(1, 1, STOCK_CONFIG, api_keys=KEYS, admin_key="admin-key-0") as rig:
        for path in ("/v1/chat/completions", "/v1/completions"):
            resp = await rig.post(path, {"prompt": "x", "messages": []}, headers=headers)
            err = assert_error(resp, 401)
            assert err["type"] == "AuthenticationError"
            assert resp.headers["www-authenticate"] == "Bearer"
            assert "key-a-123" not in resp.text
        assert_error(await rig.get("/v1/models", headers=headers), 401)
        assert not any(e.received for e in rig.cluster.engines)  # nothing reached a node
        # the health check and metrics stay open
        assert (await rig.get("/health")).status_code == 200
        assert (await rig.get("/metrics")).status_code == 200


async def test_anthropic_clients_key_in_x_api_key_names_its_tenant() -> None:
    """Claude Code and Anthropic's SDKs send ``ANTHROPIC_API_KEY`` as ``x-api-key``; a
    Bearer token, when both come, is the key that counts."""
    body = {"model": "tiny", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello there"}]}
    async with routed(1, 1, STOCK_CONFIG, api_keys=KEYS) as rig:
        resp = await rig.post("/v1/messages", body, headers={"x-api-key": "key-b-456"})
        assert resp.status_code == 200, resp.text
        resp = await rig.post("/v1/messages", body, headers={"x-api-key": "key-a-123", **B})
        assert resp.status_code == 200
        stats = (await rig.get("/stats", headers=B)).json()
        assert [d["tenant"] for d in stats["decisions"]["recent"]] == ["tenant-b"] * 2


async def test_a_tenants_stats_show_no_other_tenants_load_or_traffic() -> None:
    """The prompt tokens in flight on a node tell how long another tenant's prompt is, and
    the cost fits' sample counts how many requests others send: a tenant's ``/stats`` shows
    the nodes without them, the admin's with them."""
    async with routed(1, 1, STOCK_CONFIG, api_keys=KEYS, admin_key="admin-key-0") as rig:
        resp = await conversation(rig, "c").turn(LONG)
        assert resp[0].status_code == 401
        rig.headers.update(A)
        assert (await conversation(rig, "c").turn(LONG))[0].status_code == 200
        tenant = (await rig.get("/stats", headers=B)).json()["nodes"]
        admin = (await rig.get("/stats", headers={"Authorization": "Bearer admin-key-0"})
                 ).json()["nodes"]
        assert [set(n) for n in tenant] == [{"id", "role", "up", "drained"}] * 2
        assert all({"outstanding_prefill_tokens", "costs"} <= set(n) for n in admin)
        assert [n["id"] for n in tenant] == [n["id"] for n in admin]


async def test_bare_key_maps_to_the_default_tenant() -> None:
    async with routed(1, 1, STOCK_CONFIG, api_keys=KEYS) as rig:
        chat_ = conversation(rig, "c")
        resp, _ = await chat_.turn(LONG, )
        assert_error(resp, 401)
        rig.headers["Authorization"] = "Bearer bare-key-789"
        chat_.messages.clear()
        resp, _ = await chat_.turn(LONG)
        assert resp.status_code == 200
        await rig.settle()
        assert await chat_.entry(tenant="default") is not None
        assert await chat_.entry(tenant="bare-key-789") is None
        assert (await rig.get("/v1/models")).status_code == 200


async def test_admin_endpoints_need_the_admin_key() -> None:
    async with routed(1, 2, STOCK_CONFIG, api_keys=KEYS, admin_key="admin-key-0") as rig:
        path = "/admin/nodes/decode-0/drain"
        assert_error(await rig.post(path, b""), 401)
        assert_error(await rig.post(path, b"", headers=A), 403)
        assert_error(await rig.post("/admin/nodes/nope/drain", b"", headers=ADMIN), 404)
        assert_error(await rig.get(path, headers=ADMIN), 405)
        resp = await rig.post(path, b"", headers=ADMIN)
        assert resp.json() == {"node": "decode-0", "drained": True}
        # node details are the admin's: /admin/nodes
        assert_error(await rig.get("/admin/nodes"), 401)
        assert_error(await rig.get("/admin/nodes", headers=A), 403)
        # a key sent as Anthropic's x-api-key is the same key: a tenant's 403, the admin's in
        assert_error(await rig.get("/admin/nodes", headers={"x-api-key": "key-a-123"}), 403)
        assert_error(await rig.get("/admin/nodes", headers={"x-api-key": "wrong"}), 401)
        assert (await rig.get("/admin/nodes", headers={"x-api-key": "admin-key-0"})
                ).status_code == 200
        nodes = (await rig.get("/admin/nodes", headers=ADMIN)).json()["nodes"]
        assert [(n["id"], n["url"], n["drained"]) for n in nodes] == [
            ("prefill-0", rig.cluster.prefill_urls[0], False),
            ("decode-0", rig.cluster.decode_urls[0], True),
            ("decode-1", rig.cluster.decode_urls[1], False)]
        assert [n["guard"] for n in nodes] == ["tokenize"] * 3  # stock vLLM, nothing seen
        rig.headers.update(A)
        for i in range(3):  # no new turn goes to the drained node
            resp, _ = await conversation(rig, f"d{i}").turn(LONG)
            assert resp.status_code == 200
            assert (await rig.last_decision())["decode_node"] == "decode-1"
        stats = (await rig.get("/stats", headers=ADMIN)).json()
        assert [n["drained"] for n in stats["nodes"]] == [False, True, False]
        assert (await rig.post("/admin/nodes/decode-0/undrain", b"", headers=ADMIN)).json()[
            "drained"] is False

        # drop one conversation of one tenant
        chat_a = conversation(rig, "to-drop")
        assert (await chat_a.turn(LONG))[0].status_code == 200
        await rig.settle()
        body = {"tenant": "tenant-a", "conversation_id": "to-drop"}
        assert_error(await rig.post("/admin/conversations/drop", body, headers=B), 403)
        assert_error(await rig.post("/admin/conversations/drop", {"tenant": "x"},
                                    headers=ADMIN), 400)
        assert await chat_a.entry(tenant="tenant-a") is not None
        resp = await rig.post("/admin/conversations/drop", body, headers=ADMIN)
        assert resp.json() == {"dropped": True, "entries": 1, "turns_under_way": 0}
        assert await chat_a.entry(tenant="tenant-a") is None
        resp = await rig.post("/admin/conversations/drop", body, headers=ADMIN)
        assert resp.json() == {"dropped": False, "entries": 0, "turns_under_way": 0}
        await chat_a.turn("next")
        assert (await rig.last_decision())["reason"] == "no_entry"
        # the admin sees every tenant's decisions
        recent = (await rig.get("/stats", headers=ADMIN)).json()["decisions"]["recent"]
        assert {d["tenant"] for d in recent} == {"tenant-a"}


async def test_one_tenant_cannot_evict_anothers_entries() -> None:
    """Each tenant holds at most ``max_entries_per_tenant`` entries: a tenant starting many
    conversations evicts its own oldest, never another tenant's."""
    async with routed(1, 1, STOCK_CONFIG, api_keys=KEYS, max_entries_per_tenant=2,
                      max_entries=10) as rig:
        rig.headers.update(B)
        b_chat = conversation(rig, None)
        await b_chat.turn(LONG)
        rig.headers.update(A)
        a_chats = [conversation(rig, None) for _ in range(4)]
        for i, c in enumerate(a_chats):
            assert (await c.turn(f"{LONG} {i}"))[0].status_code == 200
        assert len(rig.ctx.index) == 3
        assert [await c.entry(tenant="tenant-a") is not None for c in a_chats] == [
            False, False, True, True]
        assert await b_chat.entry(tenant="tenant-b") is not None
        assert rig.ctx.metrics.dropped.labels("capacity")._value.get() == 2
        rig.headers.update(B)
        resp, _ = await b_chat.turn("next")
        assert resp.headers["x-kvrelay-action"] == "pull"


async def test_admin_endpoints_do_not_exist_without_an_admin_key() -> None:
    async with routed(1, 1, STOCK_CONFIG, api_keys=KEYS) as rig:
        for path in ("/admin/nodes/decode-0/drain", "/admin/conversations/drop"):
            for headers in ({}, A, {"Authorization": "Bearer admin-key-0"}):
                err = assert_error(await rig.post(path, b"{}", headers=headers), 404)
                assert err["type"] == "NotFoundError"


async def test_without_keys_the_router_is_open() -> None:
    async with routed(1, 1, STOCK_CONFIG) as rig:
        resp, _ = await conversation(rig, "c").turn(LONG)
        assert resp.status_code == 200
        assert (await rig.get("/stats")).status_code == 200


async def test_logs_never_show_raw_conversation_ids_or_keys(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    raw_id = "RAW-conversation-ID-7f3a"
    held = PermitSleep()  # D's reports wait for deliver()
    # vLLM 0.32 engines: a 0.33 D's stream carries its params, so no report would be pending
    config = replace(STOCK_CONFIG, report_delay_s=0.1, vllm_version="0.32")

    async def deliver(r: Routed) -> None:
        held.grant(held.waiting)
        await r.cluster.drain_reports()

    async with routed(1, 2, config, sleep=held, api_keys=KEYS, admin_key="admin-key-0",
                      report_wait_s=0.01) as rig:
        rig.headers.update(A)
        chat_ = conversation(rig, raw_id, stream=True)
        assert (await chat_.turn(LONG))[0].status_code == 200
        await chat_.turn("report still pending")  # logs that the report is pending
        await deliver(rig)
        for d in rig.cluster.decode:  # a D failure, retried elsewhere
            await d.crash()
        await chat_.turn("and a failure")
        rig.headers.update(B)
        await conversation(rig, raw_id).turn(LONG, stream=True)
        await rig.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                "conversation_id": raw_id, "n": 3})
        await rig.post("/admin/conversations/drop", {"conversation_id": raw_id}, headers=ADMIN)
        await deliver(rig)
    messages = [r.getMessage() for r in caplog.records]
    assert any("pending" in m for m in messages)  # the id-bearing paths did log
    assert any("down" in m for m in messages)
    for record in caplog.records:
        text = record.getMessage() + repr(record.args) + str(record.exc_info)
        assert raw_id not in text
        for secret in ("key-a-123", "key-b-456", "admin-key-0"):
            assert secret not in text


@pytest.mark.parametrize("layer", [
    {"api_keys": ["a:"]}, {"api_keys": [":k"]}, {"api_keys": ["k", "k"]},
    {"api_keys": ["a:k k"]}, {"tenants": {"a": 3}}, {"tenants": ["a"]},
    {"api_keys": ["k"], "admin_key": "k"}, {"api_keys": 5},
    {"max_body_bytes": 0}, {"max_in_flight": 0}, {"drain_timeout_s": 0},
])
def test_invalid_security_settings(layer: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        build_config({"prefill": ["http://p:1"], "decode": ["http://d:2"]}, layer)


def test_key_settings_layers_and_formats() -> None:
    base = {"prefill": ["http://p:1"], "decode": ["http://d:2"],
            "tenants": {"t1": ["s1", "s2"], "t2": "s3"}, "api_keys": ["s4", "t3:s:5"]}
    config = build_config(base)
    assert [(k.tenant, k.secret) for k in config.api_keys] == [
        ("t1", "s1"), ("t1", "s2"), ("t2", "s3"), (None, "s4"), ("t3", "s:5")]
    assert "s1" not in repr(config)
    env = build_config(base, {"api_keys": "t9:e1, e2", "admin_key": "adm"})  # env replaces
    assert [(k.tenant, k.secret) for k in env.api_keys] == [("t9", "e1"), (None, "e2")]
    assert "adm" not in repr(env)


async def test_health_says_unavailable_when_every_d_is_drained() -> None:
    """A router whose every D (or P) is drained can route nothing: ``/health`` answers 503
    ``unavailable`` (a readiness probe takes it out of service), ``degraded`` while one D
    is drained. Before, it answered ok while every turn got a 503 (probe 14, K6)."""
    async with routed(1, 2, STOCK_CONFIG, admin_key="admin-key-0") as rig:
        assert (await rig.get("/health")).json() == {"status": "ok"}
        await rig.post("/admin/nodes/decode-0/drain", b"", headers=ADMIN)
        assert (await rig.get("/health")).json() == {"status": "degraded"}
        await rig.post("/admin/nodes/decode-1/drain", b"", headers=ADMIN)
        health = await rig.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
        await rig.post("/admin/nodes/decode-1/undrain", b"", headers=ADMIN)
        await rig.post("/admin/nodes/prefill-0/drain", b"", headers=ADMIN)
        assert (await rig.get("/health")).status_code == 503
