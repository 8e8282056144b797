"""The router served on loopback in front of a ``FakeCluster`` (real HTTP both ways, D-side
reports to the internal listener included), sharing one ``ManualClock`` so TTLs move without
sleeping, plus a fault-free reference engine of its own for recomputes.

The engines run kvrelay's connector by default (the router's ``connector`` guard mode);
``STOCK_CONFIG`` is stock vLLM (the router's ``/tokenize`` mode). They speak the vLLM
protocol ``KVRELAY_FAKE_VLLM_VERSION`` names (``fake_vllm_version``; 0.32 by default)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from kvrelay.fakevllm import FakeCluster, FakeEngine, FakeEngineConfig, ManualClock
from kvrelay.fakevllm.config import RequestRecord
from kvrelay.fakevllm.server import HttpServer
from kvrelay.router.app import RouterApp, create_app
from kvrelay.router.config import RouterConfig
from kvrelay.router.index import Found
from kvrelay.router.request import Endpoint
from kvrelay.router.state import RouterContext
from tests.component.fake_vllm_version import engine_config
from tests.component.router_rig import lookup
from tests.costs import fixed
from tests.ports import free_ports

ENGINE_CONFIG = engine_config(report_delay_s=0.0, default_max_tokens=16)
STOCK_CONFIG = replace(ENGINE_CONFIG, kvrelay_connector=False)
"""Stock vLLM on every node: the router guards pulls itself (``/tokenize`` mode)."""
GUARD_CONFIGS = {"connector": ENGINE_CONFIG, "tokenize": STOCK_CONFIG}


class PermitSleep:
    """An injectable engine ``sleep`` that returns only when a permit is granted, so a test
    decides exactly how many slowed steps (e.g. streamed tokens) an engine may take."""

    def __init__(self) -> None:
        self._permits = asyncio.Semaphore(0)
        self.waiting = 0

    def grant(self, n: int = 1) -> None:
        for _ in range(n):
            self._permits.release()

    async def __call__(self, seconds: float) -> None:
        self.waiting += 1
        try:
            await self._permits.acquire()
        finally:
            self.waiting -= 1


@dataclass
class Routed:
    """The router (``app``, its state ``ctx``) served at ``url`` in front of ``cluster``.
    ``client()`` talks HTTP to ``url``; ``get``/``post`` call the app in process, with
    ``headers`` (e.g. an API key) as a client's default headers."""

    cluster: FakeCluster
    ctx: RouterContext
    url: str
    clock: ManualClock
    reference: FakeEngine
    app: RouterApp
    headers: dict[str, str] = field(default_factory=dict)

    def client(self, **kw: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=30.0, trust_env=False, **kw)

    def asgi_client(self) -> httpx.AsyncClient:
        """A client of the public app called in process (no HTTP parser in between, so it
        sends headers exactly as given, e.g. ``Bearer `` with its trailing space)."""
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app.public),
                                 base_url="http://router", timeout=30.0)

    async def get(self, path: str, *, headers: dict[str, str] | None = None) -> httpx.Response:
        """GET (in process) with ``headers`` over ``self.headers``."""
        async with self.asgi_client() as c:
            return await c.get(path, headers={**self.headers, **(headers or {})})

    async def internal_get(self, path: str) -> httpx.Response:
        """GET (in process) on the internal listener's app (e.g. the complete ``/metrics``,
        request-size series included, as the shipped scrapers read it)."""
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app.internal),
                                     base_url="http://router-internal", timeout=30.0) as c:
            return await c.get(path)

    async def post(self, path: str, body: Any, *, headers: dict[str, str] | None = None,
                   ) -> httpx.Response:
        """POST (in process) a JSON value, or raw ``bytes``/``str``, with ``headers`` over
        ``self.headers``."""
        sent = {**self.headers, **(headers or {})}
        async with self.asgi_client() as c:
            if isinstance(body, bytes | str):
                return await c.post(path, content=body, headers=sent)
            return await c.post(path, json=body, headers=sent)

    async def stats(self) -> dict[str, Any]:
        resp = await self.get("/stats")
        assert resp.status_code == 200
        result: dict[str, Any] = resp.json()
        return result

    async def last_decision(self) -> dict[str, Any]:
        recent: list[dict[str, Any]] = (await self.stats())["decisions"]["recent"]
        assert recent
        return recent[-1]

    async def find(
        self, body: dict[str, Any], endpoint: Endpoint = "chat", tenant: str = "default"
    ) -> Found | None:
        """The entry the router would find for this request (``ConversationIndex.lookup``
        on the request's own identity), without sending it."""
        return await lookup(self.ctx, body, endpoint=endpoint, tenant=tenant)

    async def recompute(self, body: dict[str, Any], endpoint: Endpoint = "chat") -> str:
        """The reply a plain recompute gives: the request (not streamed, no conversation
        id) straight to the reference engine, which shares no KV with the cluster."""
        plain = {k: v for k, v in body.items()
                 if k not in ("conversation_id", "stream", "stream_options")}
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        async with httpx.AsyncClient(timeout=30.0, trust_env=False) as c:
            resp = await c.post(self.reference.url + path, json=plain)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        return str(choice["message"]["content"] if endpoint == "chat" else choice["text"])

    async def settle(self) -> None:
        """Let D's reports arrive and every pending turn settle."""
        await self.cluster.drain_reports()
        for _ in range(200):
            if len(self.ctx.desk) == 0:
                return
            await asyncio.sleep(0.005)
        raise AssertionError("reports still pending")


