"""Retention through the router on fake engines (no latency, one ``ManualClock``): identical
conversations each keep their entry, entries the router drops are released on D, D's
releases reach the router (and the next turn recomputes, ``released``), and D's retention
numbers show in ``/stats`` and ``/metrics``."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import replace
from typing import Any

import httpx
import msgspec
import pytest

from kvrelay.client.prometheus import parse_prometheus
from kvrelay.client.sse import sse_events
from kvrelay.core.consequences import ANSWERED_READ_GRACE_S, SPENT_READ_GRACE_S
from kvrelay.core.conversation import ConversationEntry, GapKind
from kvrelay.core.retention_sync import (
    RETAIN_S_KEY,
    RETENTION_PATH,
    RETENTION_URL_KEY,
    RETURN_CURVE_KEY,
    STALE_SYNC_S,
    Released,
    RetentionSync,
    encode,
)
from kvrelay.core.return_curve import ReturnCurve
from kvrelay.router.app import create_app
from kvrelay.router.request import IdRules, parse_request
from kvrelay.router.retention import sync_token
from tests.component.router_fake import ENGINE_CONFIG, GUARD_CONFIGS, Routed, routed, until

SILENT_D = replace(ENGINE_CONFIG, retention_sync=False)
"""Engines that do not sync their retention themselves: the tests below are D, posting the
syncs by hand (test_router_fake_retention_sync.py runs the fake's own)."""
STOCK_D = replace(ENGINE_CONFIG, kvrelay_retention=False)
"""kvrelay's connector in stock mode (``kvrelay up --retention stock``): one global TTL."""
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


def sync_body(engine_id: str, *, released: tuple[tuple[str, str], ...] = (),
              retained_blocks: int = 4, num_blocks_free: int = 100, retained_requests: int = 1,
              num_blocks_total: int = 128) -> bytes:
    """A sync as D's connector sends it (``core.retention_sync``), written here by hand."""
    return encode(RetentionSync(
        engine_id=engine_id, block_size=16, bytes_per_block=4096,
        num_blocks_total=num_blocks_total, num_blocks_free=num_blocks_free,
        retained_requests=retained_requests, retained_blocks=retained_blocks,
        retained_tokens=retained_blocks * 16,
        releases_total={cause: sum(1 for _, c in released if c == cause)
                        for cause in ("pressure", "router", "expired")},
        released=tuple(Released(rid, cause) for rid, cause in released),  # type: ignore[arg-type]
    ))


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sample ``name{labels}`` whatever the order of its labels; missing is an error."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base == name and set(filter(None, rest.rstrip("}").split(","))) == want:
            return value
    raise AssertionError((name, labels, sorted(k for k in samples if k.startswith(name))))


async def post_sync(r: Routed, body: bytes) -> httpx.Response:
    async with httpx.AsyncClient(trust_env=False, timeout=10.0) as c:
        return await c.post(r.ctx.retention.url_for("decode-0"), content=body)


def follow_up(answer: str) -> list[dict[str, Any]]:
    return [*first_turn(), {"role": "assistant", "content": answer},
            {"role": "user", "content": "Now run the tests."}]


async def one_first_turn(r: Routed) -> tuple[list[dict[str, Any]], ConversationEntry]:
    async with r.client() as c:
        reply = await chat(c, first_turn())
    await r.settle()
    history = follow_up(reply.json()["choices"][0]["message"]["content"])
    found = await r.find({"model": "tiny", "messages": history})
    assert found is not None
    return history, found.entry


@pytest.mark.parametrize("guard", list(GUARD_CONFIGS))
async def test_decode_requests_tell_a_connector_d_where_to_sync(guard: str) -> None:
    """kvrelay's connector on D gets the router's retention URL and a retention time (never
    above D's TTL); stock D gets neither (vLLM passes unknown keys through, but nobody
    would read them)."""
    async with routed(engine_config=GUARD_CONFIGS[guard]) as r:
        async with r.client() as c:
            await chat(c, first_turn())
            await chat(c, first_turn())  # D's capabilities are known after its first answer
        params = r.cluster.decode[0].records[-1].request_kv_transfer_params
        assert params is not None
        if guard == "connector":
            url = params[RETENTION_URL_KEY]
            assert url == r.ctx.retention.url_for("decode-0")
            assert url.startswith(
                f"http://127.0.0.1:{r.ctx.config.listen_internal_port}{RETENTION_PATH}/")
            retain_s = params[RETAIN_S_KEY]
            assert isinstance(retain_s, float)
            assert 0 < retain_s <= ENGINE_CONFIG.decoder_kv_blocks_ttl
        else:
            assert RETENTION_URL_KEY not in params and RETAIN_S_KEY not in params


