"""The router served by uvicorn on loopback in front of a ``FakeCluster`` (real HTTP both ways,
D-side reports included), sharing one ``ManualClock`` so TTLs move without sleeping."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from kvrelay.router.app import create_app
from kvrelay.router.config import RouterConfig
from kvrelay.router.state import RouterContext
from kvrelay.testing import FakeCluster, FakeEngine, FakeEngineConfig, ManualClock
from kvrelay.testing.fake_config import RequestRecord
from kvrelay.testing.fake_server import HttpServer
from tests.ports import free_port

ENGINE_CONFIG = FakeEngineConfig(report_delay_s=0.0, default_max_tokens=16)


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
    cluster: FakeCluster
    ctx: RouterContext
    url: str
    clock: ManualClock

    def client(self, **kw: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=30.0, trust_env=False, **kw)

    async def stats(self) -> dict[str, Any]:
        async with self.client() as c:
            resp = await c.get("/stats")
        assert resp.status_code == 200
        result: dict[str, Any] = resp.json()
        return result

    async def last_decision(self) -> dict[str, Any]:
        recent: list[dict[str, Any]] = (await self.stats())["decisions"]["recent"]
        assert recent
        return recent[-1]

    async def settle(self) -> None:
        """Let D's reports arrive and every pending turn settle."""
        await self.cluster.drain_reports()
        for _ in range(200):
            if len(self.ctx.reports) == 0:
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
    **settings: Any,
) -> AsyncIterator[Routed]:
    clock = ManualClock()
    extra = {"sleep": sleep} if sleep is not None else {}
    async with FakeCluster(num_prefill, num_decode, engine_config, clock=clock,
                           **extra) as cluster:
        port = free_port()
        defaults: dict[str, Any] = {"port": port, "internal_port": free_port(),
                                    "health_interval_s": 3600.0, "report_wait_s": 5.0}
        config = RouterConfig.from_urls(
            cluster.prefill_urls, cluster.decode_urls,
            block_size=engine_config.block_size, **{**defaults, **settings},
        )
        app = create_app(config, clock=clock)
        ctx: RouterContext = app.ctx
        server = HttpServer(app.public, "127.0.0.1", port)
        internal = HttpServer(app.internal, "127.0.0.1", config.listen_internal_port)
        await server.start()
        await internal.start()
        try:
            yield Routed(cluster, ctx, f"http://127.0.0.1:{port}", clock)
        finally:
            await server.stop()
            await internal.stop()
            await ctx.upstream.aclose()