def last_prefill_record(engine: FakeEngine) -> RequestRecord:
    """The newest generation request P served (tokenize calls leave no record)."""
    return engine.records[-1]


async def until(predicate: Any, what: str, spins: int = 2000) -> None:
    for _ in range(spins):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


@contextlib.asynccontextmanager
async def routed(
    num_prefill: int = 1,
    num_decode: int = 1,
    engine_config: FakeEngineConfig = ENGINE_CONFIG,
    *,
    sleep: Any = None,
    clock: ManualClock | None = None,
    prefill_config: FakeEngineConfig | None = None,
    decode_data_parallel: int = 1,
    **settings: Any,
) -> AsyncIterator[Routed]:
    """The router in front of a fresh ``FakeCluster``; ``settings`` over the rig's defaults
    (fixed costs where every pull pays: ``tests.costs``). ``clock`` is the shared clock
    (a new ``ManualClock`` if not given), ``sleep`` the engines' simulated-latency sleep,
    ``prefill_config`` P's engines' own config (else ``engine_config``),
    ``decode_data_parallel`` the ranks each D runs behind its URL."""
    clock = clock if clock is not None else ManualClock()
    extra: dict[str, Any] = {"sleep": sleep} if sleep is not None else {}
    if prefill_config is not None:
        extra["prefill_config"] = prefill_config
    async with FakeCluster(num_prefill, num_decode, engine_config, clock=clock,
                           decode_data_parallel=decode_data_parallel, **extra) as cluster, \
            FakeCluster(1, 0, engine_config, model=cluster.model) as reference:
        port, internal_port = free_ports(2)
        defaults: dict[str, Any] = {"port": port, "internal_port": internal_port,
                                    "health_interval_s": 3600.0, "report_wait_s": 5.0,
                                    "block_size": engine_config.block_size, **fixed()}
        config = RouterConfig.from_urls(
            cluster.prefill_urls, cluster.decode_urls, **{**defaults, **settings},
        )
        app = create_app(config, clock=clock)
        ctx: RouterContext = app.ctx
        server = HttpServer(app.public, "127.0.0.1", port)
        internal = HttpServer(app.internal, "127.0.0.1", config.listen_internal_port)
        await server.start()
        await internal.start()
        try:
            yield Routed(cluster, ctx, f"http://127.0.0.1:{port}", clock,
                         reference.prefill[0], app)
        finally:
            await server.stop()
            await internal.stop()
            await ctx.upstream.aclose()
