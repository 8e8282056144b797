"""Issue #23, finding 7: WebSocket upgrades and malformed HTTP get a 4xx with an OpenAI
error body, on both listeners.

The router before the fix answered every WebSocket upgrade with 500 ("ASGI callable
returned without completing handshake"), on every path, and what uvicorn's parser refused
with a plain-text 400.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from kvrelay.fakevllm import FakeCluster
from tests.component.fake_vllm_version import engine_config
from tests.component.raw_http import RawConnection, RawResponse, request_bytes
from tests.component.router_process import (
    PATIENCE_S,
    RouterProcess,
    is_openai_error,
    run_router,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

WEBSOCKET = [("Upgrade", "websocket"), ("Connection", "Upgrade"),
             ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="), ("Sec-WebSocket-Version", "13")]
PUBLIC_PATHS = ("/health", "/metrics", "/v1/chat/completions", "/v1/models", "/nope", "/")
INTERNAL_PATHS = ("/health", "/internal/kv-report", "/nope")
MALFORMED = {
    "not HTTP at all": b"GARBAGE\r\n\r\n",
    "a header line without a colon": b"GET /health HTTP/1.1\r\nHost: x\r\nNo colon\r\n\r\n",
    "a Content-Length that is not a number":
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    "Content-Length and chunked both":
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "an unknown HTTP version": b"GET /health HTTP/7.3\r\nHost: x\r\n\r\n",
    "a space in the header name": b"GET /health HTTP/1.1\r\nHost: x\r\nBad Name: v\r\n\r\n",
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RouterProcess]:
    log_dir = tmp_path_factory.mktemp("router-protocol")
    async with FakeCluster(1, 1, engine_config(report_delay_s=0.0)) as cluster, \
            run_router(cluster, log_dir, internal=True) as started:
        assert started.internal_port is not None, "the router has no internal listener"
        yield started


async def exchange(router: RouterProcess, port: int, data: bytes) -> RawResponse:
    conn = await RawConnection.open(router.host, port)
    try:
        await conn.send(data)
        return await asyncio.wait_for(conn.read_response(), PATIENCE_S)
    finally:
        conn.abort()


def problem(resp: RawResponse, what: str) -> str | None:
    """Why ``resp`` is not a 4xx with an OpenAI error body, or ``None``."""
    if not 400 <= resp.status < 500:
        return f"{what}: HTTP {resp.status or 'no answer'} {resp.body[:120]!r}"
    try:
        body = resp.json()
    except ValueError:
        return f"{what}: HTTP {resp.status} with a body that is not JSON: {resp.body[:120]!r}"
    if not is_openai_error(body, resp.status):
        return f"{what}: HTTP {resp.status} without an OpenAI error body: {resp.body[:120]!r}"
    return None


async def test_websocket_upgrades_get_4xx_with_an_openai_error_on_both_listeners(
    router: RouterProcess,
) -> None:
    assert router.internal_port is not None
    cases = [(router.port, path) for path in PUBLIC_PATHS]
    cases += [(router.internal_port, path) for path in INTERNAL_PATHS]
    problems = []
    for port, path in cases:
        resp = await exchange(router, port, request_bytes("GET", path, WEBSOCKET))
        found = problem(resp, f"a WebSocket upgrade of {path} on port {port}")
        if found is None and resp.headers.get("upgrade"):
            found = f"{path} on port {port} answered with an Upgrade header"
        if found is not None:
            problems.append(found)
    assert not problems, "\n".join(problems)
    async with router.client() as c:  # the router is unharmed
        assert (await c.get("/health")).status_code == 200


async def test_malformed_http_gets_400_with_an_openai_error_on_both_listeners(
    router: RouterProcess,
) -> None:
    assert router.internal_port is not None
    problems = []
    for port in (router.port, router.internal_port):
        for what, data in MALFORMED.items():
            found = problem(await exchange(router, port, data), f"{what} on port {port}")
            if found is not None:
                problems.append(found)
    assert not problems, "\n".join(problems)
