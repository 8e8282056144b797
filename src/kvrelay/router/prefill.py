"""Step 2 of a turn: P computes the prompt (pulling D's verified KV, or recomputing it).

P gets the client's body computing one token with ``kv_transfer_params``: D's retained
params (pull; with the fingerprint, so P's connector proves every token and cuts the pull
itself; or already cut by the router in ``/tokenize`` mode), or ``{"do_remote_decode":
true}`` (recompute). P answers with its own params for D; the router learns P's engine id,
whether P runs kvrelay's connector, the exact prompt length, how many tokens P did not
compute (``remote_prefill_cached_tokens``) and, for a pull, how many P's connector verified;
and it feeds P's timing, on the router clock (``ctx.clock``, injectable like every clock),
to the cost estimates (``core.consequences.learn_prefill``) unless ``learn_costs`` is off
(fixed costs: no decision then depends on how fast this machine was).

The claimed entry's read ends with the pull (``ConversationIndex.read_done``): when P
answered it, or never received it. A pull P may still be reading (an error answer, a
timeout, a reset, the client gone) stays a read in progress for
``core.consequences.SPENT_READ_GRACE_S`` more (``read_spent``), so D is not told it may
free those blocks until P's dead request can no longer use them; then it is, and ordered
to (no entry points at the turn any more, and P may never have read it).

A failed P call is retried once on another P (the same one if it is the only P). A pull
that P never received (connection refused, or a 503) is retried as the same pull, since
D's blocks are untouched; otherwise the retry recomputes and the entry stays spent (P may
have read D's blocks, which frees them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec

from kvrelay.core.consequences import (
    SPENT_READ_GRACE_S,
    learn_prefill,
    params_spent,
    prefill_retry,
    spent_read_grace_s,
)
from kvrelay.core.guard import loaded_outcome
from kvrelay.core.params import (
    KVParamsError,
    RemoteBlocks,
    parse_remote_blocks,
    request_remote_decode,
)
from kvrelay.router.config import NodeConfig
from kvrelay.router.errors import RouterError
from kvrelay.router.state import RouterContext
from kvrelay.router.turn import Turn, TurnState
from kvrelay.router.upstream import UpstreamError

_RECOMPUTE: dict[str, object] = request_remote_decode()

log = logging.getLogger("kvrelay.router")


@dataclass(frozen=True)
class Prefilled:
    """P's answer: the node, and the params for D (addressed as D reaches P)."""

    node: NodeConfig
    params: dict[str, object]


class Prefiller:
    """Runs the P step of turns for one router app (module docstring)."""

    def __init__(self, ctx: RouterContext) -> None:
        self._ctx = ctx

    async def run(self, turn: Turn, *, pull: bool) -> Prefilled:
        ctx = self._ctx
        turn.move(TurnState.PREFILLING)
        node = turn.prefill_node
        if node is None or not ctx.nodes.is_up(node.node_id):
            node = ctx.nodes.choose_prefill()
        claimed = turn.found.entry if pull and turn.found is not None else None
        spent = False
        grace_s = 0.0  # how long a spent read may still be under way (spent_read_grace_s)
        try:
            if node is None:
                raise RouterError(503, "no prefill node is up and not drained")
            for attempt in (0, 1):
                params = self._pull_params(turn) if pull else _RECOMPUTE
                try:
                    return await self._once(turn, node, params, pull=pull)
                except UpstreamError as exc:
                    if pull and params_spent(exc.kind, exc.status):
                        spent, grace_s = True, max(grace_s, spent_read_grace_s(exc.kind))
                    await ctx.nodes.request_failed(exc)
                    if not prefill_retry(exc.kind, exc.status, attempt):
                        raise exc.to_router_error("prefill") from exc
                    ctx.metrics.retries.labels("prefill").inc()
                    turn.retries += 1
                    node = ctx.nodes.choose_prefill(frozenset({node.node_id})) or node
                    if pull and params_spent(exc.kind, exc.status):
                        pull = False
                        turn.refused = "prefill_failed"
                except BaseException:
                    if pull:  # cancelled mid-pull: P may still be reading
                        spent, grace_s = True, SPENT_READ_GRACE_S
                    raise
            raise AssertionError("unreachable")
        finally:
            if claimed is not None and not spent:
                await ctx.index.read_done(claimed.decode_node_id, claimed.request_id)
            elif claimed is not None:
                await ctx.index.read_spent(claimed.decode_node_id, claimed.request_id,
                                           grace_s)

    def _pull_params(self, turn: Turn) -> dict[str, object]:
        """D's retained params as the policy sent them, addressed as P reaches D."""
        blocks = turn.decision.blocks_to_send
        assert blocks is not None and turn.found is not None
        holder = self._ctx.nodes.config(turn.found.entry.decode_node_id)
        return holder.reached(blocks).to_json()

    async def _once(
        self, turn: Turn, node: NodeConfig, params: dict[str, object], *, pull: bool
    ) -> Prefilled:
        ctx = self._ctx
        req = turn.request
        body = req.adapter.prefill_body(req.body, params)
        started = ctx.clock()
        with ctx.nodes.busy(node.node_id, turn.prompt_tokens):
            raw = await ctx.upstream.post(node, req.path, body)
        seconds = ctx.clock() - started
        try:
            p_params, prompt = req.adapter.prefill_answer(raw)
            blocks = parse_remote_blocks(p_params)
        except (msgspec.DecodeError, msgspec.ValidationError, KVParamsError) as exc:
            raise UpstreamError(node.node_id, "protocol", f"P's answer: {exc}") from exc
        if blocks.direction != "prefill_to_decode":
            raise UpstreamError(node.node_id, "protocol", "P returned no prefill params")
        ctx.nodes.observe_params(node.node_id, blocks)
        turn.prompt_tokens = prompt if prompt > 0 else turn.prompt_tokens
        turn.cached_tokens = min(max(blocks.prefill_cached_tokens or 0, 0), turn.prompt_tokens)
        turn.verified_tokens = blocks.verified_tokens
        turn.prefill_node = node
        found = turn.found
        if pull and not turn.decision.exact and found is not None \
                and blocks.verified_tokens is not None:
            outcome = loaded_outcome(found.entry.fingerprint, turn.prompt_tokens,
                                     blocks.verified_tokens,
                                     ctx.config.policy.kv_recompute_threshold)
            turn.refused = None if outcome == "pull" else outcome
        if pull and turn.refused is None and blocks.prefill_cached_tokens == 0:
            # P took the pull and loaded nothing (P says so: vLLM counts what it did not
            # compute): D's read failed (its engine restarted, its blocks were gone) or P's
            # own kv_recompute_threshold is above the span, and P recomputed, so the turn is
            # a recompute, not a pull of 0 tokens
            turn.refused = "not_loaded"
        log.debug("P %s %s: %d prompt tokens, %d not computed, %.4f s", node.node_id,
                  "pull" if pull else "recompute", turn.prompt_tokens, turn.cached_tokens,
                  seconds)
        if ctx.config.learn_costs:
            ctx.nodes.set_costs(node.node_id, learn_prefill(
                ctx.nodes.costs(node.node_id), pulled=pull, prompt_tokens=turn.prompt_tokens,
                cached_tokens=turn.cached_tokens, seconds=seconds,
            ))
        reused = turn.cached_tokens if pull else 0
        ctx.metrics.tokens(reused, turn.prompt_tokens - reused)
        return Prefilled(node, self._for_decode(node, blocks))

    @staticmethod
    def _for_decode(node: NodeConfig, blocks: RemoteBlocks) -> dict[str, object]:
        return node.reached(blocks).to_vllm_json()
