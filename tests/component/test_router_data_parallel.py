"""A D run data parallel behind one URL (vLLM's ``--data-parallel-size``): one engine per
rank, each with its own KV cache, engine id (``<group>_dp<rank>``) and side channel, behind
one URL whose balancer spreads the turns (``fakevllm.data_parallel``, round robin). Before,
every answer from another rank "restarted" the D: the router dropped the other rank's
entries, refused every streamed turn's report (``mismatch_engine``) and heard the other
rank's syncs as an unknown engine's."""

from __future__ import annotations

import math
import re
from typing import Any

import httpx
import pytest
from msgspec.structs import replace

from kvrelay.client.sse import sse_events
from kvrelay.core.engine_group import engine_group
from kvrelay.core.engine_load import room_from_metrics
from kvrelay.core.retention_sync import Released
from kvrelay.core.return_curve import ReturnCurve
from kvrelay.fakevllm import FakeEngine
from kvrelay.router.retention import CurveQueues
from tests.component.router_fake import GUARD_CONFIGS, Routed, routed, until
from tests.component.router_rig import stream_text
from tests.component.test_router_fake_retention_sync import (
    chat,
    conversation,
    follow_up,
    retained,
    syncs_pass,
)

FOLLOW_UPS = ["Go on.", "Which test failed first?", "Fix it."]


async def interleaved(r: Routed, num_conversations: int, *, stream: bool) -> list[str]:
    """``num_conversations`` conversations of four turns, their turns interleaved (so each
    conversation's turns land on alternating ranks); each turn settled before the next.
    Returns the replies."""
    histories = [conversation(i) for i in range(num_conversations)]
    replies: list[str] = []
    async with r.client() as c:
        for user in [None, *FOLLOW_UPS]:
            for i, history in enumerate(histories):
                if user is not None:
                    history.append({"role": "user", "content": user})
                body: dict[str, Any] = {"model": "tiny", "messages": history,
                                        "max_tokens": 16, "stream": stream}
                resp = await c.post("/v1/chat/completions", json=body)
                assert resp.status_code == 200, resp.text
                text = stream_text(sse_events(resp.text)) if stream \
                    else resp.json()["choices"][0]["message"]["content"]
                histories[i] = [*history, {"role": "assistant", "content": text}]
                replies.append(text)
                await r.settle()
    return replies


def ranks(r: Routed) -> list[FakeEngine]:
    return r.cluster.decode


@pytest.mark.parametrize("guard", list(GUARD_CONFIGS))
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("num_conversations", [2, 3])
async def test_every_follow_up_pulls_from_the_rank_that_holds_it(
        num_conversations: int, stream: bool, guard: str) -> None:
    """Two or three conversations, so that D's last answer is from another rank than the
    one a follow-up's entry names (two) or from the same one (three)."""
    n = num_conversations
    async with routed(engine_config=GUARD_CONFIGS[guard], decode_data_parallel=2) as r:
        await interleaved(r, n, stream=stream)
        d0, d1 = ranks(r)
        decisions = (await r.stats())["decisions"]["recent"]
        assert [x["reason"] for x in decisions] == ["no_entry"] * n + ["pull"] * 3 * n
        pulls = [rec for rec in r.cluster.prefill[0].records if rec.plan == "pull"]
        assert len(pulls) == 3 * n
        assert {rec.pulled_from_engine for rec in pulls} == {d0.engine_id, d1.engine_id}
        for rec in pulls:
            assert rec.pulled_tokens > 0 and rec.pulled_matches_prompt and not rec.wrong_reuse
        assert not d0.freed_reads and not d1.freed_reads
        assert set(r.ctx.nodes.engines("decode-0")) == {d0.engine_id, d1.engine_id}
        checks = r.ctx.metrics.engine_checks
        assert checks.labels("decode-0", "restarted")._value.get() == 0
        # a 0.32 stream's report from a rank not seen answering asks that rank, once (a
        # 0.33 stream ends with D's params, as a non-streamed answer does: no report)
        rank_checks = checks.labels("decode-0", "rank")._value.get()
        if stream and not d0.config.protocol.stream_kv_params:
            assert 0 < rank_checks <= 2
        else:
            assert rank_checks == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_follow_up_decodes_on_the_rank_that_holds_its_turn(stream: bool) -> None:
    """Each follow-up names its rank (``X-data-parallel-rank``), where the pull freed the
    last turn into D's prefix cache: D loads from P only what that cache lacks, as much as a
    D of one engine does. Without the rank vLLM's balancer sent three conversations' turns
    round robin, and D loaded 3,549 prompt tokens from P instead of 2,013."""
    loaded = {}
    for ranks_per_d in (1, 2):
        async with routed(decode_data_parallel=ranks_per_d) as r:
            await interleaved(r, 3, stream=stream)
            records = [rec for d in ranks(r) for rec in d.records if rec.plan == "pull"]
            loaded[ranks_per_d] = sum(rec.pulled_tokens for rec in records)
            if ranks_per_d == 2:
                assert r.ctx.metrics.decode_ranks.labels("affinity")._value.get() == 9
                conversations = [  # by their first tokens: each one's turns on one rank
                    len({rec.prompt_token_ids[:24] for rec in d.records
                         if len(rec.prompt_token_ids) > 100}) for d in ranks(r)]
                assert sorted(conversations) == [1, 2]
    assert loaded[2] == loaded[1]