async def test_a_release_d_syncs_makes_the_next_turn_recompute_released() -> None:
    """D released a retained turn (memory pressure): its sync tells the router, the entry
    is never pulled, and the next turn recomputes with reason ``released`` (headers,
    ``/stats``, metrics), its answer equal to a recompute."""
    async with routed(engine_config=SILENT_D) as r:
        d, d_id = r.cluster.decode[0], r.ctx.config.decode[0].node_id
        history, entry = await one_first_turn(r)
        resp = await post_sync(r, sync_body(d.engine_id, released=(
            (entry.request_id, "pressure"), ("unknown-request", "expired"))))
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"release": [], "dropped": []}
        found = await r.find({"model": "tiny", "messages": history})
        assert found is not None and found.entry.released == "pressure"
        async with r.client() as c:
            reply = await chat(c, history)
        assert reply.headers["x-kvrelay-action"] == "recompute"
        assert reply.headers["x-kvrelay-reason"] == "released"
        assert reply.headers["x-kvrelay-released-cause"] == "pressure"
        assert reply.json()["choices"][0]["message"]["content"] == await r.recompute(
            {"model": "tiny", "messages": history, "max_tokens": 16})
        assert not any(rec.plan == "pull" for rec in r.cluster.prefill[0].records)
        stats = await r.stats()
        assert stats["decisions"]["by_reason"]["released"] == 1
        assert stats["retention"][d_id]["retained_blocks"] == 4
        assert stats["retention"][d_id]["releases_total"]["pressure"] == 1
        metrics = parse_prometheus((await r.internal_get("/metrics")).text)
        assert metric(metrics, "kvrelay_router_d_retained_bytes", node=d_id) == 4 * 4096
        assert metric(metrics, "kvrelay_router_d_releases_total", node=d_id,
                      cause="pressure") == 1
        assert metric(metrics, "kvrelay_router_retention_releases_seen_total", node=d_id,
                      cause="expired") == 1
        assert metric(metrics, "kvrelay_router_entries_released_total", node=d_id) == 1
        assert metric(metrics, "kvrelay_router_turn_decisions_total", action="recompute",
                      reason="released") == 1


async def test_a_sync_from_an_unknown_engine_changes_nothing_a_malformed_one_is_a_400(
) -> None:
    """A sync of an engine no D ran is heard where it can only make that engine's entries
    recompute (none here); D's own entries are untouched."""
    async with routed(engine_config=SILENT_D) as r:
        history, entry = await one_first_turn(r)
        forged = await post_sync(r, sync_body("not-an-engine", released=(
            (entry.request_id, "pressure"),)))
        assert forged.status_code == 200 and forged.json().get("release", []) == []
        for bad in (b"{", b"[]", b'{"engine_id": "x"}',
                    sync_body(r.cluster.decode[0].engine_id).replace(b'"block_size":16',
                                                                      b'"block_size":-1')):
            resp = await post_sync(r, bad)
            assert resp.status_code == 400, (bad, resp.text)
            assert resp.json()["error"]["message"]
        found = await r.find({"model": "tiny", "messages": history})
        assert found is not None and found.entry.released is None
        async with r.client() as c:
            assert (await chat(c, history)).headers["x-kvrelay-reason"] == "pull"
        public = await r.post(RETENTION_PATH, sync_body(r.cluster.decode[0].engine_id))
        assert public.status_code == 404  # the internal listener only


async def test_a_sync_not_at_the_url_d_was_given_takes_no_orders() -> None:
    """Whoever reaches the internal listener and knows D's engine id cannot sync as D: a
    sync not at the URL the router gave that D (a MAC of its node id and URL; the bare
    path, another token, another D's, D's id under another URL) takes none of D's release
    orders (which D would then never get, keeping dropped turns pinned) and leaves D's
    numbers as D reported them. It is still heard where it can only make entries recompute
    (D's URL may predate a router restart): its releases mark entries released, its asks
    are answered."""
    async with routed(engine_config=SILENT_D, kv_recompute_threshold=100_000) as r:
        history, entry = await one_first_turn(r)
        async with r.client() as c:  # recomputes: the entry it continued is to be released
            assert (await chat(c, history)).headers["x-kvrelay-reason"] == "below_threshold"
        await r.settle()
        engine = r.cluster.decode[0].engine_id
        base = f"http://127.0.0.1:{r.ctx.config.listen_internal_port}{RETENTION_PATH}"
        forged = sync_body(engine, retained_blocks=0, num_blocks_free=128)
        async with httpx.AsyncClient(trust_env=False, timeout=10.0) as c:
            for url in (base, base + "/", base + "/" + "0" * 32,
                        f"{base}/{sync_token(r.ctx.tag_key, 'decode-1', 'http://d1:8000')}",
                        f"{base}/{sync_token(r.ctx.tag_key, 'decode-0', 'http://d1:8000')}",
                        r.ctx.retention.url_for("decode-0") + "0"):
                resp = await c.post(url, content=forged)
                assert resp.status_code == 200, (url, resp.text)
                assert resp.json()["release"] == [] and "curves" not in resp.json()
        metrics = parse_prometheus((await r.internal_get("/metrics")).text)
        assert metric(metrics, "kvrelay_router_retention_syncs_total", outcome="bad_token") == 6
        assert r.ctx.retention.snapshot() == {}  # no numbers taken from a forged sync
        assert await orders_for(r) == [entry.request_id]  # D's own sync gets the order
        assert r.ctx.retention.snapshot()["decode-0"]["retained_blocks"] == 4
        # a stale URL's release still marks the entry released: it is never pulled
        second, live = await one_first_turn(r)
        async with httpx.AsyncClient(trust_env=False, timeout=10.0) as c:
            resp = await c.post(base, content=sync_body(
                engine, released=((live.request_id, "pressure"),)))
        assert resp.status_code == 200
        async with r.client() as c:
            assert (await chat(c, second)).headers["x-kvrelay-reason"] == "released"


