"""Two router replicas sharing conversation state in a real Redis, in front of the same fake
P/D engines: turns alternating between replicas still pull, concurrent follow-ups pull once,
and a Redis outage turns pulls into recomputes (never errors) until Redis is back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from kvrelay.client.prometheus import parse_prometheus
from kvrelay.client.sse import sse_events
from kvrelay.core.retention_sync import Released, RetentionSync, encode
from kvrelay.fakevllm import FakeCluster, FakeEngineConfig, ManualClock
from kvrelay.fakevllm.server import HttpServer
from kvrelay.router.app import create_app
from kvrelay.router.config import RouterConfig
from kvrelay.router.state import RouterContext
from tests.component.redis_server import RedisServer
from tests.component.router_fake import ENGINE_CONFIG
from tests.component.router_rig import lookup, stream_text
from tests.component.test_router_agent_apis import FOLLOW_UPS, PATHS, Reply, first_body, follow_up
from tests.costs import fixed
from tests.ports import free_ports

FIRST = "Tell me everything about the rivers of Europe, in order of length. " * 6


@dataclass
class Replicas:
    cluster: FakeCluster
    ctxs: list[RouterContext]
    urls: list[str]
    servers: list[list[HttpServer]]
    """Each replica's public and internal listeners."""

    async def stop(self, replica: int) -> None:
        """Replica ``replica`` goes away (scaled down, crashed): its listeners close."""
        for server in self.servers[replica]:
            await server.stop()

    async def settle(self) -> None:
        await self.cluster.drain_reports()
        for _ in range(2000):
            if all(len(c.desk) == 0 for c in self.ctxs):
                return
            await asyncio.sleep(0.005)
        raise AssertionError("reports still pending")

    async def turn(self, replica: int, messages: list[dict[str, Any]],
                   conversation: str | None) -> tuple[str, str, str]:
        """One chat turn through ``replica`` (``conversation``: its id, or ``None`` to send
        none): (action, reason, reply text)."""
        body: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": 16}
        if conversation is not None:
            body["conversation_id"] = conversation
        async with httpx.AsyncClient(timeout=60.0, trust_env=False) as c:
            resp = await c.post(self.urls[replica] + "/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        text = resp.json()["choices"][0]["message"]["content"]
        return resp.headers["x-kvrelay-action"], resp.headers["x-kvrelay-reason"], text

    async def state_errors(self) -> float:
        total = 0.0
        for url in self.urls:
            async with httpx.AsyncClient(timeout=60.0, trust_env=False) as c:
                metrics = parse_prometheus((await c.get(url + "/metrics")).text)
            total += sum(v for name, v in metrics.items()
                         if name.startswith("kvrelay_router_state_errors_total{"))
        return total


class CuttableLink:
    """A TCP relay to Redis whose link a test cuts: a replica that loses Redis while it
    stays up (a network partition), when the others still reach it."""

    def __init__(self, target_port: int) -> None:
        self._target = target_port
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target)
        self._writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def cut(self) -> None:
        """Close every connection; new ones are accepted and closed at once."""
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        self._server = await asyncio.start_server(
            lambda _r, w: w.close(), "127.0.0.1", self.port)

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()