async def test_a_direct_turn_decodes_on_the_rank_whose_prefix_cache_has_it() -> None:
    """``--direct``: D serves the history from its prefix cache, which only the holding rank
    has. Through vLLM's balancer D computed the whole prompt on a rank without it (probe
    16: 11,377 prompt tokens on two ranks against 4,209 on one engine)."""
    computed = {}
    for ranks_per_d in (1, 2):
        async with routed(decode_data_parallel=ranks_per_d, direct_enabled=True) as r:
            await interleaved(r, 3, stream=False)
            decisions = (await r.stats())["decisions"]["recent"]
            assert [x["action"] for x in decisions] == ["recompute"] * 3 + ["direct"] * 9
            computed[ranks_per_d] = sum(
                len(rec.prompt_token_ids) - rec.local_cache_hit_tokens - rec.pulled_tokens
                for d in ranks(r) for rec in d.records if rec.plan != "pull")
    assert computed[2] == computed[1]


async def test_the_answers_equal_a_single_engine_d() -> None:
    async with routed(decode_data_parallel=2) as r:
        with_ranks = await interleaved(r, 2, stream=False)
    async with routed() as r:
        single = await interleaved(r, 2, stream=False)
    assert with_ranks == single


async def test_an_entry_the_router_evicts_is_released_on_its_rank() -> None:
    """Release orders go to the rank that holds the turn (its engine's sync), and ``/stats``
    sums the ranks' own numbers."""
    async with routed(max_entries=1, decode_data_parallel=2) as r:
        d0, d1 = ranks(r)
        async with r.client() as c:
            first = await chat(c, conversation(1))  # rank 0
            await r.settle()
            history = follow_up(conversation(1), first)
            found = await r.find({"model": "tiny", "messages": history})
            assert found is not None and found.entry.decode_engine_id == d0.engine_id
            await chat(c, conversation(2))  # rank 1: evicts conversation 1's entry
            await r.settle()
            assert await r.find({"model": "tiny", "messages": history}) is None
            await syncs_pass(r)
            await until(lambda: found.entry.request_id not in retained(d0),
                        "rank 0 released the evicted entry's turn")
            await syncs_pass(r)
            stats = (await r.stats())["retention"]["decode-0"]
            assert stats["retained_requests"] == len(retained(d0)) + len(retained(d1)) == 1
            assert stats["total_blocks"] == 2 * (ENGINE_BLOCKS - 1)
            assert stats["releases_total"].get("router") == 1
            reply = await chat(c, history)
        assert reply.headers["x-kvrelay-action"] == "recompute"
        assert r.ctx.metrics.retention_syncs.labels("unknown_engine")._value.get() == 0


ENGINE_BLOCKS = GUARD_CONFIGS["connector"].num_gpu_blocks


async def test_a_restart_of_every_rank_is_a_restart() -> None:
    async with routed(decode_data_parallel=2) as r:
        d0, d1 = ranks(r)
        old = d0.engine_id
        async with r.client() as c:
            first = await chat(c, conversation(1))
            await r.settle()
            for rank in (d0, d1):
                await rank.stop()
            for rank in (d0, d1):
                await rank.start()
            assert engine_group(d0.engine_id) == engine_group(d1.engine_id) != engine_group(old)
            await chat(c, conversation(2))  # D's answer names its new engine
            await r.settle()
            reply = await chat(c, follow_up(conversation(1), first))
        assert reply.headers["x-kvrelay-reason"] == "engine_restarted"
        assert {engine_group(e) for e in r.ctx.nodes.engines("decode-0")} == {
            engine_group(d0.engine_id)}