def conversation(i: int) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Conversation {i}: " + FIRST}]


async def orders_for(r: Routed) -> list[str]:
    """What the router answers D's next sync (an empty one: D released nothing)."""
    resp = await post_sync(r, sync_body(r.cluster.decode[0].engine_id))
    assert resp.status_code == 200, resp.text
    release: list[str] = resp.json()["release"]
    return release


async def test_an_entry_evicted_for_capacity_is_released_on_d() -> None:
    """``--max-entries 1``: the second conversation's entry evicts the first's, whose D
    request id the router orders released in its answer to D's next sync (once)."""
    async with routed(engine_config=SILENT_D, max_entries=1) as r:
        async with r.client() as c:
            first = await chat(c, conversation(1))
            await r.settle()
            history = [*conversation(1), first.json()["choices"][0]["message"],
                       {"role": "user", "content": "go on"}]
            evicted = await r.find({"model": "tiny", "messages": history})
            assert evicted is not None
            await chat(c, conversation(2))
            await r.settle()
        assert await r.find({"model": "tiny", "messages": history}) is None
        assert await orders_for(r) == [evicted.entry.request_id]
        assert await orders_for(r) == []


async def test_a_turn_that_did_not_pull_supersedes_and_releases_the_entry_it_continued(
) -> None:
    """Every follow-up recomputes (threshold above any prompt): once it commits, the entry
    it continued is dead (the conversation moved on) and D is told to release it."""
    async with routed(engine_config=SILENT_D, kv_recompute_threshold=100_000) as r:
        history, entry = await one_first_turn(r)
        async with r.client() as c:
            reply = await chat(c, history)
        await r.settle()
        assert reply.headers["x-kvrelay-reason"] == "below_threshold"
        assert await r.find({"model": "tiny", "messages": history}) is None
        assert await orders_for(r) == [entry.request_id]
        metrics = parse_prometheus((await r.get("/metrics")).text)
        assert metric(metrics, "kvrelay_router_entries_dropped_total", reason="superseded") == 1
        assert metric(metrics, "kvrelay_router_release_orders_total",
                      node=r.ctx.config.decode[0].node_id) == 1


