"""D's retention as the router sees it: D's syncs in, the router's release orders out.

kvrelay's connector on D (and the fake engine) POSTs a ``core.retention_sync.RetentionSync``
to the ``kvrelay_retention_url`` its decode requests carry, ``RETENTION_PATH/<token>`` on the
internal listener (``url_for``), every ``SYNC_INTERVAL_S`` while it holds retained turns, and
at once after a release. ``RetentionDesk.accept``:

1. decodes the body (``decode_sync``; a bad one is a 400, never a 5xx) and finds the D it is
   from by its engine id (``NodeRegistry.decode_node_for_engine``: only an engine id this
   router learned from that D's own answers or checked reports) or, before this router
   learned any engine of that D (a restart), by the URL's token, a MAC of that D's node id and URL
   under the router's key that only decode requests to that D carry: such a sync is D's,
   and its engine id becomes D's. It then checks the token. A sync without it
   (``bad_token``: forged, or D's URL from before a restart without ``--tag-key`` or from
   an older router) is heard only in what can make entries recompute (2 and 4): it takes
   none of D's release orders (which would keep D's dropped turns pinned) and its numbers
   are not kept (3). One this router cannot name at all (unknown engine, no D's token) is
   heard the same way on every D (``unknown_engine``), so that D can still free turns under
   pressure. The connector posts to the URL as given (any version);
2. marks every entry of that D whose request id D released as released
   (``ConversationIndex.mark_released``): it is never claimed again, and the conversation's
   next turn recomputes with reason ``released``;
3. keeps D's own numbers (retained requests, blocks, tokens, bytes; free and total blocks;
   releases by cause since D started) for ``/stats`` (``snapshot``) and the metrics, and
   counts the releases the sync told of by cause;
4. for the turns D asks to free itself (``releasing``: pressure, headroom), marks their
   entries released so no claim takes them, and answers in ``dropped`` those no P leg is
   reading (``ConversationIndex.release_requested``; a claim counts as a read until the P
   leg ends, ``prefill``); D frees exactly those. When the index cannot tell (shared
   state down) the sync fails with a 503, not an answer as if heard: D tells its releases
   again and asks a replica that can answer;
5. answers ``RetentionOrders``: the release orders the index queued for that D and engine
   (``take_releases``): entries the router dropped while D still held them. With Redis the
   queue and the reads in progress are shared, so whichever replica D syncs with answers
   for all of them, and each answer names the shared state (``shared``,
   ``ConversationIndex.shared_state``): D asks any replica that names it for the turns of
   one that does not answer (gone, or beyond the routers D syncs with). Beside them, the
   return curves of turns this replica committed since that ended another way than the
   curve D was told (``settled``: a turn that ended in a
   tool call comes back within the tools' run time or not at all; told the replies' curve,
   D would keep it over younger replies). Those are this replica's own (D syncs with every
   replica that sent it turns), at most ``MAX_ORDERS`` per D, the oldest dropped first.

``decode_params`` gives a decode request to a D that runs kvrelay's connector
(``NodeRegistry.manages_retention``) ``kvrelay_retention_url`` (``url_for`` the D) and, unless
learning is off (``kvrelay route --no-learned-retention``), ``kvrelay_retain_s``: how long
D keeps the turn, ``core.retention_time.plan_retention`` from the gaps between turns seen
(``router.retain_times``, fed by ``observe_gap``, per kind: after a tool call, after a
reply) and D's share available to live work at its last sync (free blocks and retained ones,
which D releases on demand); and once gaps are learned, ``kvrelay_return_curve``: how such
turns come back (D releases those least likely still to be pulled first). D is told the
longer of the two kinds' times and that kind's curve (``RetainPlan.on_d``); the plan goes
with the turn (``DecodeRetention``), and once the answer is read the entry keeps its kind's
time, ordering D to release the blocks at the entry's expiry when that is shorter
(``commit``, ``ConversationEntry.release_at_expiry``). Every committed turn counts as one
that ended its kind's way (``RetainTimes.ended``: the share that came back).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import msgspec

from kvrelay.core.conversation import GapKind
from kvrelay.core.engine_group import engine_group, same_group
from kvrelay.core.retention_sync import (
    MAX_ORDERS,
    RELEASE_CAUSES,
    RETAIN_S_KEY,
    RETENTION_PATH,
    RETENTION_URL_KEY,
    RETURN_CURVE_KEY,
    STALE_SYNC_S,
    RetentionOrders,
    RetentionSync,
    RetentionSyncError,
    TurnCurve,
    decode_sync,
)
from kvrelay.core.retention_time import (
    RetainPlan,
    RetentionTimeConfig,
    available_fraction,
    plan_retention,
)
from kvrelay.core.return_curve import ReturnCurve
from kvrelay.router.commit import PendingTurn
from kvrelay.router.config import NodeConfig
from kvrelay.router.engine_check import EngineChecks
from kvrelay.router.errors import ClientError
from kvrelay.router.index import ConversationIndex, IndexUnavailable
from kvrelay.router.metrics import RouterMetrics
from kvrelay.router.nodes import NodeRegistry
from kvrelay.router.request import TurnRequest
from kvrelay.router.retain_times import RetainTimes
from kvrelay.router.turn import Turn

log = logging.getLogger("kvrelay.router")

MAX_ANSWERS_KEPT = 4096
"""Asks whose last counted answer is remembered (``release_requests_total`` counts an ask
once per answer); more than D's turns in asking at once on every D."""


