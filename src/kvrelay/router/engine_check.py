"""Asking a D that may have restarted which engine it runs, and learning it from D's answer.

The router learns a D's engine id only from what D itself answers
(``NodeRegistry.observe_params``), never from a report or a sync: a report or a sync is
checked against it. On vLLM 0.32 a D that serves only streams answers nothing with its
params, so after a restart the health loop did not see (shorter than its failures to down;
a rolling replacement behind the same URL), every report of D's new engine was refused
``mismatch_engine`` and D's syncs were heard as ``unknown_engine``: no turn on that D
committed again until a non-streamed answer or a failed health check, and the turns D
retained were out of the router's reach (probe 9, finding 3).

A report for a turn on D, or a sync at D's own URL, that names another engine is reason
to doubt what the router knows, not to believe the report: ``EngineChecks.doubt`` asks D.
The check is one non-streamed completion of one token (``CHECK_PROMPT``) with the params of
a direct turn, which D answers with its retained params, and so with its engine id; a D
that manages its retention keeps that turn ``CHECK_RETAIN_S``, one a stock-keeping D holds
is released through P (``router.stock_release``). A forged report or a stale process's
sync costs at most one check per ``MIN_INTERVAL_S`` for each D, and an engine a check
refuted is not checked again for ``REFUTED_FOR_S``. ``ReportDesk`` hears the reports
refused for their engine again once the check they raised has ended (the latest of each
turn's, once).

A report or sync naming a rank of a data-parallel D (``core.engine_group``) that this router
has not seen D answer from asks that rank (vLLM's ``X-data-parallel-rank`` header, where D
takes ranks by id: ``addressable``): its answer names the rank's engine and side channel,
which D's balancer alone might take many checks to show. Each such rank has a check of its
own.

A D that comes up with its engine unknown is asked the same way (``learn``, from its
passing health check: ``NodeRegistry.engine_unknown``), before it serves a turn where it
can. Before, while such a D answered nothing but streams, the first report that passed the
other checks fixed D's engine and side channel (trust on first use): one forged with a
live turn id, naming another engine and side channel, was believed, and later pulls would
have gone there. The first report is now trusted that way only when the check got no
answer.

A P that comes up is asked too (``learn``): one token with ``do_remote_decode``, whose
answer names P's engine and says whether P runs kvrelay's connector (``kvrelay_guard``).
Until a replica had sent P a turn it did not know, so the first Responses or Messages
follow-up it served there recomputed (probe 13, H3). vLLM holds the one block of that
answer for D's read until its ``kv_lease_duration`` (30 s by default) runs out.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from typing import Literal

import msgspec

from kvrelay.core.engine_group import dp_rank, same_group
from kvrelay.core.params import (
    DIRECT_PARAMS,
    KVParamsError,
    RemoteBlocks,
    parse_optional_remote_blocks,
    request_remote_decode,
)
from kvrelay.core.retention_sync import RETAIN_S_KEY, RETENTION_URL_KEY
from kvrelay.router.config import NodeConfig
from kvrelay.router.metrics import RouterMetrics
from kvrelay.router.nodes import NodeRegistry
from kvrelay.router.upstream import Answer, Upstream, UpstreamError

log = logging.getLogger("kvrelay.router")

CheckOutcome = Literal["learned", "restarted", "rank", "same", "no_params", "failed"]
"""How a check ended: D's answer named its engine where the router knew none (a D that came
up: ``EngineChecks.learn``), another engine than the one the router trusted (now learned),
another rank of a data-parallel D's (``core.engine_group``; now learned), the same, none (D
retained nothing: not a bidirectional D), or D gave no answer."""

MIN_INTERVAL_S = 5.0
"""At most one check of a D begins within this many seconds."""
CHECK_TIMEOUT_S = 30.0
CHECK_PROMPT = "."
CHECK_RETAIN_S = 0.001
"""How long a D that reads ``kvrelay_retain_s`` keeps the check's turn: its next step
frees it."""
MAX_RANKS = 1024
"""Ranks of a data-parallel D checked one by one (``_check_key``); a higher rank shares D's
check (vLLM's largest deployments run hundreds)."""
FIRST_RANK = 0
"""The rank a check names when it asks no particular one: every vLLM server runs an engine 0,
so the header is always valid, and a data-parallel D behind one URL is then first seen as
rank 0, after which it takes ranks by id (``core.engine_group.addressable``)."""
REFUTED_KEPT = 32
"""Engine ids refuted by a check, remembered per D."""
REFUTED_FOR_S = 30.0
"""How long a refuted engine id raises no check. Not for good: during a rolling replacement
behind one URL the check can reach the old process and refute the new one, which is D's
alone once the old one is gone (probe 11, finding 1)."""


class _Answer(msgspec.Struct):
    kv_transfer_params: dict[str, object] | None = None


_ANSWER = msgspec.json.Decoder(_Answer)


class EngineChecks:
    """Checks of D nodes' engines (module docstring); one in flight per D at most."""

    def __init__(
        self,
        nodes: NodeRegistry,
        upstream: Upstream,
        metrics: RouterMetrics,
        *,
        clock: Callable[[], float],
        retention_url: Callable[[str], str],
        release: Callable[[NodeConfig, RemoteBlocks], Awaitable[bool]],
    ) -> None:
        """``retention_url``: where D ``node_id`` syncs with this router;
        ``release``: frees a retained turn of a D that keeps turns the stock way."""
        self._nodes = nodes
        self._upstream = upstream
        self._metrics = metrics
        self._clock = clock
        self._retention_url = retention_url
        self._release = release
        self._running: dict[str, asyncio.Task[CheckOutcome]] = {}
        self._began_s: dict[str, float] = {}
        self._refuted: dict[str, OrderedDict[str, float]] = {}
        """Per D: engine ids a check refuted, and when."""

    def doubt(self, node_id: str, engine_id: str) -> asyncio.Task[CheckOutcome] | None:
        """Something not D's own answer says D ``node_id`` runs ``engine_id``: the check
        that will tell (the one in flight, else a new one), or ``None`` when none is due
        (not a D that is up, the engine known or refuted within ``REFUTED_FOR_S``, a check
        began within ``MIN_INTERVAL_S``)."""
        key = self._check_key(node_id, engine_id)
        running = self._running.get(key)
        if running is not None:
            return running
        state = self._nodes.state(node_id)
        if state is None or state.role != "decode" or not state.up or not engine_id \
                or self._nodes.knows_engine(node_id, engine_id) \
                or self._refuted_s_ago(node_id, engine_id) < REFUTED_FOR_S:
            return None
        return self._start(node_id, self._check(node_id, engine_id), key)

    def _check_key(self, node_id: str, engine_id: str) -> str:
        """Whose check ``engine_id`` raises: a rank not seen yet of D's data-parallel group
        has its own (one per rank, so each rank's first report is heard within one check,
        not one rank per ``MIN_INTERVAL_S``); any other id, D's one."""
        rank = dp_rank(engine_id)
        known = self._nodes.trusted_identity(node_id)[0]
        if rank is None or rank >= MAX_RANKS or known is None \
                or not same_group(known, engine_id):
            return node_id
        return f"{node_id}/dp{rank}"

    def learn(self, node_id: str) -> asyncio.Task[CheckOutcome] | None:
        """Node ``node_id`` is up and the router knows none of its engine: the check that
        asks it (the one in flight, else a new one), or ``None`` when none is due (not a
        node that is up, its engine known, a check began within ``MIN_INTERVAL_S``)."""
        running = self._running.get(node_id)
        if running is not None:
            return running
        state = self._nodes.state(node_id)
        if state is None or not state.up \
                or self._nodes.trusted_identity(node_id)[0] is not None:
            return None
        if state.role == "prefill":
            return self._start(node_id, self._learn_prefill(node_id))
        return self._start(node_id, self._learn(node_id))

    async def _learn_prefill(self, node_id: str) -> CheckOutcome:
        outcome = await self._ask_prefill(self._nodes.config(node_id))
        self._metrics.child(self._metrics.engine_checks, node_id, outcome).inc()
        log.info("P %s came up with its engine unknown; asked it: %s (%s)", node_id, outcome,
                 "kvrelay's connector" if self._nodes.verifies_pulls(node_id) else "no guard")
        return outcome

    async def _ask_prefill(self, node: NodeConfig) -> CheckOutcome:
        body = msgspec.json.encode({"prompt": CHECK_PROMPT, "max_tokens": 1,
                                    "temperature": 0, "stream": False,
                                    "kv_transfer_params": request_remote_decode()})
        blocks = await self._answer(node, body, "prefill_to_decode", FIRST_RANK)
        if isinstance(blocks, str):
            return blocks
        self._nodes.observe_params(node.node_id, blocks)
        return "learned"

    def _start(self, node_id: str, check: Coroutine[object, object, CheckOutcome],
               key: str | None = None) -> asyncio.Task[CheckOutcome] | None:
        """Run ``check`` as D ``node_id``'s one check (``key``: a rank's, ``_check_key``),
        unless one began within ``MIN_INTERVAL_S`` (then ``None``)."""
        key = key or node_id
        now = self._clock()
        began = self._began_s.get(key)
        if began is not None and now - began < MIN_INTERVAL_S:
            check.close()
            return None
        self._began_s[key] = now
        task = asyncio.get_running_loop().create_task(
            check, name=f"kvrelay-engine-check-{key}")
        self._running[key] = task
        task.add_done_callback(lambda _: self._running.pop(key, None))
        return task

    async def _learn(self, node_id: str) -> CheckOutcome:
        outcome = await self._ask(self._nodes.config(node_id))
        if outcome == "restarted":
            outcome = "learned"  # there was no engine to restart from
        self._metrics.child(self._metrics.engine_checks, node_id, outcome).inc()
        log.info("D %s came up with its engine unknown; asked it: %s", node_id, outcome)
        return outcome

    def _refuted_s_ago(self, node_id: str, engine_id: str) -> float:
        """Seconds since a check refuted ``engine_id`` on D ``node_id`` (inf: never)."""
        refuted = self._refuted.get(node_id)
        at = refuted.get(engine_id) if refuted is not None else None
        return float("inf") if at is None else self._clock() - at

    async def aclose(self) -> None:
        """Cancel the checks in flight."""
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _check(self, node_id: str, claimed: str) -> CheckOutcome:
        # an unseen rank's id asks that rank, where D takes ranks by id (vLLM's balancer
        # would pick any: core.engine_group.addressable)
        rank = dp_rank(claimed) if self._check_key(node_id, claimed) != node_id \
            and self._nodes.takes_ranks(node_id) else FIRST_RANK
        outcome = await self._ask(self._nodes.config(node_id), rank)
        self._metrics.child(self._metrics.engine_checks, node_id, outcome).inc()
        if outcome != "failed" and not self._nodes.knows_engine(node_id, claimed):
            refuted = self._refuted.setdefault(node_id, OrderedDict())
            refuted.pop(claimed, None)
            refuted[claimed] = self._clock()
            while len(refuted) > REFUTED_KEPT:
                refuted.popitem(last=False)
        log.info("D %s engine check (a report or sync named engine %s): %s",
                 node_id, claimed, outcome)
        return outcome

    async def _ask(self, node: NodeConfig, rank: int | None = FIRST_RANK) -> CheckOutcome:
        params: dict[str, object] = dict(DIRECT_PARAMS)
        if self._nodes.manages_retention(node.node_id):
            params[RETENTION_URL_KEY] = self._retention_url(node.node_id)
            params[RETAIN_S_KEY] = CHECK_RETAIN_S
        body = msgspec.json.encode({"prompt": CHECK_PROMPT, "max_tokens": 1,
                                    "temperature": 0, "stream": False,
                                    "kv_transfer_params": params})
        blocks = await self._answer(node, body, "decode_to_prefill", rank)
        if isinstance(blocks, str):
            return blocks
        known = self._nodes.trusted_identity(node.node_id)[0]
        was_known = self._nodes.knows_engine(node.node_id, blocks.engine_id)
        self._nodes.observe_params(node.node_id, blocks)
        if blocks.retention == "stock" or not self._nodes.manages_retention(node.node_id):
            await self._release(node, blocks)
        if was_known:
            return "same"
        return "rank" if known is not None and same_group(known, blocks.engine_id) \
            else "restarted"

    async def _answer(self, node: NodeConfig, body: bytes, direction: str,
                      rank: int | None = None) -> RemoteBlocks | CheckOutcome:
        """The params of the node's answer to the check ``body`` (served by data-parallel
        rank ``rank``, when given), or how it failed (``failed``; ``no_params``: none in
        ``direction``)."""
        answer = await self._post(node, body, rank)
        if answer is None:
            return "failed"
        if answer.status >= 400:
            log.warning("%s engine check answered %d", node.node_id, answer.status)
            return "failed"
        try:
            blocks = parse_optional_remote_blocks(_ANSWER.decode(answer.body).kv_transfer_params)
        except (msgspec.DecodeError, msgspec.ValidationError, KVParamsError) as exc:
            log.warning("%s engine check: a bad answer: %s", node.node_id, exc)
            return "failed"
        if blocks is None or blocks.direction != direction:
            return "no_params"
        return blocks

    async def _post(self, node: NodeConfig, body: bytes, rank: int | None = None
                    ) -> Answer | None:
        """D's answer, or ``None`` if D gave none. Tried twice when the connection closed:
        a restarted D's pooled keep-alive connection fails once that way."""
        for attempt in range(2):
            try:
                with self._nodes.busy(node.node_id):
                    return await self._upstream.transport.request(
                        node, "POST", "/v1/completions", body, CHECK_TIMEOUT_S, dp_rank=rank)
            except UpstreamError as exc:
                if exc.kind != "closed" or attempt:
                    log.warning("%s engine check failed: %s", node.node_id, exc)
                    return None
        return None