async def test_an_admin_flush_releases_the_conversation_on_d() -> None:
    async with routed(engine_config=SILENT_D, admin_key="root") as r:
        async with r.client() as c:
            resp = await c.post("/v1/chat/completions", json={
                "model": "tiny", "messages": first_turn(), "max_tokens": 16,
                "conversation_id": "flush-me"})
            assert resp.status_code == 200
        await r.settle()
        answer = {"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]}
        (entry,) = [f.entry for f in [await r.find({
            "model": "tiny", "messages": [*first_turn(), answer, {"role": "user", "content": "?"}],
            "conversation_id": "flush-me"})] if f]
        dropped = await r.post("/admin/conversations/drop", {"conversation_id": "flush-me"},
                               headers={"Authorization": "Bearer root"})
        assert dropped.json() == {"dropped": True, "entries": 1, "turns_under_way": 0}
        assert await orders_for(r) == [entry.request_id]


async def test_a_pulled_entry_is_never_ordered_released() -> None:
    """A pull consumes the entry (P's read frees D's blocks): no order for it."""
    async with routed(engine_config=SILENT_D) as r:
        history, _ = await one_first_turn(r)
        async with r.client() as c:
            assert (await chat(c, history)).headers["x-kvrelay-reason"] == "pull"
        await r.settle()
        assert await orders_for(r) == []


def learn_gaps(r: Routed, gap_s: float, n: int = 120, kind: GapKind = "user") -> None:
    """Tell the router ``n`` follow-ups came ``gap_s`` after their turn (as ``plan`` does
    when it finds an entry), in the default tenant; ``kind``: how the turn they followed
    ended (a reply, a tool call)."""
    req = parse_request("chat", json.dumps({"model": "tiny", "messages": first_turn()}).encode(),
                        {}, "default", IdRules(()))
    for _ in range(n):
        r.ctx.retention.observe_gap(req, gap_s, kind)


async def retain_s_sent(r: Routed) -> object:
    params = r.cluster.decode[0].records[-1].request_kv_transfer_params
    assert params is not None
    return params.get(RETAIN_S_KEY)


async def curve_sent(r: Routed) -> ReturnCurve | None:
    params = r.cluster.decode[0].records[-1].request_kv_transfer_params
    assert params is not None
    raw = params.get(RETURN_CURVE_KEY)
    return None if raw is None else msgspec.convert(raw, ReturnCurve)


async def test_d_keeps_each_turn_as_long_as_the_gaps_seen_ask_and_the_entry_follows() -> None:
    """Follow-ups come 20 s after their turn: D is asked to keep the next turn about 50 s
    (the gaps' high quantile + the router's margin), not its 480 s TTL, and the router's
    entry expires with it; a D short of free blocks is asked for less."""
    async with routed(engine_config=SILENT_D) as r:
        async with r.client() as c:
            await chat(c, conversation(0))  # D's capabilities are known after its first answer
            await r.settle()
            await chat(c, conversation(1))
            await r.settle()
            assert await retain_s_sent(r) == ENGINE_CONFIG.decoder_kv_blocks_ttl  # the prior
            assert await curve_sent(r) is None  # the prior: no curve
            learn_gaps(r, 20.0)
            history, entry = await one_first_turn(r)
            retain_s = await retain_s_sent(r)
            assert isinstance(retain_s, float)
            curve = await curve_sent(r)  # follow-ups come after ~20 s
            assert curve is not None and math.exp(curve.log_mean) == pytest.approx(20.0)
            assert 0.0 < curve.return_p <= 1.0
            margin = r.ctx.config.ttl_safety_margin_s + r.ctx.config.policy.near_expiry_s
            assert margin + 20.0 <= retain_s < margin + 20.0 * 1.25
            assert entry.expires_at_s - entry.created_at_s == pytest.approx(
                retain_s - r.ctx.config.ttl_safety_margin_s)
            full = await post_sync(r, sync_body(r.cluster.decode[0].engine_id,
                                                num_blocks_free=6))  # 6 of 128 free
            assert full.status_code == 200
            await chat(c, conversation(2))
            await r.settle()
            shorter = await retain_s_sent(r)
            assert isinstance(shorter, float) and shorter < retain_s
        metrics = parse_prometheus((await r.get("/metrics")).text)
        for reason in ("prior", "learned", "headroom"):
            assert metric(metrics, "kvrelay_router_retain_time_decisions_total",
                          reason=reason) >= 1
        del history


async def test_no_learned_retention_sends_no_retain_s() -> None:
    async with routed(engine_config=SILENT_D, learned_retention=False) as r:
        learn_gaps(r, 3.0)
        async with r.client() as c:
            await chat(c, conversation(0))
            await chat(c, conversation(1))
        params = r.cluster.decode[0].records[-1].request_kv_transfer_params
        assert params is not None and RETENTION_URL_KEY in params
        assert RETAIN_S_KEY not in params


async def test_a_turn_d_asks_to_free_is_dropped_and_answered_then_recomputes_released(
) -> None:
    """D wants the blocks (pressure) and asks first (``releasing``): the router marks the
    entry released (no pull can start), answers that D may free it (no P leg reads it), and
    the next turn recomputes, reason ``released``."""
    async with routed(engine_config=SILENT_D) as r:
        d = r.cluster.decode[0]
        history, entry = await one_first_turn(r)
        r.clock.advance(SPENT_READ_GRACE_S)  # a turn it never saw may be a predecessor's
        body = encode(RetentionSync(
            engine_id=d.engine_id, block_size=16, bytes_per_block=4096, num_blocks_total=128,
            num_blocks_free=0, retained_requests=1, retained_blocks=4, retained_tokens=64,
            releasing=(entry.request_id, "never-seen")))
        resp = await post_sync(r, body)
        assert resp.status_code == 200, resp.text
        assert sorted(resp.json()["dropped"]) == sorted([entry.request_id, "never-seen"])
        async with r.client() as c:
            reply = await chat(c, history)
        assert reply.headers["x-kvrelay-reason"] == "released"
        metrics = parse_prometheus((await r.get("/metrics")).text)
        assert metric(metrics, "kvrelay_router_release_requests_total",
                      node=r.ctx.config.decode[0].node_id, answer="dropped") == 2


async def test_an_ask_d_repeats_in_every_sync_is_counted_once_per_answer() -> None:
    """D asks again in every sync (every 0.25 s) until it may free a turn: while a P leg
    reads it the answer is ``reading``, once, however many syncs ask; then ``dropped``,
    once (a 3 s read was counted 12 times: probe 8a, finding 4)."""
    async with routed(engine_config=SILENT_D) as r:
        d = r.cluster.decode[0]
        history, entry = await one_first_turn(r)
        found = await r.find({"model": "tiny", "messages": history})
        assert found is not None
        assert await r.ctx.index.claim(found.ref, found.entry) == entry  # a P leg reads it
        body = encode(RetentionSync(
            engine_id=d.engine_id, block_size=16, bytes_per_block=4096, num_blocks_total=128,
            num_blocks_free=0, retained_requests=1, retained_blocks=4, retained_tokens=64,
            releasing=(entry.request_id,)))
        node = r.ctx.config.decode[0].node_id
        for _ in range(3):
            assert (await post_sync(r, body)).json().get("dropped", []) == []
        await r.ctx.index.read_done(entry.decode_node_id, entry.request_id)
        for _ in range(3):
            assert (await post_sync(r, body)).json()["dropped"] == [entry.request_id]
        metrics = parse_prometheus((await r.get("/metrics")).text)
        for answer in ("reading", "dropped"):
            assert metric(metrics, "kvrelay_router_release_requests_total",
                          node=node, answer=answer) == 1


async def test_a_pull_p_failed_releases_the_claimed_turn_on_d_after_the_grace() -> None:
    """P answers the pull with a 500 before it reads: the turn recomputes and the claimed
    turn, which no entry points at any more, is ordered released on D once the spent read's
    grace is over, not kept its whole retention time (7 blocks still held 16 s later with
    a 60 s TTL: probe 8a, finding 3)."""
    async with routed() as r:
        d, p = r.cluster.decode[0], r.cluster.prefill[0]
        history, entry = await one_first_turn(r)
        p.faults.error_status, p.faults.error_count = 500, 1
        async with r.client() as c:
            reply = await chat(c, history)
        assert reply.status_code == 200
        assert reply.headers["x-kvrelay-action"] == "recompute"
        await r.settle()
        assert d.state.retention is not None
        held = {h.request_id for h in d.state.holds.snapshot()}
        assert entry.request_id in held  # P never read it: D still holds it
        r.clock.advance(ANSWERED_READ_GRACE_S / 2)
        await asyncio.sleep(0.3)  # D syncs (it holds turns): the grace is not over
        assert entry.request_id in {h.request_id for h in d.state.holds.snapshot()}
        r.clock.advance(ANSWERED_READ_GRACE_S)
        await until(lambda: entry.request_id not in {
            h.request_id for h in d.state.holds.snapshot()}, "the claimed turn released")
        assert d.state.retention.releases_total["router"] == 1


async def test_a_turn_goes_to_a_d_with_room_when_ds_own_numbers_say_one_is_full() -> None:
    """D0's latest sync says its KV cache is full of live work (nothing retained to
    release): a new conversation goes to D1 although both Ds have no request of this
    router's, and so does a follow-up whose KV is on D0 (P still pulls it from D0). A full
    D made such turns wait 8.5 s while the other D was idle (probe 9, finding 1). Numbers
    older than STALE_SYNC_S are not used: load decides again."""
    async with routed(num_decode=2, engine_config=SILENT_D) as r:
        history, entry = await one_first_turn(r)
        assert entry.decode_node_id == "decode-0"
        d0 = r.cluster.engine("decode-0")
        full = sync_body(d0.engine_id, retained_blocks=0, num_blocks_free=1,
                         retained_requests=0, num_blocks_total=64)
        assert (await post_sync(r, full)).status_code == 200
        async with r.client() as c:
            await chat(c, [{"role": "user", "content": "A new task: " + FIRST}])
            assert (await r.last_decision())["decode_node"] == "decode-1"
            reply = await chat(c, history)
            assert reply.headers["x-kvrelay-reason"] == "pull"
            assert (await r.last_decision())["decode_node"] == "decode-1"
            r.clock.advance(STALE_SYNC_S + 0.1)
            await chat(c, [{"role": "user", "content": "Another task: " + FIRST}])
            assert (await r.last_decision())["decode_node"] == "decode-0"


async def test_a_turn_goes_to_a_d_with_free_room_rather_than_release_retained_turns() -> None:
    """D0's sync says its cache is full of retained turns (it could release them) and D1 has
    free room: the new conversation goes to D1, which keeps D0's turns for their own
    conversations. Retained blocks counted as room here, as free by D's sync and as used by
    its gauges: the replica D0 synced with sent its turns to D0, where each release for one
    cost another conversation its KV (3 of 3 follow-ups recomputed), while another replica
    sent them to D1 (probe 11, finding 3)."""
    async with routed(num_decode=2, engine_config=SILENT_D) as r:
        _, entry = await one_first_turn(r)
        assert entry.decode_node_id == "decode-0"
        d0 = r.cluster.engine("decode-0")
        retained = sync_body(d0.engine_id, retained_blocks=62, num_blocks_free=1,
                             retained_requests=6, num_blocks_total=64)
        assert (await post_sync(r, retained)).status_code == 200
        assert r.ctx.retention.room_tokens("decode-0") == 16
        async with r.client() as c:
            await chat(c, [{"role": "user", "content": "A new task: " + FIRST}])
        assert (await r.last_decision())["decode_node"] == "decode-1"


RUN: dict[str, Any] = {"name": "run", "description": "Run a shell command",
                       "input_schema": {"type": "object", "properties": {
                           "input": {"type": "string"}}, "required": ["input"]}}


def agent_body(messages: list[dict[str, Any]], *, tool_call: bool) -> dict[str, Any]:
    """A Messages request as an agent sends it (always the same ``tools``); a tool call is
    forced (``tool_choice``), as the fake answers it like vLLM does."""
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 96 if tool_call else 16,
                            "tools": [RUN], "messages": messages}
    if tool_call:
        body["tool_choice"] = {"type": "tool", "name": "run"}
    return body


