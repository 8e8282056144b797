"""Graceful shutdown of ``python -m kvrelay.cli route``: on SIGTERM it refuses new work, lets
streams in flight finish (up to ``--drain-timeout-s``) and exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator

import httpx

from kvrelay.testing import FakeCluster
from tests.component.router_fake import ENGINE_CONFIG, free_port
from tests.component.test_router_cli import wait_healthy

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
        "--port", str(port), "--block-size", "128", "--log-level", "info", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    try:
        await wait_healthy(url, proc)
        yield url, proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def new_request_after_sigterm(url: str) -> str:
    """What a new client gets: a refused connection or a 503."""
    async with httpx.AsyncClient(trust_env=False, timeout=10) as c:
        try:
            resp = await c.post(url + "/v1/chat/completions", json=BODY)
        except httpx.TransportError:
            return "refused"
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["code"] == 503
    return "503"


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
            assert await new_request_after_sigterm(url) in ("refused", "503")
            rest = [line async for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
            assert len(rest) > 5  # the tokens kept coming after SIGTERM
            out, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, out.decode(errors="replace")[-2000:]
        assert b"draining" in out and b"Traceback" not in out


async def test_drain_deadline_cuts_streams_that_take_too_long_and_exits_0() -> None:
    async with FakeCluster(1, 1, ENGINE_CONFIG) as cluster:
        cluster.decode[0].faults.slow_stream_s = 5.0  # a minute for the whole stream
        async with router(cluster, "--drain-timeout-s", "1") as (url, proc), \
                httpx.AsyncClient(base_url=url, trust_env=False, timeout=60) as c, \
                c.stream("POST", "/v1/chat/completions", json=BODY) as stream:
            assert stream.status_code == 200
            lines = stream.aiter_lines()
            await anext(lines)
            proc.send_signal(signal.SIGTERM)
            out, _ = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, out.decode(errors="replace")[-2000:]
            got: list[str] = []
            with contextlib.suppress(httpx.TransportError):
                got.extend([line async for line in lines])
            assert "data: [DONE]" not in got
