"""Every turn-policy reason, reached through the router's HTTP API (scripted mock cluster of
stock vLLM nodes, so the router runs the exact prefix guard itself with P's ``/tokenize``;
injected router clock: no sleeps for TTLs). Every test also checks what P read: never a
wrong prefix, never one D request twice."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from msgspec.structs import replace

from kvrelay.router.config import build_config
from tests.component.router_mock import MockCluster
from tests.component.router_rig import Chat, Rig, until
from tests.costs import fixed

LONG = "please explain the following in detail: " + "z" * 80
TTL, MARGIN = 480.0, 10.0

_rigs: list[Rig] = []


@pytest.fixture(autouse=True)
async def reads_are_exact() -> AsyncIterator[None]:
    """After each test: every pull read exactly the prompt's prefix, each D request once."""
    _rigs.clear()
    yield
    for rig in _rigs:
        assert not rig.cluster.wrong_reuses, rig.cluster.wrong_reuses
        assert not rig.cluster.double_reads, rig.cluster.double_reads


async def make(cluster: MockCluster | None = None, **settings: Any) -> Rig:
    rig = Rig(cluster or MockCluster(), settings)
    _rigs.append(rig)
    return rig


async def two_turns(
    rig: Rig, between: Any = None, second: str = "go on", max_tokens: int = 8,
    chat: Chat | None = None,
) -> dict[str, Any]:
    chat = chat or Chat(rig, "c", max_tokens=max_tokens)
    resp, _ = await chat.turn(LONG)
    assert resp.status_code == 200
    if between is not None:
        await between(chat)
    resp, _ = await chat.turn(second)
    assert resp.status_code == 200, resp.text
    return await rig.last_decision()


@pytest.mark.parametrize("conversation_id", ["c", None])
async def test_pull_consumes_the_entry_and_replaces_it(conversation_id: str | None) -> None:
    rig = await make()
    try:
        chat = Chat(rig, conversation_id)
        await chat.turn(LONG)
        chat.messages.append({"role": "user", "content": "more"})
        found = await rig.lookup(chat.body())
        chat.messages.pop()
        assert found is not None and found.entry.turn == 1
        await chat.turn("more")
        assert (await rig.last_decision())["reason"] == "pull"
        second = await chat.entry()
        assert second is not None and second.turn == 2
        assert second.blocks.request_id != found.entry.blocks.request_id
        assert len(rig.ctx.index) == 1
        # the consumed entry can never be claimed again, nor found
        assert not await rig.ctx.index.claim(found.ref, found.entry)
        assert [r.request_id for r in rig.cluster.reads] == [found.entry.blocks.request_id]
    finally:
        await rig.close()


@pytest.mark.parametrize(
    ("advance_s", "reason"),
    [(TTL - MARGIN, "expired"), (TTL - MARGIN - 15.0 + 0.5, "near_expiry"),
     (TTL - MARGIN - 15.0 - 0.5, "pull")],
)
async def test_expiry_on_the_router_clock(advance_s: float, reason: str) -> None:
    rig = await make()
    try:
        async def wait(chat: Chat) -> None:
            rig.clock.advance(advance_s)

        last = await two_turns(rig, wait)
        assert last["reason"] == reason
        expected = 1.0 if reason == "expired" else 0.0
        assert rig.ctx.metrics.expirations._value.get() == expected
    finally:
        await rig.close()


async def test_per_decode_ttl() -> None:
    cluster = MockCluster(1, 2)
    config = build_config({
        "prefill": cluster.prefill_urls,
        "decode": [{"url": cluster.decode_urls[0], "ttl_s": 60},
                   {"url": cluster.decode_urls[1]}],
        "kv_recompute_threshold": 16, **fixed(),
    })
    rig = Rig(cluster, config=config)
    try:
        chat = Chat(rig, "c")
        await chat.turn(LONG)
        entry = await chat.entry()
        assert entry is not None and entry.decode_node_id == "decode-0"
        assert entry.expires_at_s == pytest.approx(rig.clock() + 60 - MARGIN)
        assert config.decode[1].ttl_s == TTL
    finally:
        await rig.close()


async def test_node_down_drops_its_entries() -> None:
    rig = await make(MockCluster(1, 2))
    try:
        async def fail_d0(chat: Chat) -> None:
            rig.cluster.node("decode-0").health = 503
            await rig.ctx.nodes.check_all()
            await rig.ctx.nodes.check_all()
            assert len(rig.ctx.index) == 0

        last = await two_turns(rig, fail_d0)
        assert last["reason"] == "no_entry" and last["decode_node"] == "decode-1"
        assert rig.ctx.metrics.dropped.labels("node_down")._value.get() == 1
    finally:
        await rig.close()