async def agent_turn(r: Routed, task: str, *, tool_call: bool) -> tuple[dict[str, Any],
                                                                        ConversationEntry]:
    """One first turn over ``/v1/messages``; returns its follow-up's body (a tool result,
    or the user's next message) and the entry the router committed for it."""
    first = [{"role": "user", "content": task}]
    async with r.client() as c:
        resp = await c.post("/v1/messages", json=agent_body(first, tool_call=tool_call))
    assert resp.status_code == 200, resp.text
    await r.settle()
    content = resp.json()["content"]
    if tool_call:
        assert [b["type"] for b in content] == ["tool_use"]
        reply: list[dict[str, Any]] = [{"type": "tool_result",
                                        "tool_use_id": content[0]["id"], "content": "ok"}]
    else:
        assert [b["type"] for b in content] == ["text"]
        reply = [{"type": "text", "text": "Now run the tests."}]
    body = agent_body([*first, {"role": "assistant", "content": content},
                       {"role": "user", "content": reply}], tool_call=False)
    found = await r.find(body, endpoint="messages")
    assert found is not None
    return body, found.entry


async def test_a_tool_call_turn_is_kept_for_the_tool_gaps_then_released_on_d() -> None:
    """Tool results come back ~20 s after a tool call, users ~200 s after a reply. Before D
    answers, nobody knows which its answer will be: D is told to keep the turn for the
    replies' time. A turn that ended in a tool call keeps its entry only for the tools'
    time; D's next sync is answered with the tools' return curve for it and, once
    the entry expires on the router's clock, with its release (once), long before D's own
    deadline; a reply's entry keeps D's time and is not ordered released. The gap of each
    follow-up is learned under the kind it followed."""
    async with routed(engine_config=SILENT_D) as r:
        async with r.client() as c:
            await chat(c, conversation(0))  # D's capabilities are known after its first answer
            await r.settle()
        learn_gaps(r, 200.0, kind="user")
        learn_gaps(r, 20.0, kind="tool")
        margin = r.ctx.config.ttl_safety_margin_s + r.ctx.config.policy.near_expiry_s
        safety = r.ctx.config.ttl_safety_margin_s
        tool_follow_up, tool = await agent_turn(r, "Fix the failing test.", tool_call=True)
        told = await retain_s_sent(r)
        assert isinstance(told, float) and margin + 200.0 <= told < margin + 200.0 * 1.25
        assert (tool.waits_for, tool.release_at_expiry) == ("tool", True)
        kept = tool.expires_at_s - tool.created_at_s + safety
        assert margin + 20.0 <= kept < margin + 20.0 * 1.25 < told
        told_curve = await curve_sent(r)  # the replies'
        assert told_curve is not None and math.exp(told_curve.log_mean) == pytest.approx(200.0)
        answer = await post_sync(r, sync_body(r.cluster.decode[0].engine_id))
        [[request_id, raw]] = answer.json()["curves"]  # the tools', sent once
        tools = msgspec.convert(raw, ReturnCurve)
        assert request_id == tool.request_id and math.exp(tools.log_mean) == pytest.approx(20.0)
        assert "curves" not in (await post_sync(r, sync_body(r.cluster.decode[0].engine_id))
                                ).json()  # none to send: the answer an older D reads
        reply_follow_up, reply = await agent_turn(r, "Explain the bug.", tool_call=False)
        assert (reply.waits_for, reply.release_at_expiry) == ("user", False)
        assert reply.expires_at_s - reply.created_at_s + safety == pytest.approx(
            await retain_s_sent(r))
        assert await orders_for(r) == []
        r.clock.advance(kept)  # the tool call's entry expired on the router's clock
        assert await orders_for(r) == [tool.request_id]
        assert await orders_for(r) == []
        async with r.client() as c:
            late = await c.post("/v1/messages", json=tool_follow_up)
            on_time = await c.post("/v1/messages", json=reply_follow_up)
        assert late.headers["x-kvrelay-action"] == "recompute"
        assert on_time.headers["x-kvrelay-reason"] == "pull"
        await r.settle()
        gaps = r.ctx.retention._gaps.histograms  # what plan observed
        req = parse_request("messages", json.dumps(tool_follow_up).encode(), {}, "default",
                            IdRules(()))
        tool_seen, user_seen = gaps(req, "tool")[-1], gaps(req, "user")[-1]
        assert tool_seen is not None and user_seen is not None
        assert (tool_seen.samples, user_seen.samples) == (121, 121)


