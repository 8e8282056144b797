"""The router's ASGI app: ``create_app(config)`` composes one (``router.server.serve`` runs it).

Two listeners share one app: the public one (generation, ``/v1/models``, ``/health``,
``/metrics``, ``/stats``, ``/admin/*``) and the internal one, loopback by default, where D's
connector posts its reports (``/internal/kv-report``). ``RouterApp`` dispatches by the
listening port; ``app.public`` and ``app.internal`` are the two ASGI apps on their own
(tests call them in process).

All state lives in the ``RouterContext`` (``app.ctx``); nothing is module-global, so any
number of apps can run in one process. The health loop runs while the app's lifespan is
active (uvicorn); without a lifespan nodes stay as they are unless
``await app.ctx.nodes.check_all()`` is called.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from kvrelay.core.consequences import SPENT_READ_GRACE_S
from kvrelay.core.retention_time import RetentionTimeConfig
from kvrelay.router.admin import internal_routes, public_routes
from kvrelay.router.asgi import (
    Receive,
    Route,
    Routes,
    Scope,
    Send,
    refuse_websocket,
    send_error,
    wants_websocket,
)
from kvrelay.router.auth import Authenticator
from kvrelay.router.commit import ReportDesk
from kvrelay.router.config import RouterConfig
from kvrelay.router.engine_check import EngineChecks
from kvrelay.router.handler import GenerationHandler
from kvrelay.router.index import ConversationIndex, InMemoryIndex
from kvrelay.router.limits import Admission
from kvrelay.router.metrics import RouterMetrics
from kvrelay.router.nodes import NodeRegistry
from kvrelay.router.request import PATHS
from kvrelay.router.response_store import InMemoryResponseStore, ResponseStore
from kvrelay.router.retention import RetentionDesk
from kvrelay.router.state import RouterContext
from kvrelay.router.stats import RouterStats
from kvrelay.router.stock_release import StockReleases
from kvrelay.router.turnlog import TurnLogWriter
from kvrelay.router.upstream import AiohttpTransport, Transport, Upstream

log = logging.getLogger("kvrelay.router")

_OPEN_WHILE_DRAINING = frozenset({"/metrics"})
_GENERATION_PATHS = frozenset(PATHS.values())


class RouterApp:
    """The composed router (module docstring)."""

    def __init__(self, ctx: RouterContext, public: Routes, internal: Routes) -> None:
        self.ctx = ctx
        self.public = _Draining(ctx.admission, ctx.metrics, public)
        self.internal = internal
        self._health: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "websocket" or (kind == "http" and wants_websocket(scope)):
            await refuse_websocket(scope, receive, send)
        elif kind == "http":
            server = scope.get("server")
            port = server[1] if server else None
            if port == self.ctx.config.listen_internal_port:
                await self.internal(scope, receive, send)
            else:
                await self.public(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def startup(self) -> None:
        """Start the health loop (the lifespan does this under a server)."""
        if self._health is None:
            self._health = asyncio.create_task(self._background(), name="kvrelay-health")
        guard = self.ctx.config.guard
        log.info("router up: prefix guard %s (%s)", guard, {
            "auto": "per node: in P's connector once P shows it runs kvrelay's, else /tokenize",
            "connector": "in kvrelay's connector on P; no /tokenize",
            "tokenize": "in the router, prompt ids from P's /tokenize",
        }[guard])

    async def shutdown(self) -> None:
        task, self._health = self._health, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.ctx.engine_checks is not None:
            await self.ctx.engine_checks.aclose()
        await self.ctx.upstream.aclose()
        await self.ctx.index.aclose()
        if self.ctx.responses is not None:
            await self.ctx.responses.aclose()
        if self.ctx.turn_log is not None:
            self.ctx.turn_log.close()

    async def _background(self) -> None:
        """The health loop, the reads of D's room (``NodeRegistry.run_room_loop``), stock
        D's release orders (``router.stock_release``), and the turn log's idle flush
        (records are buffered)."""
        loops = [asyncio.ensure_future(self.ctx.nodes.run_health_loop()),
                 asyncio.ensure_future(self.ctx.nodes.run_room_loop()),
                 asyncio.ensure_future(self.ctx.stock_releases.run())]
        try:
            while True:
                await asyncio.sleep(1.0)
                if self.ctx.turn_log is not None:
                    self.ctx.turn_log.flush()
        finally:
            for loop in loops:
                loop.cancel()
            await asyncio.gather(*loops, return_exceptions=True)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.startup()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return


class _Draining:
    """While draining, every public request but ``/metrics`` gets 503, counted in
    ``rejected_requests_total{reason="draining"}`` (and, for generation, in
    ``requests_total``)."""

    def __init__(self, admission: Admission, metrics: RouterMetrics, routes: Routes) -> None:
        self._admission = admission
        self._metrics = metrics
        self._routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if self._admission.draining and path not in _OPEN_WHILE_DRAINING:
            self._metrics.rejected.labels("draining").inc()
            if path in _GENERATION_PATHS:
                self._metrics.request_done(path, 503)
            await send_error(send, 503, "The router is shutting down", {"Connection": "close"})
            return
        await self._routes(scope, receive, send)


def create_app(
    config: RouterConfig,
    *,
    transport: Transport | None = None,
    clock: Callable[[], float] = time.monotonic,
    index: ConversationIndex | None = None,
    response_store: ResponseStore | None = None,
) -> RouterApp:
    """A router app for ``config``. ``transport`` replaces the network to the nodes (tests),
    ``clock`` is the router clock for entry expiry, ``index`` defaults to a ``RedisIndex``
    on ``config.state`` when set (shared by router replicas), else to an ``InMemoryIndex``
    capped at ``config.max_entries`` (``config.tenant_entries`` per tenant).
    ``response_store`` defaults to the one ``config.response_store`` names (none if off)."""
    metrics = RouterMetrics()
    if index is None:
        index = _default_index(config, clock, metrics)
    if response_store is None and config.response_store != "off":
        response_store = _default_response_store(config, clock, metrics)
    upstream = Upstream(transport or AiohttpTransport(
        max_connections=config.max_connections,
        connect_timeout_s=config.connect_timeout_s,
        read_timeout_s=config.read_timeout_s,
    ))
    nodes = NodeRegistry(config, upstream, index, metrics, clock=clock)
    tag_key = config.conversation_tag_key()
    ctx = RouterContext(
        config=config,
        clock=clock,
        upstream=upstream,
        nodes=nodes,
        index=index,
        desk=ReportDesk(index, nodes, clock, metrics, safety_margin_s=config.ttl_safety_margin_s,
                        report_timeout_s=config.report_timeout_s),
        metrics=metrics,
        stats=RouterStats(config.recent_decisions),
        admission=Admission(config.max_in_flight, config.tenant_in_flight, metrics,
                            max_body_bytes=config.max_body_bytes),
        auth=Authenticator(config.api_keys, config.admin_key, config.tenant,
                           config.metrics_key),
        retention=RetentionDesk(
            index, nodes, metrics, clock, base_url=config.internal_base_url,
            key=tag_key,
            learned=RetentionTimeConfig(
                quantile=config.retain_quantile,
                router_margin_s=config.ttl_safety_margin_s + config.policy.near_expiry_s,
                min_window_s=config.retain_min_window_s,
            ) if config.learned_retention else None,
        ),
        tag_key=tag_key,
        turn_log=TurnLogWriter(
            config.turn_log, max_bytes=config.turn_log_max_mb << 20,
            backups=config.turn_log_backups,
        ) if config.turn_log else None,
        responses=response_store,
        stock_releases=StockReleases(index, nodes, upstream, metrics, list(config.decode),
                                     clock=clock),
    )
    ctx.engine_checks = EngineChecks(nodes, upstream, metrics, clock=clock,
                                     retention_url=ctx.retention.url_for,
                                     release=ctx.stock_releases.release)
    ctx.retention.engine_checks = ctx.engine_checks
    nodes.engine_unknown = ctx.engine_checks.learn
    ctx.desk.engine_checks = ctx.engine_checks
    ctx.desk.unheld = ctx.stock_releases.unheld
    metrics.track_live_entries(lambda: len(ctx.index))
    metrics.track_pending_reports(lambda: len(ctx.desk))
    no_tokens = {node.node_id: 0 for node in config.decode}  # a D without entries reads 0
    metrics.track_retained_tokens(
        lambda: {**no_tokens, **ctx.index.retained_tokens(ctx.clock())})
    metrics.track_d_retention(ctx.retention.gauges)
    generation = GenerationHandler(ctx)
    public = Routes([
        *(Route(path, frozenset({"POST"}), generation.route(endpoint))
          for endpoint, path in PATHS.items()),
        *public_routes(ctx),
        *generation.stored_routes(),
    ])
    return RouterApp(ctx, public, Routes(internal_routes(ctx)))


def _default_index(
    config: RouterConfig, clock: Callable[[], float], metrics: RouterMetrics
) -> ConversationIndex:
    if config.state is not None:
        from kvrelay.router.index_redis import RedisIndex

        return RedisIndex.from_url(
            config.state,
            timeout_s=config.state_timeout_ms / 1000.0,
            deployment=config.deployment,
            clock=clock,
            expired_retention_s=config.expired_retention_s,
            max_entries=config.max_entries,
            max_per_tenant=config.tenant_entries,
            on_error=lambda op: metrics.state_errors.labels(op).inc(),
            on_evict=lambda why, count: metrics.dropped.labels(why).inc(count),
            on_text_digests=metrics.text_lookup,
        )

    def evicted(entry: Any, why: str) -> None:
        if why == "expired":
            metrics.expirations.inc()
            metrics.expired_unused.inc(
                entry.num_tokens * max(0.0, entry.expires_at_s - entry.created_at_s)
            )
        else:
            metrics.dropped.labels(why).inc()

    return InMemoryIndex(
        config.max_entries,
        max_per_tenant=config.tenant_entries,
        clock=clock,
        expired_retention_s=config.expired_retention_s,
        on_evict=evicted,
        on_text_digests=metrics.text_lookup,
        predecessor_grace_s=SPENT_READ_GRACE_S,
    )



def _default_response_store(
    config: RouterConfig, clock: Callable[[], float], metrics: RouterMetrics
) -> ResponseStore:
    def evicted(reason: str) -> None:
        metrics.responses_evicted.labels(reason).inc()

    ttl_s, max_bytes = config.response_store_ttl_s, config.response_store_max_mb << 20
    per_tenant = config.response_store_max_mb_per_tenant
    tenant_bytes = per_tenant << 20 if per_tenant is not None else None
    if config.response_store == "redis":
        from kvrelay.router.response_store_redis import RedisResponseStore

        assert config.state is not None
        return RedisResponseStore.from_url(
            config.state, ttl_s=ttl_s, max_bytes=max_bytes, max_bytes_per_tenant=tenant_bytes,
            deployment=config.deployment,
            timeout_s=max(config.state_timeout_ms / 1000.0, RESPONSE_STORE_MIN_TIMEOUT_S),
            on_error=lambda op: metrics.state_errors.labels(op).inc(), on_evict=evicted)
    return InMemoryResponseStore(ttl_s=ttl_s, max_bytes=max_bytes,
                                 max_bytes_per_tenant=tenant_bytes, clock=clock,
                                 on_evict=evicted)


RESPONSE_STORE_MIN_TIMEOUT_S = 1.0
"""The response store's Redis calls wait at least this long (``state_timeout_ms`` bounds the
index's, whose failure only costs a recompute): a ``previous_response_id`` the store cannot
answer has no fallback but a 503, and a stored conversation can be megabytes."""
