"""Router turns against a scripted mock cluster (stock vLLM nodes: the router verifies the
prefix itself with P's ``/tokenize`` and D's token ids): decisions, reports, stripping,
conversation identity with and without ids, stats, metrics and health."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from kvrelay.core.conversation import ConversationKey
from tests.component.router_mock import MockCluster
from tests.component.router_rig import (
    Chat,
    Rig,
    assert_no_internal_fields,
    sse_events,
    until,
)

LONG = "tell me a long story about " + "x" * 60
SYSTEM = {"role": "system", "content": "You are a careful agent. Follow the tool protocol. " * 3}
FIRST = {"role": "user", "content": "Task: summarise the repository layout in detail."}


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    r = Rig(MockCluster())
    yield r
    assert not r.cluster.wrong_reuses and not r.cluster.double_reads
    await r.close()


def p_paths(rig: Rig) -> list[str]:
    return [path for path, _ in rig.cluster.node("prefill-0").requests]


def cached_tokens(payload: dict[str, Any]) -> int:
    value: int = payload["usage"]["prompt_tokens_details"]["cached_tokens"]
    return value


async def test_two_turns_non_streamed_pull_on_turn_two(rig: Rig) -> None:
    chat = Chat(rig, "conv-a")
    resp, _ = await chat.turn(LONG)
    assert resp.status_code == 200
    assert (await rig.last_decision())["reason"] == "no_entry"
    assert cached_tokens(resp.json()) == 0  # OpenAI's usage convention, non-streamed always
    assert len(rig.ctx.index) == 1
    resp, _ = await chat.turn("and then?")
    assert resp.status_code == 200
    last = await rig.last_decision()
    assert (last["action"], last["reason"], last["exact"]) == ("pull", "pull", True)
    held = len(chat.messages[0]["content"]) + 8  # a lower bound: prompt 1 + generated - 1
    assert last["verified_tokens"] >= held
    # stock P: the router tokenized the prompt on P (turn 2 only: turn 1 had no entry)
    assert p_paths(rig) == ["/v1/chat/completions", "/tokenize", "/v1/chat/completions"]
    # P got D's retained params, capped to the verified prefix, host as advertised
    p_body = rig.cluster.node("prefill-0").generation_requests()[-1]
    params = p_body["kv_transfer_params"]
    assert params["do_remote_decode"] is True
    assert params["remote_num_tokens"] == last["reused_tokens"] <= last["verified_tokens"]
    assert params["remote_engine_id"] == "engine-decode-0-1"
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert "conversation_id" not in p_body
    assert [r.num_tokens for r in rig.cluster.reads] == [params["remote_num_tokens"]]
    # D got P's params and return_token_ids (stock D), no report target: a non-streamed
    # answer carries D's params itself
    d_body = rig.cluster.node("decode-0").generation_requests()[-1]
    assert d_body["kv_transfer_params"]["do_remote_prefill"] is True
    assert not any(k.startswith("kvrelay_") for k in d_body["kv_transfer_params"])
    assert d_body["return_token_ids"] is True
    assert "conversation_id" not in d_body
    data = resp.json()
    assert_no_internal_fields([data])
    assert "prompt_token_ids" not in data
    assert "token_ids" not in data["choices"][0]
    assert resp.headers["x-kvrelay-action"] == "pull"
    assert resp.headers["x-kvrelay-reason"] == "pull"
    assert int(resp.headers["x-kvrelay-reused-tokens"]) == last["reused_tokens"] > 0
    assert cached_tokens(data) == last["reused_tokens"]
    assert data["usage"]["prompt_tokens"] > cached_tokens(data)
    # the pulled entry is spent, the new turn's entry replaces it
    assert len(rig.ctx.index) == 1
    entry = await chat.entry()
    assert entry is not None and entry.turn == 2


async def test_streamed_turns_use_the_report_and_strip_fields(rig: Rig) -> None:
    chat = Chat(rig, "conv-s", stream=True)
    resp, text1 = await chat.turn(LONG)
    assert resp.status_code == 200 and len(text1) == 8
    events = sse_events(resp.text)
    assert_no_internal_fields(events)
    assert all("usage" not in e for e in events if isinstance(e, dict))  # not asked for
    assert (resp.headers["x-kvrelay-action"], resp.headers["x-kvrelay-reason"]) == (
        "recompute", "no_entry")
    assert resp.headers["x-kvrelay-reused-tokens"] == "0"
    d_params = rig.cluster.node("decode-0").generation_requests()[-1]["kv_transfer_params"]
    assert d_params["kvrelay_report_url"] == "http://127.0.0.1:18001/internal/kv-report"
    assert d_params["kvrelay_turn_id"]
    resp, _ = await chat.turn("more")
    assert resp.status_code == 200
    last = await rig.last_decision()
    assert (last["action"], last["reason"]) == ("pull", "pull")
    assert resp.headers["x-kvrelay-action"] == "pull"
    assert int(resp.headers["x-kvrelay-reused-tokens"]) == last["reused_tokens"] > 0
    assert_no_internal_fields(sse_events(resp.text))
    await rig.settle()
    assert rig.cluster.report_results == [{"outcome": "matched"}] * 2
    assert rig.ctx.metrics.reports.labels("matched")._value.get() == 2
    assert len(rig.ctx.desk) == 0 and len(rig.ctx.index) == 1


async def test_streamed_usage_gets_cached_tokens_when_the_client_asks(rig: Rig) -> None:
    chat = Chat(rig, "usage", stream=True)
    options = {"stream_options": {"include_usage": True}}
    resp, _ = await chat.turn(LONG, **options)
    usage = [e for e in sse_events(resp.text) if isinstance(e, dict) and e.get("usage")]
    assert len(usage) == 1 and cached_tokens(usage[0]) == 0
    await rig.settle()
    resp, _ = await chat.turn("more", **options)
    events = sse_events(resp.text)
    usage = [e for e in events if isinstance(e, dict) and e.get("usage")]
    reused = int(resp.headers["x-kvrelay-reused-tokens"])
    assert reused > 0 and len(usage) == 1
    assert cached_tokens(usage[0]) == reused < usage[0]["usage"]["prompt_tokens"]
    assert_no_internal_fields(events)


async def test_untouched_events_pass_through_byte_for_byte() -> None:
    """Only events the router must change are re-encoded: with the client asking for the
    token ids itself (nothing to strip) and no usage asked for, the client gets D's stream
    exactly as D sent it."""
    cluster = MockCluster()
    rig = Rig(cluster)
    sent: list[bytes] = []
    original = cluster._stream

    async def record(*args: Any, **kw: Any) -> AsyncIterator[bytes]:
        async for chunk in original(*args, **kw):
            sent.append(chunk)
            yield chunk

    cluster._stream = record  # type: ignore[method-assign]
    try:
        resp = await rig.post("/v1/chat/completions", {
            "model": "mock", "messages": [{"role": "user", "content": LONG}],
            "max_tokens": 8, "stream": True, "return_token_ids": True})
        assert resp.status_code == 200
        assert resp.content == b"".join(sent)
    finally:
        await rig.close()


async def test_report_before_stream_end_also_commits() -> None:
    rig = Rig(MockCluster(report_mode="before"))
    try:
        chat = Chat(rig, "c", stream=True)
        await chat.turn(LONG)
        await chat.turn("again")
        assert (await rig.last_decision())["reason"] == "pull"
        assert rig.cluster.report_results[0] == {"outcome": "matched"}
    finally:
        await rig.close()


async def test_final_chunk_params_v033_commit_without_report() -> None:
    rig = Rig(MockCluster(final_chunk_params=True, report_mode="never"))
    try:
        chat = Chat(rig, "c", stream=True)
        resp, _ = await chat.turn(LONG)
        assert_no_internal_fields(sse_events(resp.text))
        assert len(rig.ctx.index) == 1 and len(rig.ctx.desk) == 0
        await chat.turn("again")
        assert (await rig.last_decision())["reason"] == "pull"
    finally:
        await rig.close()


@pytest.mark.parametrize("conversation_id", ["c", None])
async def test_next_turn_waits_for_a_late_report(conversation_id: str | None) -> None:
    rig = Rig(MockCluster(report_mode="manual"))
    try:
        chat = Chat(rig, conversation_id, stream=True)
        await chat.turn(LONG)
        assert len(rig.ctx.desk) == 1 and len(rig.ctx.index) == 0
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


async def test_batched_reports_commit_every_turn() -> None:
    """D's connector posts the reports that are due together, as one JSON list."""
    rig = Rig(MockCluster(1, 2, report_mode="manual"))
    try:
        chats = [Chat(rig, None, stream=True) for _ in range(3)]
        for i, chat in enumerate(chats):
            await chat.turn(f"{LONG} number {i}")
        assert len(rig.ctx.desk) == 3 and len(rig.ctx.index) == 0
        held, rig.cluster.held_reports = rig.cluster.held_reports, []
        forged = {**held[0], "turn_id": "forged"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=rig.app.internal),
                                     base_url="http://router") as internal:
            resp = await internal.post("/internal/kv-report", json=[*held, forged, {}])
        assert resp.json() == {"outcomes": ["matched"] * 3 + ["unknown_turn", "invalid"]}
        assert len(rig.ctx.desk) == 0 and len(rig.ctx.index) == 3
        for chat in chats:
            resp, _ = await chat.turn("next")
            assert resp.headers["x-kvrelay-action"] == "pull"
    finally:
        await rig.close()


