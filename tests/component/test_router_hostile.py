"""Hostile input: oversized and malformed bodies, unknown paths, long or odd conversation
ids, header injection, slow clients. Always a 4xx with an OpenAI error body, never a 5xx.
The router runs in front of fake engines (``router_fake``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from kvrelay.fakevllm import FakeCluster, FakeEngine
from kvrelay.router.app import create_app
from kvrelay.router.config import RouterConfig
from kvrelay.router.plan import Planner
from kvrelay.router.server import bind, make_server
from kvrelay.router.state import RouterContext
from tests.component.asgi_direct import call, is_openai_error
from tests.component.router_fake import ENGINE_CONFIG, Routed, routed, until
from tests.costs import fixed
from tests.ports import free_ports

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hello there"}]
JSON = (b"content-type", b"application/json")


def body(**extra: Any) -> bytes:
    return json.dumps({"model": "tiny", "messages": MSG, "max_tokens": 4, **extra}).encode()


def generation_requests(engine: FakeEngine) -> list[bytes]:
    """The generation request bodies ``engine`` received (not ``/tokenize``)."""
    return [r.body for r in engine.received if r.path.startswith("/v1/")]


@pytest.fixture
async def rig() -> AsyncIterator[Routed]:
    async with routed(max_body_bytes=1000) as r:
        yield r


async def test_unknown_paths_and_methods_get_openai_errors(rig: Routed) -> None:
    for method, path, status in [("GET", "/nope", 404), ("POST", "/v1/embeddings", 404),
                                 ("GET", CHAT, 405), ("DELETE", "/stats", 405),
                                 ("POST", "/v1/chat/completions/x", 404),
                                 ("POST", "/internal/kv-report", 404)]:  # internal listener only
        answer = await call(rig.app, method, path)
        assert answer.status == status
        assert is_openai_error(answer) and answer.json()["error"]["code"] == status


async def test_head_is_answered_wherever_get_is(rig: Routed) -> None:
    async with rig.client() as client:
        for path in ("/", "/health", "/v1/models", "/stats", "/metrics"):
            get, head = await client.get(path), await client.head(path)
            assert (get.status_code, head.status_code, head.content) == (200, 200, b""), path
        refused = await client.head(CHAT)
        assert refused.status_code == 405 and refused.headers["allow"] == "POST"
        assert (await client.post("/health")).headers["allow"] == "GET, HEAD"


async def test_models_name_no_path_on_ps_disk(rig: Routed) -> None:
    async with rig.client() as client:
        direct = (await client.get(rig.cluster.prefill_urls[0] + "/v1/models")).json()
        routed_ = (await client.get("/v1/models")).json()
    (model,) = direct["data"]
    assert model["root"].startswith("/")  # vLLM names the directory it loaded from
    assert routed_["data"] == [{**model, "root": model["id"]}]


async def test_declared_oversized_body_is_refused_before_reading(rig: Routed) -> None:
    answer = await call(rig.app, "POST", CHAT, [JSON, (b"content-length", b"1000000000")],
                        chunks=[b"x" * 100] * 50)
    assert answer.status == 413 and is_openai_error(answer)
    assert answer.json()["error"]["type"] == "RequestEntityTooLargeError"
    assert answer.header("connection") == "close"
    assert answer.chunks_read == 0


async def test_streamed_oversized_body_is_cut_off_while_reading(rig: Routed) -> None:
    answer = await call(rig.app, "POST", CHAT, [JSON], chunks=[b"x" * 100] * 50)
    assert answer.status == 413 and is_openai_error(answer)
    assert answer.chunks_read == 11  # stopped at the first chunk over 1000 bytes, of 50
    resp = await rig.post(CHAT, body(pad="y" * 2000), headers={"content-type": "x"})
    assert resp.status_code == 413  # through an HTTP client too
    assert not rig.cluster.prefill[0].received


async def test_body_just_under_the_limit_is_served(rig: Routed) -> None:
    raw = body()
    raw = raw[:-1] + b', "pad": "' + b"z" * (1000 - len(raw) - 11) + b'"}'
    assert len(raw) == 1000
    resp = await rig.post(CHAT, raw)
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("raw", [
    b"\xff\xfe{}", b'{"messages": "\xc3\x28"}', b'{"messages": [{"role": "user", '
    b'"content": "\\ud800"}]}', b'{"messages": [], "max_tokens": NaN}',
    b'{"max_tokens": Infinity}', b"[" * 100_000 + b"]" * 100_000, b"", b"null",
    b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1' + b"0" * 5000 + b"}",
])
async def test_malformed_bodies_are_400(raw: bytes) -> None:
    async with routed() as rig:  # default 8 MiB limit: the deep nesting fits
        resp = await rig.post(CHAT, raw)
        assert resp.status_code == 400, resp.text
        assert is_openai_error(await call(rig.app, "POST", CHAT, [JSON], [raw]))
        assert not any(e.received for e in rig.cluster.engines)


def anthropic_error(answer: Any) -> bool:
    body = answer.json()
    return (set(body) == {"type", "error"} and body["type"] == "error"
            and set(body["error"]) == {"type", "message"})


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
@pytest.mark.parametrize("raw", [
    b"\xff\xfe{}", b'{"input": "\xc3\x28"}', b'{"messages": [{"role": "user", '
    b'"content": "\\ud800"}]}', b'{"max_tokens": NaN}', b'{"max_output_tokens": -Infinity}',
    b"[" * 100_000 + b"]" * 100_000, b"", b"null", b"[]",
    b'{"input": [], "messages": [], "max_tokens": 1' + b"0" * 5000 + b"}",
    # an item's type that is no string (was a 500: a set lookup of a dict)
    b'{"input": [{"type": {}, "role": "user", "content": "hi"}], "messages": [{"role": '
    b'{}, "content": "hi"}]}',
    b'{"input": [{"type": ["message"], "role": "user", "content": "hi"}], "messages": '
    b'[{"role": ["user"], "content": "hi"}]}',
])
async def test_malformed_agent_api_bodies_are_400_in_their_shape(path: str, raw: bytes) -> None:
    async with routed() as rig:
        answer = await call(rig.app, "POST", path, [JSON], [raw])
        assert answer.status == 400, answer.body[:200]
        assert (anthropic_error if path == "/v1/messages" else is_openai_error)(answer)
        assert not any(e.received for e in rig.cluster.engines)


async def test_agent_api_ids_and_keys_are_checked_in_their_shape(rig: Routed) -> None:
    messages = {"model": "tiny", "max_tokens": 4, "messages": MSG}
    resp = await rig.post("/v1/messages?beta=true", messages,
                          headers={"X-Claude-Code-Session-Id": "h" * 257})
    assert resp.status_code == 400 and anthropic_error(resp)
    user = json.dumps({"session_id": "s\r\nX-Injected: 1"})
    resp = await rig.post("/v1/messages", {**messages, "metadata": {"user_id": user}})
    assert resp.status_code == 400 and "x-injected" not in resp.headers
    # prompt_cache_key is no conversation id (issue #23 finding 2): forwarded, never checked
    # as one
    resp = await rig.post("/v1/responses", {"model": "tiny", "input": "hi",
                                            "prompt_cache_key": "k" * 300})
    assert resp.status_code == 200
    async with routed(api_keys=["t:key"]) as keyed:
        resp = await keyed.post("/v1/messages", messages)
        assert resp.status_code == 401 and anthropic_error(resp)
        assert resp.json()["error"]["type"] == "authentication_error"
        resp = await keyed.post("/v1/messages/count_tokens", messages)
        assert resp.status_code == 401 and anthropic_error(resp)


async def test_invalid_content_length_is_400(rig: Routed) -> None:
    answer = await call(rig.app, "POST", CHAT, [(b"content-length", b"12abc")], [body()])
    assert answer.status == 400 and is_openai_error(answer)


@pytest.mark.parametrize(("conversation_id", "status"), [
    ("x" * 256, 200), ("x" * 257, 400), ("\u00e9" * 128, 200), ("\u00e9" * 129, 400),
    ("a\r\nX-Injected: yes", 400), ("tab\there", 400), ("nul\x00", 400),
    ("\ud800", 400), ("emoji \U0001F600 ok", 200),
])
async def test_conversation_id_limits(rig: Routed, conversation_id: str, status: int) -> None:
    raw = json.dumps({"model": "tiny", "messages": MSG, "max_tokens": 4,
                      "conversation_id": conversation_id}).encode()
    resp = await rig.post(CHAT, raw)
    assert resp.status_code == status, resp.text
    if status == 400:
        assert resp.json()["error"]["param"] in ("conversation_id", None)
    assert "x-injected" not in resp.headers


async def test_long_conversation_id_header_is_400(rig: Routed) -> None:
    resp = await rig.post(CHAT, body(), headers={"X-Conversation-ID": "h" * 257})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "conversation_id"
    resp = await rig.post(CHAT, body(), headers={"X-Session-ID": "h" * 256})
    assert resp.status_code == 200


async def test_nothing_from_the_request_is_reflected_in_headers(rig: Routed) -> None:
    evil = "m\r\nX-Injected: 1"
    for extra in ({"model": evil}, {"conversation_id": "ok", "user": evil}):
        answer = await call(rig.app, "POST", CHAT,
                            [JSON, (b"x-conversation-id", b"v\rX-Injected: 2")], [body(**extra)])
        assert answer.status < 500
        for name, value in answer.headers:
            assert b"\r" not in value and b"\n" not in value
            assert name.lower() != b"x-injected"
            assert b"Injected" not in value


async def test_tool_call_arguments_nested_too_deep_to_read_are_no_crash() -> None:
    """An assistant tool call whose arguments string nests deeper than Python's JSON reader
    goes (the body's own nesting is limited, a string's is not): its digest raised
    ``RecursionError``, which escaped the turn as a 500. Now it digests as sent."""
    history = [*MSG, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    async with routed() as r, r.client() as c:  # the rig's 1000-byte bodies are too small
        resp = await c.post(CHAT, json={"model": "tiny", "messages": history, "max_tokens": 4})
    assert resp.status_code == 200, resp.text


async def test_huge_max_tokens_is_left_to_the_engine(rig: Routed) -> None:
    resp = await rig.post(CHAT, body(max_tokens=10**30))
    assert resp.status_code == 400  # the engine's answer (vLLM: exceeds max_model_len)
    assert "cannot be greater than max_model_len" in resp.json()["error"]["message"]
    assert resp.json()["error"]["code"] == 400


async def test_a_client_that_leaves_cancels_its_turn(rig: Routed) -> None:
    """The client goes away while P computes: the turn stops there (D never asked),
    nothing is kept, the slot is free again."""
    p, d = rig.cluster.prefill[0], rig.cluster.decode[0]
    p.faults.hang = True
    held = asyncio.Event()

    async def hold() -> None:
        await until(lambda: p.faults.num_hung == 1, "P holds the request")
        held.set()

    watcher = asyncio.create_task(hold())
    answer = await call(rig.app, "POST", CHAT, [JSON], [body(conversation_id="gone")],
                        disconnect_on=held)
    await watcher
    assert answer.status == 0  # nobody left to answer
    assert rig.ctx.admission.in_flight == 0
    assert rig.ctx.metrics.requests.labels(CHAT, "499")._value.get() == 1
    last = await rig.last_decision()
    assert (last["outcome"], last["state"]) == ("client_gone", "failed")
    assert len(generation_requests(p)) == 1
    assert not generation_requests(d)
    assert len(rig.ctx.desk) == 0 and len(rig.ctx.index) == 0
    p.faults.hang = False


# -- slow clients against the real server -------------------------------------------------


@contextlib.asynccontextmanager
async def served(**settings: Any) -> AsyncIterator[tuple[str, RouterContext]]:
    async with FakeCluster(1, 1, ENGINE_CONFIG) as cluster:
        port, internal_port = free_ports(2)
        config = RouterConfig.from_urls(
            cluster.prefill_urls, cluster.decode_urls, port=port, internal_port=internal_port,
            health_interval_s=3600.0, drain_timeout_s=1, **{**fixed(), **settings})
        app = create_app(config)
        server = make_server(config, app, install_signals=False, log_config=None)
        sockets = [bind(config.host, config.port),
                   bind(config.internal_host, config.listen_internal_port)]
        task = asyncio.create_task(server.serve(sockets=sockets))
        try:
            for _ in range(500):
                if server.started:
                    break
                await asyncio.sleep(0.01)
            assert server.started
            yield f"127.0.0.1:{port}", app.ctx
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 30)
            await app.ctx.upstream.aclose()


async def read_all(reader: asyncio.StreamReader) -> bytes:
    """Everything until the router closes the connection (a reset ends it too, and so does
    a broken pipe: the same socket's writer, still trickling, hit the closed connection)."""
    out = b""
    with contextlib.suppress(ConnectionError):
        while chunk := await asyncio.wait_for(reader.read(65536), 30):
            out += chunk
    return out


async def trickle(writer: asyncio.StreamWriter, data: bytes, pause_s: float) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        for i in range(len(data)):
            writer.write(data[i:i + 1])
            await writer.drain()
            await asyncio.sleep(pause_s)


async def test_slow_clients_are_cut_off_without_blocking_others() -> None:
    async with served(header_timeout_s=0.5, body_timeout_s=0.5) as (addr, ctx):
        host, port = addr.split(":")
        raw = body()
        # a body sent byte by byte (far slower than the body deadline allows)
        r1, w1 = await asyncio.open_connection(host, int(port))
        w1.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(raw))
        slow_body = asyncio.create_task(trickle(w1, raw, 0.05))
        # headers sent byte by byte
        r2, w2 = await asyncio.open_connection(host, int(port))
        slow_head = asyncio.create_task(
            trickle(w2, b"POST /v1/chat/completions HTTP/1.1\r\nX-Slow: " + b"z" * 200, 0.05))
        # a connection that sends nothing
        r3, w3 = await asyncio.open_connection(host, int(port))

        async with httpx.AsyncClient(base_url=f"http://{addr}", trust_env=False,
                                     timeout=30) as c:
            for _ in range(3):  # others are served meanwhile
                resp = await c.post(CHAT, content=raw, headers={"content-type": "application/json"})
                assert resp.status_code == 200

        # the router answers 408 and closes; the client, still sending, may see a reset
        # instead of the answer (the kernel drops unread data on RST)
        answer = await read_all(r1)
        if answer:
            head, _, rest = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408 ")
            err = json.loads(rest)["error"]
            assert err["code"] == 408 and err["type"] == "RequestTimeoutError"
        assert ctx.metrics.requests.labels(CHAT, "408")._value.get() == 1
        assert ctx.metrics.requests.labels(CHAT, "200")._value.get() == 3
        assert await read_all(r2) == b""  # closed without an answer
        assert await read_all(r3) == b""
        for task in (slow_body, slow_head):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for w in (w1, w2, w3):
            w.close()


async def test_a_crash_is_answered_500_and_counted_as_one(
        rig: Routed, monkeypatch: pytest.MonkeyPatch) -> None:
    async def crash(self: Planner, req: object) -> None:
        raise RuntimeError("a bug in the router")

    monkeypatch.setattr(Planner, "plan", crash)
    async with rig.client() as client:
        resp = await client.post(CHAT, content=body(), headers=dict([JSON]))
    assert resp.status_code == 500
    metrics = (await rig.internal_get("/metrics")).text
    done = 'kvrelay_router_requests_total{endpoint="/v1/chat/completions",status="%s"}'
    assert done % "500" + " 1.0" in metrics
    assert done % "200" not in metrics
