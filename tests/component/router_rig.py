"""Helpers for router tests: a router app on a ``MockCluster``, a manual clock, the text of a
stream (events parsed by ``kvrelay.client.sse``), a multi-turn chat driver, and index lookups
made the way the router makes them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from kvrelay.client.sse import chunk_content, sse_events
from kvrelay.core.conversation import ConversationEntry
from kvrelay.router.app import create_app
from kvrelay.router.config import RouterConfig
from kvrelay.router.index import Found
from kvrelay.router.request import Endpoint, parse_request
from kvrelay.router.state import RouterContext
from tests.component.httpx_transport import HttpxTransport
from tests.component.router_mock import MockCluster


async def until(predicate: Any, what: str, spins: int = 5000) -> None:
    """Yield to the event loop until ``predicate()`` holds (bounded, never a time threshold)."""
    for _ in range(spins):
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never happened: {what}")


class Clock:
    """A router clock that moves only when told to."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def stream_text(events: list[Any]) -> str:
    """The text of a stream's events (``sse_events``)."""
    return "".join(chunk_content(ev) for ev in events if isinstance(ev, Mapping))


def reply_text(obj: dict[str, Any]) -> str:
    choice = obj["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


def walk_keys(obj: Any) -> list[tuple[str, Any]]:
    """Every (key, value) pair in a JSON value, recursively."""
    out: list[tuple[str, Any]] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append((k, v))
            out.extend(walk_keys(v))
    elif isinstance(obj, list):
        for v in obj:
            out.extend(walk_keys(v))
    return out


def assert_no_internal_fields(payloads: list[Any]) -> None:
    """No router-internal field reaches the client: no ``kv_transfer_params`` (vLLM 0.33's
    ``null`` ones on stream chunks included), nothing from inside them, no ``kvrelay_*`` key
    at all, token ids only as vLLM's own ``null``."""
    for payload in payloads:
        for key, value in walk_keys(payload):
            assert not key.startswith("kvrelay_"), key
            assert key not in ("kv_transfer_params", "remote_registration_generation"), payload
            if key in ("token_ids", "prompt_token_ids"):
                assert value is None, (key, value)


async def lookup(
    ctx: RouterContext,
    body: dict[str, Any],
    *,
    endpoint: Endpoint = "chat",
    headers: dict[str, str] | None = None,
    tenant: str = "default",
) -> Found | None:
    """The entry ``ctx``'s router would find for the request ``body`` (see ``Rig.lookup``)."""
    lower = {k.lower(): v for k, v in (headers or {}).items()}
    req = parse_request(endpoint, json.dumps(body).encode(), lower, tenant,
                        ctx.config.id_rules)
    return await ctx.index.lookup(req.identity)


@dataclass
class Rig:
    """A router app (no lifespan: no health loop) on a mock cluster, with an ASGI client."""

    cluster: MockCluster
    settings: dict[str, Any] = field(default_factory=dict)
    clock: Clock = field(default_factory=Clock)
    config: RouterConfig | None = None

    def __post_init__(self) -> None:
        if self.config is None:
            self.config = self.cluster.config(**self.settings)
        self.app = create_app(
            self.config, transport=HttpxTransport(self.cluster.transport), clock=self.clock
        )
        self.cluster.router_app = self.app.internal
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app.public), base_url="http://router",
            timeout=30,
        )

    @property
    def ctx(self) -> RouterContext:
        return self.app.ctx

    async def close(self) -> None:
        await self.cluster.drain()
        await self.client.aclose()
        await self.ctx.upstream.aclose()

    async def post(self, path: str, body: Any, **kw: Any) -> httpx.Response:
        if isinstance(body, bytes | str):
            return await self.client.post(path, content=body, **kw)
        return await self.client.post(path, json=body, **kw)

    async def stats(self) -> dict[str, Any]:
        resp = await self.client.get("/stats")
        assert resp.status_code == 200
        result: dict[str, Any] = resp.json()
        return result

    async def last_decision(self) -> dict[str, Any]:
        recent = (await self.stats())["decisions"]["recent"]
        assert recent, "no decision recorded"
        last: dict[str, Any] = recent[-1]
        return last

    async def settle(self) -> None:
        """Let pending D reports arrive and be processed."""
        await self.cluster.drain()

    async def lookup(
        self,
        body: dict[str, Any],
        *,
        endpoint: Endpoint = "chat",
        headers: dict[str, str] | None = None,
        tenant: str = "default",
    ) -> Found | None:
        """The entry the router would find for the request ``body`` (a follow-up turn): the
        request parsed as the router parses it (scope from tenant, ``conversation_id`` or a
        session header), then ``index.lookup`` on its digests."""
        return await lookup(self.ctx, body, endpoint=endpoint, headers=headers, tenant=tenant)


class Router(Protocol):
    """What ``Chat`` drives: a ``Rig`` (mock cluster) or ``router_fake.Routed`` (fake one)."""

    @property
    def ctx(self) -> RouterContext: ...

    async def post(self, path: str, body: Any, *, headers: dict[str, str] | None = None,
                   ) -> httpx.Response: ...


@dataclass
class Chat:
    """One conversation: keeps the messages and sends each turn through the router
    (``model``: the served name, ``mock`` for the mock cluster, ``tiny`` for fake engines)."""

    rig: Router
    conversation_id: str | None
    stream: bool = False
    max_tokens: int = 8
    messages: list[dict[str, Any]] = field(default_factory=list)
    last_response: httpx.Response | None = None
    model: str = "mock"
    headers: dict[str, str] | None = None
    """Sent with every turn (e.g. a gateway's id header)."""

    def body(self, **extra: Any) -> dict[str, Any]:
        """The request for the messages so far (the last one is the new user message)."""
        body: dict[str, Any] = {
            "model": self.model, "messages": list(self.messages),
            "max_tokens": self.max_tokens, "stream": self.stream, **extra,
        }
        if self.conversation_id is not None:
            body["conversation_id"] = self.conversation_id
        return body

    async def entry(
        self, *, tenant: str = "default", headers: dict[str, str] | None = None
    ) -> ConversationEntry | None:
        """The entry this conversation's next turn would continue (``None``: it would
        recompute with ``no_entry``)."""
        self.messages.append({"role": "user", "content": "(probe)"})
        try:
            found = await lookup(self.rig.ctx, self.body(), headers=headers, tenant=tenant)
        finally:
            self.messages.pop()
        return found.entry if found is not None else None

    async def turn(self, user: str, **extra: Any) -> tuple[httpx.Response, str]:
        self.messages.append({"role": "user", "content": user})
        body = self.body(**extra)
        resp = await self.rig.post("/v1/chat/completions", body, headers=self.headers)
        self.last_response = resp
        text = ""
        if resp.status_code == 200:
            if self.stream:
                events = sse_events(resp.text)
                assert events[-1] == "[DONE]"
                text = stream_text(events)
            else:
                text = reply_text(resp.json())
            self.messages.append({"role": "assistant", "content": text})
        return resp, text