@contextlib.asynccontextmanager
async def replicas(redis: RedisServer, n: int = 2, engine_config: FakeEngineConfig = ENGINE_CONFIG,
                   states: list[str] | None = None, **settings: Any) -> AsyncIterator[Replicas]:
    """``n`` replicas on ``redis`` (``states``: each replica's own URL for it instead)."""
    clock = ManualClock()
    async with FakeCluster(1, 1, engine_config, clock=clock) as cluster:
        servers, ctxs, urls = [], [], []
        try:
            for i in range(n):
                port, internal_port = free_ports(2)
                defaults: dict[str, Any] = {
                    "port": port, "internal_port": internal_port, "health_interval_s": 3600.0,
                    "report_wait_s": 5.0, "state": states[i] if states else redis.url,
                    "state_timeout_ms": 2000.0,
                    **fixed(),
                }
                config = RouterConfig.from_urls(
                    cluster.prefill_urls, cluster.decode_urls,
                    block_size=ENGINE_CONFIG.block_size, **{**defaults, **settings},
                )
                app = create_app(config, clock=clock)
                servers.append([])
                for served, at in ((app.public, port),
                                   (app.internal, config.listen_internal_port)):
                    server = HttpServer(served, "127.0.0.1", at)
                    await server.start()
                    servers[-1].append(server)
                ctxs.append(app.ctx)
                urls.append(f"http://127.0.0.1:{port}")
            yield Replicas(cluster, ctxs, urls, servers)
        finally:
            for server in (one for each in servers for one in each):
                await server.stop()
            for ctx in ctxs:
                await ctx.upstream.aclose()
                await ctx.index.aclose()


async def conversation(r: Replicas, name: str | None, turns: int, first_replica: int = 0,
                       first: str = FIRST) -> list[tuple[str, str]]:
    """``turns`` turns alternating between the replicas; their (action, reason)."""
    messages: list[dict[str, Any]] = []
    out: list[tuple[str, str]] = []
    for i in range(turns):
        messages.append({"role": "user", "content": first if i == 0 else f"And then {i}?"})
        action, reason, text = await r.turn((first_replica + i) % 2, list(messages), name)
        messages.append({"role": "assistant", "content": text})
        out.append((action, reason))
        await r.settle()
    return out


async def test_alternating_replicas_pull_every_follow_up(redis_server: RedisServer) -> None:
    async with replicas(redis_server) as r:
        p, d = r.cluster.prefill[0], r.cluster.decode[0]
        got = await conversation(r, "conv-alt", 5)
        assert got == [("recompute", "no_entry")] + [("pull", "pull")] * 4
        pulls = [rec for rec in p.records if rec.plan == "pull"]
        assert len(pulls) == 4
        for rec in pulls:
            assert rec.pulled_from_engine == d.engine_id and rec.pulled_tokens > 0
            assert rec.pulled_matches_prompt and not rec.wrong_reuse
            assert not rec.read_freed_blocks
        assert not d.freed_reads


async def test_alternating_replicas_pull_without_any_conversation_id(
    redis_server: RedisServer,
) -> None:
    async with replicas(redis_server) as r:
        p = r.cluster.prefill[0]
        got = await conversation(r, None, 5, first="No id here. " + FIRST)
        assert got == [("recompute", "no_entry")] + [("pull", "pull")] * 4
        pulls = [rec for rec in p.records if rec.plan == "pull"]
        assert len(pulls) == 4 and all(not rec.wrong_reuse for rec in pulls)


async def test_concurrent_follow_ups_on_two_replicas_pull_once(
    redis_server: RedisServer,
) -> None:
    async with replicas(redis_server) as r:
        p = r.cluster.prefill[0]
        messages: list[dict[str, Any]] = [{"role": "user", "content": FIRST}]
        _, _, text = await r.turn(0, list(messages), "conv-race")
        await r.settle()
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": "And Asia?"}]
        results = await asyncio.gather(r.turn(0, list(messages), "conv-race"),
                                       r.turn(1, list(messages), "conv-race"))
        actions = sorted((a, why) for a, why, _ in results)
        assert actions == [("pull", "pull"), ("recompute", "no_entry")]
        assert len([rec for rec in p.records if rec.plan == "pull"]) == 1
        assert not any(rec.read_freed_blocks for rec in p.records)


