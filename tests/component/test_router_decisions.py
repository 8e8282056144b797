"""Every turn-policy reason, reached through the router's HTTP API (scripted mock cluster,
injected router clock: no sleeps for TTLs)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvrelay.core.conversation import ConversationKey
from kvrelay.router.config import build_config
from tests.component.router_mock import MockCluster
from tests.component.router_rig import Chat, Rig, until

LONG = "please explain the following in detail: " + "z" * 80
KEY = ConversationKey("default", "c")
TTL, MARGIN = 480.0, 10.0


async def make(cluster: MockCluster | None = None, **settings: Any) -> Rig:
    return Rig(cluster or MockCluster(), settings)


async def two_turns(
    rig: Rig, between: Any = None, second: str = "go on", max_tokens: int = 8
) -> dict[str, Any]:
    chat = Chat(rig, "c", max_tokens=max_tokens)
    resp, _ = await chat.turn(LONG)
    assert resp.status_code == 200
    if between is not None:
        await between(chat)
    resp, _ = await chat.turn(second)
    assert resp.status_code == 200, resp.text
    return await rig.last_decision()


async def test_pull_consumes_the_entry_and_replaces_it() -> None:
    rig = await make()
    try:
        chat = Chat(rig, "c")
        await chat.turn(LONG)
        first = await rig.ctx.store.get(KEY)
        assert first is not None and first.turn == 1
        await chat.turn("more")
        assert (await rig.last_decision())["reason"] == "pull"
        second = await rig.ctx.store.get(KEY)
        assert second is not None and second.turn == 2
        assert second.blocks.request_id != first.blocks.request_id
        # the consumed entry can never be claimed again
        assert not await rig.ctx.store.claim(KEY, first)
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
        "kv_recompute_threshold": 16,
    })
    rig = Rig(cluster, config=config)
    try:
        await Chat(rig, "c").turn(LONG)
        entry = await rig.ctx.store.get(KEY)
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
            assert len(rig.ctx.store) == 0

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
        assert (await rig.ctx.store.get(KEY)) is not None
        resp, _ = await chat.turn("again")
        assert resp.status_code == 200
        last = await rig.last_decision()
        assert (last["reason"], last["decode_node"]) == ("node_down", "decode-1")
        assert rig.ctx.metrics.dropped.labels("node_down")._value.get() == 1
    finally:
        await rig.close()


async def test_node_down_for_an_entry_of_an_unknown_node() -> None:
    """A shared store may hold entries of D nodes this router does not know."""
    from dataclasses import replace

    rig = await make()
    try:
        async def foreign(chat: Chat) -> None:
            entry = await rig.ctx.store.get(KEY)
            assert entry is not None
            await rig.ctx.store.put(KEY, replace(entry, decode_node_id="elsewhere"))

        assert (await two_turns(rig, foreign))["reason"] == "node_down"
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

        assert (await two_turns(rig, restart_after_b))["reason"] == "engine_restarted"
        assert await rig.ctx.store.get(KEY) is not None  # the new turn's entry
        # b's entry, retained by the dead engine, was purged with it
        assert await rig.ctx.store.get(ConversationKey("default", "b")) is None
        assert rig.ctx.metrics.dropped.labels("engine_restarted")._value.get() == 2
    finally:
        await rig.close()


async def test_prefix_mismatch_when_an_earlier_message_is_edited() -> None:
    rig = await make()
    try:
        async def edit(chat: Chat) -> None:
            chat.messages[0]["content"] = "PLEASE" + chat.messages[0]["content"][6:]

        last = await two_turns(rig, edit)
        assert last["reason"] == "prefix_mismatch" and last["verified_tokens"] < 16
        assert rig.cluster.node("prefill-0").generation_requests()[-1]["kv_transfer_params"] \
            == {"do_remote_decode": True}
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
    """Turn 2 keeps only the first 40 characters of the 64-token reply: a partial reuse."""
    async def cut(chat: Chat) -> None:
        chat.messages[-1]["content"] = chat.messages[-1]["content"][:40] + "!"

    return await two_turns(rig, cut, max_tokens=64)


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
        entry_held = len(LONG) + len("<user><assistant>") + 64 - 1
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
        assert len(rig.ctx.store) == 0
        assert rig.ctx.metrics.turn_entries.labels("bad_block_layout")._value.get() == 1
    finally:
        await rig.close()


async def test_direct_when_enabled() -> None:
    rig = await make(direct_enabled=True)
    try:
        last = await two_turns(rig)
        assert (last["action"], last["reason"]) == ("direct", "direct")
        p_paths = [p for p, _ in rig.cluster.node("prefill-0").requests]
        assert p_paths.count("/v1/chat/completions") == 1  # turn 1 only
        d_body = rig.cluster.node("decode-0").generation_requests()[-1]
        assert d_body["kv_transfer_params"]["do_remote_prefill"] is False
        assert d_body["kv_transfer_params"]["do_remote_decode"] is False
        assert d_body["kv_transfer_params"]["kvrelay_turn_id"]
        assert (await rig.ctx.store.get(KEY)) is not None
    finally:
        await rig.close()


async def test_direct_d_failure_falls_back_to_p_and_another_d() -> None:
    rig = await make(MockCluster(1, 2), direct_enabled=True)
    try:
        async def break_d0(chat: Chat) -> None:
            rig.cluster.node("decode-0").faults.append("connect")

        last = await two_turns(rig, break_d0)
        assert last["action"] == "direct" and last["decode_node"] == "decode-1"
        assert last["retries"] == 1
        p_paths = [p for p, _ in rig.cluster.node("prefill-0").requests]
        assert p_paths.count("/v1/chat/completions") == 2
    finally:
        await rig.close()


def pulled_request_ids(rig: Rig) -> list[str]:
    sent = [b["kv_transfer_params"] for b in rig.cluster.node("prefill-0").generation_requests()]
    return [p["remote_request_id"] for p in sent if p.get("remote_block_ids")]


async def test_concurrent_turns_pull_an_entry_at_most_once() -> None:
    """Both turns wait for the same pending report, then race for its entry."""
    rig = await make(MockCluster(report_mode="manual"))
    try:
        chat = Chat(rig, "c", stream=True)
        await chat.turn(LONG)
        body = {"messages": [*chat.messages, {"role": "user", "content": "next"}],
                "max_tokens": 8, "conversation_id": "c"}
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
        assert len(pulled_request_ids(rig)) == 1
    finally:
        await rig.close()


async def test_many_concurrent_turns_never_pull_an_entry_twice() -> None:
    rig = await make()
    try:
        chat = Chat(rig, "c")
        await chat.turn(LONG)
        body = {"messages": [*chat.messages, {"role": "user", "content": "next"}],
                "max_tokens": 8, "conversation_id": "c"}
        results = await asyncio.gather(
            *(rig.post("/v1/chat/completions", body) for _ in range(8)))
        assert all(r.status_code == 200 for r in results)
        ids = pulled_request_ids(rig)
        assert ids and len(ids) == len(set(ids))
    finally:
        await rig.close()


async def test_side_channel_rewrite() -> None:
    cluster = MockCluster(1, 1)
    settings = {"side_channels": {cluster.prefill_urls[0]: "10.0.0.1:7000",
                                  "decode-0": "10.0.0.2"}}
    rig = Rig(cluster, settings)
    try:
        await two_turns(rig)
        p_sent = cluster.node("prefill-0").generation_requests()[-1]["kv_transfer_params"]
        assert (p_sent["remote_host"], p_sent["remote_port"]) == ("10.0.0.2", 5601)
        d_sent = cluster.node("decode-0").generation_requests()[-1]["kv_transfer_params"]
        assert (d_sent["remote_host"], d_sent["remote_port"]) == ("10.0.0.1", 7000)
    finally:
        await rig.close()