async def test_report_that_never_comes_recomputes_no_entry() -> None:
    rig = Rig(MockCluster(report_mode="never"), {"report_wait_s": 0.05})
    try:
        chat = Chat(rig, "c", stream=True)
        await chat.turn(LONG)
        await chat.turn("again")
        assert (await rig.last_decision())["reason"] == "no_entry"
        assert len(rig.ctx.index) == 0
    finally:
        await rig.close()


async def test_report_timeout_settles_the_pending_turn() -> None:
    rig = Rig(MockCluster(report_mode="manual"), {"report_timeout_s": 0.01})
    try:
        chat = Chat(rig, "c", stream=True)
        await chat.turn(LONG)
        await until(lambda: len(rig.ctx.desk) == 0, "the pending turn timed out")
        await rig.cluster.deliver_reports()  # too late: refused, nothing committed
        assert rig.cluster.report_results[-1]["outcome"] == "late"
        assert len(rig.ctx.index) == 0
        assert rig.ctx.metrics.turn_entries.labels("report_timeout")._value.get() == 1
        assert rig.ctx.metrics.reports.labels("late")._value.get() == 1
    finally:
        await rig.close()


@pytest.mark.parametrize("conversation_id", ["comp", None])
async def test_completions_streamed_and_not(rig: Rig, conversation_id: str | None) -> None:
    prompt = "once upon a time " * 5
    for stream in (False, True):
        first = f"{stream}: {prompt}"
        body: dict[str, Any] = {"model": "mock", "prompt": first, "max_tokens": 8,
                                "stream": stream}
        if conversation_id is not None:
            body["conversation_id"] = f"{conversation_id}-{stream}"
        resp = await rig.post("/v1/completions", body)
        assert resp.status_code == 200
        payloads = sse_events(resp.text) if stream else [resp.json()]
        assert_no_internal_fields(payloads)
        text = "".join(c["text"] for p in payloads if isinstance(p, dict) for c in p["choices"])
        await rig.settle()
        follow_up = {**body, "prompt": first + text + " next"}
        resp = await rig.post("/v1/completions", follow_up)
        assert resp.status_code == 200
        assert (await rig.last_decision())["reason"] == "pull", stream
    assert len(rig.cluster.reads) == 2


