"""Per-turn orchestration, part 2: carrying a decided ``Turn`` out on P and D.

* ``pull`` / ``recompute``: P computes one token with ``kv_transfer_params`` (D's retained
  params capped to the verified prefix, or ``{"do_remote_decode": true}``); then D decodes
  the client's request with P's returned params.
* ``direct``: the whole turn goes to the D holding the conversation, which reuses its local
  prefix cache; nothing crosses NIXL.

Failures (before the client has seen a byte; afterwards see ``relay``):

* P fails (not a 4xx): retried once, as a recompute, on another P (the same one if it is the
  only P). A pull's entry stays consumed: D's blocks may already have been read.
* D fails: retried once on another D. If D provably never started (connection refused, or
  HTTP 503) P's params are reused; if D may have read P's blocks (timeout, broken connection,
  another error status: vLLM answers 500 after a failed KV read) P's params are spent, so P
  computes the turn again first (vLLM does not refuse a second read of freed blocks: it would
  silently read reused memory).
* 4xx from a node: passed through to the client with its status.
* A direct turn whose D fails falls back to P -> another D.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import Any

from starlette.responses import Response

from kvrelay.core.params import (
    KVParamsError,
    RemoteBlocks,
    parse_remote_blocks,
    request_remote_decode,
)
from kvrelay.router.bodies import decode_body, prefill_body
from kvrelay.router.config import NodeConfig
from kvrelay.router.errors import RouterError, json_response
from kvrelay.router.relay import (
    BeforeFirstByte,
    decision_headers,
    learn_decode_engine,
    start_stream,
    turn_done,
)
from kvrelay.router.reports import PendingTurn
from kvrelay.router.state import RouterContext
from kvrelay.router.streaming import Collected, collect, strip
from kvrelay.router.turns import Turn
from kvrelay.router.upstream import UpstreamError

_DIRECT_PARAMS: dict[str, object] = {"do_remote_prefill": False, "do_remote_decode": False}


@dataclass(frozen=True)
class Prefilled:
    """P's answer: the node and its params, rewritten for D to reach P's side channel."""

    node: NodeConfig
    params: dict[str, object]


class Forwarder:
    """Runs decided turns against the nodes of one router app."""

    def __init__(self, ctx: RouterContext) -> None:
        self._ctx = ctx

    async def run(self, turn: Turn) -> Response:
        if turn.decision.action == "direct":
            assert turn.entry is not None
            node = self._ctx.nodes.config(turn.entry.decode_node_id)
            try:
                return await self._decode_once(turn, node, _DIRECT_PARAMS, direct=True)
            except BeforeFirstByte as failed:
                if failed.error.client_fault:
                    raise failed.error.to_router_error("decode") from failed
                self._retried(turn, "decode")
                pre = await self._prefill(turn, pull=False)
                return await self._decode(turn, pre, frozenset({node.node_id}))
        pre = await self._prefill(turn, pull=turn.decision.action == "pull")
        return await self._decode(turn, pre, frozenset())

    # -- P ----------------------------------------------------------------------------------

    async def _prefill(self, turn: Turn, *, pull: bool) -> Prefilled:
        ctx = self._ctx
        node: NodeConfig | None = turn.prefill_node
        if not _up(ctx, turn.prefill_node):
            node = ctx.nodes.choose_prefill()
        if node is None:
            raise RouterError(503, "no prefill node is up")
        for attempt in (0, 1):
            params = self._pull_params(turn) if pull else request_remote_decode()
            try:
                return await self._prefill_once(turn, node, params, pull=pull)
            except UpstreamError as exc:
                await ctx.nodes.request_failed(exc)
                if exc.client_fault or attempt == 1:
                    raise exc.to_router_error("prefill") from exc
                self._retried(turn, "prefill")
                node = ctx.nodes.choose_prefill(frozenset({node.node_id})) or node
                pull = False
        raise AssertionError("unreachable")

    def _pull_params(self, turn: Turn) -> dict[str, object]:
        """D's retained params as the policy capped them (to the verified prefix, block list
        cut to match), addressed as P reaches D's side channel."""
        blocks = turn.decision.blocks_to_send
        assert blocks is not None and turn.entry is not None
        holder = self._ctx.nodes.config(turn.entry.decode_node_id)
        if holder.side_channel is not None:
            blocks = blocks.with_host(holder.side_channel.host, holder.side_channel.port)
        return blocks.to_json()

    async def _prefill_once(
        self, turn: Turn, node: NodeConfig, params: dict[str, object], *, pull: bool
    ) -> Prefilled:
        ctx = self._ctx
        body = prefill_body(turn.req, params)
        with ctx.nodes.busy(node.node_id, turn.prompt_tokens):
            started = time.perf_counter()
            data = await ctx.upstream.post_json(node, turn.req.path, body)
            seconds = time.perf_counter() - started
        raw = data.get("kv_transfer_params")
        try:
            blocks = parse_remote_blocks(raw)
        except KVParamsError as exc:
            raise UpstreamError(node.node_id, "protocol", f"P's params: {exc}") from exc
        if blocks.direction != "prefill_to_decode" or not isinstance(raw, dict):
            raise UpstreamError(node.node_id, "protocol", "P returned no prefill params")
        ctx.nodes.observe_engine(node.node_id, blocks.engine_id)
        self._learn(turn, node, blocks, data, seconds, pull=pull)
        turn.record["prefill_node"] = node.node_id
        out = dict(raw)
        if node.side_channel is not None:
            out["remote_host"] = node.side_channel.host
            if node.side_channel.port is not None:
                out["remote_port"] = node.side_channel.port
        return Prefilled(node, out)

    def _learn(
        self,
        turn: Turn,
        node: NodeConfig,
        blocks: RemoteBlocks,
        data: dict[str, object],
        seconds: float,
        *,
        pull: bool,
    ) -> None:
        """Update P's cost estimates and the reused/recomputed token counters."""
        ctx = self._ctx
        usage = data.get("usage")
        prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        n = prompt if isinstance(prompt, int) and prompt > 0 else turn.prompt_tokens
        cached = min(max(blocks.prefill_cached_tokens or 0, 0), n)
        costs = ctx.nodes.costs(node.node_id)
        if pull and cached > 0:
            prefill_s = costs.prefill_s(n - cached, context_tokens=cached)
            costs = replace(
                costs,
                transfer=costs.transfer.observe(
                    num_tokens=cached, seconds=max(0.0, seconds - prefill_s)
                ),
            )
        else:
            costs = replace(
                costs,
                prefill=costs.prefill.observe(
                    num_tokens=n - cached, context_tokens=cached, seconds=seconds
                ),
            )
        ctx.nodes.set_costs(node.node_id, costs)
        reused = cached if pull else 0
        ctx.metrics.prompt_tokens.labels("reused").inc(reused)
        ctx.metrics.prompt_tokens.labels("recomputed").inc(n - reused)
        turn.record["reused_tokens"] = reused

    # -- D ----------------------------------------------------------------------------------

    async def _decode(self, turn: Turn, pre: Prefilled, exclude: frozenset[str]) -> Response:
        ctx = self._ctx
        node = ctx.nodes.choose_decode(turn.affinity, exclude)
        for attempt in (0, 1):
            if node is None:
                raise RouterError(503, "no decode node is up")
            try:
                return await self._decode_once(turn, node, pre.params, direct=False)
            except BeforeFirstByte as failed:
                exc = failed.error
                if exc.client_fault or attempt == 1:
                    raise exc.to_router_error("decode") from failed
                exclude = exclude | {node.node_id}
                other = ctx.nodes.choose_decode(None, exclude)
                if other is None:
                    raise exc.to_router_error("decode") from failed
                self._retried(turn, "decode")
                if _params_spent(exc):
                    pre = await self._prefill(turn, pull=False)
                node = other
        raise AssertionError("unreachable")

    async def _decode_once(
        self, turn: Turn, node: NodeConfig, params: dict[str, object], *, direct: bool
    ) -> Response:
        ctx, req = self._ctx, turn.req
        pending: PendingTurn | None = None
        if req.key is not None:
            pending = ctx.reports.open(
                req.key,
                node.node_id,
                turn=turn.next_turn_number,
                ttl_s=node.ttl_s,
                block_size=node.block_size,
                fallback_prompt_ids=turn.prompt_token_ids,
            )
        body = decode_body(
            req,
            params,
            report_url=ctx.config.report_url if pending else None,
            turn_id=pending.turn_id if pending else None,
        )
        turn.record["decode_node"] = node.node_id
        if direct:
            turn.record["reused_tokens"] = turn.decision.reused_tokens
            ctx.metrics.prompt_tokens.labels("reused").inc(turn.decision.reused_tokens)
            ctx.metrics.prompt_tokens.labels("recomputed").inc(
                max(0, turn.prompt_tokens - turn.decision.reused_tokens)
            )
        d_prefill = max(0, turn.prompt_tokens - turn.decision.reused_tokens) if direct else 0
        stack = contextlib.ExitStack()
        stack.enter_context(ctx.nodes.busy(node.node_id, d_prefill))
        try:
            if not req.stream:
                with stack:
                    data = await ctx.upstream.post_json(node, req.path, body)
                return await self._finish_json(turn, node, data, pending)
            stream = await ctx.upstream.open_stream(node, req.path, body)
        except UpstreamError as exc:
            stack.close()
            if pending is not None:
                ctx.reports.fail(pending, "failed")
            await ctx.nodes.request_failed(exc)
            raise BeforeFirstByte(exc) from exc
        except BaseException:  # cancelled (client gone) or a bug: never leave it pending
            stack.close()
            if pending is not None and pending.response_done_s is None:
                ctx.reports.fail(pending, "cancelled")
            raise
        return await start_stream(ctx, turn, node, stream, pending, stack)

    async def _finish_json(
        self, turn: Turn, node: NodeConfig, data: dict[str, Any], pending: PendingTurn | None
    ) -> Response:
        ctx = self._ctx
        got = Collected()
        collect(data, got)
        learn_decode_engine(self._ctx, node, got.kv_transfer_params)
        if pending is not None:
            await ctx.reports.response_finished(
                pending,
                prompt_token_ids=got.prompt_token_ids,
                generated_token_ids=got.generated_token_ids,
                params=got.kv_transfer_params,
            )
        strip(data, keep_token_ids=turn.req.wants_token_ids)
        turn_done(self._ctx, turn, "ok")
        response = json_response(data)
        response.headers.update(decision_headers(turn))
        return response

    def _retried(self, turn: Turn, role: str) -> None:
        self._ctx.metrics.retries.labels(role).inc()
        turn.record["retries"] += 1

def _params_spent(exc: UpstreamError) -> bool:
    """Whether D may have read P's blocks, or tried and failed, so P's params must not be
    sent again: anything D received, except a 503 (an engine that is overloaded or not
    ready schedules nothing). vLLM answers 500 after a failed KV read
    (``kv_load_failure_policy=fail``), e.g. when P died after its answer."""
    return exc.sent and not (exc.kind == "status" and exc.status == 503)


def _up(ctx: RouterContext, node: NodeConfig) -> bool:
    state = ctx.nodes.state(node.node_id)
    return state is not None and state.up
