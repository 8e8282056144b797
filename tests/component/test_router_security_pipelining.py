"""Issue #23, finding 1: request heads are limited when pipelined too.

On one connection a client sends a streamed chat and at once, behind it, ``GET /health``
with one header that never ends, in 64 KiB pieces. While the chat is being answered (D
holds its stream), the router must not parse that head unlimited: it stops reading and
closes the connection long before 64 MiB went in (the router before the fix parsed all of
it, 99 MiB in 22 s, on the event loop). Another client is served meanwhile. Pipelining
itself keeps working: requests sent behind a stream, or behind a request with a body, are
answered in order on the same connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import pytest_asyncio

from kvrelay.fakevllm import FakeCluster
from tests.component.fake_vllm_version import engine_config
from tests.component.raw_http import RawConnection, parse_response, request_bytes
from tests.component.router_process import (
    PATIENCE_S,
    HeldSleep,
    RouterProcess,
    eventually,
    run_router,
    until,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

KIB = 1024
CHAT = "/v1/chat/completions"
PIECE = b"f" * (64 * KIB)
PIECES = 1024  # 64 MiB


@dataclass
class Held:
    router: RouterProcess
    cluster: FakeCluster
    sleep: HeldSleep


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def held(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Held]:
    sleep = HeldSleep()
    log_dir = tmp_path_factory.mktemp("router-pipelining")
    async with FakeCluster(1, 1, engine_config(report_delay_s=0.0), sleep=sleep) as cluster, \
            run_router(cluster, log_dir) as router:
        cluster.decode[0].faults.slow_stream_s = 0.01  # every token is a step of ``sleep``
        yield Held(router, cluster, sleep)


def body(max_tokens: int, stream: bool = True) -> dict[str, object]:
    return {"model": "tiny", "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": "Name three rivers."}]}


def chat(max_tokens: int, stream: bool = True) -> bytes:
    raw = json.dumps(body(max_tokens, stream)).encode()
    return request_bytes("POST", CHAT, [("Content-Type", "application/json")], raw)


def responses(raw: bytes) -> list[int]:
    """The statuses of the complete responses in ``raw``, in order."""
    out = []
    while raw:
        resp = parse_response(raw)
        if not resp.complete:
            break
        out.append(resp.status)
        # the next response starts after this one's body (chunked: after its last chunk)
        end = raw.find(b"\r\n0\r\n\r\n") + 7 if resp.headers.get("transfer-encoding") \
            else raw.find(b"\r\n\r\n") + 4 + len(resp.body)
        raw = raw[end:]
    return out


async def test_a_pipelined_endless_header_is_not_read_while_a_stream_is_served(
    held: Held,
) -> None:
    router, sleep = held.router, held.sleep
    sleep.hold()
    conn = await RawConnection.open(router.host, router.port)
    other: asyncio.Task[int] | None = None

    async def get_metrics() -> int:
        async with router.client() as c:
            return (await c.get("/metrics")).status_code

    sent = 0
    try:
        await conn.send(chat(64) + b"GET /health HTTP/1.1\r\nHost: router.test\r\nX-Flood: ")
        await until(lambda: sleep.held >= 1, "D holds the chat's stream")
        while sent < PIECES and await conn.send(PIECE):
            sent += 1
            if sent == 1:
                other = asyncio.create_task(get_metrics())
        assert conn.closed.is_set() and sent < PIECES, (
            f"the router took all {sent} pieces (64 MiB) of a pipelined header while the "
            f"stream before it was held, and the connection is still open")
        ended = conn.received.find(b"data: [DONE]")
        assert ended < 0 or b"pipelined behind" in conn.received[:ended], \
            "the held stream cannot have ended but by being abandoned"
        assert other is not None
        status = await asyncio.wait_for(other, PATIENCE_S)
        assert status == 200, f"another client's GET /metrics during the flood got {status}"
    finally:
        sleep.release()
        conn.abort()
        if other is not None and not other.done():
            other.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await other
    async with router.client() as c:
        resp = await c.post(CHAT, json=body(4, stream=False))
    assert resp.status_code == 200, f"another client's chat after the flood: {resp.status_code}"
    await eventually(router.metrics, lambda m: m.value("kvrelay_router_in_flight") == 0,
                     "the cut stream's turn ended")


def sse_errors(raw: bytes) -> list[dict[str, object]]:
    """The ``error`` objects of the SSE error events in ``raw``."""
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {"):
            with contextlib.suppress(ValueError):
                event = json.loads(line[6:])
                if isinstance(event, dict) and isinstance(event.get("error"), dict):
                    out.append(event["error"])
    return out


async def flood_head(conn: RawConnection) -> bytes:
    """Send 256 KiB more of the head begun on ``conn`` (over the 64 KiB head limit, while
    the router takes it), then wait for two answers or the close; what came back."""
    for _ in range(4):
        if not await conn.send(PIECE):
            break
    await until(lambda: conn.closed.is_set() or len(responses(bytes(conn.received))) == 2,
                "two answers, or the connection closed")
    return bytes(conn.received)


async def test_the_request_before_an_over_limit_pipelined_head_is_abandoned_at_once(
    held: Held,
) -> None:
    """A flooding client stops costing engine and router work the moment its pipelined head
    goes over a limit: the stream in progress (held by D, so it cannot end on its own) is
    cancelled at D and ends with an error event and ``[DONE]`` (or, if D had sent nothing
    yet, the chat is answered 431), the turn leaves the in-flight
    count, and the 431 for the head follows, all before the router closes the connection
    (the router before this serves the stream on until that close)."""
    router, sleep = held.router, held.sleep
    sleep.hold()
    conn = await RawConnection.open(router.host, router.port)
    try:
        await conn.send(chat(64) + b"GET /health HTTP/1.1\r\nHost: router.test\r\nX-Flood: ")
        await until(lambda: sleep.held >= 1, "D holds the chat's stream")
        got = await flood_head(conn)
        assert not conn.closed.is_set() or b"data: [DONE]" in got, (
            "the router closed the connection with the stream still running: it served the "
            "request before the over-limit head on, instead of abandoning it")
        statuses = responses(got)
        if statuses[:1] == [200]:  # the stream had begun: it ends with the reason
            errors = sse_errors(got)
            assert len(errors) == 1 and errors[0].get("code") == 431, errors
            assert "pipelined behind" in str(errors[0].get("message")), errors
        else:  # D held its first event: the chat's own answer is the 431
            assert parse_response(got).json()["error"]["message"].endswith(
                "(a request pipelined behind this one)"), got[:600]
        assert statuses in ([200, 431], [431, 431]), got[-600:]
        # D's steps are still held: only a cancel can end its stream
        await until(lambda: sleep.held == 0, "D's stream cancelled")
        await eventually(router.metrics, lambda m: m.value("kvrelay_router_in_flight") == 0,
                         "the abandoned turn left the in-flight count")
    finally:
        sleep.release()
        conn.abort()


async def test_pipelined_requests_are_answered_in_order(held: Held) -> None:
    """A stream, then ``GET /health``, then a non-streamed chat with a body, then
    ``GET /health`` again, all sent in one write on one connection."""
    router, sleep = held.router, held.sleep
    sleep.hold()
    conn = await RawConnection.open(router.host, router.port)
    try:
        health = request_bytes("GET", "/health")
        await conn.send(chat(8) + health + chat(4, stream=False) + health)
        await until(lambda: sleep.held >= 1, "D holds the first stream")
        assert responses(bytes(conn.received)) == [], "nothing completes before the stream"
        sleep.release()
        await until(lambda: len(responses(bytes(conn.received))) == 4 or conn.closed.is_set(),
                    "four answers")
        assert responses(bytes(conn.received)) == [200, 200, 200, 200], conn.received[-400:]
        assert not conn.closed.is_set(), "the connection stays open after pipelined requests"
    finally:
        sleep.release()
        conn.abort()


async def test_a_pipelined_head_over_the_limit_in_one_write_is_refused(held: Held) -> None:
    """Behind a non-streamed chat, a ``GET /health`` with a 9 KiB header in the same write:
    the chat is answered, or abandoned (a 431 of its own), or the connection cut, but the
    head is never served."""
    router, sleep = held.router, held.sleep
    sleep.release()
    conn = await RawConnection.open(router.host, router.port)
    try:
        big = request_bytes("GET", "/health", [("X-Big", "b" * (9 * KIB))])
        await conn.send(chat(4, stream=False) + big)
        await asyncio.wait_for(conn.closed.wait(), PATIENCE_S)
        got = responses(bytes(conn.received))
        assert 200 not in got[1:], f"a 9 KiB pipelined header was served: {got}"
        assert got in ([200], [200, 431], [431, 431], []), got
    finally:
        conn.abort()


def chunked_chat() -> bytes:
    raw = json.dumps(body(4, stream=False)).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: router.test\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"%x\r\n%s\r\n0\r\n\r\n" % (len(raw), raw))


async def test_a_chunked_request_is_the_connections_last(held: Held) -> None:
    """Only the parser knows where a chunked body ends, so nothing behind one is parsed
    under the head limits: the chunked request is answered with ``Connection: close``, and
    a request sent right behind it is never served."""
    router = held.router
    held.sleep.release()
    for behind in (b"", request_bytes("GET", "/health")):
        conn = await RawConnection.open(router.host, router.port)
        try:
            await conn.send(chunked_chat() + behind)
            await asyncio.wait_for(conn.closed.wait(), PATIENCE_S)
            got = responses(bytes(conn.received))
            assert got in ([200], []) if behind else got == [200], (behind, got)
            if not behind:
                assert conn.response().headers.get("connection") == "close"
        finally:
            conn.abort()


async def test_an_over_limit_pipelined_messages_head_gets_anthropics_431(held: Held) -> None:
    """The late 431 of a head pipelined behind a request is in the shape of the head's own
    API: Anthropic's for a Messages path (its clients read only that)."""
    conn = await RawConnection.open(held.router.host, held.router.port)
    try:
        await conn.send(chat(4, stream=False)
                        + b"POST /v1/messages?beta=true HTTP/1.1\r\nHost: router.test\r\n"
                          b"X-Flood: ")
        got = await flood_head(conn)
        assert responses(got)[-1:] == [431], got[-600:]
        last = parse_response(got[got.rindex(b"HTTP/1.1 431"):])
        assert last.json() == {"type": "error", "error": {
            "type": "invalid_request_error", "message": "Request header fields too large"}}
    finally:
        conn.abort()