async def test_a_stock_d_keeps_every_turn_its_ttl_so_the_entry_does_too() -> None:
    """D runs kvrelay's connector in stock mode and says so in its params
    (``kvrelay_retention: stock``) while the router learns retention: D keeps every turn
    its TTL whatever it is told, so a tool call's entry keeps D's TTL too (not the tools'
    time: the router would give up a turn D still holds) and nothing is ordered released."""
    async with routed(engine_config=STOCK_D) as r:
        async with r.client() as c:
            await chat(c, conversation(0))
            await r.settle()
        learn_gaps(r, 200.0, kind="user")
        learn_gaps(r, 20.0, kind="tool")
        _, tool = await agent_turn(r, "Fix the failing test.", tool_call=True)
        assert (tool.waits_for, tool.release_at_expiry) == ("tool", False)
        safety = r.ctx.config.ttl_safety_margin_s
        assert tool.expires_at_s - tool.created_at_s + safety == pytest.approx(
            ENGINE_CONFIG.decoder_kv_blocks_ttl)
        r.clock.advance(60.0)  # past the tools' time: the entry is still there
        assert await orders_for(r) == []


@pytest.mark.parametrize("same_key", [True, False])
async def test_a_restarted_router_answers_ds_asks_before_any_answer_of_ds(
    same_key: bool,
) -> None:
    """A router restarted (with the same ``--tag-key``, or without one) knows no engine of
    D until D answers it; D's asks under pressure must still be answered, or the request
    waiting for D's blocks, the one that would bring that answer, waits for D's TTL (they
    were a 404: probe 6, finding 1). With D's token the sync is D's and teaches D's engine;
    without, it is heard on every D where it can only make entries recompute. For
    ``SPENT_READ_GRACE_S`` after it starts, the turns it has no entry of are answered as
    read: its predecessor's P legs may still read them (D freed a turn 0.7 s after the old
    router died mid-pull: probe 9, finding 2)."""
    key = "k" * 32
    async with routed(engine_config=SILENT_D, tag_key=key) as r:
        _, entry = await one_first_turn(r)
        d = r.cluster.decode[0]
        token = r.ctx.retention.url_for("decode-0").rsplit("/", 1)[1]
        config = replace(r.ctx.config, tag_key=key if same_key else "n" * 32)
        restarted = create_app(config, clock=r.clock)
        try:
            ask = encode(RetentionSync(
                engine_id=d.engine_id, block_size=16, bytes_per_block=4096,
                num_blocks_total=128, num_blocks_free=0, retained_requests=1,
                retained_blocks=4, retained_tokens=64, releasing=(entry.request_id,)))
            orders = await restarted.ctx.retention.accept(ask, token)
            assert orders.dropped == ()
            r.clock.advance(SPENT_READ_GRACE_S - 0.1)
            assert (await restarted.ctx.retention.accept(ask, token)).dropped == ()
            r.clock.advance(0.1)
            orders = await restarted.ctx.retention.accept(ask, token)
            assert orders.dropped == (entry.request_id,)
            knows = restarted.ctx.nodes.trusted_identity("decode-0")[0]
            assert knows == (d.engine_id if same_key else None)
            assert (restarted.ctx.retention.latest("decode-0") is not None) is same_key
        finally:
            await restarted.ctx.upstream.aclose()


