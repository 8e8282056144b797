"""A generation request, top to bottom: handler -> plan -> P -> D -> commit.

1. Authenticate (401), take an in-flight slot for the tenant (429, 503 while draining),
   read and validate the body (``request.parse_request``; 4xx, never 5xx, for bad input,
   and beyond ``request_limits``). A body over ``PARSE_INLINE_BYTES`` is parsed in a worker
   thread: the event loop keeps serving other clients meanwhile (the interpreter switches
   threads every few ms) instead of stalling for the whole parse.
2. Plan (``plan.Planner``): the entry the request continues, the decision, the claim.
3. P (``prefill.Prefiller``) unless the turn goes ``direct``.
4. D (``decode.Decoder``): the answer goes to the client; the entry's halves go to the
   report desk (``commit.ReportDesk``), which commits it when D's params are in.

Retries follow ``core.consequences``: a D that failed before the client saw a byte is
replaced once by another D, with P's params again only if D provably never started, else
after P computed afresh; a direct turn whose D failed goes P -> another D. A client that
disconnects cancels the turn (and the node requests it awaits) wherever it is.
"""

from __future__ import annotations

import asyncio
import logging

from kvrelay.core.consequences import decode_retry
from kvrelay.core.params import DIRECT_PARAMS
from kvrelay.router.apis import ADAPTERS
from kvrelay.router.asgi import DisconnectWatch, Request, Route, read_body, send_response
from kvrelay.router.commit import PendingTurn
from kvrelay.router.decode import BeforeFirstByte, Decoder
from kvrelay.router.errors import ClientError, RouterError
from kvrelay.router.plan import Planner
from kvrelay.router.prefill import Prefiller
from kvrelay.router.request import PARSE_INLINE_BYTES, parse_request
from kvrelay.router.state import RouterContext
from kvrelay.router.stored_responses import RESPONSES_PREFIX, ResponseRoutes, StoredResponses
from kvrelay.router.turn import Turn
from kvrelay.router.turnlog import TurnLogWriter

log = logging.getLogger("kvrelay.router")