async def test_node_down_for_an_entry_completed_after_the_node_went_down() -> None:
    rig = await make(MockCluster(1, 2))
    d0 = rig.cluster.node("decode-0")
    try:
        d0.faults.append("hang")
        chat = Chat(rig, "c")
        turn1 = asyncio.create_task(chat.turn(LONG))
        await until(lambda: bool(d0.generation_requests()), "turn 1 reached D0")
        d0.health = "connect"
        await rig.ctx.nodes.check_all()
        await rig.ctx.nodes.check_all()
        d0.release.set()
        resp, _ = await turn1
        assert resp.status_code == 200
        assert (await chat.entry()) is not None
        resp, _ = await chat.turn("again")
        assert resp.status_code == 200
        last = await rig.last_decision()
        assert (last["reason"], last["decode_node"]) == ("node_down", "decode-1")
        assert rig.ctx.metrics.dropped.labels("node_down")._value.get() == 1
    finally:
        await rig.close()


async def test_node_down_for_an_entry_of_an_unknown_node() -> None:
    """A shared index may hold entries of D nodes this router does not know."""
    rig = await make()
    try:
        async def foreign(chat: Chat) -> None:
            chat.messages.append({"role": "user", "content": "(probe)"})
            found = await rig.lookup(chat.body())
            chat.messages.pop()
            assert found is not None
            await rig.ctx.index.put(
                found.ref, replace(found.entry, decode_node_id="elsewhere"), tenant="default")

        assert (await two_turns(rig, foreign))["reason"] == "node_down"
        assert not rig.cluster.reads
    finally:
        await rig.close()


async def test_engine_restarted() -> None:
    rig = await make()
    try:
        async def restart(chat: Chat) -> None:
            rig.cluster.node("decode-0").engine_id = "engine-decode-0-2"
            await Chat(rig, "other").turn("another conversation " * 5)  # learns the new id
            assert rig.ctx.nodes.state("decode-0").engine_id == "engine-decode-0-2"  # type: ignore[union-attr]

        chat_b = Chat(rig, "b")
        await chat_b.turn(LONG)  # another entry of the old engine

        async def restart_after_b(chat: Chat) -> None:
            await restart(chat)

        chat = Chat(rig, "c")
        assert (await two_turns(rig, restart_after_b, chat=chat))["reason"] == \
            "engine_restarted"
        assert await chat.entry() is not None  # the new turn's entry
        # b's entry, retained by the dead engine, was purged with it
        assert await chat_b.entry() is None
        assert rig.ctx.metrics.dropped.labels("engine_restarted")._value.get() == 2
        assert not rig.cluster.reads
    finally:
        await rig.close()


@pytest.mark.parametrize(("conversation_id", "gateway", "reason"), [
    ("c", True, "prefix_mismatch"), ("c", False, "no_entry"), (None, False, "no_entry")])
async def test_an_edited_earlier_message(
    conversation_id: str | None, gateway: bool, reason: str,
) -> None:
    """The request no longer contains the entry's request. With an id bound to its caller
    (a gateway's header) the scope's latest entry is still this caller's: the guard proves
    too little of it matches (``prefix_mismatch``). With an id anyone may send, or without
    one, it is a new conversation (``no_entry``): any other caller's entry could be taken
    for it. Nothing of the entry is read either way."""
    rig = await make(gateway_id_headers=("x-gw-session",))
    try:
        async def edit(chat: Chat) -> None:
            chat.messages[0]["content"] = "PLEASE" + chat.messages[0]["content"][6:]

        chat = (Chat(rig, None, headers={"x-gw-session": "c"}) if gateway
                else Chat(rig, conversation_id))
        last = await two_turns(rig, edit, chat=chat)
        assert last["reason"] == reason
        assert (reason == "prefix_mismatch") is (last["exact"] and last["verified_tokens"] < 16)
        assert rig.cluster.node("prefill-0").generation_requests()[-1]["kv_transfer_params"] \
            == {"do_remote_decode": True}
        assert not rig.cluster.reads
    finally:
        await rig.close()


async def test_prefix_mismatch_when_the_rendered_prompt_changes() -> None:
    """Same messages, but P now renders them differently (a new chat template, a date in
    the system prompt): the digests match, the tokens do not; the router's guard proves
    fewer than the threshold and recomputes, and the useless entry is not pulled."""
    rig = await make()
    try:
        async def new_template(chat: Chat) -> None:
            rig.cluster.preamble = "<date:2026-12-02>"

        last = await two_turns(rig, new_template)
        assert (last["reason"], last["exact"]) == ("prefix_mismatch", True)
        assert last["verified_tokens"] < 16
        assert rig.cluster.node("prefill-0").generation_requests()[-1]["kv_transfer_params"] \
            == {"do_remote_decode": True}
        assert not rig.cluster.reads
    finally:
        await rig.close()


