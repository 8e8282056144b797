"""Small helpers shared by the fake-engine component tests (HTTP calls, SSE parsing)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvrelay.client.sse import line_chunks
from kvrelay.core.retention_sync import (
    RETENTION_PATH,
    RetentionOrders,
    RetentionSync,
    decode_sync,
    encode,
)
from kvrelay.fakevllm.engine import FakeEngine
from kvrelay.fakevllm.server import HttpServer

BLOCK = 128
DATA = "tests/data/vllm-0.32.0"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=30.0, trust_env=False)


async def post(engine: FakeEngine, path: str, body: dict[str, Any], status: int = 200) -> Any:
    async with client() as http:
        response = await http.post(engine.url + path, json=body)
    assert response.status_code == status, response.text
    return response.json()


async def chat(engine: FakeEngine, messages: list[dict[str, Any]], **body: Any) -> Any:
    """A non-streamed chat completion (asserts HTTP 200)."""
    return await post(engine, "/v1/chat/completions", {"messages": messages, **body})


def text_of(response: Any) -> str:
    return str(response["choices"][0]["message"]["content"])


async def prompt_len(engine: FakeEngine, messages: list[dict[str, Any]]) -> int:
    return len(engine.model.encode_chat(messages))


async def sse_lines(engine: FakeEngine, path: str, body: dict[str, Any]) -> list[str]:
    """Every ``data:`` line of a streamed response, ``data: [DONE]`` included."""
    async with client() as http, http.stream("POST", engine.url + path, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return [line async for line in response.aiter_lines() if line]


def sse_json(lines: list[str]) -> list[Any]:
    """The JSON chunks of ``sse_lines`` (everything before ``[DONE]``)."""
    assert lines[-1] == "data: [DONE]"
    return list(line_chunks(lines[:-1]))


async def iter_sse(response: httpx.Response) -> AsyncIterator[str]:
    async for line in response.aiter_lines():
        if line:
            yield line


class Receiver:
    """A loopback HTTP server that records the JSON bodies POSTed to ``/report``."""

    def __init__(self) -> None:
        self.bodies: list[Any] = []
        self.arrived = asyncio.Event()

        async def report(request: Request) -> Response:
            self.bodies.append(json.loads(await request.body()))
            self.arrived.set()
            return Response(status_code=204)

        self._server = HttpServer(Starlette(routes=[Route("/report", report, methods=["POST"])]))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.port}/report"

    async def __aenter__(self) -> Receiver:
        await self._server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._server.stop()

    async def next_body(self) -> Any:
        """Wait for (at most 10 s: a safety net, not a timing assertion) the next report."""
        await asyncio.wait_for(self.arrived.wait(), 10)
        self.arrived.clear()
        return self.bodies[-1]


class GatedSleep:
    """An injectable ``sleep``: records every requested delay and returns only while the gate
    is open, so tests check simulated latency without measuring wall-clock time."""

    def __init__(self, open_: bool = True) -> None:
        self.requested: list[float] = []
        self.gate = asyncio.Event()
        if open_:
            self.gate.set()

    async def __call__(self, seconds: float) -> None:
        self.requested.append(seconds)
        await self.gate.wait()


async def until(predicate: Callable[[], bool], what: str, spins: int = 2000) -> None:
    """Yield to the event loop until ``predicate()`` holds (bounded by loop turns)."""
    for _ in range(spins):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


async def gather_all(*aws: Awaitable[Any]) -> list[Any]:
    return list(await asyncio.gather(*aws))


class RouterStandIn:
    """The router's retention endpoint (``core.retention_sync``): records each sync and
    answers the queued ``orders``; with ``confirm``, every id D asks for (``releasing``) is
    answered ``dropped``, as a router that holds no entry for them would."""

    def __init__(self, confirm: bool = True, *, hang: bool = False) -> None:
        """``hang``: read each sync and answer nothing until the stand-in stops (a wedged
        router); ``entered`` counts the syncs it got."""
        self.syncs: list[RetentionSync] = []
        self.orders: list[RetentionOrders] = []
        self.confirm = confirm
        self.entered = 0
        self._unhang = asyncio.Event()
        if not hang:
            self._unhang.set()

        async def sync(request: Request) -> Response:
            body = decode_sync(await request.body())
            self.entered += 1
            await self._unhang.wait()
            self.syncs.append(body)
            answer = self.orders.pop(0) if self.orders else RetentionOrders()
            if self.confirm and body.releasing:
                answer = RetentionOrders(release=answer.release, dropped=body.releasing,
                                         curves=answer.curves)  # as the router answers
            return Response(encode(answer), media_type="application/json")

        self._server = HttpServer(Starlette(routes=[Route(RETENTION_PATH, sync,
                                                          methods=["POST"])]))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.port}{RETENTION_PATH}"

    async def __aenter__(self) -> RouterStandIn:
        await self._server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._unhang.set()
        await self._server.stop()

    async def wait_for(self, predicate: Callable[[RetentionSync], bool], what: str
                       ) -> RetentionSync:
        """The first sync ``predicate`` holds for (waiting for it, bounded by loop turns)."""
        await until(lambda: any(predicate(s) for s in self.syncs), what)
        return next(s for s in self.syncs if predicate(s))