class GenerationHandler:
    """The generation endpoints (one per API adapter, ``router.apis``) of one router app;
    every error it answers is in the endpoint's API shape (``ApiAdapter.error``)."""

    def __init__(self, ctx: RouterContext) -> None:
        self._ctx = ctx
        self._limits = ctx.config.request_limits
        self._id_rules = ctx.config.id_rules
        self._planner = Planner(ctx)
        self._prefiller = Prefiller(ctx)
        self._decoder = Decoder(ctx)
        self._stored = StoredResponses(
            ctx.responses, rules=self._id_rules, limits=self._limits,
            max_body_bytes=ctx.config.max_body_bytes, inline_bytes=PARSE_INLINE_BYTES,
            on_error=lambda op: ctx.metrics.state_errors.labels(op).inc(),
        ) if ctx.responses is not None else None

    def route(self, endpoint: str) -> RouteHandler:
        return RouteHandler(self, endpoint)

    def stored_routes(self) -> list[Route]:
        """``GET`` / ``DELETE /v1/responses/{id}`` when the response store is on."""
        if self._stored is None:
            return []
        return [Route(RESPONSES_PREFIX, frozenset({"GET", "DELETE"}),
                      ResponseRoutes(self._stored, self._ctx.auth,
                                     self._ctx.metrics.request_done), prefix=True)]

    async def handle(self, request: Request, endpoint: str) -> None:
        ctx = self._ctx
        path = request.path
        try:
            tenant = ctx.auth.tenant(request.headers)
            raw = await read_body(request, ctx.config.max_body_bytes,
                                  ctx.config.body_timeout_s, ctx.admission.bodies)
            ctx.admission.admit(tenant)
        except ClientError as exc:
            await _answer_error(request, endpoint, exc)
            ctx.metrics.request_done(path, exc.status)
            return
        status = 500  # what escapes the turn unanswered is a crash, and is counted as one
        try:
            status = await self._turn(request, endpoint, tenant, raw)
        finally:
            ctx.admission.release(tenant)
            ctx.metrics.request_done(path, status)

    async def _turn(self, request: Request, endpoint: str, tenant: str, raw: bytes) -> int:
        """Serve one turn (its body ``raw`` read); returns the status answered."""
        ctx = self._ctx
        turn: Turn | None = None
        try:
            if self._stored is not None and endpoint == "responses":
                req = await self._stored.request(raw, request.headers, tenant)
            else:
                args = (endpoint, raw, request.headers, tenant, self._id_rules, self._limits)
                req = (parse_request(*args) if len(raw) <= PARSE_INLINE_BYTES
                       else await asyncio.to_thread(parse_request, *args))
        except (ClientError, RouterError) as exc:
            await _answer_error(request, endpoint, exc)
            return exc.status
        watch = DisconnectWatch(request)
        ctx.admission.opened(watch)
        try:
            turn = await self._planner.plan(req)
            await self._carry_out(turn, request, watch)
            return 200
        except RouterError as exc:
            if turn is not None:
                turn.finish(f"error_{exc.status}")
            watch.stop()
            await _answer_error(request, endpoint, exc)
            return exc.status
        except asyncio.CancelledError:
            if not watch.cancelled_us:
                raise
            _uncancel()
            if turn is not None:
                turn.finish("client_gone" if watch.gone else "cut")
            if watch.was_cut and not watch.gone:
                order = watch.cut_order
                cut = RouterError(order.status, order.message)
                cut.headers = {"Connection": "close"}  # the server closes; no Retry-After
                await _answer_error(request, endpoint, cut)
                return order.status
            return 499
        finally:
            ctx.admission.closed(watch)
            await watch.aclose()
            if turn is not None:
                ctx.metrics.decided(*turn.effective)
                ctx.stats.count(turn)
                if ctx.turn_log is not None:
                    self._log(turn, ctx.turn_log)

    async def _carry_out(self, turn: Turn, request: Request, watch: DisconnectWatch) -> None:
        ctx = self._ctx
        send = request.send
        exclude: frozenset[str] = frozenset()
        if turn.decision.action == "direct":
            assert turn.found is not None
            holder = ctx.nodes.config(turn.found.entry.decode_node_id)
            try:
                await self._decoder.run(turn, holder, DIRECT_PARAMS, send, watch)
                return
            except BeforeFirstByte as failed:
                if failed.error.client_fault:
                    raise failed.error.to_router_error("decode") from failed
                self._retried(turn, "decode")
                exclude = frozenset({holder.node_id})
                turn.refused = "decode_failed"  # P recomputes it: reported as what happened
        pulled = turn.decision.action == "pull"
        pre = await self._prefiller.run(turn, pull=pulled)
        # a pull frees the conversation's retained turn on its D, whose prefix cache then
        # finds it: that D needs that much less room
        held = turn.found.entry.num_tokens if pulled and turn.found is not None else 0
        for attempt in (0, 1):
            node = ctx.nodes.choose_decode(turn.affinity, exclude,
                                           needed_tokens=turn.prompt_tokens + 1,
                                           room=ctx.retention.room_tokens,
                                           affinity_held_tokens=held)
            if node is None:
                raise RouterError(503, "no decode node is up and not drained")
            try:
                await self._decoder.run(turn, node, pre.params, send, watch)
                return
            except BeforeFirstByte as failed:
                error = failed.error
                retry = decode_retry(error.kind, error.status, attempt)
                if retry == "none" or ctx.nodes.choose_decode(None, exclude | {node.node_id}) \
                        is None:
                    raise error.to_router_error("decode") from failed
                self._retried(turn, "decode")
                exclude = exclude | {node.node_id}
                if retry == "fresh_prefill":
                    if turn.refused is None and turn.decision.action == "pull":
                        turn.refused = "decode_failed"  # the pull was spent: P recomputes
                    pre = await self._prefiller.run(turn, pull=False)
        raise AssertionError("unreachable")

    @staticmethod
    def _log(turn: Turn, writer: TurnLogWriter) -> None:
        """Append the turn's record once its entry is settled (what D retains is known)."""
        def write(p: PendingTurn | None) -> None:
            blocks = p.blocks if p is not None and p.outcome == "committed" else None
            writer.append(turn.log_record(blocks.num_tokens if blocks is not None else None))

        pending = turn.pending
        if pending is not None and pending.outcome is None:
            pending.on_settle.append(write)
        else:
            write(pending)

    def _retried(self, turn: Turn, role: str) -> None:
        self._ctx.metrics.retries.labels(role).inc()
        turn.retries += 1


class RouteHandler:
    """The ``asgi.Handler`` of one endpoint."""

    __slots__ = ("_endpoint", "_handler")

    def __init__(self, handler: GenerationHandler, endpoint: str) -> None:
        self._handler = handler
        self._endpoint = endpoint

    async def __call__(self, request: Request) -> None:
        await self._handler.handle(request, self._endpoint)


async def _answer_error(
    request: Request, endpoint: str, exc: ClientError | RouterError
) -> None:
    body = ADAPTERS[endpoint].error(exc)
    await send_response(request.send, exc.status, body, headers=exc.headers)


def _uncancel() -> None:
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