async def test_completions_given_as_token_ids_pull_with_an_explicit_id(rig: Rig) -> None:
    """A prompt of token ids: the router has the exact ids without ``/tokenize``."""
    ids = list(b"once upon a time " * 6)
    body = {"model": "mock", "prompt": ids, "max_tokens": 8, "conversation_id": "ids"}
    resp = await rig.post("/v1/completions", body)
    answer = list(resp.json()["choices"][0]["text"].encode())
    resp = await rig.post("/v1/completions", {**body, "prompt": ids + answer + [32, 110]})
    assert (resp.headers["x-kvrelay-action"], resp.headers["x-kvrelay-reason"]) == (
        "pull", "pull")
    assert "/tokenize" not in p_paths(rig)
    assert [r.num_tokens for r in rig.cluster.reads] == [len(ids) + len(answer) - 1]


async def test_client_token_ids_are_kept_when_asked(rig: Rig) -> None:
    body = {"model": "mock", "messages": [{"role": "user", "content": LONG}],
            "max_tokens": 4, "return_token_ids": True, "conversation_id": "ids"}
    data = (await rig.post("/v1/chat/completions", body)).json()
    assert data["choices"][0]["token_ids"] and data["prompt_token_ids"]
    assert "kv_transfer_params" not in data
    resp = await rig.post("/v1/chat/completions", {**body, "stream": True})
    events = [e for e in sse_events(resp.text) if isinstance(e, dict)]
    assert events[0]["prompt_token_ids"]
    assert all(e["choices"][0]["token_ids"] for e in events[1:])
    assert all("kv_transfer_params" not in e for e in events)