async def test_a_fast_follow_up_of_a_streamed_turn_on_the_other_replica_pulls(
    redis_server: RedisServer,
) -> None:
    """vLLM 0.32 puts no params on a stream's last chunk: the streamed turn's entry is
    written when D's report reaches the replica that served it (~0.1 s later). A follow-up
    sent at once to the other replica found no entry and recomputed; the serving replica
    announces the entry in Redis, so the other one waits for it as the serving one would.
    (D on 0.32, whatever protocol the suite runs: it reports 1 s after the stream's end
    here, so the follow-up surely comes first.)"""
    config = replace(ENGINE_CONFIG, report_delay_s=1.0, vllm_version="0.32")
    async with replicas(redis_server, engine_config=config) as r:
        for i in range(3):
            messages: list[dict[str, Any]] = [
                {"role": "user", "content": f"Streamed conversation {i}. " + FIRST}]
            body = {"model": "tiny", "messages": messages, "max_tokens": 16, "stream": True}
            async with httpx.AsyncClient(timeout=60.0, trust_env=False) as c:
                resp = await c.post(r.urls[0] + "/v1/chat/completions", json=body)
            assert resp.status_code == 200
            text = stream_text(sse_events(resp.text))
            assert r.ctxs[0].desk.pending_of(None) == 1  # D's report is not in yet
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": "And Asia?"}]
            action, reason, _ = await r.turn(1, messages, None)
            assert (action, reason) == ("pull", "pull")
        await r.settle()
        # a turn that found nothing announced does not wait: a new conversation
        assert (await r.turn(1, [{"role": "user", "content": "New. " + FIRST}], None))[:2] \
            == ("recompute", "no_entry")


async def test_an_entry_committed_between_a_look_and_the_withdrawal_is_found(
    redis_server: RedisServer, monkeypatch: Any,
) -> None:
    """The waiting replica looks (no entry yet), then the serving replica commits the entry
    and withdraws its announcement, then the waiting one sees it withdrawn: it looks once
    more and pulls (it stopped with no entry: a follow-up recomputed under CI's load)."""
    config = replace(ENGINE_CONFIG, report_delay_s=0.3, vllm_version="0.32")
    async with replicas(redis_server, engine_config=config) as r:
        index = r.ctxs[1].index
        real_announced = index.announced
        calls = 0

        async def racing_announced(identity: Any) -> bool:
            nonlocal calls
            calls += 1
            if calls > 1:  # after a look that found nothing: the turn commits now
                await r.settle()
            return await real_announced(identity)

        monkeypatch.setattr(index, "announced", racing_announced)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Streamed. " + FIRST}]
        body = {"model": "tiny", "messages": messages, "max_tokens": 16, "stream": True}
        async with httpx.AsyncClient(timeout=60.0, trust_env=False) as c:
            resp = await c.post(r.urls[0] + "/v1/chat/completions", json=body)
        text = stream_text(sse_events(resp.text))
        assert r.ctxs[0].desk.pending_of(None) == 1  # D's report is not in yet
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": "And Asia?"}]
        assert (await r.turn(1, messages, None))[:2] == ("pull", "pull")
        assert calls == 2


async def test_redis_outage_recomputes_then_pulls_resume(redis_server: RedisServer) -> None:
    async with replicas(redis_server, state_timeout_ms=500.0) as r:
        assert await conversation(r, "before", 2) == [("recompute", "no_entry"),
                                                       ("pull", "pull")]
        assert await r.state_errors() == 0
        redis_server.stop()
        during: list[tuple[str, str]] = []
        for i in range(3):  # every request still succeeds (turn() asserts 200)
            during += await conversation(r, f"during-{i}", 3, first_replica=i)
        assert all(action == "recompute" for action, _ in during)
        assert ("recompute", "state_unavailable") in during
        assert await r.state_errors() > 0
        redis_server.start()  # same port, empty
        for attempt in range(200):
            got = await conversation(r, f"after-{attempt}", 2, first_replica=attempt)
            if got[1] == ("pull", "pull"):
                break
        else:
            raise AssertionError("pulls never resumed after Redis came back")
        assert await conversation(r, "after-final", 3) == [("recompute", "no_entry")] + [
            ("pull", "pull")] * 2


