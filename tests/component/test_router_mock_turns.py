"""Router turns against a scripted mock cluster: decisions, reports, stripping, stats."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvrelay.core.conversation import ConversationKey
from tests.component.router_mock import MockCluster
from tests.component.router_rig import (
    Chat,
    Rig,
    assert_no_internal_fields,
    sse_events,
)

LONG = "tell me a long story about " + "x" * 60


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    r = Rig(MockCluster())
    yield r
    await r.close()


async def test_two_turns_non_streamed_pull_on_turn_two(rig: Rig) -> None:
    chat = Chat(rig, "conv-a")
    resp, _ = await chat.turn(LONG)
    assert resp.status_code == 200
    assert (await rig.last_decision())["reason"] == "no_entry"
    assert len(rig.ctx.store) == 1
    resp, _ = await chat.turn("and then?")
    assert resp.status_code == 200
    last = await rig.last_decision()
    assert (last["action"], last["reason"]) == ("pull", "pull")
    held = len(chat.messages[0]["content"]) + 8  # a lower bound: prompt 1 + generated - 1
    assert last["verified_tokens"] >= held
    # P got D's retained params, capped to the verified prefix, host as advertised
    p_body = rig.cluster.node("prefill-0").generation_requests()[-1]
    params = p_body["kv_transfer_params"]
    assert params["do_remote_decode"] is True
    assert params["remote_num_tokens"] == last["verified_tokens"]
    assert params["remote_engine_id"] == "engine-decode-0-1"
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert "conversation_id" not in p_body
    # D got P's params plus the report keys, and return_token_ids
    d_body = rig.cluster.node("decode-0").generation_requests()[-1]
    assert d_body["kv_transfer_params"]["do_remote_prefill"] is True
    assert d_body["kv_transfer_params"]["kvrelay_report_url"].endswith("/internal/kv-report")
    assert d_body["kv_transfer_params"]["kvrelay_turn_id"]
    assert d_body["return_token_ids"] is True
    assert "conversation_id" not in d_body
    assert_no_internal_fields([resp.json()])
    assert "prompt_token_ids" not in resp.json()
    assert "token_ids" not in resp.json()["choices"][0]
    assert resp.headers["x-kvrelay-action"] == "pull"
    assert resp.headers["x-kvrelay-reason"] == "pull"
    assert int(resp.headers["x-kvrelay-reused-tokens"]) == last["reused_tokens"] > 0


async def test_streamed_turns_use_the_report_and_strip_fields(rig: Rig) -> None:
    chat = Chat(rig, "conv-s", stream=True)
    resp, text1 = await chat.turn(LONG)
    assert resp.status_code == 200 and len(text1) == 8
    events = sse_events(resp.text)
    assert_no_internal_fields(events)
    assert (resp.headers["x-kvrelay-action"], resp.headers["x-kvrelay-reason"]) == (
        "recompute", "no_entry")
    assert resp.headers["x-kvrelay-reused-tokens"] == "0"
    resp, _ = await chat.turn("more")
    assert resp.status_code == 200
    last = await rig.last_decision()
    assert (last["action"], last["reason"]) == ("pull", "pull")
    assert resp.headers["x-kvrelay-action"] == "pull"
    assert int(resp.headers["x-kvrelay-reused-tokens"]) == last["reused_tokens"] > 0
    assert_no_internal_fields(sse_events(resp.text))
    assert rig.ctx.metrics.reports.labels("matched")._value.get() >= 2


async def test_report_before_stream_end_also_commits() -> None:
    rig = Rig(MockCluster(report_mode="before"))
    try:
        chat = Chat(rig, "c", stream=True)
        await chat.turn(LONG)
        await chat.turn("again")
        assert (await rig.last_decision())["reason"] == "pull"
    finally:
        await rig.close()


async def test_final_chunk_params_v033_commit_without_report() -> None:
    rig = Rig(MockCluster(final_chunk_params=True, report_mode="never"))
    try:
        chat = Chat(rig, "c", stream=True)
        resp, _ = await chat.turn(LONG)
        assert_no_internal_fields(sse_events(resp.text))
        assert len(rig.ctx.store) == 1 and len(rig.ctx.reports) == 0
        await chat.turn("again")
        assert (await rig.last_decision())["reason"] == "pull"
    finally:
        await rig.close()


async def test_next_turn_waits_for_a_late_report() -> None:
    rig = Rig(MockCluster(report_mode="manual"))
    try:
        chat = Chat(rig, "c", stream=True)
        await chat.turn(LONG)
        assert len(rig.ctx.reports) == 1 and len(rig.ctx.store) == 0
        turn2 = asyncio.create_task(chat.turn("again"))
        for _ in range(100):  # until turn 2 is waiting on the pending report
            await asyncio.sleep(0)
        assert not turn2.done()
        await rig.cluster.deliver_reports()
        resp, _ = await turn2
        assert resp.status_code == 200
        assert (await rig.last_decision())["reason"] == "pull"
    finally:
        await rig.close()


async def test_report_that_never_comes_recomputes_no_entry() -> None:
    rig = Rig(MockCluster(report_mode="never"), {"report_wait_s": 0.05})
    try:
        chat = Chat(rig, "c", stream=True)
        await chat.turn(LONG)
        await chat.turn("again")
        assert (await rig.last_decision())["reason"] == "no_entry"
    finally:
        await rig.close()


async def test_report_timeout_settles_the_pending_turn() -> None:
    rig = Rig(MockCluster(report_mode="manual"), {"report_timeout_s": 0.01})
    try:
        chat = Chat(rig, "c", stream=True)
        await chat.turn(LONG)
        key = ConversationKey("default", "c")
        assert await rig.ctx.reports.wait_for(key, 5.0)
        assert len(rig.ctx.reports) == 0
        await rig.cluster.deliver_reports()  # too late: ignored
        assert rig.cluster.report_results[-1]["outcome"] == "unknown_turn"
        assert len(rig.ctx.store) == 0
        assert rig.ctx.metrics.turn_entries.labels("report_timeout")._value.get() == 1
    finally:
        await rig.close()


async def test_completions_streamed_and_not(rig: Rig) -> None:
    prompt = "once upon a time " * 5
    for stream in (False, True):
        body = {"model": "mock", "prompt": prompt, "max_tokens": 8, "stream": stream,
                "conversation_id": f"comp-{stream}"}
        resp = await rig.post("/v1/completions", body)
        assert resp.status_code == 200
        payloads = sse_events(resp.text) if stream else [resp.json()]
        assert_no_internal_fields(payloads)
        text = "".join(c["text"] for p in payloads if isinstance(p, dict) for c in p["choices"])
        resp = await rig.post("/v1/completions", {**body, "prompt": prompt + text + " next"})
        assert resp.status_code == 200
        assert (await rig.last_decision())["reason"] == "pull", stream


async def test_client_token_ids_are_kept_when_asked(rig: Rig) -> None:
    body = {"model": "mock", "messages": [{"role": "user", "content": LONG}],
            "max_tokens": 4, "return_token_ids": True, "conversation_id": "ids"}
    data = (await rig.post("/v1/chat/completions", body)).json()
    assert data["choices"][0]["token_ids"] and data["prompt_token_ids"]
    assert "kv_transfer_params" not in data
    resp = await rig.post("/v1/chat/completions", {**body, "stream": True})
    events = [e for e in sse_events(resp.text) if isinstance(e, dict)]
    assert events[0]["prompt_token_ids"]
    assert all("kv_transfer_params" not in e for e in events)


async def test_identity_from_headers_and_body_precedence(rig: Rig) -> None:
    msgs = [{"role": "user", "content": LONG}]
    for headers in ({"X-Conversation-ID": "h1"}, {"X-Session-ID": "h2"}):
        resp = await rig.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 4},
                              headers=headers)
        assert resp.status_code == 200
        assert (await rig.last_decision())["reason"] == "no_entry"
    assert await rig.ctx.store.get(ConversationKey("default", "h1")) is not None
    assert await rig.ctx.store.get(ConversationKey("default", "h2")) is not None
    await rig.post("/v1/chat/completions",
                   {"messages": msgs, "max_tokens": 4, "conversation_id": "body"},
                   headers={"X-Conversation-ID": "h3"})
    assert await rig.ctx.store.get(ConversationKey("default", "body")) is not None
    assert await rig.ctx.store.get(ConversationKey("default", "h3")) is None


async def test_no_conversation_id_recomputes_without_tokenize_or_report(rig: Rig) -> None:
    resp, _ = await Chat(rig, None).turn(LONG)
    assert resp.status_code == 200
    last = await rig.last_decision()
    assert (last["action"], last["reason"], last["key"]) == ("recompute", "no_conversation_id",
                                                             None)
    p = rig.cluster.node("prefill-0")
    assert [path for path, _ in p.requests] == ["/v1/chat/completions"]
    d_body = rig.cluster.node("decode-0").generation_requests()[-1]
    assert "kvrelay_report_url" not in d_body["kv_transfer_params"]
    assert "return_token_ids" not in d_body
    assert len(rig.ctx.store) == 0


async def test_stats_hash_keys_and_show_nodes(rig: Rig) -> None:
    await Chat(rig, "secret-conversation").turn(LONG)
    stats = await rig.stats()
    text = str(stats)
    assert "secret-conversation" not in text
    assert stats["decisions"]["recent"][-1]["key"] == ConversationKey(
        "default", "secret-conversation").hashed()
    assert {n["id"] for n in stats["nodes"]} == {"prefill-0", "decode-0"}
    assert stats["conversations"]["live"] == 1
    assert stats["decisions"]["by_reason"] == {"no_entry": 1}
    assert stats["decisions"]["by_action"] == {"recompute": 1}
    assert stats["decisions"]["recompute"] == {"no_entry": 1}
    assert stats["decisions"]["pull"] == {} and stats["decisions"]["direct"] == {}
    assert stats["decisions"]["recent"][-1]["outcome"] == "ok"


async def test_metrics_exposition(rig: Rig) -> None:
    chat = Chat(rig, "m", stream=True)
    await chat.turn(LONG)
    await chat.turn("next")
    text = (await rig.client.get("/metrics")).text
    assert 'kvrelay_router_turn_decisions_total{action="pull",reason="pull"} 1.0' in text
    assert 'kvrelay_router_requests_total{endpoint="/v1/chat/completions",status="200"} 2.0' \
        in text
    assert 'kvrelay_router_ttft_seconds_count{action="pull"} 1.0' in text
    assert 'kvrelay_router_node_up{node="decode-0",role="decode"} 1.0' in text
    assert "kvrelay_router_live_entries 1.0" in text
    assert "kvrelay_router_pending_reports" in text
    reused = rig.ctx.metrics.prompt_tokens.labels("reused")._value.get()
    assert reused == (await rig.last_decision())["verified_tokens"]


async def test_models_and_health(rig: Rig) -> None:
    models = await rig.client.get("/v1/models")
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "mock"
    health = await rig.client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    rig.cluster.node("decode-0").health = 503
    health = await rig.client.get("/health")  # one failure: not yet down (2 needed)
    assert health.json()["status"] == "ok"
    health = await rig.client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "unavailable"
    rig.cluster.node("decode-0").health = 200
    assert (await rig.client.get("/health")).status_code == 200
