"""Relaying a streamed D response: first event before answering, then chunk by chunk.

``start_stream`` reads D's first SSE event before the client gets a status line, so a D
that dies before sending anything can still be retried (``BeforeFirstByte``). After that
every event is forwarded as soon as it arrives (internal fields stripped, token ids
collected); a D failure mid-stream becomes ``data: {"error": ...}`` and ``data: [DONE]`` and
drops the conversation's entry. The client's ``[DONE]`` goes out as soon as D's arrives;
the entry is committed later, when D's report is in (``reports``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from starlette.responses import Response

from kvrelay.router.config import NodeConfig
from kvrelay.router.reports import PendingTurn
from kvrelay.router.state import RouterContext
from kvrelay.router.streaming import (
    SSE_DONE,
    Collected,
    ManagedStreamingResponse,
    relay_chunk,
    sse_data,
    sse_error,
)
from kvrelay.router.turns import Turn
from kvrelay.router.upstream import UpstreamError, UpstreamStream


class BeforeFirstByte(Exception):
    """D failed before the client saw anything: the turn may be retried."""

    def __init__(self, error: UpstreamError) -> None:
        super().__init__(str(error))
        self.error = error


def decision_headers(turn: Turn) -> dict[str, str]:
    """``X-KVRelay-Action`` / ``-Reason`` / ``-Reused-Tokens``: what the router did with the
    turn (reused tokens as P reported them: 0 when P recomputed after all)."""
    return {
        "X-KVRelay-Action": turn.decision.action,
        "X-KVRelay-Reason": turn.decision.reason,
        "X-KVRelay-Reused-Tokens": str(int(turn.record.get("reused_tokens") or 0)),
    }


def turn_done(ctx: RouterContext, turn: Turn, outcome: str) -> None:
    """Record the turn's outcome and duration once (the first call wins)."""
    if turn.record.get("outcome") is not None:
        return
    turn.record["outcome"] = outcome
    ctx.metrics.turn_seconds.labels(
        turn.decision.action, "true" if turn.req.stream else "false"
    ).observe(time.perf_counter() - turn.started_s)


def learn_decode_engine(ctx: RouterContext, node: NodeConfig, params: object) -> None:
    """Note D's engine id from retained params it returned (a new id: D restarted)."""
    if isinstance(params, dict):
        engine = params.get("remote_engine_id")
        if isinstance(engine, str) and params.get("do_remote_decode") is True:
            ctx.nodes.observe_engine(node.node_id, engine)


async def lose_entry(
    ctx: RouterContext, turn: Turn, pending: PendingTurn | None, reason: str
) -> None:
    """The turn failed after the first byte: no entry for it, and drop the older one."""
    if pending is not None:
        ctx.reports.fail(pending, reason)
    if turn.req.key is not None and await ctx.store.drop(turn.req.key):
        ctx.metrics.dropped.labels("turn_failed").inc()


async def start_stream(
    ctx: RouterContext,
    turn: Turn,
    node: NodeConfig,
    stream: UpstreamStream,
    pending: PendingTurn | None,
    stack: contextlib.ExitStack,
) -> Response:
    """Read D's first event before answering, so a D that dies before sending anything
    is retried instead of leaving the client with an empty stream."""
    events = sse_data(stream.lines())
    failure: UpstreamError | None = None
    try:
        first = await anext(events)
    except StopAsyncIteration:
        failure = UpstreamError(node.node_id, "closed", "stream ended before any event")
    except UpstreamError as exc:
        failure = exc
    if failure is not None:
        await stream.aclose()
        stack.close()
        if pending is not None:
            ctx.reports.fail(pending, "failed")
        await ctx.nodes.request_failed(failure)
        raise BeforeFirstByte(failure)
    got = Collected() if pending is not None else None

    async def cleanup() -> None:
        await stream.aclose()
        stack.close()
        if pending is not None and pending.response_done_s is None:
            ctx.reports.fail(pending, "client_gone")
        turn_done(ctx, turn, "client_gone")

    body = _relay(ctx, turn, node, first, events, got, pending)
    return ManagedStreamingResponse(body, cleanup, headers=decision_headers(turn))


async def _relay(
    ctx: RouterContext,
    turn: Turn,
    node: NodeConfig,
    first: str,
    events: AsyncIterator[str],
    got: Collected | None,
    pending: PendingTurn | None,
) -> AsyncIterator[bytes]:
    """D's events to the client as they come. After the first byte a D failure becomes
    an SSE error event and ``[DONE]``; the turn's entry is dropped."""
    keep = turn.req.wants_token_ids
    action = turn.decision.action
    try:
        out = relay_chunk(first, got, keep_token_ids=keep)
        ctx.metrics.ttft.labels(action).observe(time.perf_counter() - turn.started_s)
        if out is SSE_DONE:
            raise UpstreamError(node.node_id, "protocol", "stream had no content")
        yield out
        async for data in events:
            out = relay_chunk(data, got, keep_token_ids=keep)
            if out is SSE_DONE:
                break
            yield out
        else:
            raise UpstreamError(node.node_id, "closed", "stream ended without [DONE]")
    except UpstreamError as exc:
        await ctx.nodes.request_failed(exc)
        await lose_entry(ctx, turn, pending, "failed")
        turn_done(ctx, turn, "failed_mid_stream")
        yield sse_error(502, f"decode node {node.node_id} failed mid-stream: {exc.message}")
        yield SSE_DONE
        return
    if got is not None:
        learn_decode_engine(ctx, node, got.kv_transfer_params)
    if got is not None and got.error is not None:
        ctx.metrics.upstream_errors.labels(node.node_id, "error_event").inc()
        await lose_entry(ctx, turn, pending, "error_event")
        turn_done(ctx, turn, "error_event")
    else:
        if pending is not None and got is not None:
            await ctx.reports.response_finished(
                pending,
                prompt_token_ids=got.prompt_token_ids,
                generated_token_ids=got.generated_token_ids,
                params=got.kv_transfer_params,
            )
        turn_done(ctx, turn, "ok")
    yield SSE_DONE
    await _drain(events)


async def _drain(events: AsyncIterator[str], max_events: int = 16) -> None:
    """Read the end of D's response after ``[DONE]`` (normally nothing but the end of the
    chunked body), so its keep-alive connection returns to the pool: closing a response
    that was not read to the end closes the connection."""
    with contextlib.suppress(UpstreamError, StopAsyncIteration):
        for _ in range(max_events):
            await anext(events)