async def test_a_sync_that_said_d_holds_turns_goes_stale_and_idle_ds_read_zero() -> None:
    """D syncs every SYNC_INTERVAL_S while it holds turns: a sync that said it holds some and
    was not followed for STALE_SYNC_S is not D's numbers any more (a restarted D posts
    nowhere until a decode request reaches it; its dead engine's 3 turns showed for good:
    probe 6, finding 7). One that said D holds none stands. The router's own
    ``retained_tokens`` reads 0 for a D without live entries (the series vanished: finding
    9)."""
    async with routed(engine_config=SILENT_D) as r:
        d = r.cluster.decode[0]
        await one_first_turn(r)
        assert (await post_sync(r, sync_body(d.engine_id, retained_blocks=4))).status_code == 200
        assert "decode-0" in (await r.get("/stats")).json()["retention"]
        r.clock.advance(STALE_SYNC_S - 0.1)
        assert r.ctx.retention.latest("decode-0") is not None
        r.clock.advance(0.2)
        assert r.ctx.retention.latest("decode-0") is None
        assert "decode-0" not in (await r.get("/stats")).json()["retention"]
        metrics = parse_prometheus((await r.internal_get("/metrics")).text)
        assert not any(k.startswith("kvrelay_router_d_retained_blocks") for k in metrics)
        idle = encode(RetentionSync(
            engine_id=d.engine_id, block_size=16, bytes_per_block=4096, num_blocks_total=128,
            num_blocks_free=128, retained_requests=0, retained_blocks=0, retained_tokens=0))
        assert (await post_sync(r, idle)).status_code == 200
        r.clock.advance(10 * STALE_SYNC_S)
        assert r.ctx.retention.latest("decode-0") is not None
        await r.ctx.index.drop_node("decode-0")
        metrics = parse_prometheus((await r.internal_get("/metrics")).text)
        assert metric(metrics, "kvrelay_router_retained_tokens", node="decode-0") == 0