async def post_sync(ctx: RouterContext, engine_id: str,
                    released: tuple[tuple[str, str], ...] = ()) -> list[str]:
    """A D retention sync (written here by hand) to one replica; its release orders."""
    body = encode(RetentionSync(
        engine_id=engine_id, block_size=16, bytes_per_block=4096, num_blocks_total=128,
        num_blocks_free=100, retained_requests=1, retained_blocks=4, retained_tokens=64,
        released=tuple(Released(rid, cause) for rid, cause in released),  # type: ignore[arg-type]
    ))
    async with httpx.AsyncClient(timeout=60.0, trust_env=False) as c:
        resp = await c.post(ctx.retention.url_for("decode-0"), content=body)
    assert resp.status_code == 200, resp.text
    orders: list[str] = resp.json()["release"]
    return orders


async def test_a_release_order_queued_on_one_replica_is_delivered_by_the_other(
    redis_server: RedisServer,
) -> None:
    """Replica 0 evicts replica 1's entry (``max_entries`` 1 in Redis); D syncs with
    replica 1, which hands it the order: the queue lives in Redis. A release D tells
    replica 1 of makes replica 0's next turn of that conversation recompute (``released``).
    The test is D (its syncs written by hand): the fake D does not sync itself."""
    async with replicas(redis_server, engine_config=replace(ENGINE_CONFIG, retention_sync=False),
                        max_entries=1) as r:
        d = r.cluster.decode[0]
        a = [{"role": "user", "content": "conversation A " + FIRST}]
        _, _, a_text = await r.turn(1, a, None)
        await r.settle()
        a_next = [*a, {"role": "assistant", "content": a_text}, {"role": "user", "content": "go"}]
        found_a = await lookup(r.ctxs[1], {"model": "tiny", "messages": a_next})
        assert found_a is not None
        b = [{"role": "user", "content": "conversation B " + FIRST}]
        _, _, b_text = await r.turn(0, b, None)
        await r.settle()
        assert await lookup(r.ctxs[0], {"model": "tiny", "messages": a_next}) is None
        assert await post_sync(r.ctxs[1], d.engine_id) == [found_a.entry.request_id]
        assert await post_sync(r.ctxs[0], d.engine_id) == []  # delivered once
        b_next = [*b, {"role": "assistant", "content": b_text}, {"role": "user", "content": "go"}]
        found_b = await lookup(r.ctxs[0], {"model": "tiny", "messages": b_next})
        assert found_b is not None
        await post_sync(r.ctxs[1], d.engine_id, ((found_b.entry.request_id, "pressure"),))
        assert (await r.turn(0, b_next, None))[:2] == ("recompute", "released")


async def test_a_gone_replicas_turns_are_released_under_pressure_through_another(
    redis_server: RedisServer,
) -> None:
    """Replica 0 gave D three turns and goes away; a long new turn through replica 1 needs
    their blocks. D asks replica 1 for them (both name the same shared state, the Redis
    they share), replica 1 answers from the shared reads and entries, and the new turn is
    served without waiting (D asked only replica 0: the turn waited for their TTL, 57 s
    with a 60 s TTL: probe 6, finding 3). D's clock is manual: a wait would be for good."""
    config = replace(ENGINE_CONFIG, num_gpu_blocks=12, max_model_len=1536)  # 128-token blocks
    async with replicas(redis_server, engine_config=config) as r:
        d = r.cluster.decode[0]
        for i in range(3):
            await r.turn(0, [{"role": "user", "content": f"topic {i} " + "word " * 140}], None)
            await r.settle()
        held = d.state.holds.snapshot()
        assert len(held) == 3 and sum(len(h.block_ids) for h in held) == 9  # of 12
        await r.stop(0)
        big = [{"role": "user", "content": "the long one " + "word " * 300}]  # 6 blocks
        action, _, _ = await asyncio.wait_for(r.turn(1, big, None), timeout=30.0)
        assert action == "recompute"
        assert d.state.retention is not None
        assert d.state.retention.releases_total["pressure"] >= 1