# -- conversation identity ----------------------------------------------------------------


async def test_identity_from_headers_body_and_prompt_cache_key(rig: Rig) -> None:
    """An explicit id scopes the entry: only a follow-up with the same id finds it. The
    body's ``conversation_id`` beats a session header; ``prompt_cache_key`` is no id
    (clients share one across conversations with a common prefix): it scopes nothing."""
    chats: dict[str, tuple[Chat, dict[str, str]]] = {}
    for name, headers, extra in [
        ("h1", {"X-Conversation-ID": "h1"}, {}),
        ("h2", {"X-Session-ID": "h2"}, {}),
        ("body", {"X-Conversation-ID": "h3"}, {"conversation_id": "body"}),
        ("h4", {"X-Session-ID": "h4"}, {"prompt_cache_key": "pck"}),
        ("pck", {}, {"prompt_cache_key": "pck2"}),
    ]:
        chat = Chat(rig, None)
        chat.messages.append({"role": "user", "content": LONG})
        resp = await rig.post("/v1/chat/completions", chat.body(**extra), headers=headers)
        assert resp.status_code == 200
        assert (await rig.last_decision())["reason"] == "no_entry"
        chat.messages.append({"role": "assistant", "content": resp.json()["choices"][0][
            "message"]["content"]})
        chats[name] = (chat, headers)
    assert len(rig.ctx.index) == 5  # one history, five scopes

    def ids(conversation_id: str) -> dict[str, str]:
        return {"X-Conversation-ID": conversation_id}

    chat = chats["h1"][0]
    assert await chat.entry(headers=ids("h1")) is not None
    assert await chat.entry(headers={"X-Session-ID": "h2"}) is not None
    assert await chat.entry(headers=ids("body")) is not None
    assert await chat.entry(headers=ids("h3")) is None  # the body's id won over the header
    assert await chat.entry(headers=ids("h4")) is not None  # the header, not the cache key
    assert await chat.entry(headers=ids("pck")) is None
    assert await chat.entry(headers=ids("pck2")) is None
    assert await chat.entry() is not None  # the cache key's turn is in the id-less scope
    # the follow-up itself, with its id, pulls
    chat, headers = chats["h2"]
    chat.messages.append({"role": "user", "content": "and then?"})
    resp = await rig.post("/v1/chat/completions", chat.body(), headers=headers)
    assert resp.headers["x-kvrelay-action"] == "pull"


async def test_no_conversation_id_pulls_on_the_follow_ups(rig: Rig) -> None:
    """Most agent clients send no id: the router finds the entry from the messages alone."""
    chat = Chat(rig, None)
    resp, _ = await chat.turn(LONG)
    assert resp.status_code == 200
    first = await rig.last_decision()
    assert (first["action"], first["reason"]) == ("recompute", "no_entry")
    assert first["key"]  # a tag for the new conversation
    assert p_paths(rig) == ["/v1/chat/completions"]  # no entry: nothing to verify
    assert len(rig.ctx.index) == 1
    for turn, user in enumerate(["and then?", "why?", "thanks"], start=2):
        resp, _ = await chat.turn(user)
        last = await rig.last_decision()
        assert (last["action"], last["reason"], last["turn"]) == ("pull", "pull", turn)
        assert last["key"] == first["key"]  # inherited from the entry continued
        assert int(resp.headers["x-kvrelay-reused-tokens"]) > 0
    assert p_paths(rig).count("/tokenize") == 3
    assert len(rig.cluster.reads) == 3 and len(rig.ctx.index) == 1


async def test_another_id_never_continues_an_entry(rig: Rig) -> None:
    """An explicit id narrows the scope: the same history under another id, or without an
    id, is a new conversation and leaves the owner's entry alone."""
    owner = Chat(rig, "owner")
    await owner.turn(LONG)
    for intruder in ("other", None):
        chat = Chat(rig, intruder, messages=[dict(m) for m in owner.messages])
        resp, _ = await chat.turn("continue")
        assert resp.status_code == 200
        assert (resp.headers["x-kvrelay-action"], resp.headers["x-kvrelay-reason"]) == (
            "recompute", "no_entry")
    assert not rig.cluster.reads
    resp, _ = await owner.turn("continue")
    assert resp.headers["x-kvrelay-action"] == "pull"