async def test_the_fake_front_is_vllm_data_parallel() -> None:
    """What the rest relies on: ids ``<group>_dp<rank>`` sharing a group, each rank its own
    side channel, vLLM's ``X-data-parallel-rank`` header obeyed, and ``/metrics`` per engine
    (the room read is the roomiest rank's)."""
    async with routed(decode_data_parallel=3) as r:
        d = ranks(r)
        assert [re.sub(r"^.*_dp", "", e.engine_id) for e in d] == ["0", "1", "2"]
        assert len({engine_group(e.engine_id) for e in d}) == 1
        assert len({e.side_channel_port for e in d}) == 3
        assert r.cluster.decode_urls == [d[0].url]
        async with httpx.AsyncClient(base_url=d[0].url, trust_env=False) as c:
            resp = await c.post("/v1/completions", headers={"X-data-parallel-rank": "2"},
                                json={"model": "tiny", "prompt": "Hello " * 200,
                                      "max_tokens": 4})
            assert resp.status_code == 200
            assert len(d[2].records) == 1 and not d[0].records and not d[1].records
            metrics = (await c.get("/metrics")).text
        assert {'engine="0"', 'engine="1"', 'engine="2"'} <= set(
            re.findall(r'engine="\d"', metrics))
        room = room_from_metrics(metrics)
        total = ENGINE_BLOCKS * GUARD_CONFIGS["connector"].block_size
        assert room is not None and room.free_tokens == total  # rank 0 and 1 are empty


def test_each_rank_takes_its_own_return_curves() -> None:
    """The curves of a data-parallel D's turns wait for the sync of the rank that holds
    each; one rank's sync took the whole D's queue and dropped the others' (probe 16: 4 of
    8 tool-call turns on two ranks kept the replies' curve). Another group's (D restarted)
    are dropped."""
    tool = ReturnCurve(0.9, math.log(3.0), 0.5)
    queues = CurveQueues()
    for engine, request_id in [("G_dp0", "a"), ("G_dp1", "b"), ("OLD_dp0", "c"),
                               ("G_dp1", "d")]:
        queues.put("decode-0", engine, request_id, tool)
    queues.put("decode-1", "G_dp1", "e", tool)
    assert [c.request_id for c in queues.take("decode-0", "G_dp1")] == ["b", "d"]
    assert queues.take("decode-0", "G_dp1") == ()
    assert [c.request_id for c in queues.take("decode-0", "G_dp0")] == ["a"]
    assert queues.take("decode-0", "OLD_dp0") == ()  # dropped by G's takes
    assert [c.request_id for c in queues.take("decode-1", "G_dp1")] == ["e"]


async def test_a_rank_d_refuses_is_not_named_again_and_the_turn_is_served() -> None:
    """A D that takes no rank by its id after all (a layout ``addressable`` misread, an entry
    from before D ran fewer ranks) answers vLLM's 400 "data_parallel_rank N is out of range":
    D never scheduled it, so the turn goes again without a rank and is answered, and D's
    ranks are not named again until its engine group changes. Before, the client got the
    400."""
    async with routed(decode_data_parallel=2) as r:
        d0 = ranks(r)[0]
        histories = [conversation(i) for i in range(2)]
        async with r.client() as c:
            for i, history in enumerate(histories):  # rank 0, then rank 1: D takes ranks
                reply = await c.post("/v1/chat/completions", json={
                    "model": "tiny", "messages": history, "max_tokens": 16,
                    "conversation_id": f"c{i}"})
                histories[i] = follow_up(history, reply)
                await r.settle()
            assert r.ctx.nodes.takes_ranks("decode-0")
            body = {"model": "tiny", "messages": histories[0], "max_tokens": 16,
                    "conversation_id": "c0"}
            found = await r.find(body)
            assert found is not None
            gone = engine_group(d0.engine_id) + "_dp5"  # a rank this D does not run
            await r.ctx.index.put(found.ref, replace(found.entry, blocks=replace(
                found.entry.blocks, engine_id=gone)), tenant="default")
            reply = await c.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"] == await r.recompute(
                {"model": "tiny", "messages": histories[0], "max_tokens": 16})
            assert r.ctx.metrics.decode_ranks.labels("refused")._value.get() == 1
            assert not r.ctx.nodes.takes_ranks("decode-0")
            await r.settle()
            again = await c.post("/v1/chat/completions", json={
                "model": "tiny", "messages": histories[1], "max_tokens": 16,
                "conversation_id": "c1"})
            assert again.status_code == 200
        assert r.ctx.metrics.decode_ranks.labels("not_addressable")._value.get() == 1


async def test_a_follow_up_whose_turn_the_rank_released_names_no_rank() -> None:
    """D released the turn (pressure): its rank holds nothing of it, so vLLM's balancer
    picks (probe 17: pinned, such recomputes queued on one rank while the other idled)."""
    async with routed(decode_data_parallel=2) as r:
        async with r.client() as c:
            first = await chat(c, conversation(1))
            await r.settle()
            history = follow_up(conversation(1), first)
            found = await r.find({"model": "tiny", "messages": history})
            assert found is not None
            entry = found.entry
            await r.ctx.index.mark_released(entry.decode_node_id, entry.decode_engine_id,
                                            [Released(entry.request_id, "pressure")])
            reply = await chat(c, history)
        assert reply.headers["x-kvrelay-reason"] == "released"
        assert r.ctx.metrics.decode_ranks.labels("released")._value.get() == 1
        assert r.ctx.metrics.decode_ranks.labels("affinity")._value.get() == 0
