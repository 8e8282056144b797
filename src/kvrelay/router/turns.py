"""Per-turn orchestration, part 1: from a client request to a decided ``Turn``.

Steps (``decide``):

1. Validate the request (``bodies.parse_turn``; bad input is a 400, never a 500).
2. Pick the P (least outstanding prefill work). With a conversation id, get the prompt's
   exact engine token ids from that P's ``/tokenize`` (chat template included); skipped
   without an id. A P that cannot answer is replaced once by another.
3. If the conversation's previous turn is still waiting for its D report, wait for it, at
   most ``report_wait_s``.
4. ``core.policy.decide_turn`` on the stored entry, the holding D's state and P's costs.
   A store that cannot answer (``StoreUnavailable``, e.g. Redis down) makes the turn a
   recompute with reason ``state_unavailable``. An entry's engine id is shown to the node
   registry (``observe_entry``): with replicas it may be news of a D restart.
5. A ``pull`` atomically claims (consumes) the entry before P is ever called; losing the claim
   to a concurrent turn of the same conversation turns the decision into ``no_entry``.
   Entries the decision proves useless (``expired``, ``near_expiry``, ``node_down``,
   ``engine_restarted``) are dropped; ``engine_restarted`` also purges every other entry
   of the same dead engine (``store.drop_engine``): their turns will say ``no_entry``.

Part 2, carrying the decision out, is ``forward.Forwarder``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrelay.core.conversation import ConversationEntry
from kvrelay.core.policy import TurnDecision, decide_turn
from kvrelay.router.bodies import Endpoint, TurnRequest, parse_turn, tokenize_body
from kvrelay.router.config import NodeConfig
from kvrelay.router.errors import RouterError
from kvrelay.router.state import RouterContext
from kvrelay.router.store import StoreUnavailable
from kvrelay.router.upstream import UpstreamError

log = logging.getLogger("kvrelay.router")

#: Decisions after which the entry can never be used again.
_INVALIDATING = frozenset({"expired", "near_expiry", "node_down", "engine_restarted"})


@dataclass
class Turn:
    """A decided turn. ``entry`` is the entry the decision was made on (already claimed if
    the action is ``pull``); ``record`` is its ``/stats`` record, completed as it runs."""

    req: TurnRequest
    decision: TurnDecision
    prompt_token_ids: list[int] | None
    entry: ConversationEntry | None
    prefill_node: NodeConfig
    record: dict[str, Any]
    started_s: float = field(default_factory=time.perf_counter)

    @property
    def prompt_tokens(self) -> int:
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        return self.req.approx_prompt_tokens

    @property
    def next_turn_number(self) -> int:
        return self.entry.turn + 1 if self.entry is not None else 1

    @property
    def affinity(self) -> str | None:
        """The D that held this conversation's KV (preferred again: its prefix cache)."""
        return self.entry.decode_node_id if self.entry is not None else None


class TurnPlanner:
    """Decides turns for one router app (see the module docstring)."""

    def __init__(self, ctx: RouterContext) -> None:
        self._ctx = ctx

    async def decide(
        self,
        endpoint: Endpoint,
        raw: bytes,
        headers: Mapping[str, str],
        tenant: str | None = None,
    ) -> Turn:
        """``tenant`` (from the request's API key; default ``config.tenant``) scopes the
        conversation id."""
        started = time.perf_counter()
        ctx = self._ctx
        tenant = tenant or ctx.config.tenant
        req = parse_turn(endpoint, raw, headers, tenant)
        p = ctx.nodes.choose_prefill()
        if p is None:
            raise RouterError(503, "no prefill node is up")
        prompt_ids: list[int] | None = None
        entry: ConversationEntry | None = None
        state_down = False
        if req.key is not None:
            prompt_ids, p = await self._tokenize(req, p)
            if ctx.reports.is_pending(req.key):
                settled = await ctx.reports.wait_for(req.key, ctx.config.report_wait_s)
                if not settled:
                    log.info("turn of %s: previous report still pending", req.key.hashed())
            try:
                entry = await ctx.store.get(req.key)
            except StoreUnavailable:
                state_down = True
            if entry is not None:
                ctx.nodes.observe_entry(
                    entry.decode_node_id, entry.decode_engine_id, entry.created_at_s
                )
        if state_down:
            decision = TurnDecision("recompute", "state_unavailable")
        else:
            decision = self._decide(req, entry, prompt_ids or (), p)
        if decision.action == "pull":
            assert req.key is not None and entry is not None
            if not await ctx.store.claim(req.key, entry):
                log.info("turn of %s lost the claim to a concurrent turn", req.key.hashed())
                entry = None
                decision = self._decide(req, None, prompt_ids or (), p)
        elif (
            decision.reason in _INVALIDATING
            and req.key is not None
            and entry is not None
            and await ctx.store.drop(req.key, entry)
        ):
            if decision.reason == "expired":
                ctx.metrics.expirations.inc()
            else:
                ctx.metrics.dropped.labels(decision.reason).inc()
            if decision.reason == "engine_restarted":
                # every entry of that engine incarnation is gone on D: purge them all now
                stale = await ctx.store.drop_engine(entry.decode_node_id, entry.decode_engine_id)
                if stale:
                    ctx.metrics.dropped.labels("engine_restarted").inc(stale)
        ctx.metrics.decisions.labels(decision.action, decision.reason).inc()
        record = ctx.stats.record(
            at_s=ctx.clock(),
            key=req.key,
            decision=decision,
            endpoint=endpoint,
            stream=req.stream,
            prompt_tokens=len(prompt_ids) if prompt_ids is not None else req.approx_prompt_tokens,
        )
        record["tenant"] = tenant  # /stats shows a tenant only its own decisions
        if req.key is not None:
            log.debug(
                "turn %s: %s (%s), verified %d tokens",
                req.key.hashed(), decision.action, decision.reason, decision.verified_tokens,
            )
        return Turn(req, decision, prompt_ids, entry, p, record, started_s=started)

    def _decide(
        self,
        req: TurnRequest,
        entry: ConversationEntry | None,
        prompt_ids: Sequence[int],
        p: NodeConfig,
    ) -> TurnDecision:
        ctx = self._ctx
        return decide_turn(
            key=req.key,
            entry=entry,
            prompt_token_ids=prompt_ids,
            now_s=ctx.clock(),
            decode_node=ctx.nodes.state(entry.decode_node_id) if entry is not None else None,
            config=ctx.config.policy,
            costs=ctx.nodes.costs(p.node_id),
        )

    async def _tokenize(self, req: TurnRequest, p: NodeConfig) -> tuple[list[int], NodeConfig]:
        """The prompt's engine token ids, from ``p`` or (once) another P; and the P used."""
        body = tokenize_body(req)
        if body is None:
            assert req.prompt_token_ids is not None
            return list(req.prompt_token_ids), p
        ctx = self._ctx
        node = p
        for attempt in (0, 1):
            try:
                data = await ctx.upstream.post_json(node, "/tokenize", body)
                tokens = data.get("tokens")
                if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
                    raise UpstreamError(node.node_id, "protocol", "tokenize: no token list")
                return list(tokens), node
            except UpstreamError as exc:
                await ctx.nodes.request_failed(exc)
                if exc.client_fault or attempt == 1:
                    raise exc.to_router_error("prefill") from exc
                other = ctx.nodes.choose_prefill(frozenset({node.node_id}))
                if other is None:
                    raise exc.to_router_error("prefill") from exc
                ctx.metrics.retries.labels("tokenize").inc()
                node = other
        raise AssertionError("unreachable")