async def test_below_threshold() -> None:
    rig = await make(kv_recompute_threshold=100_000)
    try:
        last = await two_turns(rig)
        assert last["reason"] == "below_threshold" and last["verified_tokens"] > 0
    finally:
        await rig.close()


async def test_cost_model() -> None:
    rig = await make(pull_cost_factor=1e9)
    try:
        last = await two_turns(rig)
        assert last["reason"] == "cost_model"
        assert last["predicted_transfer_s"] > 0 and last["predicted_prefill_s"] > 0
    finally:
        await rig.close()


async def partial_turns(rig: Rig) -> dict[str, Any]:
    """Turn 2 re-sends the 64-token reply with a leading space: the same answer for the
    lookup (whitespace around an answer is not part of it), other tokens for the template,
    so only the prompt before the reply is proven: a partial reuse."""
    async def respace(chat: Chat) -> None:
        chat.messages[-1]["content"] = " " + chat.messages[-1]["content"]

    return await two_turns(rig, respace, max_tokens=64)


@pytest.mark.parametrize(
    ("cluster_bs", "extra", "configured"), [(16, 0, None), (32, 0, None), (16, 2, 16)]
)
async def test_partial_pull_cuts_the_block_list(
    cluster_bs: int, extra: int, configured: int | None
) -> None:
    rig = await make(MockCluster(block_size=cluster_bs, extra_blocks=extra),
                     block_size=configured)
    try:
        last = await partial_turns(rig)
        assert last["reason"] == "pull"
        prompt1 = len(LONG) + len("<user><assistant>")
        entry_held = prompt1 + 64 - 1
        assert last["reused_tokens"] == prompt1 // 16 * 16  # whole fingerprint chunks
        assert 0 < last["reused_tokens"] < entry_held
        sent = rig.cluster.node("prefill-0").generation_requests()[-1]["kv_transfer_params"]
        assert sent["remote_num_tokens"] == last["reused_tokens"]
        # the first ceil(n / bs) ids of D's list: vLLM pairs P's blocks with the list's tail
        held_ids = rig.cluster.held_block_ids[0]
        need = -(-sent["remote_num_tokens"] // cluster_bs)
        assert sent["remote_block_ids"] == [held_ids[:need]]
    finally:
        await rig.close()


async def test_partial_reuse_unsafe_without_a_block_size() -> None:
    rig = await make(MockCluster(extra_blocks=1))  # no block size fits: whole reuse only
    try:
        last = await partial_turns(rig)
        assert last["reason"] == "partial_reuse_unsafe"
    finally:
        await rig.close()


async def test_configured_block_size_too_large_for_the_list_stores_nothing() -> None:
    rig = await make(MockCluster(block_size=16), block_size=4)
    try:
        await Chat(rig, "c").turn(LONG)
        assert len(rig.ctx.index) == 0
        assert rig.ctx.metrics.turn_entries.labels("bad_block_layout")._value.get() == 1
    finally:
        await rig.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_direct_when_enabled(stream: bool) -> None:
    rig = await make(direct_enabled=True)
    try:
        chat = Chat(rig, "c", stream=stream)
        last = await two_turns(rig, chat=chat)
        assert (last["action"], last["reason"]) == ("direct", "direct")
        p_paths = [p for p, _ in rig.cluster.node("prefill-0").requests]
        assert p_paths.count("/v1/chat/completions") == 1  # turn 1 only
        d_body = rig.cluster.node("decode-0").generation_requests()[-1]
        assert d_body["kv_transfer_params"]["do_remote_prefill"] is False
        assert d_body["kv_transfer_params"]["do_remote_decode"] is False
        # a report target only for streams: a non-streamed answer carries D's params
        assert ("kvrelay_turn_id" in d_body["kv_transfer_params"]) is stream
        if not stream:  # D's own usage: only D knows what its prefix cache still held
            assert last["reused_tokens"] > 0  # the router's plan (X-KVRelay-Reused-Tokens)
            assert chat.last_response is not None
            usage = chat.last_response.json()["usage"]
            assert "prompt_tokens_details" not in usage
        await rig.settle()
        entry = await chat.entry()
        assert entry is not None and entry.turn == 2
        assert not rig.cluster.reads  # D reused its own prefix cache: nothing was pulled
    finally:
        await rig.close()


async def test_direct_d_failure_falls_back_to_p_and_another_d() -> None:
    rig = await make(MockCluster(1, 2), direct_enabled=True)
    try:
        async def break_d0(chat: Chat) -> None:
            rig.cluster.node("decode-0").faults.append("connect")

        last = await two_turns(rig, break_d0)
        # P recomputed it for another D: reported as that (probe 14, K7), decided direct
        assert (last["decided"], last["action"], last["reason"]) == (
            "direct/direct", "recompute", "decode_failed")
        assert last["decode_node"] == "decode-1" and last["retries"] == 1
        assert last["reused_tokens"] == 0
        p_paths = [p for p, _ in rig.cluster.node("prefill-0").requests]
        assert p_paths.count("/v1/chat/completions") == 2
    finally:
        await rig.close()


def pulled_request_ids(rig: Rig) -> list[str]:
    sent = [b["kv_transfer_params"] for b in rig.cluster.node("prefill-0").generation_requests()]
    return [p["remote_request_id"] for p in sent if p.get("remote_block_ids")]


@pytest.mark.parametrize("conversation_id", ["c", None])
async def test_concurrent_turns_pull_an_entry_at_most_once(conversation_id: str | None) -> None:
    """Both turns wait for the same pending report, then race for its entry."""
    rig = await make(MockCluster(report_mode="manual"))
    try:
        chat = Chat(rig, conversation_id, stream=True)
        await chat.turn(LONG)
        chat.messages.append({"role": "user", "content": "next"})
        body = chat.body(stream=False)
        p0 = rig.cluster.node("prefill-0")
        p0.faults.extend(["hang", "hang"])  # hold both turns at P until both decided
        turns = [asyncio.create_task(rig.post("/v1/chat/completions", body))
                 for _ in range(2)]
        for _ in range(200):
            await asyncio.sleep(0)
        assert not any(t.done() for t in turns)
        await rig.cluster.deliver_reports()
        await until(lambda: len(p0.generation_requests()) == 3, "both turns held at P")
        p0.release.set()
        r1, r2 = await asyncio.gather(*turns)
        assert r1.status_code == r2.status_code == 200
        assert r1.json()["choices"][0]["message"] == r2.json()["choices"][0]["message"]
        recent = (await rig.stats())["decisions"]["recent"][-2:]
        assert sorted(d["reason"] for d in recent) == ["no_entry", "pull"]
        assert len(pulled_request_ids(rig)) == 1 and len(rig.cluster.reads) == 1
    finally:
        await rig.close()


@pytest.mark.parametrize("conversation_id", ["c", None])
async def test_many_concurrent_turns_never_pull_an_entry_twice(
    conversation_id: str | None,
) -> None:
    """Forks: eight requests continue one entry at once; exactly one pulls it. With an
    explicit id, a fork that finds its sibling's fresh entry (the scope's latest) may pull
    that one, proven by the guard; but no entry is ever read twice."""
    rig = await make()
    try:
        chat = Chat(rig, conversation_id)
        await chat.turn(LONG)
        chat.messages.append({"role": "user", "content": "next"})
        body = chat.body()
        results = await asyncio.gather(
            *(rig.post("/v1/chat/completions", body) for _ in range(8)))
        assert all(r.status_code == 200 for r in results)
        ids = pulled_request_ids(rig)
        assert ids and len(ids) == len(set(ids)) == len(rig.cluster.reads)
        assert ids.count(rig.cluster.reads[0].request_id) == 1  # turn 1's entry: once
        if conversation_id is None:
            assert len(ids) == 1
            reasons = sorted(r.headers["x-kvrelay-reason"] for r in results)
            assert reasons == ["no_entry"] * 7 + ["pull"]
    finally:
        await rig.close()


async def test_side_channel_rewrite() -> None:
    cluster = MockCluster(1, 1)
    rig = await make(cluster, side_channels={cluster.prefill_urls[0]: "10.0.0.1:7000",
                                             "decode-0": "10.0.0.2"})
    try:
        await two_turns(rig)
        p_sent = cluster.node("prefill-0").generation_requests()[-1]["kv_transfer_params"]
        assert (p_sent["remote_host"], p_sent["remote_port"]) == ("10.0.0.2", 5601)
        d_sent = cluster.node("decode-0").generation_requests()[-1]["kv_transfer_params"]
        assert (d_sent["remote_host"], d_sent["remote_port"]) == ("10.0.0.1", 7000)
    finally:
        await rig.close()
