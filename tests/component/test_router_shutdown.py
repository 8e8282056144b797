"""Graceful shutdown of ``python -m kvrelay.cli route``: on SIGTERM it refuses new work with
503 (its listeners stay open; ``/metrics`` still answers), lets streams in flight finish (up
to ``--drain-timeout-s``), ends the streams still open then with an SSE error event and
``[DONE]`` (one log line each), and exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import replace

import httpx

from kvrelay.client.sse import line_chunks
from kvrelay.fakevllm import FakeCluster
from tests.component.raw_http import RawConnection, request_bytes
from tests.component.redis_server import RedisServer
from tests.component.router_fake import ENGINE_CONFIG
from tests.component.router_rig import stream_text
from tests.component.test_router_cli import wait_healthy
from tests.costs import fixed_costs_flag
from tests.ports import free_port

BODY = {"model": "tiny", "stream": True, "max_tokens": 12,
        "messages": [{"role": "user", "content": "Count slowly from one to twelve."}]}


@contextlib.asynccontextmanager
async def router(cluster: FakeCluster, *args: str) -> AsyncIterator[
        tuple[str, asyncio.subprocess.Process]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrelay.cli", "route",
        "--prefill", cluster.prefill_urls[0], "--decode", cluster.decode_urls[0],
        "--port", str(port), "--internal-port", "0", "--block-size", "128",
        "--log-level", "info", "--fixed-costs", fixed_costs_flag(), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    try:
        await wait_healthy(url, proc)
        yield url, proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def assert_draining(url: str) -> None:
    """While draining: new work gets 503 with ``Connection: close`` (the listener stays open
    so a load balancer sees a clear answer), the metrics still answer. Every probe on a new
    connection: a draining router closes a kept-alive one once its response is out, and a
    request sent on it meanwhile would read a reset (HTTP/1.1's keep-alive race)."""
    fresh = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(trust_env=False, timeout=10, limits=fresh) as c:
        # The signal is handled asynchronously: wait for it on /health, which starts no
        # stream (a chat request sent before it would be a new stream the drain waits for).
        for _ in range(200):
            health = await c.get(url + "/health")
            if health.status_code == 503:
                break
            await asyncio.sleep(0.01)
        assert health.status_code == 503, health.text
        resp = await c.post(url + "/v1/chat/completions", json=BODY)
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == 503
        assert resp.headers["connection"] == "close"
        metrics = await c.get(url + "/metrics")
        assert metrics.status_code == 200
        assert 'kvrelay_router_rejected_requests_total{reason="draining"}' in metrics.text
        assert ('kvrelay_router_requests_total{endpoint="/v1/chat/completions",status="503"}'
                in metrics.text)


async def test_sigterm_lets_the_stream_finish_then_exits_0() -> None:
    async with FakeCluster(1, 1, ENGINE_CONFIG) as cluster:
        cluster.decode[0].faults.slow_stream_s = 0.15
        async with router(cluster, "--drain-timeout-s", "60") as (url, proc), \
                httpx.AsyncClient(base_url=url, trust_env=False, timeout=60) as c, \
                c.stream("POST", "/v1/chat/completions", json=BODY) as stream:
            assert stream.status_code == 200
            lines = stream.aiter_lines()
            first = await anext(lines)
            assert first.startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            await assert_draining(url)
            rest = [line async for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
            assert len(rest) > 5  # the tokens kept coming after SIGTERM
            assert not any('"error"' in line for line in rest)
            out, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, out.decode(errors="replace")[-2000:]
        assert b"draining" in out and b"Traceback" not in out
        assert b"cut at the drain deadline" not in out


async def test_drain_deadline_cuts_streams_that_take_too_long_and_exits_0() -> None:
    async with FakeCluster(1, 1, ENGINE_CONFIG) as cluster:
        cluster.decode[0].faults.slow_stream_s = 5.0  # a minute for the whole stream
        # The deadline leaves time for assert_draining on a loaded machine; the stream
        # needs a minute, so it is cut either way.
        async with router(cluster, "--drain-timeout-s", "5") as (url, proc), \
                httpx.AsyncClient(base_url=url, trust_env=False, timeout=60) as c, \
                c.stream("POST", "/v1/chat/completions", json=BODY) as stream:
            assert stream.status_code == 200
            lines = stream.aiter_lines()
            await anext(lines)
            proc.send_signal(signal.SIGTERM)
            await assert_draining(url)
            out, _ = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, out.decode(errors="replace")[-2000:]
            got = [line async for line in lines if line.startswith("data: ")]
        # the stream ended cleanly: an OpenAI error event, then [DONE]
        assert got[-1] == "data: [DONE]"
        chunks = list(line_chunks(got))
        err = chunks[-1]["error"]
        assert (err["code"], err["type"]) == (503, "ServiceUnavailableError")
        assert err["message"] == "the router is shutting down"
        assert all("error" not in chunk for chunk in chunks[:-1])
        log = out.decode(errors="replace")
        assert log.count("stream of a recompute turn cut at the drain deadline") == 1, log
        assert "Traceback" not in log


async def test_requests_arriving_as_the_drain_begins_get_503_not_a_reset() -> None:
    """When the drain begins the router closes kept-alive connections that are idle. One
    opened just before with nothing sent yet, and one that has sent part of its next request,
    are not idle: each is answered 503 with ``Connection: close``, never reset."""
    async with FakeCluster(1, 1, ENGINE_CONFIG) as cluster:
        cluster.decode[0].faults.slow_stream_s = 5.0  # the stream holds the drain open
        async with router(cluster, "--drain-timeout-s", "60") as (url, proc), \
                httpx.AsyncClient(base_url=url, trust_env=False, timeout=60) as c, \
                c.stream("POST", "/v1/chat/completions", json=BODY) as stream:
            assert stream.status_code == 200
            host, port = "127.0.0.1", int(url.rsplit(":", 1)[1])
            chat = request_bytes("POST", "/v1/chat/completions",
                                 [("Content-Type", "application/json")],
                                 json.dumps(BODY).encode())
            idle = await RawConnection.open(host, port)
            partial = await RawConnection.open(host, port)
            for conn in (idle, partial):  # one answered request each: kept alive
                await conn.send(request_bytes("GET", "/health"))
                assert (await asyncio.wait_for(conn.read_response(), 30)).status == 200
                conn.received.clear()
            await partial.send(chat[:20])
            fresh = await RawConnection.open(host, port)
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(idle.closed.wait(), 30)  # the drain has begun
            assert await partial.send(chat[20:])
            assert await fresh.send(chat)
            for conn in (partial, fresh):
                got = await asyncio.wait_for(conn.read_response(), 30)
                assert got.status == 503, bytes(conn.received)[:200]
                assert got.headers["connection"] == "close"
                assert got.json()["error"]["code"] == 503


async def test_with_shared_state_the_drain_waits_for_ds_report_of_a_finished_stream(
    redis_server: RedisServer,
) -> None:
    """Replicas on Redis: a stream ends during the drain, and D's report of it (vLLM 0.32:
    the params come in the report, here 1 s after the stream's end) reaches the draining
    router before it exits, so the entry is in Redis and the next turn, on another
    replica, pulls. Before, the router exited when the stream ended and the next turn
    recomputed (probe 14, K8: on every rolling update)."""
    config = replace(ENGINE_CONFIG, report_delay_s=1.0, vllm_version="0.32")
    async with FakeCluster(1, 1, config) as cluster:
        cluster.decode[0].faults.slow_stream_s = 0.05
        state = ("--state", redis_server.url)
        first = [{"role": "user", "content": "Count slowly from one to twelve. " * 30}]
        async with router(cluster, "--drain-timeout-s", "60", *state) as (url, proc), \
                httpx.AsyncClient(base_url=url, trust_env=False, timeout=60) as c:
            async with c.stream("POST", "/v1/chat/completions",
                                json={**BODY, "messages": first}) as stream:
                assert stream.status_code == 200
                proc.send_signal(signal.SIGTERM)
                text = stream_text([json.loads(line[6:]) for line in
                                    [x async for x in stream.aiter_lines()]
                                    if line.startswith("data: {")])
            out, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, out.decode(errors="replace")[-2000:]
        assert b"waiting for D's report of 1 finished turn" in out
        messages = [*first, {"role": "assistant", "content": text},
                    {"role": "user", "content": "And backwards?"}]
        async with router(cluster, *state) as (other, _), \
                httpx.AsyncClient(base_url=other, trust_env=False, timeout=60) as c:
            resp = await c.post("/v1/chat/completions", json={
                "model": "tiny", "messages": messages, "max_tokens": 4})
        assert resp.status_code == 200
        assert (resp.headers["x-kvrelay-action"], resp.headers["x-kvrelay-reason"]) == (
            "pull", "pull")
