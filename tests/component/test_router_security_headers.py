"""Issue #12, defect 1: request heads are bounded before auth, while they are being read.

Limits: request line 8 KiB (414 or 431), one header field 8 KiB (431), all header fields
64 KiB or more than 100 of them (431). An answer that has a body carries an OpenAI error.
A 64 MiB header is refused while the client is still sending it, and ``/metrics`` keeps
answering meanwhile. API keys are configured, and no request here carries one (or only
alongside an oversized head): the limits come before authentication.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

import pytest
import pytest_asyncio

from tests.component.raw_http import RawConnection, RawResponse, request_bytes
from tests.component.router_process import (
    PATIENCE_S,
    Rig,
    RouterProcess,
    fake_rig,
    is_openai_error,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

KIB = 1024
CHAT = "/v1/chat/completions"
KEYS = ("--api-key", "alice:KA", "--api-key", "bob:KB")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    async with fake_rig(tmp_path_factory.mktemp("router-headers"), *KEYS) as started:
        yield started


async def exchange(router: RouterProcess, data: bytes) -> RawResponse:
    """Send one request on a fresh connection and read the answer."""
    conn = await RawConnection.open(router.host, router.port)
    try:
        await conn.send(data)
        return await asyncio.wait_for(conn.read_response(), PATIENCE_S)
    finally:
        conn.abort()


def refused(resp: RawResponse, statuses: Sequence[int], what: str) -> str | None:
    """Why ``resp`` is not a refusal with one of ``statuses`` (and, if it has a body, an
    OpenAI error body), or ``None`` if it is one."""
    if resp.status not in statuses:
        return f"{what}: HTTP {resp.status or 'no answer'}, expected {'/'.join(map(str, statuses))}"
    announced = resp.headers.get("transfer-encoding") or resp.headers.get("content-length", "0")
    if announced == "0":
        return None
    try:
        body = resp.json()
    except ValueError:
        return f"{what}: HTTP {resp.status} with a body that is not JSON: {resp.body[:200]!r}"
    if not is_openai_error(body, resp.status):
        return f"{what}: HTTP {resp.status} without an OpenAI error body: {resp.body[:200]!r}"
    return None


async def check_all(router: RouterProcess, cases: list[tuple[str, bytes, Sequence[int]]]) -> None:
    problems = []
    for what, data, statuses in cases:
        problem = refused(await exchange(router, data), statuses, what)
        if problem is not None:
            problems.append(problem)
    assert not problems, "\n".join(problems)


async def test_request_line_over_8_kib_is_refused_before_auth(rig: Rig) -> None:
    query = "q=" + "a" * (9 * KIB)
    await check_all(rig.router, [
        ("GET /health with a 9 KiB query", request_bytes("GET", "/health?" + query),
         (414, 431)),
        ("POST /v1/chat/completions (no key) with a 9 KiB query",
         request_bytes("POST", f"{CHAT}?{query}", [("Content-Type", "application/json")],
                       b"{}"), (414, 431)),
    ])
    ok = await exchange(rig.router, request_bytes("GET", "/health?" + "a" * (7 * KIB)))
    assert ok.status == 200, f"a 7 KiB request line is within the limit: HTTP {ok.status}"


async def test_one_header_over_8_kib_is_431_before_auth(rig: Rig) -> None:
    big = ("X-Big", "b" * (9 * KIB))
    await check_all(rig.router, [
        ("GET /health with one 9 KiB header", request_bytes("GET", "/health", [big]), (431,)),
        ("POST /v1/chat/completions without a key, one 9 KiB header",
         request_bytes("POST", CHAT, [big], b"{}"), (431,)),
        ("POST /v1/chat/completions with a valid key, one 9 KiB header",
         request_bytes("POST", CHAT, [("Authorization", "Bearer KA"), big], b"{}"), (431,)),
        ("a 9 KiB Authorization header",
         request_bytes("POST", CHAT, [("Authorization", "Bearer " + "k" * (9 * KIB))],
                       b"{}"), (431,)),
    ])
    ok = await exchange(rig.router, request_bytes("GET", "/health", [("X-Big", "b" * 7 * KIB)]))
    assert ok.status == 200, f"a 7 KiB header is within the limit: HTTP {ok.status}"


async def test_headers_over_64_kib_in_all_or_over_100_fields_are_431(rig: Rig) -> None:
    ten_big = [(f"X-Part-{i}", "p" * (7 * KIB)) for i in range(10)]  # 70 KiB, each < 8 KiB
    many = [(f"X-Field-{i}", "v") for i in range(150)]
    await check_all(rig.router, [
        ("GET /health with 10 headers of 7 KiB (70 KiB)",
         request_bytes("GET", "/health", ten_big), (431,)),
        ("POST /v1/chat/completions (no key) with 70 KiB of headers",
         request_bytes("POST", CHAT, ten_big, b"{}"), (431,)),
        ("GET /health with 150 header fields", request_bytes("GET", "/health", many), (431,)),
        ("POST /v1/chat/completions (no key) with 150 header fields",
         request_bytes("POST", CHAT, many, b"{}"), (431,)),
    ])
    within = [(f"X-Part-{i}", "p" * (7 * KIB)) for i in range(8)]  # 56 KiB
    ok = await exchange(rig.router, request_bytes("GET", "/health", within))
    assert ok.status == 200, f"56 KiB of headers are within the limit: HTTP {ok.status}"
    ok = await exchange(rig.router, request_bytes("GET", "/health", many[:90]))
    assert ok.status == 200, f"92 header fields are within the limit: HTTP {ok.status}"


async def test_a_64_mib_header_is_refused_while_it_is_still_being_sent(rig: Rig) -> None:
    """The flood connection sends ``GET /health`` with one header of 64 MiB, in 64 KiB
    pieces, and stops as soon as an answer arrives. The answer must be a 431 that arrived
    before the last piece was sent (the router did not read the whole header first), and
    ``GET /metrics`` on another connection, started while the flood is being sent, answers
    200 while the flood connection is still open."""
    router = rig.router
    piece = b"f" * (64 * KIB)
    pieces = 1024
    conn = await RawConnection.open(router.host, router.port)
    metrics_status: asyncio.Task[int] | None = None

    async def get_metrics() -> int:
        async with router.client() as c:
            return (await c.get("/metrics")).status_code

    sent = 0
    try:
        await conn.send(b"GET /health HTTP/1.1\r\nHost: router.test\r\nX-Flood: ")
        while sent < pieces and not conn.has_status:
            if not await conn.send(piece):
                break
            sent += 1
            if sent == 1:
                metrics_status = asyncio.create_task(get_metrics())
            await asyncio.sleep(0)
        answered_early = conn.has_status
        if not answered_early and not conn.closed.is_set():
            # Nothing came back while 64 MiB went out: end the header to see what the
            # router does with it (for the failure message).
            await conn.send(b"\r\n\r\n")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(conn.wait_status(), PATIENCE_S)
        got = conn.response()
        assert answered_early, (
            f"no answer while the client sent {sent} of {pieces} pieces (64 MiB) of one "
            f"header; once the header ended the router answered "
            f"{got.status or 'nothing'}{' (connection closed)' if conn.closed.is_set() else ''}")
        assert got.status == 431, (
            f"the flood got HTTP {got.status} after {sent} of {pieces} pieces, expected 431")
        assert sent < pieces
        assert metrics_status is not None
        status = await asyncio.wait_for(metrics_status, PATIENCE_S)
        assert status == 200, f"GET /metrics during the flood answered {status}"
    finally:
        conn.abort()
        if metrics_status is not None and not metrics_status.done():
            metrics_status.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await metrics_status


def anthropic_refusal(resp: RawResponse, status: int) -> bool:
    body = resp.json()
    return (resp.status == status and body["type"] == "error"
            and set(body["error"]) == {"type", "message"})


async def test_refusals_of_messages_requests_are_in_anthropics_shape(rig: Rig) -> None:
    """Anthropic's clients read only Anthropic's error body: what the router refuses itself
    on the Messages API's paths (a head too large, one it cannot parse, no such path, a wrong
    method) is in that shape; the same refusals elsewhere stay OpenAI's."""
    big = ("X-Big", "b" * (9 * KIB))
    for path in ("/v1/messages", "/v1/messages?beta=true", "/v1/messages/count_tokens"):
        resp = await exchange(rig.router, request_bytes("POST", path, [big], b"{}"))
        assert anthropic_refusal(resp, 431), (path, resp.status, resp.body[:200])
    resp = await exchange(rig.router, b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n"
                                      b"Bad Header: x\r\n\r\n")
    assert anthropic_refusal(resp, 400), resp.body[:200]
    resp = await exchange(rig.router, request_bytes(
        "POST", "/v1/messages/batches", [("Authorization", "Bearer KA")], b"{}"))
    assert anthropic_refusal(resp, 404), resp.body[:200]
    resp = await exchange(rig.router, request_bytes(
        "GET", "/v1/messages", [("Authorization", "Bearer KA")]))
    assert anthropic_refusal(resp, 405) and resp.headers["allow"] == "POST", resp.body[:200]
    resp = await exchange(rig.router, request_bytes("POST", CHAT, [big], b"{}"))
    assert refused(resp, (431,), "chat") is None