@dataclass(frozen=True)
class DRetention:
    """The latest sync of one D (its own numbers) and when the router got it (router
    clock)."""

    node_id: str
    sync: RetentionSync
    synced_at_s: float

    @property
    def free_fraction(self) -> float:
        """D's KV cache available to live work, 0..1: free blocks and retained ones (D
        releases those on demand, ``core.retention``), so that retention never shortens
        itself because of its own blocks; only live work makes D short."""
        return available_fraction(num_blocks_free=self.sync.num_blocks_free,
                                  retained_blocks=self.sync.retained_blocks,
                                  num_blocks_total=self.sync.num_blocks_total)


class CurveQueues:
    """Return curves for D's next sync, per D: its turns committed since that ended
    another way than the curve D was told (``RetentionDesk.settled``), at most
    ``MAX_ORDERS`` per D, the oldest dropped first. A sync takes its own engine's; another
    rank's of a data-parallel D stay for that rank's sync (probe 16: half of two ranks'
    tool-call turns kept the replies' curve), another group's (D restarted) are dropped."""

    def __init__(self) -> None:
        self._queues: dict[str, OrderedDict[tuple[str, str], ReturnCurve]] = {}

    def put(self, node_id: str, engine_id: str, request_id: str, curve: ReturnCurve) -> None:
        queue = self._queues.setdefault(node_id, OrderedDict())
        queue[(engine_id, request_id)] = curve
        while len(queue) > MAX_ORDERS:
            queue.popitem(last=False)

    def take(self, node_id: str, engine_id: str) -> tuple[TurnCurve, ...]:
        queue = self._queues.get(node_id)
        if not queue:
            return ()
        taken = tuple(TurnCurve(request_id, curve)
                      for (engine, request_id), curve in queue.items() if engine == engine_id)
        for key in [k for k in queue if k[0] == engine_id or not same_group(k[0], engine_id)]:
            del queue[key]
        if not queue:
            del self._queues[node_id]
        return taken


@dataclass(frozen=True)
class DecodeRetention:
    """What ``decode_params`` decided for one decode request: the keys for D's params
    (``None`` for a D without kvrelay's connector), how long D keeps the turn (what the
    entry's expiry follows unless the plan shortens it), and the plan per kind (``None``
    unless learned)."""

    keys: Mapping[str, object] | None
    retain_s: float
    plan: RetainPlan | None = None