async def test_a_replica_that_lost_redis_fails_d_s_sync_and_d_asks_one_that_has_it(
    redis_server: RedisServer,
) -> None:
    """Replica 0 gave D three turns, then loses its link to Redis but stays up. A long new
    turn through replica 1 needs their blocks; D asks replica 0, which cannot tell whether
    a P reads them: it fails the sync (503, ``retention_syncs_total{outcome="unavailable"}``)
    and D asks replica 1 (the same shared state), which answers: the turn is served. Before,
    replica 0 answered "none dropped" as if heard, D never asked replica 1, and the turn
    waited for the turns' TTL (38.5 s with a 40 s TTL: probe 8a, finding 1). D's clock is
    manual: a wait would be for good."""
    link = CuttableLink(redis_server.port)
    await link.start()
    config = replace(ENGINE_CONFIG, num_gpu_blocks=12, max_model_len=1536)  # 128-token blocks
    try:
        async with replicas(redis_server, engine_config=config,
                            states=[link.url, redis_server.url]) as r:
            d = r.cluster.decode[0]
            for i in range(3):
                await r.turn(0, [{"role": "user", "content": f"topic {i} " + "word " * 140}],
                             None)
                await r.settle()
            assert sum(len(h.block_ids) for h in d.state.holds.snapshot()) == 9  # of 12
            await link.cut()
            big = [{"role": "user", "content": "the long one " + "word " * 300}]  # 6 blocks
            action, _, _ = await asyncio.wait_for(r.turn(1, big, None), timeout=30.0)
            assert action == "recompute"
            assert d.state.retention is not None
            assert d.state.retention.releases_total["pressure"] >= 1
            async with httpx.AsyncClient(timeout=60.0, trust_env=False) as c:
                metrics = parse_prometheus((await c.get(r.urls[0] + "/metrics")).text)
            assert metrics['kvrelay_router_retention_syncs_total{outcome="unavailable"}'] >= 1
    finally:
        await link.aclose()


async def test_an_admin_drop_through_one_replica_reaches_a_turn_the_other_is_serving(
    redis_server: RedisServer,
) -> None:
    """Replica 0 serves a streamed turn whose D report is still on its way when an admin
    drops the conversation through replica 1 (probe 9, N6): the turn is dropped as it
    commits on replica 0 (the flush is marked in Redis), D is ordered to release it, and the
    conversation's next turn recomputes. Before, it committed there and the next turn
    pulled. A turn that begins after the drop commits as usual. (The router clock is the
    test's: it is moved on as the wall clock moves, as a real one would be.)"""
    config = replace(ENGINE_CONFIG, report_delay_s=1.0, vllm_version="0.32",
                     retention_sync=False)
    async with replicas(redis_server, engine_config=config, admin_key="root") as r:
        d = r.cluster.decode[0]
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Forget me. " + FIRST}]
        body = {"model": "tiny", "messages": messages, "max_tokens": 16, "stream": True,
                "conversation_id": "forget-me"}
        async with httpx.AsyncClient(timeout=60.0, trust_env=False) as c:
            resp = await c.post(r.urls[0] + "/v1/chat/completions", json=body)
            text = stream_text(sse_events(resp.text))
            assert r.ctxs[0].desk.pending_of(None) == 1  # D's report is not in yet
            r.cluster.clock.advance(5.0)
            dropped = await c.post(r.urls[1] + "/admin/conversations/drop",
                                   json={"conversation_id": "forget-me"},
                                   headers={"Authorization": "Bearer root"})
        assert dropped.json() == {"dropped": False, "entries": 0, "turns_under_way": 0}
        await r.settle()
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "?"}]
        follow_up = {"model": "tiny", "messages": messages, "conversation_id": "forget-me"}
        assert await lookup(r.ctxs[0], follow_up) is None
        rid = d_request_id(d)
        assert await post_sync(r.ctxs[1], d.engine_id) == [rid]  # D is told to free it
        r.cluster.clock.advance(5.0)
        action, reason, text = await r.turn(0, messages, "forget-me")
        assert (action, reason) == ("recompute", "no_entry")
        await r.settle()
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "!"}]
        assert (await r.turn(1, messages, "forget-me"))[:2] == ("pull", "pull")


