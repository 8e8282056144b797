"""Every endpoint but generation: health, metrics, models, stats, admin, D's reports.

Who sees what (docs/security.md):

* ``GET /health`` – anyone: liveness only, ``{"status": "ok" | "degraded" | "unavailable"}``
  from the last known node states (200 while at least one P and one D are up, else 503).
  It never calls a node: only the health loop and real request failures change states.
* ``GET /metrics`` – Prometheus (node ids, no request content). With ``metrics_key`` set it
  needs that key or the admin key (401 otherwise); without one it is open but leaves out
  the request-size series (``metrics.SIZE_SERIES``), which only the admin key gets. Not on
  the public listener at all with ``metrics_listener = "internal"``; always, complete, on
  the internal listener.
* ``GET /v1/models`` – client key; answered by the first up P, a model's ``root`` and
  ``parent`` that name a path on P's disk (vLLM's: a model loaded from a directory) replaced
  by its id.
* ``POST /v1/messages/count_tokens`` – client key; the body checked as a Messages request
  (``apis.messages``) within the count limits (``request_limits``), with an in-flight slot
  like a generation request, answered by the least loaded P; errors in Anthropic's shape.
* ``GET /stats`` – client key: the nodes (up, drained), the guard mode per node, and
  the caller's own tenant's decision counts, pending reports and recent turns (keys
  hashed). The admin key (or an open router) sees every tenant's, the nodes' load and
  learned costs, and the index's size.
* ``GET /admin/nodes`` – admin key: URLs, engine ids, side channels, capabilities and the
  kind of each node's last error. ``POST /admin/nodes/{id}/drain``/``undrain``: stop or
  resume routing new turns to a node. ``POST /admin/conversations/drop`` with
  ``{"tenant"?, "conversation_id", "user"?, "safety_identifier"?, "cache_salt"?}``: forget
  the entries of one explicit conversation id (of that end user and salt, as its requests
  sent them).
  Without an admin key these routes do not exist (404); no/wrong key 401, a tenant's 403.
* ``POST /internal/kv-report`` – only on the internal listener: D's reports, at most
  ``core.report.MAX_REPORT_BYTES``, each checked against its turn (``commit``).
* ``POST /internal/kv-retention/<token>`` (``core.retention_sync.RETENTION_PATH``) – only
  on the internal listener: D's retention syncs, at most ``MAX_SYNC_BYTES``, at the URL the
  router gave that D (``RetentionDesk.url_for``), answered with the release orders for that
  D (``router.retention``). ``/stats`` shows each D's numbers under
  ``retention``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from kvrelay.core.identity import scope_of
from kvrelay.core.report import MAX_REPORT_BYTES
from kvrelay.core.retention_sync import MAX_SYNC_BYTES, RETENTION_PATH, encode
from kvrelay.router.apis.messages import MessagesAdapter
from kvrelay.router.asgi import Request, Route, read_body, send_response
from kvrelay.router.errors import ClientError, RouterError, dumps
from kvrelay.router.index import IndexUnavailable
from kvrelay.router.metrics import CONTENT_TYPE
from kvrelay.router.request import PARSE_INLINE_BYTES, load_body
from kvrelay.router.state import RouterContext
from kvrelay.router.upstream import UpstreamError

MESSAGES = MessagesAdapter()
ROOT_BODY = b'{"object":"kvrelay.router"}'
"""What ``GET /`` answers: only that this is kvrelay's router listening."""
Endpoint = Callable[[Request], Awaitable[bytes]]
Handler = Callable[[Request], Awaitable[None]]