async def test_an_admin_flush_drops_the_conversations_turn_under_way_too() -> None:
    """A streamed turn (D on vLLM 0.32: its params come in D's report, here 1 s late) is
    under way when an admin drops its conversation: it commits nothing to pull, and D is
    ordered to release it (it committed after the drop and its next turn pulled: probe 6,
    finding 8)."""
    config = replace(SILENT_D, vllm_version="0.32", report_delay_s=1.0)
    async with routed(engine_config=config, admin_key="root") as r:
        body = {"model": "tiny", "messages": first_turn(), "max_tokens": 16,
                "conversation_id": "flush-me", "stream": True}
        async with r.client() as c:
            resp = await c.post("/v1/chat/completions", json=body)
        text = "".join(str(e["choices"][0]["delta"].get("content") or "")  # type: ignore[index]
                       for e in sse_events(resp.text) if not isinstance(e, str))
        assert len(r.ctx.desk) == 1  # D's report is awaited
        dropped = await r.post("/admin/conversations/drop", {"conversation_id": "flush-me"},
                               headers={"Authorization": "Bearer root"})
        assert dropped.json() == {"dropped": True, "entries": 0, "turns_under_way": 1}
        await r.settle()
        history = [*first_turn(), {"role": "assistant", "content": text},
                   {"role": "user", "content": "?"}]
        found = await r.find({"model": "tiny", "messages": history,
                              "conversation_id": "flush-me"})
        assert found is None
        assert len(await orders_for(r)) == 1
        async with r.client() as c:
            again = await c.post("/v1/chat/completions", json={
                "model": "tiny", "messages": history, "max_tokens": 4,
                "conversation_id": "flush-me"})
        assert again.headers["x-kvrelay-action"] == "recompute"


async def test_a_sync_at_ds_url_naming_a_new_engine_makes_the_router_ask_d() -> None:
    """D restarted between health checks (probe 9, finding 3): its sync, at D's own URL,
    names the new engine. The sync does not teach it (heard as ``unknown_engine``: a sync
    never changes a known engine id), but it makes the router ask D itself, whose answer
    does; D's next sync is then D's (``ok``) and its numbers are kept. Before, every sync of
    the restarted D stayed ``unknown_engine`` and D's retained-KV numbers were gone."""
    async with routed(engine_config=SILENT_D) as r:
        await one_first_turn(r)
        d = r.cluster.decode[0]
        old_engine = d.engine_id
        await d.restart()
        token = r.ctx.retention.url_for("decode-0").rsplit("/", 1)[1]
        syncs = r.ctx.metrics.retention_syncs
        await r.ctx.retention.accept(sync_body(d.engine_id), token)
        assert syncs.labels("unknown_engine")._value.get() == 1
        await until(lambda: r.ctx.nodes.trusted_identity("decode-0")[0] == d.engine_id,
                    "the router learned D's new engine from D")
        assert d.engine_id != old_engine
        assert r.ctx.metrics.engine_checks.labels("decode-0", "restarted")._value.get() == 1
        await r.ctx.retention.accept(sync_body(d.engine_id), token)
        assert syncs.labels("ok")._value.get() == 1
        state = r.ctx.retention.latest("decode-0")
        assert state is not None and state.sync.engine_id == d.engine_id


async def test_a_turn_goes_to_a_d_with_room_when_ds_metrics_say_one_is_full() -> None:
    """D0 is full of live work this router did not send (another replica's, or traffic
    past any router) and retains nothing, so it never syncs: the router counted its room as
    unknown, that is as room, and a new conversation waited 8.5 s on D0 while D1 sat idle
    (probe 10, finding R2). vLLM's own ``/metrics`` says D0 is full: the turn goes to D1.
    Once the work has ended, the next read makes D0 roomy again."""
    async with routed(num_decode=2,
                      engine_config=replace(SILENT_D, num_gpu_blocks=24, block_size=16)) as r:
        d0 = r.cluster.engine("decode-0")
        d0.faults.slow_stream_s = 0.05
        task = [{"role": "user", "content": "Fix the flaky test in the parser module. " * 14}]
        async with httpx.AsyncClient(timeout=30.0, trust_env=False) as direct, \
                r.client() as c:
            long_work = asyncio.create_task(direct.post(d0.url + "/v1/completions", json={
                "model": "tiny", "prompt": "The tide rolls in. " * 40, "max_tokens": 40}))
            await until(lambda: d0.state.pool.num_free <= 6, "D0 is full of live work")
            for node_id in ("decode-0", "decode-1"):
                await r.ctx.nodes.read_room(node_id)
            rooms = [r.ctx.retention.room_tokens(d) or 0 for d in ("decode-0", "decode-1")]
            free = [d0.state.pool.num_free * 16, 23 * 16]  # within a block: vLLM's usage
            assert all(abs(a - b) <= 16 for a, b in zip(rooms, free, strict=True)), rooms
            await chat(c, task)
            decision = await r.last_decision()
            assert decision["decode_node"] == "decode-1"
            assert decision["prompt_tokens"] > d0.state.pool.num_free * 16
            assert not long_work.done()  # D0 was still full when the turn went to D1
            d0.faults.slow_stream_s = 0.0
            assert (await long_work).status_code == 200
            for node_id in ("decode-0", "decode-1"):
                await r.ctx.nodes.read_room(node_id)
            await chat(c, [{"role": "user", "content": "Another task: " + FIRST}])
            assert (await r.last_decision())["decode_node"] == "decode-0"