def d_request_id(d: Any) -> str:
    """The D request id of D's latest generation request (its retained turn)."""
    rid: str = [rec for rec in d.records if rec.request_kv_transfer_params][-1].internal_request_id
    return rid


async def test_a_drain_through_one_replica_reaches_the_others(redis_server: RedisServer) -> None:
    """An admin's drain reaches one replica behind a Service; the drain is kept in Redis and
    every replica adopts it at its next health round, so none places new conversations on
    the drained D (probe 14, K2: the other replica placed 4 of 4 there); an undrain the
    same way."""
    async with replicas(redis_server, admin_key="root") as r:
        # one P, one D: with the only D drained the other replica refuses new turns
        async with httpx.AsyncClient(timeout=60.0, trust_env=False) as c:
            drained = await c.post(r.urls[1] + "/admin/nodes/decode-0/drain",
                                   headers={"Authorization": "Bearer root"})
            assert drained.json() == {"node": "decode-0", "drained": True}
            await r.ctxs[0].nodes.health_round()
            health = await c.get(r.urls[0] + "/health")
            assert health.status_code == 503
            resp = await c.post(r.urls[0] + "/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": FIRST}],
                "max_tokens": 4})
            assert resp.status_code == 503
            assert "drained" in resp.json()["error"]["message"]
            await c.post(r.urls[1] + "/admin/nodes/decode-0/undrain",
                         headers={"Authorization": "Bearer root"})
            await r.ctxs[0].nodes.health_round()
            assert (await c.get(r.urls[0] + "/health")).status_code == 200
        assert (await r.turn(0, [{"role": "user", "content": FIRST}], None))[0] == "recompute"


async def test_drains_redis_lost_are_written_again_not_undone(redis_server: RedisServer) -> None:
    """Redis (kept without persistence) restarts and loses the drains: each replica keeps
    its own and writes them again at its health round, instead of every replica undraining
    every node (probe 15, L2: 6 of 6 new conversations then went to the drained D)."""
    async with replicas(redis_server, admin_key="root") as r:
        async with httpx.AsyncClient(timeout=60.0, trust_env=False) as c:
            await c.post(r.urls[1] + "/admin/nodes/decode-0/drain",
                         headers={"Authorization": "Bearer root"})
        await r.ctxs[0].nodes.health_round()
        assert r.ctxs[0].nodes.drained() == {"decode-0"}
        raw = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        try:
            await raw.flushall()  # what a restart without persistence leaves
            await r.ctxs[0].nodes.health_round()
            assert r.ctxs[0].nodes.drained() == {"decode-0"}
            assert set(await raw.hkeys("kvrelay:default:drained")) == {".", "decode-0"}
            await r.ctxs[1].nodes.health_round()
            assert r.ctxs[1].nodes.drained() == {"decode-0"}
        finally:
            await raw.aclose()


async def test_replicas_listing_the_nodes_in_another_order_are_told_so(
    redis_server: RedisServer, caplog: Any,
) -> None:
    """Node ids are positions (``decode-0``, ...): a replica listing the same D's in another
    order reads the other's entries, engines and orders for other nodes (probe 14, K3:
    engines flapping "restarted", reports refused, half the turns recomputed), and nothing
    said so. Each replica publishes its ids' URLs at its health round and says, in an error
    line and ``node_config_conflicts``, which ids another lists with other URLs."""
    async with FakeCluster(1, 2, ENGINE_CONFIG) as cluster:
        apps = []
        for decode in (cluster.decode_urls, cluster.decode_urls[::-1], cluster.decode_urls):
            config = RouterConfig.from_urls(
                cluster.prefill_urls, decode, state=redis_server.url, state_timeout_ms=2000.0,
                block_size=ENGINE_CONFIG.block_size, **fixed())
            apps.append(create_app(config))
        try:
            same, reversed_, again = (app.ctx for app in apps)
            await same.nodes.health_round()
            assert same.metrics.node_config_conflicts._value.get() == 0
            await reversed_.nodes.health_round()
            assert reversed_.metrics.node_config_conflicts._value.get() == 2
            assert "lists node(s) ['decode-0', 'decode-1'] with other URLs" in caplog.text
            await same.nodes.health_round()
            assert same.metrics.node_config_conflicts._value.get() == 2
            await again.nodes.health_round()  # the same list as the first: no conflict
            assert again.metrics.node_config_conflicts._value.get() == 0
        finally:
            for app in apps:
                await app.ctx.upstream.aclose()
                await app.ctx.index.aclose()