def _without_paths(raw: bytes) -> bytes:
    """P's ``/v1/models`` answer with each model's ``root`` / ``parent`` that is a path on
    P's disk replaced by the model's id (a client needs the id; the path tells it P's
    filesystem layout and user); anything not in vLLM's shape is passed on as it came."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return raw
    models = body.get("data") if isinstance(body, dict) else None
    if not isinstance(models, list):
        return raw
    for model in models:
        if not isinstance(model, dict):
            continue
        for key in ("root", "parent"):
            value = model.get(key)
            if isinstance(value, str) and (value.startswith(("/", "~", "./", "../"))
                                           or value[1:3] in (":\\", ":/")):
                model[key] = model.get("id")
    return dumps(body)


def _counted(
    ctx: RouterContext, name: str, handler: Endpoint,
    render: Callable[[ClientError | RouterError], bytes] | None = None,
) -> Handler:
    """Run ``handler`` (which returns a JSON body), answering errors as OpenAI JSON (or as
    ``render`` makes them)."""

    async def handle(request: Request) -> None:
        status, headers = 200, {}
        try:
            body = await handler(request)
        except (ClientError, RouterError) as exc:
            status, headers = exc.status, exc.headers
            body = exc.body() if render is None else render(exc)
        await send_response(request.send, status, body, headers=headers)
        ctx.metrics.request_done(name, status)

    return handle


def public_routes(ctx: RouterContext) -> list[Route]:
    config, auth = ctx.config, ctx.auth

    async def health(request: Request) -> bytes:
        has_p, has_d = ctx.nodes.available()
        everything = all(s.up for s in ctx.nodes.states()) and not ctx.nodes.drained()
        if not (has_p and has_d):
            raise RouterError(503, "unavailable", body={"status": "unavailable"})
        return dumps({"status": "ok" if everything else "degraded"})

    async def models(request: Request) -> bytes:
        auth.tenant(request.headers)
        last: UpstreamError | None = None
        for node in config.prefill:
            if not ctx.nodes.is_up(node.node_id):
                continue
            try:
                answer = await ctx.upstream.get(node, "/v1/models")
            except UpstreamError as exc:
                await ctx.nodes.request_failed(exc)
                last = exc
                continue
            if answer.status != 200:
                continue
            return _without_paths(answer.body)
        if last is not None:
            raise last.to_router_error("prefill")
        raise RouterError(503, "no prefill node is up")

    def check_count_body(raw: bytes) -> None:
        body = load_body(raw, config.request_limits)
        if "kv_transfer_params" in body:
            raise ClientError("kv_transfer_params is reserved for the router",
                              "kv_transfer_params")
        MESSAGES.parse(body)

    async def count_tokens(request: Request) -> bytes:
        """As costly for P as a prefill's rendering, so held to what a generation request
        is: the count limits, a large body parsed off the event loop, an in-flight slot
        (probe 12, finding G1: 150,000 messages were counted, stalling the loop 1.4 s)."""
        tenant = auth.tenant(request.headers)
        raw = await read_body(request, config.max_body_bytes, config.body_timeout_s,
                              ctx.admission.bodies)
        ctx.admission.admit(tenant)
        try:
            if len(raw) <= PARSE_INLINE_BYTES:
                check_count_body(raw)
            else:
                await asyncio.to_thread(check_count_body, raw)
            node = ctx.nodes.choose_prefill()
            if node is None:
                raise RouterError(503, "no prefill node is up and not drained")
            try:
                return await ctx.upstream.post(node, "/v1/messages/count_tokens", raw)
            except UpstreamError as exc:
                await ctx.nodes.request_failed(exc)
                raise exc.to_router_error("prefill") from exc
        finally:
            ctx.admission.release(tenant)

    async def stats(request: Request) -> bytes:
        viewer = auth.viewer(request.headers)
        out: dict[str, object] = {
            "guard": {"mode": config.guard, "nodes": {
                n.node_id: ctx.nodes.guard_mode(n.node_id) for n in config.nodes}},
            "nodes": ctx.nodes.describe(admin=viewer is None and auth.is_admin(request.headers),
                                        load=viewer is None),
        }
        if viewer is None:  # every tenant's: not a tenant's to see
            out["conversations"] = {"live": len(ctx.index)}
            out["retention"] = ctx.retention.snapshot()
        out["pending_reports"] = ctx.desk.pending_of(viewer)
        out["decisions"] = ctx.stats.snapshot(viewer)
        return dumps(out)

    async def metrics(request: Request) -> None:
        allowed = auth.reads_metrics(request.headers)
        if auth.metrics_locked and not allowed:
            exc = ClientError("Missing or invalid metrics key: send 'Authorization: Bearer "
                              "<metrics key>'", status=401, headers={"WWW-Authenticate": "Bearer"})
            await send_response(request.send, exc.status, exc.body(), headers=exc.headers)
            return
        await send_response(request.send, 200, ctx.metrics.render(sizes=allowed),
                            CONTENT_TYPE.encode())

    async def root(request: Request) -> None:
        """``GET /`` / ``HEAD /``: the listener answers (Claude Code probes ``HEAD /``
        before its first request); nothing about the nodes (that is ``/health``)."""
        await send_response(request.send, 200, b"" if request.method == "HEAD" else ROOT_BODY)
        ctx.metrics.request_done("/", 200)

    routes = [
        Route("/", frozenset({"GET", "HEAD"}), root),
        Route("/health", frozenset({"GET"}), _counted(ctx, "/health", health)),
        Route("/v1/models", frozenset({"GET"}), _counted(ctx, "/v1/models", models)),
        Route("/stats", frozenset({"GET"}), _counted(ctx, "/stats", stats)),
        Route("/v1/messages/count_tokens", frozenset({"POST"}),
              _counted(ctx, "/v1/messages/count_tokens", count_tokens, MESSAGES.error)),
    ]
    if config.metrics_listener == "public":
        routes.append(Route("/metrics", frozenset({"GET"}), metrics))
    if auth.admin_enabled:
        routes.extend(_admin_routes(ctx))
    return routes


def _admin_routes(ctx: RouterContext) -> list[Route]:
    config, auth = ctx.config, ctx.auth

    async def nodes(request: Request) -> bytes:
        auth.require_admin(request.headers)
        return dumps({"nodes": ctx.nodes.describe(admin=True)})

    def drain(on: bool) -> Endpoint:
        async def handle(request: Request) -> bytes:
            auth.require_admin(request.headers)
            node_id = request.path.split("/")[3]
            try:
                await ctx.index.set_drained(node_id, on)  # the other replicas' too
            except IndexUnavailable:
                raise RouterError(503, "the shared state did not answer: nothing drained "
                                       "(try again)") from None
            ctx.nodes.set_drained(node_id, on)
            return dumps({"node": node_id, "drained": on})

        return handle

    async def drop(request: Request) -> bytes:
        auth.require_admin(request.headers)
        raw = await read_body(request, config.max_body_bytes, config.body_timeout_s)
        try:
            body: Any = msgspec.json.decode(raw)
        except (msgspec.DecodeError, RecursionError):
            raise ClientError("body is not JSON") from None
        if not isinstance(body, dict):
            raise ClientError("body must be a JSON object")
        conversation_id = body.get("conversation_id")
        tenant = body.get("tenant", auth.default_tenant)
        if not isinstance(conversation_id, str) or not conversation_id:
            raise ClientError("conversation_id must be a non-empty string", "conversation_id")
        if not isinstance(tenant, str) or not tenant:
            raise ClientError("tenant must be a non-empty string", "tenant")
        for name in ("user", "safety_identifier", "cache_salt"):
            if body.get(name) is not None and not isinstance(body[name], str):
                raise ClientError(f"{name} must be a string", name)
        dropped = pending = 0
        for bound in (False, True):  # the id as a client sent it, and as a gateway set it
            scope = scope_of(tenant, conversation_id, bound=bound, user=body.get("user"),
                             safety_identifier=body.get("safety_identifier"),
                             cache_salt=body.get("cache_salt"))
            pending += ctx.desk.flush_scope(scope)  # turns under way: dropped as they commit
            dropped += await ctx.index.drop_scope(scope)
        if dropped:
            ctx.metrics.dropped.labels("admin").inc(dropped)
        return dumps({"dropped": dropped + pending > 0, "entries": dropped,
                      "turns_under_way": pending})

    routes = [Route("/admin/nodes", frozenset({"GET"}), _counted(ctx, "/admin/nodes", nodes))]
    for node in config.nodes:
        for verb, on in (("drain", True), ("undrain", False)):
            routes.append(Route(f"/admin/nodes/{node.node_id}/{verb}", frozenset({"POST"}),
                                _counted(ctx, f"/admin/{verb}", drain(on))))
    routes.append(Route("/admin/conversations/drop", frozenset({"POST"}),
                        _counted(ctx, "/admin/conversations/drop", drop)))
    return routes


def internal_routes(ctx: RouterContext) -> list[Route]:
    async def kv_report(request: Request) -> bytes:
        raw = await read_body(request, MAX_REPORT_BYTES, ctx.config.body_timeout_s)
        outcomes = await ctx.desk.accept_reports(raw)
        return dumps({"outcome": outcomes[0]} if len(outcomes) == 1 else {"outcomes": outcomes})

    async def retention(request: Request) -> bytes:
        raw = await read_body(request, MAX_SYNC_BYTES, ctx.config.body_timeout_s)
        token = request.path[len(RETENTION_PATH) + 1:]  # "" for the bare path
        return encode(await ctx.retention.accept(raw, token))

    async def health(request: Request) -> bytes:
        return dumps({"status": "ok"})

    async def metrics(request: Request) -> None:
        await send_response(request.send, 200, ctx.metrics.render(), CONTENT_TYPE.encode())

    return [
        Route("/metrics", frozenset({"GET"}), metrics),
        Route("/internal/kv-report", frozenset({"POST"}),
              _counted(ctx, "/internal/kv-report", kv_report)),
        Route(RETENTION_PATH, frozenset({"POST"}), _counted(ctx, RETENTION_PATH, retention)),
        Route(RETENTION_PATH + "/", frozenset({"POST"}),
              _counted(ctx, RETENTION_PATH, retention), prefix=True),
        Route("/health", frozenset({"GET"}), _counted(ctx, "/internal/health", health)),
    ]
