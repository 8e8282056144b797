"""Diagnostics and admin endpoints, scoped by ``router.auth``.

* ``GET /stats``: open when no API key is configured; otherwise a tenant's key sees only its
  own tenant's ``recent`` decisions (keys hashed, as always), the admin key sees all. Counts
  (``by_action``, ``by_reason``, ``conversations.live``) are aggregates and reveal no ids.
* ``POST /admin/nodes/{node_id}/drain`` and ``.../undrain``: stop / resume routing new turns
  to a node (``NodeRegistry.set_drained``); entries it holds stay pullable until they expire.
* ``POST /admin/conversations/drop`` with ``{"tenant"?, "conversation_id"}``: forget one
  conversation's entry (its next turn recomputes, ``no_entry``).

The ``/admin/*`` routes exist only when an admin key is configured (else 404, like any
unknown path) and answer 401 without a valid key, 403 for a tenant's key.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvrelay.core.conversation import ConversationKey
from kvrelay.router.auth import Authenticator
from kvrelay.router.errors import ClientError, error_response, json_response
from kvrelay.router.limits import read_body
from kvrelay.router.state import RouterContext

Handler = Callable[[Request], Awaitable[Response]]


def stats_handler(ctx: RouterContext, auth: Authenticator) -> Handler:
    async def stats(request: Request) -> Response:
        viewer = auth.viewer(request.headers)
        decisions = ctx.stats.snapshot()
        if viewer is not None:
            decisions["recent"] = [r for r in decisions["recent"] if r.get("tenant") == viewer]
        return json_response({
            "nodes": ctx.nodes.describe(),
            "conversations": {"live": len(ctx.store)},
            "pending_reports": len(ctx.reports),
            "decisions": decisions,
        })

    return stats


def admin_routes(
    ctx: RouterContext, auth: Authenticator, counted: Callable[[str, Handler], Handler]
) -> list[Route]:
    """The ``/admin/*`` routes, or none without an admin key."""
    if not auth.admin_enabled:
        return []
    config = ctx.config

    def drain(on: bool) -> Handler:
        async def handle(request: Request) -> Response:
            auth.require_admin(request.headers)
            node_id = request.path_params["node_id"]
            if node_id not in {n.node_id for n in config.nodes}:
                raise ClientError("unknown node", "node_id", status=404)
            ctx.nodes.set_drained(node_id, on)
            return json_response({"node": node_id, "drained": on})

        return handle

    async def drop(request: Request) -> Response:
        auth.require_admin(request.headers)
        raw = await read_body(request, config.max_body_bytes, config.body_timeout_s)
        try:
            body: Any = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise ClientError("body is not JSON") from None
        if not isinstance(body, dict):
            raise ClientError("body must be a JSON object")
        conversation_id = body.get("conversation_id")
        tenant = body.get("tenant", auth.default_tenant)
        if not isinstance(conversation_id, str) or not conversation_id:
            raise ClientError("conversation_id must be a non-empty string", "conversation_id")
        if not isinstance(tenant, str) or not tenant:
            raise ClientError("tenant must be a non-empty string", "tenant")
        dropped = await ctx.store.drop(ConversationKey(tenant, conversation_id))
        if dropped:
            ctx.metrics.dropped.labels("admin").inc()
        return json_response({"dropped": dropped})

    return [
        Route("/admin/nodes/{node_id}/drain", counted("/admin/drain", drain(True)),
              methods=["POST"]),
        Route("/admin/nodes/{node_id}/undrain", counted("/admin/undrain", drain(False)),
              methods=["POST"]),
        Route("/admin/conversations/drop", counted("/admin/conversations/drop", drop),
              methods=["POST"]),
    ]


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (unknown path 404, wrong method 405) as OpenAI error JSON."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    headers = (exc.headers if isinstance(exc, HTTPException) else None) or {}
    message = {404: "Not found", 405: "Method not allowed"}.get(status, "HTTP error")
    response = error_response(status, message)
    response.headers.update(headers)
    return response
