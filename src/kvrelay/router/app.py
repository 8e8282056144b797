"""The router's ASGI app: ``create_app(config)`` builds one, ``serve(config)`` runs it.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed or not),
``GET /v1/models`` (from an up P), ``GET /health`` (router and every node, checked live),
``GET /metrics`` (Prometheus), ``GET /stats`` (JSON), ``POST /internal/kv-report`` (D's
retained params, posted by kvrelay's connector), ``/admin/*`` with an admin key (``admin``).
API keys and tenants: ``auth``; body limits, in-flight cap, draining: ``limits``.

All state lives in the ``RouterContext`` on ``app.state.router``; nothing is module-global,
so any number of apps can run in one process (tests do). The health loop runs while the app's
lifespan is active (uvicorn); without a lifespan (``httpx.ASGITransport``) nodes stay as they
are unless ``await app.state.router.nodes.check_all()`` is called.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvrelay.router.admin import admin_routes, http_error, stats_handler
from kvrelay.router.auth import Authenticator
from kvrelay.router.bodies import Endpoint
from kvrelay.router.config import RouterConfig
from kvrelay.router.errors import ClientError, RouterError, error_response, json_response
from kvrelay.router.forward import Forwarder
from kvrelay.router.limits import Guard, GuardState, read_body
from kvrelay.router.metrics import CONTENT_TYPE, RouterMetrics
from kvrelay.router.nodes import NodeRegistry
from kvrelay.router.reports import ReportBook
from kvrelay.router.state import RouterContext
from kvrelay.router.stats import RouterStats
from kvrelay.router.store import ConversationStore, InMemoryStore
from kvrelay.router.turns import Turn, TurnPlanner
from kvrelay.router.upstream import Upstream, UpstreamError

log = logging.getLogger("kvrelay.router")

Handler = Callable[[Request], Awaitable[Response]]


def create_app(
    config: RouterConfig,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    clock: Callable[[], float] = time.monotonic,
    store: ConversationStore | None = None,
) -> Starlette:
    """A router app for ``config``. ``transport`` replaces the network to the nodes (tests),
    ``clock`` is the router clock for entry expiry, ``store`` defaults to a ``RedisStore`` on
    ``config.state`` when set (shared by router replicas), else to an
    ``InMemoryStore`` capped at ``config.max_entries``."""
    metrics = RouterMetrics()
    if store is None and config.state is not None:
        store = _redis_store(config, clock, metrics)
    if store is None:
        store = InMemoryStore(
            config.max_entries,
            clock=clock,
            expired_retention_s=config.expired_retention_s,
            on_evict=lambda entry, why: (
                metrics.expirations.inc() if why == "expired"
                else metrics.dropped.labels(why).inc()
            ),
        )
    upstream = Upstream(config, transport)
    nodes = NodeRegistry(config, upstream, store, metrics, clock=clock)
    reports = ReportBook(
        store,
        clock,
        metrics,
        safety_margin_s=config.ttl_safety_margin_s,
        report_timeout_s=config.report_timeout_s,
        on_engine=nodes.observe_engine,
    )
    ctx = RouterContext(
        config=config,
        clock=clock,
        upstream=upstream,
        nodes=nodes,
        store=store,
        reports=reports,
        metrics=metrics,
        stats=RouterStats(config.recent_decisions),
    )
    metrics.track_live_entries(lambda: len(ctx.store))
    metrics.track_pending_reports(lambda: len(ctx.reports))
    planner = TurnPlanner(ctx)
    forwarder = Forwarder(ctx)
    auth = Authenticator(config.api_keys, config.admin_key, config.tenant)
    guard = GuardState(config.max_in_flight)

    async def body_of(request: Request) -> bytes:
        return await read_body(request, config.max_body_bytes, config.body_timeout_s)

    def counted(endpoint: str, handler: Handler) -> Handler:
        async def handle(request: Request) -> Response:
            try:
                response = await handler(request)
            except ClientError as exc:
                response = exc.response()
            except RouterError as exc:
                response = exc.response()
            except Exception:
                log.exception("unexpected error on %s", endpoint)
                response = error_response(500, "internal router error")
            metrics.requests.labels(endpoint, str(response.status_code)).inc()
            return response

        return handle

    def generation(endpoint: Endpoint) -> Handler:
        async def handle(request: Request) -> Response:
            turn: Turn | None = None
            try:
                tenant = auth.tenant(request.headers)
                raw = await body_of(request)
                turn = await planner.decide(endpoint, raw, request.headers, tenant)
                return await forwarder.run(turn)
            except RouterError as exc:
                if turn is not None and turn.record.get("outcome") is None:
                    turn.record["outcome"] = f"error_{exc.status}"
                raise

        return handle

    async def models(request: Request) -> Response:
        auth.tenant(request.headers)
        last: UpstreamError | None = None
        for node in config.prefill:
            state = nodes.state(node.node_id)
            if state is None or not state.up:
                continue
            try:
                resp = await upstream.get(node, "/v1/models")
            except UpstreamError as exc:
                await nodes.request_failed(exc)
                last = exc
                continue
            return Response(resp.content, resp.status_code, media_type="application/json")
        if last is not None:
            raise last.to_router_error("prefill")
        raise RouterError(503, "no prefill node is up")

    async def health(request: Request) -> Response:
        await nodes.check_all()
        described = nodes.describe()
        up = {role: any(n["up"] for n in described if n["role"] == role)
              for role in ("prefill", "decode")}
        ok = all(up.values())
        everything = all(n["up"] for n in described)
        status = "ok" if everything else ("degraded" if ok else "unavailable")
        return json_response({"status": status, "nodes": described}, 200 if ok else 503)

    async def prometheus(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def kv_report(request: Request) -> Response:
        try:
            payload = json.loads(await body_of(request))
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise ClientError("report body is not JSON") from None
        if not isinstance(payload, dict) or not isinstance(payload.get("turn_id"), str):
            raise ClientError("report needs a string turn_id", "turn_id")
        outcome = await reports.accept_report(payload)
        return json_response({"outcome": outcome})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loop_task = asyncio.create_task(nodes.run_health_loop(), name="kvrelay-health")
        try:
            yield
        finally:
            loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop_task
            await upstream.aclose()
            await store.aclose()

    routes = [
        Route("/v1/chat/completions", counted("/v1/chat/completions", generation("chat")),
              methods=["POST"]),
        Route("/v1/completions", counted("/v1/completions", generation("completions")),
              methods=["POST"]),
        Route("/v1/models", counted("/v1/models", models), methods=["GET"]),
        Route("/health", counted("/health", health), methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/stats", counted("/stats", stats_handler(ctx, auth)), methods=["GET"]),
        Route("/internal/kv-report", counted("/internal/kv-report", kv_report),
              methods=["POST"]),
        *admin_routes(ctx, auth, counted),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[Middleware(Guard, state=guard, metrics=metrics)],
        exception_handlers={HTTPException: http_error},
    )
    app.state.router = ctx
    app.state.guard = guard
    return app


def _redis_store(
    config: RouterConfig, clock: Callable[[], float], metrics: RouterMetrics
) -> ConversationStore:
    from kvrelay.router.store_redis import RedisStore

    assert config.state is not None
    return RedisStore.from_url(
        config.state,
        timeout_s=config.state_timeout_ms / 1000.0,
        deployment=config.deployment,
        clock=clock,
        expired_retention_s=config.expired_retention_s,
        on_error=lambda op: metrics.state_errors.labels(op).inc(),
    )


def serve(config: RouterConfig, **uvicorn_options: Any) -> None:
    """Run the router with uvicorn on ``config.host:config.port`` until SIGTERM/SIGINT,
    then drain and return (blocking; see ``router.server``). ``kvrelay route`` and
    ``python -m kvrelay.cli route`` call this."""
    from kvrelay.router.server import serve as serve_router

    serve_router(config, **uvicorn_options)