def sync_token(key: bytes, node_id: str, url: str) -> str:
    """The token of D ``node_id``'s sync URL under the router's ``key`` (its conversation
    tag key: replicas and restarts given the same ``--tag-key`` agree on it): 128 bits of a
    keyed BLAKE2b of the node id and the node's URL, in hex. The URL too: a router that
    listed the nodes in another order gave each D the token of another D's id, and once
    fixed and restarted it believed those D's syncs under the wrong id (probe 15, L5)."""
    return hashlib.blake2b(f"{node_id}\n{url}".encode(), key=key[:64], digest_size=16,
                           person=b"kvrelay-sync").hexdigest()


class RetentionDesk:
    """D's syncs and the router's orders for one router app (module docstring).
    ``learned``: how per-turn retention times are learned (``None``: none are sent)."""

    def __init__(
        self,
        index: ConversationIndex,
        nodes: NodeRegistry,
        metrics: RouterMetrics,
        clock: Callable[[], float],
        *,
        base_url: str,
        key: bytes,
        learned: RetentionTimeConfig | None,
    ) -> None:
        self._index = index
        self._nodes = nodes
        self._metrics = metrics
        self._clock = clock
        self._base = base_url.rstrip("/") + RETENTION_PATH + "/"
        self._key = key
        self._urls: dict[str, str] = {}  # url_for's, per node: one MAC per node, not per turn
        self._learned = learned
        self._gaps = RetainTimes()
        self._latest: dict[str, dict[str, DRetention]] = {}
        """Per D, per engine (one per rank of a data-parallel D): its latest sync."""
        self._curves = CurveQueues()
        self._answers: OrderedDict[tuple[str, str], str] = OrderedDict()
        """The last answer counted per (D, request id) D asked about (``_count_answers``)."""
        self.engine_checks: EngineChecks | None = None
        """Asks a D whose sync, at D's own URL, names another engine than the one known
        (``router.engine_check``; set by the app, which builds it from ``url_for``)."""

    def url_for(self, node_id: str) -> str:
        """Where D ``node_id`` syncs with this router: ``RETENTION_PATH/<token>``, the token a
        MAC of the node id and URL (module docstring)."""
        url = self._urls.get(node_id)
        if url is None:
            url = self._urls[node_id] = self._base + self._token(node_id)
        return url

    def _token(self, node_id: str) -> str:
        return sync_token(self._key, node_id, self._nodes.config(node_id).url)

    def observe_gap(self, req: TurnRequest, gap_s: float, kind: GapKind = "user") -> None:
        """A turn arrived ``gap_s`` after the turn it continues ended (``kind``: how that
        turn ended)."""
        self._gaps.observe(req, gap_s, kind)

    def decode_params(self, turn: Turn, node: NodeConfig) -> DecodeRetention:
        """kvrelay's retention keys for ``turn``'s decode request to ``node``, how long D
        keeps the turn and the plan per kind (``DecodeRetention``)."""
        if not self._nodes.manages_retention(node.node_id):
            return DecodeRetention(None, node.ttl_s)
        if self._learned is None:
            return DecodeRetention({RETENTION_URL_KEY: self.url_for(node.node_id)}, node.ttl_s)
        state = self.latest(node.node_id)
        req = turn.request
        plan = plan_retention(
            self._gaps.histograms(req, "tool"), self._gaps.histograms(req, "user"),
            ttl_s=node.ttl_s, free_fraction=state.free_fraction if state is not None else None,
            config=self._learned,
        )
        decided = plan.on_d
        self._metrics.child(self._metrics.retain_decisions, decided.reason).inc()
        self._metrics.retain_seconds.observe(decided.retain_s)
        turn.retain_s = decided.retain_s
        keys: dict[str, object] = {RETENTION_URL_KEY: self.url_for(node.node_id),
                                   RETAIN_S_KEY: decided.retain_s}
        if decided.curve is not None:
            keys[RETURN_CURVE_KEY] = list(msgspec.structs.astuple(decided.curve))
        return DecodeRetention(keys, decided.retain_s, plan)

    @property
    def learns(self) -> bool:
        """Whether per-turn retention is learned (``settled`` then wants every turn)."""
        return self._learned is not None

    def settled(self, p: PendingTurn) -> None:
        """A decode request's turn settled. A committed one ended its kind's way
        (``RetainTimes.ended``); when D was told another kind's curve (the answer ended in a
        tool call, D was told the replies'), queue the kind's for D's next sync."""
        if p.outcome != "committed":
            return
        self._gaps.ended(p.identity, p.tenant, p.waits_for)
        blocks, plan = p.blocks, p.plan
        if blocks is None or plan is None:
            return
        curve = plan.after(p.waits_for).curve
        if curve is None or curve == plan.on_d.curve:
            return
        self._curves.put(p.decode_node_id, blocks.engine_id, blocks.request_id, curve)

    def latest(self, node_id: str) -> DRetention | None:
        """D's latest sync (``None`` before its first, once D went down or restarted, or
        once one that said D holds turns is older than ``STALE_SYNC_S``: D would have synced
        again, so its numbers are unknown; the router's view of D's engine changes only
        when D answers again, which an idle cluster may not do for long). A data-parallel
        D's ranks sync one by one: their latest, summed (``_ranks``)."""
        ranks = self._ranks(node_id)
        if len(ranks) <= 1:
            return ranks[0] if ranks else None
        syncs = [r.sync for r in ranks]
        causes: dict[str, int] = {}
        for sync in syncs:
            for cause, n in sync.releases_total.items():
                causes[cause] = causes.get(cause, 0) + n
        return DRetention(node_id, msgspec.structs.replace(
            syncs[0], engine_id=engine_group(syncs[0].engine_id),
            num_blocks_total=sum(x.num_blocks_total for x in syncs),
            num_blocks_free=sum(x.num_blocks_free for x in syncs),
            retained_requests=sum(x.retained_requests for x in syncs),
            retained_blocks=sum(x.retained_blocks for x in syncs),
            retained_tokens=sum(x.retained_tokens for x in syncs),
            releases_total=causes, released=(), releasing=()),
            min(r.synced_at_s for r in ranks))

    def _ranks(self, node_id: str) -> list[DRetention]:
        """The latest sync of each of D's current engines that is still D's state (see
        ``latest``), by engine id."""
        now = self._clock()
        return [state for engine_id, state in sorted(self._latest.get(node_id, {}).items())
                if self._nodes.knows_engine(node_id, engine_id)
                and not (state.sync.retained_requests
                         and now - state.synced_at_s > STALE_SYNC_S)]

    def room_tokens(self, node_id: str) -> int | None:
        """The tokens D's KV cache has free for live work now, from D's own numbers: a sync
        of the last ``STALE_SYNC_S``, unless a later read of D's ``/metrics`` shows requests
        waiting for capacity; else that read (``NodeRegistry.metrics_room``, none while
        requests wait); ``None`` when neither is recent (a D syncs only while it holds
        turns, and only with the routers whose requests it carried). Retained blocks are not
        room: D would release them for the work, while another D with free room keeps them
        (P pulls a conversation's KV from whichever D holds it), so both sources count them
        alike (they did not: replicas routed the same state apart, probe 11, finding 3)."""
        read = self._nodes.metrics_room(node_id)
        ranks = self._ranks(node_id)
        synced_at_s = min((r.synced_at_s for r in ranks), default=float("-inf"))
        if self._clock() - synced_at_s <= STALE_SYNC_S:
            if read is not None and read[1] > synced_at_s and read[0].num_waiting:
                return 0
            # a data-parallel D's request goes to one rank: the room of the roomiest
            return max(r.sync.num_blocks_free * r.sync.block_size for r in ranks)
        return read[0].tokens if read is not None else None

    def rank_room_tokens(self, node_id: str, engine_id: str) -> int | None:
        """The tokens free on one engine (a rank of a data-parallel D) by its own sync of
        the last ``STALE_SYNC_S``; ``None`` without one."""
        for state in self._ranks(node_id):
            if state.sync.engine_id == engine_id \
                    and self._clock() - state.synced_at_s <= STALE_SYNC_S:
                return state.sync.num_blocks_free * state.sync.block_size
        return None

    async def accept(self, raw: bytes, token: str) -> RetentionOrders:
        """Handle one sync body posted to ``url_for`` a D (``token``: the URL's last part,
        ``""`` for the bare path; module docstring); ``ClientError`` 400 / 404. A sync with a
        token not that D's (a router restarted without ``--tag-key``, an older router's bare
        URL, or a forger) is still heard where it can only make entries recompute, what D
        must be able to do whatever URL it holds: its releases mark entries released and its
        asks (``releasing``) are answered; but it takes no release orders or curves and its
        numbers are not D's (``bad_token``)."""
        try:
            sync = decode_sync(raw)
        except RetentionSyncError as exc:
            self._metrics.child(self._metrics.retention_syncs, "invalid").inc()
            raise ClientError(str(exc)) from None
        try:
            return await self._accept(sync, token)
        except IndexUnavailable:
            # what D tells or asks could not be heard (shared state down): a 503 keeps D's
            # releases pending (told again) and has D ask its turns of a replica that answers
            self._metrics.child(self._metrics.retention_syncs, "unavailable").inc()
            raise ClientError("the conversation index is unavailable; sync again",
                              status=503) from None

    async def _accept(self, sync: RetentionSync, token: str) -> RetentionOrders:
        node_id = self._nodes.decode_node_for_engine(sync.engine_id)
        if node_id is None:
            node_id = self._node_of_token(token)
            if node_id is not None and self._nodes.trusted_identity(node_id)[0] is None:
                # D itself (its URL's MAC) before any answer of D's reached this router (a
                # restarted router): its engine is D's current one. A D whose engine this
                # router knows learns of another from D's answers, not from a sync.
                self._nodes.observe_engine(node_id, sync.engine_id)
        if node_id is None or not self._nodes.knows_engine(node_id, sync.engine_id):
            if node_id is not None and self.engine_checks is not None:
                self.engine_checks.doubt(node_id, sync.engine_id)  # D restarted, unseen?
            return await self._heard_unknown(sync)
        trusted = hmac.compare_digest(token.encode(), self._token(node_id).encode())
        self._metrics.child(self._metrics.retention_syncs, "ok" if trusted else "bad_token").inc()
        if trusted:
            self._latest.setdefault(node_id, {})[sync.engine_id] = DRetention(
                node_id, sync, self._clock())
            self._forget_gone(node_id)
        dropped = await self._heard(node_id, sync, count_causes=trusted)
        shared = await self._shared()
        if not trusted:
            return RetentionOrders(dropped=dropped, shared=shared)
        orders: tuple[str, ...] = ()
        if self._nodes.takes_orders(node_id):  # a stock-keeping D's go through P
            orders = await self._index.take_releases(node_id, sync.engine_id)
        if orders:
            self._metrics.child(self._metrics.release_orders, node_id).inc(len(orders))
        curves = self._curves.take(node_id, sync.engine_id)
        return RetentionOrders(release=orders, dropped=dropped, curves=curves or msgspec.UNSET,
                               shared=shared)

    def _forget_gone(self, node_id: str) -> None:
        """Drop the syncs of D's engines that are not D's any more (a restart)."""
        ranks = self._latest.get(node_id, {})
        for engine_id in [e for e in ranks if not self._nodes.knows_engine(node_id, e)]:
            del ranks[engine_id]

    async def _shared(self) -> str | msgspec.UnsetType:
        """The shared state's name for the answer (``RetentionOrders.shared``), if any."""
        name = await self._index.shared_state()
        return msgspec.UNSET if name is None else name

    def _node_of_token(self, token: str) -> str | None:
        """The D whose sync token ``token`` is, if any."""
        for state in self._nodes.states():
            if state.role == "decode" and hmac.compare_digest(
                    token.encode(), self._token(state.node_id).encode()):
                return state.node_id
        return None

    async def _heard(self, node_id: str, sync: RetentionSync, *,
                     count_causes: bool) -> tuple[str, ...]:
        """What any sync of D ``node_id`` is heard in, whoever sent it (it can only make
        entries recompute): its releases mark entries released, its asks are answered with
        the ids no P leg is reading."""
        if sync.released:
            marked = await self._index.mark_released(node_id, sync.engine_id, sync.released)
            for cause in RELEASE_CAUSES:
                n = sum(1 for r in sync.released if r.cause == cause)
                if n and count_causes:
                    self._metrics.child(self._metrics.releases_seen, node_id, cause).inc(n)
            if marked:
                self._metrics.child(self._metrics.entries_released, node_id).inc(marked)
        dropped: tuple[str, ...] = ()
        if sync.releasing:
            dropped = await self._index.release_requested(node_id, sync.engine_id,
                                                          sync.releasing)
            self._count_answers(node_id, sync.releasing, dropped)
        return dropped

    def _count_answers(self, node_id: str, asked: Iterable[str],
                       dropped: tuple[str, ...]) -> None:
        """Count each ask once per answer: D asks again in every sync until it may free the
        turn, so a read of 3 s was counted a dozen times as ``reading``."""
        free = frozenset(dropped)
        counts: dict[str, int] = {}
        for request_id in asked:
            answer = "dropped" if request_id in free else "reading"
            key = (node_id, request_id)
            if self._answers.get(key) != answer:
                counts[answer] = counts.get(answer, 0) + 1
            self._answers[key] = answer
            self._answers.move_to_end(key)
        while len(self._answers) > MAX_ANSWERS_KEPT:
            self._answers.popitem(last=False)
        for answer, n in counts.items():
            self._metrics.child(self._metrics.release_requests, node_id, answer).inc(n)

    async def _heard_unknown(self, sync: RetentionSync) -> RetentionOrders:
        """A sync whose D this router cannot name: an engine no answer of a D showed it and a
        token no D's (a router restarted without ``--tag-key``: D still posts to the old
        URL). Its turns are another router's, or this one's before it restarted; it is
        heard, in what can only make entries recompute, on every D: releases mark entries
        of that engine released, and asks are answered with the ids no P leg reads on any
        D (D's request ids are unique). A 404 here left D unable to free anything under
        pressure until the turns' TTL, while the request waiting for the blocks was the
        one that would have told this router D's engine."""
        self._metrics.child(self._metrics.retention_syncs, "unknown_engine").inc()
        free: set[str] | None = None
        for state in self._nodes.states():
            if state.role == "decode":
                dropped = await self._heard(state.node_id, sync, count_causes=False)
                free = set(dropped) if free is None else free & set(dropped)
        return RetentionOrders(dropped=tuple(i for i in sync.releasing if i in (free or ())),
                               shared=await self._shared())

    def snapshot(self) -> dict[str, dict[str, object]]:
        """``/stats``' ``retention``: per D, its latest numbers (D's own counts)."""
        now = self._clock()
        out: dict[str, dict[str, object]] = {}
        for node_id in sorted(self._latest):
            state = self.latest(node_id)
            if state is None:
                continue
            sync = state.sync
            out[node_id] = {
                "retained_requests": sync.retained_requests,
                "retained_blocks": sync.retained_blocks,
                "retained_tokens": sync.retained_tokens,
                "retained_bytes": sync.retained_bytes,
                "free_blocks": sync.num_blocks_free,
                "total_blocks": sync.num_blocks_total,
                "releases_total": dict(sync.releases_total),
                "synced_s_ago": round(max(0.0, now - state.synced_at_s), 3),
            }
        return out

    def gauges(self) -> list[tuple[str, RetentionSync]]:
        """Each D's latest sync, for the metrics collector."""
        return [(n, s.sync) for n in sorted(self._latest) if (s := self.latest(n)) is not None]