async def test_a_sync_url_given_under_another_node_order_is_not_believed() -> None:
    """The sync URL's token binds the node id and the node's URL: a router that listed the
    D's in another order gave each D the token of another D's id, and once fixed and
    restarted (the same tag key) it believed those D's syncs under the wrong id, learned
    swapped engines and purged entries (probe 15, L5). Now such a sync names no node:
    heard only in what makes entries recompute (``unknown_engine``), its engine not learned
    (under the old tokens it was learned as decode-0's)."""
    async with FakeCluster(1, 2, ENGINE_CONFIG) as cluster:
        key = {"tag_key": "0123456789abcdef0123456789abcdef"}
        fixed_app = create_app(RouterConfig.from_urls(
            cluster.prefill_urls, cluster.decode_urls, block_size=16, **key))
        misordered = create_app(RouterConfig.from_urls(
            cluster.prefill_urls, cluster.decode_urls[::-1], block_size=16, **key))
        try:
            told = misordered.ctx.retention.url_for("decode-0")  # given to the second D
            own = fixed_app.ctx.retention.url_for("decode-0")
            assert told != own
            again = create_app(RouterConfig.from_urls(
                cluster.prefill_urls, cluster.decode_urls, block_size=16, **key))
            assert again.ctx.retention.url_for("decode-0") == own  # restarts agree
            await again.ctx.upstream.aclose()
            d1 = cluster.decode[1]
            sync = encode(RetentionSync(
                engine_id=d1.engine_id, block_size=16, bytes_per_block=4096,
                num_blocks_total=128, num_blocks_free=100, retained_requests=0,
                retained_blocks=0, retained_tokens=0))
            await fixed_app.ctx.retention.accept(sync, told.rsplit("/", 1)[1])
            syncs = fixed_app.ctx.metrics.retention_syncs
            assert syncs.labels("unknown_engine")._value.get() == 1
            assert fixed_app.ctx.nodes.trusted_identity("decode-0")[0] is None
        finally:
            for app in (fixed_app, misordered):
                await app.ctx.upstream.aclose()


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_a_replicas_first_agent_follow_up_pulls_before_it_has_heard_p(
    redis_server: RedisServer, api: str,
) -> None:
    """A replica that has sent P nothing yet does not know whether P proves pulls (the
    question its first health check asks may still be out): its first Responses or
    Messages follow-up waits for that answer and pulls. It recomputed ``unverifiable``
    (probe 15, L3; before the health check asked, ``no_entry``: probe 13, H3)."""
    async with replicas(redis_server) as r:
        assert not r.ctxs[1].nodes.verifies_pulls("prefill-0")
        body = first_body(api, False)
        async with httpx.AsyncClient(timeout=60.0, trust_env=False) as c:
            resp = await c.post(r.urls[0] + PATHS[api], json=body)
            assert resp.status_code == 200, resp.text
            await r.settle()
            reply = Reply(api, resp.text, False)
            again = await c.post(r.urls[1] + PATHS[api],
                                 json=follow_up(api, body, reply, FOLLOW_UPS[0]))
        assert again.status_code == 200, again.text
        assert (again.headers["x-kvrelay-action"], again.headers["x-kvrelay-reason"]) == (
            "pull", "pull")