async def test_idless_conversations_sharing_a_prefix_each_continue_their_own() -> None:
    """An agent's conversations share a system prompt and first message; their sampled
    answers differ. Each follow-up pulls its own conversation's entry, read by P exactly."""
    rig = Rig(MockCluster(1, 2))
    try:
        chats = [Chat(rig, None, messages=[dict(SYSTEM)]) for _ in range(4)]
        for chat in chats:
            resp, _ = await chat.turn(FIRST["content"], temperature=0.8)
            assert resp.headers["x-kvrelay-reason"] == "no_entry"
        answers = [chat.messages[-1]["content"] for chat in chats]
        assert len(set(answers)) == 4
        assert len(rig.ctx.index) == 4
        for chat, answer in zip(reversed(chats), reversed(answers), strict=True):
            resp, _ = await chat.turn("next step", temperature=0.8)
            assert resp.headers["x-kvrelay-action"] == "pull"
            read = rig.cluster.reads[-1]
            assert rig.cluster.retained_for(answer) == [read.request_id]
            assert read.correct and read.num_tokens == int(
                resp.headers["x-kvrelay-reused-tokens"])
        assert not rig.cluster.wrong_reuses and not rig.cluster.double_reads
    finally:
        await rig.close()


async def test_sharing_only_a_prefix_never_consumes_another_conversations_entry(
    rig: Rig,
) -> None:
    owner = Chat(rig, None, messages=[dict(SYSTEM)])
    await owner.turn(FIRST["content"])
    answer = owner.messages[-1]["content"]
    strangers = [
        [SYSTEM, {"role": "user", "content": "A different task entirely."}],
        [SYSTEM, FIRST],  # the same start, no answer yet: a new conversation
        [SYSTEM, FIRST, {"role": "assistant", "content": answer + " (edited)"},
         {"role": "user", "content": "go on"}],
    ]
    for messages in strangers:
        resp = await rig.post("/v1/chat/completions", {
            "model": "mock", "messages": messages, "max_tokens": 8})
        assert resp.status_code == 200
        assert resp.headers["x-kvrelay-reason"] == "no_entry"
    assert not rig.cluster.reads
    entry = await owner.entry()
    assert entry is not None and entry.turn == 1  # still there for its owner
    resp, _ = await owner.turn("next")
    assert resp.headers["x-kvrelay-action"] == "pull"
    assert rig.cluster.reads[-1].request_id in rig.cluster.retained_for(answer)


async def test_completions_sharing_only_a_prefix_never_consume_an_entry(rig: Rig) -> None:
    shared = "A long shared instruction block for every task. " * 30  # > 1 KiB
    resp = await rig.post("/v1/completions", {
        "model": "mock", "prompt": shared + "Task one:", "max_tokens": 8})
    text = resp.json()["choices"][0]["text"]
    for prompt in (shared + "Task two:", shared + "Task one:" + text[:4] + "X more"):
        resp = await rig.post("/v1/completions", {"model": "mock", "prompt": prompt,
                                                  "max_tokens": 8})
        assert resp.headers["x-kvrelay-reason"] == "no_entry", prompt[-20:]
    assert not rig.cluster.reads
    resp = await rig.post("/v1/completions", {
        "model": "mock", "prompt": shared + "Task one:" + text + " more", "max_tokens": 8})
    assert resp.headers["x-kvrelay-action"] == "pull"


@pytest.mark.parametrize("stream", [False, True])
async def test_guard_connector_forced_on_stock_nodes_never_pulls_unproven_kv(
    stream: bool,
) -> None:
    """``guard = connector`` in front of stock vLLM (a misconfiguration): the router neither
    tokenizes nor asks for token ids, D's params carry no fingerprint, so no entry is ever
    kept and nothing is pulled: slower, never wrong."""
    rig = Rig(MockCluster(), {"guard": "connector"})
    try:
        chat = Chat(rig, None, stream=stream)
        for user in (LONG, "again", "and again"):
            resp, _ = await chat.turn(user)
            assert resp.status_code == 200
            assert resp.headers["x-kvrelay-reason"] == "no_entry"
            await rig.settle()
        assert "/tokenize" not in p_paths(rig)
        d_bodies = rig.cluster.node("decode-0").generation_requests()
        assert all("return_token_ids" not in b for b in d_bodies)
        assert len(rig.ctx.index) == 0 and not rig.cluster.reads
        assert rig.ctx.metrics.turn_entries.labels("no_fingerprint")._value.get() == 3
        assert (await rig.stats())["guard"]["nodes"] == {"prefill-0": "connector",
                                                         "decode-0": "connector"}
    finally:
        await rig.close()


