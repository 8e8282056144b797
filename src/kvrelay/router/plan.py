"""Step 1 of a turn: from a validated request to a planned ``Turn``.

1. If a turn this request continues is still waiting for D's report, wait for it, at most
   ``report_wait_s`` (``ReportDesk.pending_for``).
2. Look up the entry the request continues (``ConversationIndex.lookup``: digests only, no
   tokenization). An index that cannot answer makes the turn a recompute
   (``state_unavailable``). No entry, but one announced by another replica (a shared
   index: a streamed turn that replica served and whose D report it awaits,
   ``ConversationIndex.announce``): look again until it is there, at most
   ``report_wait_s``, as for a pending turn of this replica's (step 1). An entry's engine id
   is shown to the node registry (``observe_entry``): with replicas it may be news of a D
   restart.
3. Pick the P (least outstanding prefill work). When that P cannot prove a pull itself
   (stock vLLM), get the prompt's exact ids from its ``/tokenize`` and let the policy run
   the guard; otherwise decide from estimates (``core.policy.Prompt``). An API whose prompt
   ``/tokenize`` cannot render (Responses, Messages: ``ApiAdapter.tokenizable``) cannot be
   pulled through such a P: no pull the router could prove. The turn recomputes
   (``unverifiable``) and supersedes the entry it continued, so D releases that turn when
   this one commits instead of holding it for nothing. Whether a P runs kvrelay's
   connector is asked at its first passing health check (``NodeRegistry``), so a replica
   knows before its first turn there; a follow-up that comes while that question is out
   waits for its answer (``_know_guard``).
4. ``core.policy.decide_turn``, then ``core.consequences.entry_fate``: a pull claims the
   entry before P is ever called (losing the claim to a concurrent turn makes it
   ``no_entry``); entries the decision proves useless are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec

from kvrelay.core.consequences import entry_fate, prefill_retry
from kvrelay.core.conversation import conversation_tag, id_tag
from kvrelay.core.policy import Prompt, TurnDecision, decide_turn
from kvrelay.router.apis.fields import encode
from kvrelay.router.config import NodeConfig
from kvrelay.router.errors import RouterError
from kvrelay.router.index import Found, IndexUnavailable
from kvrelay.router.request import TurnRequest, tokenize_body
from kvrelay.router.state import RouterContext
from kvrelay.router.turn import Turn
from kvrelay.router.upstream import UpstreamError

log = logging.getLogger("kvrelay.router")

ANNOUNCED_POLL_S = 0.01
"""How often a turn waiting for an entry another replica announced looks again."""


class _Tokens(msgspec.Struct):
    tokens: list[int]


_TOKENS = msgspec.json.Decoder(_Tokens)


class Planner:
    """Plans turns for one router app (module docstring)."""

    def __init__(self, ctx: RouterContext) -> None:
        self._ctx = ctx

    async def plan(self, req: TurnRequest) -> Turn:
        ctx = self._ctx
        pending = ctx.desk.pending_for(req.identity)
        if pending and not await ctx.desk.wait_for(pending, ctx.config.report_wait_s):
            log.info("turn continues one whose report is still pending")
        found: Found | None = None
        gap_s: float | None = None
        index_down = False
        try:
            found = await ctx.index.lookup(req.identity)
            if found is None and not pending:
                found = await self._wait_announced(req)
        except IndexUnavailable:
            index_down = True
        p = ctx.nodes.choose_prefill()
        if p is None:
            raise RouterError(503, "no prefill node is up and not drained")
        if found is not None:
            entry = found.entry
            ctx.nodes.observe_entry(entry.decode_node_id, entry.decode_engine_id,
                                    entry.created_at_s)
            gap_s = max(0.0, ctx.clock() - entry.created_at_s)
            ctx.metrics.turn_gap.observe(gap_s)
            ctx.retention.observe_gap(req, gap_s, entry.waits_for)
        unverifiable = False
        if found is not None and not req.adapter.tokenizable:
            await self._know_guard(p)
            # a stock P, and no /tokenize for this API: no pull can be proven
            unverifiable = not ctx.nodes.verifies_pulls(p.node_id)
        prompt, p = await self._prompt(req, found, p, exact=not unverifiable)
        if index_down:
            decision = TurnDecision("recompute", "state_unavailable")
        elif unverifiable:
            decision = TurnDecision("recompute", "unverifiable")
        else:
            decision = self._decide(found, prompt, p, req.max_output_tokens)
        fate = entry_fate(decision)
        if found is not None and fate.claim:
            found, decision = await self._claim(req, found, decision, prompt, p)
        elif found is not None and fate.drop and await ctx.index.drop(
                found.ref, found.entry, release=fate.release):
            if fate.reason == "expired":
                ctx.metrics.expirations.inc()
            else:
                ctx.metrics.dropped.labels(fate.reason).inc()
            if fate.purge_engine:
                entry = found.entry
                stale = await ctx.index.drop_engine(entry.decode_node_id, entry.decode_engine_id)
                if stale:
                    ctx.metrics.dropped.labels("engine_restarted").inc(stale)
        turn = Turn(
            request=req,
            decision=decision,
            found=found,
            conversation=_conversation(req, found, ctx.tag_key),
            number=found.entry.turn + 1 if found is not None else 1,
            prompt_tokens=prompt.est_tokens,
            prefill_node=p,
            decided_at_s=ctx.clock(),
            gap_s=gap_s,
        )
        ctx.stats.record(turn)
        return turn

    async def _know_guard(self, p: NodeConfig) -> None:
        """P has answered this router nothing yet (just started: its first health check's
        question is in flight), so whether it proves pulls is unknown: wait for that
        question's answer, at most ``health_timeout_s`` (``EngineChecks.learn``; none is
        asked again within its interval). A replica's first Responses or Messages
        follow-up in that window recomputed (probe 15, L3)."""
        ctx = self._ctx
        if ctx.engine_checks is None or ctx.nodes.verifies_pulls(p.node_id) \
                or ctx.nodes.trusted_identity(p.node_id)[0] is not None:
            return
        check = ctx.engine_checks.learn(p.node_id)
        if check is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(check), ctx.config.health_timeout_s)

    async def _claim(
        self, req: TurnRequest, found: Found, decision: TurnDecision, prompt: Prompt,
        p: NodeConfig,
    ) -> tuple[Found | None, TurnDecision]:
        """Claim the entry a pull needs. The index may hand over another entry of the same
        ref (an interchangeable one: the same tokens, maybe another D): decide again on it,
        and put it back if that is not a pull."""
        ctx = self._ctx
        claimed = await ctx.index.claim(found.ref, found.entry)
        if claimed is None:
            log.info("turn lost the claim of its entry to a concurrent turn")
            return found, self._decide(None, prompt, p)
        if claimed == found.entry:
            return found, decision
        other = Found(found.ref, claimed, found.probe)
        again = self._decide(other, prompt, p, req.max_output_tokens)
        if again.action == "pull":
            return other, again
        await ctx.index.put(found.ref, claimed, tenant=req.tenant)
        await ctx.index.read_done(claimed.decode_node_id, claimed.request_id)
        return found, self._decide(None, prompt, p)

    async def _wait_announced(self, req: TurnRequest) -> Found | None:
        """No entry, but another replica announced one on its way (a streamed turn whose D
        report it awaits, ``index.announce``): look again every ``ANNOUNCED_POLL_S`` until
        the entry is there or no longer announced, at most ``report_wait_s``, as this
        replica waits for its own pending turns."""
        ctx = self._ctx
        if not await ctx.index.announced(req.identity):
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ctx.config.report_wait_s
        while loop.time() < deadline:
            await asyncio.sleep(ANNOUNCED_POLL_S)
            found = await ctx.index.lookup(req.identity)
            if found is not None:
                return found
            if not await ctx.index.announced(req.identity):
                # withdrawn: the turn settled, maybe committed right after the look above
                return await ctx.index.lookup(req.identity)
        log.info("turn continues one another replica announced; its entry did not come")
        return None

    def _decide(self, found: Found | None, prompt: Prompt, p: NodeConfig,
                max_output_tokens: int | None = None) -> TurnDecision:
        ctx = self._ctx
        entry = found.entry if found is not None else None
        return decide_turn(
            entry=entry,
            prompt=prompt,
            now_s=ctx.clock(),
            decode_node=ctx.nodes.state(entry.decode_node_id) if entry is not None else None,
            config=ctx.config.policy,
            costs=ctx.nodes.costs(p.node_id),
            max_output_tokens=max_output_tokens,
        )

    async def _prompt(
        self, req: TurnRequest, found: Found | None, p: NodeConfig, *, exact: bool = True
    ) -> tuple[Prompt, NodeConfig]:
        """What the policy knows of the prompt, and the P to use (another one if ``p``
        could not tokenize); an estimate where P verifies pulls itself or ``exact`` is
        off."""
        if req.prompt_token_ids is not None:
            given = req.prompt_token_ids
            return Prompt(len(given), token_ids=given), p
        if found is None:
            return Prompt(max(1, req.num_bytes // 4)), p
        entry = found.entry
        covered = found.probe.covered_bytes if found.probe is not None else entry.num_bytes
        new_bytes = max(0, req.num_bytes - covered)
        est_new = round(new_bytes * entry.tokens_per_byte())
        if not exact or self._ctx.nodes.verifies_pulls(p.node_id):
            return Prompt(entry.num_tokens + est_new, est_new), p
        ids, p = await self._tokenize(req, p)
        return Prompt(len(ids), token_ids=ids), p

    async def _tokenize(self, req: TurnRequest, p: NodeConfig) -> tuple[list[int], NodeConfig]:
        """The prompt's engine token ids, from ``p`` or (once) another P; and the P used."""
        ctx = self._ctx
        body = encode(tokenize_body(req))
        node = p
        for attempt in (0, 1):
            try:
                raw = await ctx.upstream.post(node, "/tokenize", body)
                try:
                    return _TOKENS.decode(raw).tokens, node
                except (msgspec.DecodeError, msgspec.ValidationError):
                    raise UpstreamError(
                        node.node_id, "protocol", "tokenize: no token list"
                    ) from None
            except UpstreamError as exc:
                await ctx.nodes.request_failed(exc)
                other = ctx.nodes.choose_prefill(frozenset({node.node_id}))
                if not prefill_retry(exc.kind, exc.status, attempt) or other is None:
                    raise exc.to_router_error("prefill") from exc
                ctx.metrics.retries.labels("tokenize").inc()
                node = other
        raise AssertionError("unreachable")


def _conversation(req: TurnRequest, found: Found | None, tag_key: bytes) -> str:
    """The conversation's tag (keyed with ``tag_key``): its id's scope, else the one the
    continued entry carries, else a new one (from the first request's anchor)."""
    if req.has_id:
        return id_tag(tag_key, req.identity.scope)
    if found is not None:
        return found.entry.conversation
    return conversation_tag(tag_key, req.identity.scope, req.identity.anchor)