# -- what the router shows ----------------------------------------------------------------


async def test_stats_hash_keys_and_show_nodes(rig: Rig) -> None:
    await Chat(rig, "secret-conversation").turn(LONG)
    stats = await rig.stats()
    text = str(stats)
    assert "secret-conversation" not in text
    assert stats["decisions"]["recent"][-1]["key"] == ConversationKey(
        "default", "secret-conversation").hashed(rig.ctx.tag_key)
    assert {n["id"] for n in stats["nodes"]} == {"prefill-0", "decode-0"}
    for node in stats["nodes"]:  # details are the admin's (/admin/nodes)
        assert not {"url", "engine_id", "last_error", "side_channel"} & set(node)
    assert "http://" not in text and "engine-" not in text
    assert stats["guard"] == {"mode": "auto",
                              "nodes": {"prefill-0": "tokenize", "decode-0": "tokenize"}}
    assert stats["conversations"]["live"] == 1
    assert stats["decisions"]["by_reason"] == {"no_entry": 1}
    assert stats["decisions"]["by_action"] == {"recompute": 1}
    assert stats["decisions"]["recompute"] == {"no_entry": 1}
    assert stats["decisions"]["pull"] == {} and stats["decisions"]["direct"] == {}
    recent = stats["decisions"]["recent"][-1]
    assert set(recent) == {
        "at_s", "key", "turn", "tenant", "action", "reason", "decided", "exact",
        "verified_tokens",
        "reused_tokens", "prompt_tokens", "predicted_transfer_s", "predicted_prefill_s",
        "endpoint", "stream", "prefill_node", "decode_node", "retries", "state", "outcome"}
    assert (recent["outcome"], recent["state"], recent["turn"]) == ("ok", "done", 1)
    assert recent["decided"] == "recompute/no_entry"
    assert (recent["tenant"], recent["endpoint"], recent["stream"]) == ("default", "chat", False)


async def test_metrics_exposition(rig: Rig) -> None:
    chat = Chat(rig, "m", stream=True)
    await chat.turn(LONG)
    await chat.turn("next")
    await rig.settle()
    text = (await rig.client.get("/metrics")).text
    assert 'kvrelay_router_turn_decisions_total{action="pull",reason="pull"} 1.0' in text
    assert 'kvrelay_router_requests_total{endpoint="/v1/chat/completions",status="200"} 2.0' \
        in text
    assert 'kvrelay_router_ttft_seconds_count{action="pull"} 1.0' in text
    assert 'kvrelay_router_node_up{node="decode-0",role="decode"} 1.0' in text
    assert "kvrelay_router_live_entries 1.0" in text
    assert "kvrelay_router_pending_reports 0.0" in text
    assert 'kvrelay_router_turn_entries_total{outcome="committed"} 2.0' in text
    assert "kvrelay_router_retained_tokens" not in text  # sizes: not for an open scrape
    assert "kvrelay_router_prompt_tokens_total" not in text
    full = rig.ctx.metrics.render().decode()  # what the internal listener serves
    assert 'kvrelay_router_retained_tokens{node="decode-0"}' in full
    reused = rig.ctx.metrics.prompt_tokens.labels("reused")._value.get()
    assert reused == (await rig.last_decision())["reused_tokens"] > 0


async def test_models_and_health() -> None:
    rig = Rig(MockCluster(1, 2))
    try:
        models = await rig.client.get("/v1/models")
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "mock"
        health = await rig.client.get("/health")
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        d0 = rig.cluster.node("decode-0")
        d0.health = 503
        health = await rig.client.get("/health")  # the last known state: no live check
        assert health.json() == {"status": "ok"} and d0.health_checks == 0
        await rig.ctx.nodes.check_all()  # one failure: not yet down (2 needed)
        assert (await rig.client.get("/health")).json() == {"status": "ok"}
        await rig.ctx.nodes.check_all()
        health = await rig.client.get("/health")
        assert health.status_code == 200 and health.json() == {"status": "degraded"}
        rig.cluster.node("decode-1").health = "connect"
        await rig.ctx.nodes.check_all()
        await rig.ctx.nodes.check_all()
        health = await rig.client.get("/health")
        assert health.status_code == 503 and health.json() == {"status": "unavailable"}
        d0.health = 200
        await rig.ctx.nodes.check_all()
        assert (await rig.client.get("/health")).json() == {"status": "degraded"}
        assert d0.health_checks == 5  # only the explicit checks reached the node
    finally:
        await rig.close()
