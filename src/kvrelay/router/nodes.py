"""The router's live view of its nodes: up/down, engine ids, capabilities, load, costs, health.

A node starts *up* (routable) and goes down after ``health_failures_to_down`` failed health
checks in a row (the background loop), or at once when a request cannot connect to it. A
check that times out does not count against a node that completed a request for this router
since the check before it began: the node is busy (one client's huge prompt), not down, and
marking it down would drop every entry it holds. Refused connections and non-200 answers
always count.
Going down drops every entry the node holds (``index.drop_node``): a node that was down may
have lost its blocks. A passing check brings it back. ``/health`` reads the last known state;
only the loop and real request failures change it. A node's 4xx answers are the client's
fault: they neither count against the node nor leave anything in its state.

Engine ids and side channels are learned only from what a node itself answers
(``remote_engine_id``/``remote_host``/``remote_port`` in its params), never from D's reports:
a report is checked against them (``core.report``). While a D has answered nothing but
streams since it came up, the first report that passes every other check fixes the identity
later reports must match (``report_identity``); a node that goes down forgets it. That
window is closed where D answers: a D that passes a health check with its engine unknown
is asked it (``engine_unknown``, ``router.engine_check``), so a forged first report is not
believed. A new engine id from a node means it restarted: its old entries are rejected by
the policy (``engine_restarted``). A D run data parallel behind one URL answers from one
engine per rank (``core.engine_group``): an id of the same group is another rank, learned
with its own side channel, not a restart. With replicas, ``observe_entry`` adopts the engine id of
an entry another replica wrote after this router last saw the node.

Capabilities, learned from the params a node returns: a P whose answers carry
``kvrelay_guard`` verifies pulls itself (a P that comes up is asked at its first passing
health check, as a D is its engine, so a replica or a restarted router knows before the
first Responses or Messages follow-up it serves there: probe 13, H3); a D whose retained
params (in its answers or in a checked report) carry a fingerprint needs no
``return_token_ids``, and one whose retained params carry ``kvrelay_guard`` runs kvrelay's
connector: it syncs its retention with the router (``router.retention``).

A D's ``max_model_len`` is read from its ``/v1/models`` by the first passing health check
(again after it restarted or was down): a follow-up D would refuse for its length must not
spend the conversation's KV first (``core.policy``, ``too_long``).

Load (``outstanding_requests``, ``outstanding_prefill_tokens``) counts requests in flight.
``CostEstimates`` are kept per P node: its prefill line and the line of its pulls from any D,
starting at ``RouterConfig.costs`` (else the priors); ``set_costs`` is how the P step
replaces them with what it learned (it does not when ``learn_costs`` is off).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec

from kvrelay.core.costs import CostEstimates
from kvrelay.core.engine_group import addressable, dp_rank, same_group
from kvrelay.core.engine_load import EngineRoom, max_model_len_from_models, room_from_metrics
from kvrelay.core.params import RemoteBlocks
from kvrelay.core.selection import NodeState, choose_decode, choose_prefill
from kvrelay.router.config import NodeConfig, RouterConfig
from kvrelay.router.index import ConversationIndex, IndexUnavailable
from kvrelay.router.metrics import RouterMetrics
from kvrelay.router.upstream import Upstream, UpstreamError

log = logging.getLogger("kvrelay.router")

METRICS_INLINE_BYTES = 512 * 1024
"""A D's ``/metrics`` up to this is read on the event loop (vLLM's is ~100-300 KB, under a
millisecond); a larger one in a worker thread: one of 3.9 MB dense in gauge lines (under
``upstream.MAX_GET_BYTES``) blocked the loop 180 ms a read (probe 13, H4)."""
ROOM_STALE_READS = 3
"""A room read from D's ``/metrics`` is used for this many ``room_interval_s``: a missed
read or two (D busy) keeps the last one, older is not D's state any more."""


@dataclass
class _Node:
    config: NodeConfig
    up: bool = True
    engine_id: str | None = None
    """The engine id D answered from last (of a data-parallel D: its latest rank's)."""
    engine_seen_s: float = float("-inf")
    side_channel: tuple[str, int] | None = None
    ranks: dict[str, tuple[str, int] | None] = field(default_factory=dict)
    """The engines of ``engine_id``'s group D answered from (one per data-parallel rank),
    with the side channel each named (``None``: learned without one)."""
    ranks_refused: bool = False
    """Whether D answered a request naming a rank by its id with vLLM's out-of-range 400
    (``router.decode``): its ranks are not named again until its engine group changes."""
    report_identity: tuple[str, str, int] | None = None
    verifies_pulls: bool = False
    """Whether P runs kvrelay's connector: from P's own answers (the first passing health
    check asks it, ``engine_unknown``), forgotten while P is down."""
    fingerprints: bool = False
    retains: bool | None = None
    """Whether D runs kvrelay's connector (its params carry ``kvrelay_guard``); ``None``
    until D's first answer."""
    keeps_stock: bool = False
    """Whether D's connector keeps turns the stock way (``kvrelay_retention: stock``: one
    TTL, the router's orders ignored)."""
    param_streams: frozenset[str] = frozenset()
    block_size: int | None = None
    outstanding_requests: int = 0
    outstanding_prefill_tokens: int = 0
    failures: int = 0
    answers: int = 0
    answers_at_check: int = 0
    last_error: str | None = None
    costs: CostEstimates = field(default_factory=CostEstimates)
    room: tuple[EngineRoom, float] | None = None
    """D's room from its ``/metrics`` and when it was read (``read_room``)."""
    max_model_len: int | None = None
    """D's ``max_model_len`` from its ``/v1/models``, read by the first passing health
    check of each engine (``None``: not read yet, or D did not say)."""
    models_read: bool = False
    """Whether this engine's ``/v1/models`` was read (so a D whose cards carry no length is
    not asked again at every health check)."""
    engine_asked: bool = False
    """Whether the node was asked its engine since it came up (``engine_unknown``)."""

    def state(self) -> NodeState:
        c = self.config
        return NodeState(
            node_id=c.node_id,
            role=c.role,
            url=c.url,
            up=self.up,
            engine_id=self.engine_id,
            outstanding_requests=self.outstanding_requests,
            outstanding_prefill_tokens=self.outstanding_prefill_tokens,
            max_model_len=self.max_model_len,
        )


class NodeRegistry:
    """Mutable per-node state, changed only from the event loop (no locks needed)."""

    def __init__(
        self,
        config: RouterConfig,
        upstream: Upstream,
        index: ConversationIndex,
        metrics: RouterMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._clock = clock
        self._upstream = upstream
        self._index = index
        self._metrics = metrics
        start = (CostEstimates.from_lines(config.costs) if config.costs is not None
                 else CostEstimates())
        self._nodes = {n.node_id: _Node(n, block_size=n.block_size, costs=start)
                       for n in config.nodes}
        self._order = [n.node_id for n in config.nodes]
        self._drained: set[str] = set()
        self.engine_unknown: Callable[[str], Awaitable[str] | None] | None = None
        """Asks D ``node_id``, up with its engine unknown, which engine it runs
        (``EngineChecks.learn``; set by the app): returns the check, else ``None``."""
        for node in self._nodes.values():
            self._publish(node)

    # -- lookups ----------------------------------------------------------------------------

    def config(self, node_id: str) -> NodeConfig:
        return self._nodes[node_id].config

    def state(self, node_id: str) -> NodeState | None:
        """The node's state for the policy, ``None`` for a node this router does not know."""
        node = self._nodes.get(node_id)
        return node.state() if node is not None else None

    def states(self) -> list[NodeState]:
        return [self._nodes[i].state() for i in self._order]

    def is_up(self, node_id: str) -> bool:
        node = self._nodes.get(node_id)
        return node is not None and node.up

    def choose_prefill(self, exclude: frozenset[str] = frozenset()) -> NodeConfig | None:
        """Least outstanding prefill work among up P nodes not in ``exclude``."""
        exclude = exclude | self._drained
        choice = choose_prefill([s for s in self.states() if s.node_id not in exclude])
        return self._nodes[choice.node_id].config if choice else None

    def choose_decode(
        self, affinity: str | None = None, exclude: frozenset[str] = frozenset(), *,
        needed_tokens: int | None = None, room: Callable[[str], int | None] | None = None,
        affinity_held_tokens: int = 0,
    ) -> NodeConfig | None:
        """The affinity D unless down/overloaded/excluded, else the least loaded up D; of
        those with room for ``needed_tokens`` (``room``: a D's room in tokens, from its own
        numbers) when some have none (``core.selection.choose_decode``)."""
        exclude = exclude | self._drained
        states = [s for s in self.states() if s.node_id not in exclude]
        if room is not None:
            states = [msgspec.structs.replace(s, room_tokens=room(s.node_id))
                      if s.role == "decode" else s for s in states]
        choice = choose_decode(states, affinity, self._config.affinity, needed_tokens,
                               affinity_held_tokens)
        return self._nodes[choice.node_id].config if choice else None

    def set_drained(self, node_id: str, drained: bool) -> None:
        """Stop (or resume) choosing the node for new turns (``/admin/nodes/.../drain``)."""
        (self._drained.add if drained else self._drained.discard)(node_id)
        log.info("node %s %s", node_id, "drained" if drained else "undrained")

    def adopt_drained(self, drained: frozenset[str]) -> None:
        """The drains the replicas share (``ConversationIndex.drained_nodes``), for the
        nodes this router knows."""
        for node_id in self._order:
            if (node_id in drained) != (node_id in self._drained):
                self.set_drained(node_id, node_id in drained)

    def costs(self, node_id: str) -> CostEstimates:
        return self._nodes[node_id].costs

    def set_costs(self, node_id: str, costs: CostEstimates) -> None:
        self._nodes[node_id].costs = costs

    def verifies_pulls(self, node_id: str) -> bool:
        """Whether P runs kvrelay's connector (or ``guard=connector`` says so)."""
        mode = self._config.guard
        return mode == "connector" or (mode == "auto" and self._nodes[node_id].verifies_pulls)

    def fingerprints(self, node_id: str) -> bool:
        """Whether D's retained params carry the fingerprint (no token ids needed)."""
        mode = self._config.guard
        return mode == "connector" or (mode == "auto" and self._nodes[node_id].fingerprints)

    def manages_retention(self, node_id: str) -> bool:
        """Whether D runs kvrelay's connector (its retained params carry ``kvrelay_guard``,
        or ``guard=connector`` says so), so it accounts retention, syncs it with the router
        and reads ``kvrelay_retain_s``. A D not heard from yet counts as one: its first turn
        then carries the keys too (a stock D ignores them), so the turn is D's to release
        under pressure like every later one."""
        mode = self._config.guard
        return mode == "connector" or (mode == "auto" and self._nodes[node_id].retains
                                       is not False)

    def takes_orders(self, node_id: str) -> bool:
        """Whether D takes the router's release orders in its sync's answer: it manages
        retention and its connector does not keep turns the stock way (a stock-keeping D,
        like a stock vLLM one, has its orders carried out through P: ``stock_release``)."""
        return self.manages_retention(node_id) and not self._nodes[node_id].keeps_stock

    def decode_node_for_engine(self, engine_id: str) -> str | None:
        """The D one of whose current engines (``knows_engine``) is ``engine_id``, if any."""
        for node_id in self._order:
            if self._nodes[node_id].config.role == "decode" \
                    and self.knows_engine(node_id, engine_id):
                return node_id
        return None

    def engines(self, node_id: str) -> tuple[str, ...]:
        """The node's current engines (``knows_engine``): one, or a data-parallel D's ranks
        it answered from; none while unknown."""
        node = self._nodes[node_id]
        if node.engine_id is not None:
            return tuple(node.ranks)
        return (node.report_identity[0],) if node.report_identity is not None else ()

    def takes_ranks(self, node_id: str) -> bool:
        """Whether a request may name one of the node's ranks (``X-data-parallel-rank``): it
        answers as rank 0 (``core.engine_group.addressable``) and did not refuse one."""
        return not self._nodes[node_id].ranks_refused and addressable(self.engines(node_id))

    def refuse_ranks(self, node_id: str) -> None:
        """The node refused a rank a request named: name none until its group changes."""
        self._nodes[node_id].ranks_refused = True

    def knows_engine(self, node_id: str, engine_id: str) -> bool:
        """Whether ``engine_id`` is one of the node's current engines (``trusted_identity``):
        one it answered from, any rank of a data-parallel D."""
        return bool(engine_id) and self.trusted_identity(node_id, engine_id)[0] == engine_id

    def streams_params(self, node_id: str, family: str = "chunks") -> bool:
        """Whether D's last stream of a ``family`` of APIs (``ApiAdapter.stream_family``)
        ended with its params on the final event (vLLM >= 0.33 chat): then its streams need
        no report. Learned per node and family, so a D that stops doing it (a downgrade, a
        restart into another release) is asked for reports again after one stream that
        could not commit."""
        return family in self._nodes[node_id].param_streams

    def observe_stream(self, node_id: str, params_seen: bool, family: str = "chunks") -> None:
        """A stream of D's ended; ``params_seen``: its final event carried its params."""
        node = self._nodes.get(node_id)
        if node is not None:
            node.param_streams = node.param_streams | {family} if params_seen \
                else node.param_streams - {family}

    def block_size(self, node_id: str) -> int | None:
        return self._nodes[node_id].block_size

    def trusted_identity(self, node_id: str, engine_id: str | None = None
                         ) -> tuple[str | None, tuple[str, int] | None]:
        """D's engine id and side channel for checking a report that names ``engine_id``:
        from D's own answers (that engine's, when D answered from it: a rank of a
        data-parallel D; else the latest), else from the first report accepted since D came
        up."""
        node = self._nodes[node_id]
        if node.engine_id is not None:
            if engine_id is not None and engine_id in node.ranks:
                return engine_id, node.ranks[engine_id]
            return node.engine_id, node.side_channel
        if node.report_identity is not None:
            engine, host, port = node.report_identity
            return engine, (host, port)
        return None, None

    def accept_report_identity(self, node_id: str, blocks: RemoteBlocks) -> None:
        """A checked report's identity, kept only while D's own answers have shown none;
        whether D fingerprints (harmless to believe: an entry without a fingerprint is never
        committed)."""
        node = self._nodes[node_id]
        node.fingerprints = blocks.fingerprint is not None
        node.retains = blocks.guard_version is not None
        node.keeps_stock = blocks.retention == "stock"
        if node.engine_id is None and node.report_identity is None:
            node.report_identity = (blocks.engine_id, blocks.host, blocks.port)

    # -- load -------------------------------------------------------------------------------

    def busy(self, node_id: str, prefill_tokens: int = 0) -> _Busy:
        """Count one request (and its prefill tokens) as outstanding on the node while the
        returned context is entered."""
        return _Busy(self._nodes[node_id], prefill_tokens)

    # -- what nodes answer ------------------------------------------------------------------

    def observe_params(self, node_id: str, blocks: RemoteBlocks) -> bool:
        """Learn from params a node returned itself: engine id, side channel, capabilities.
        True if the engine id changed from a known one (the node restarted)."""
        node = self._nodes.get(node_id)
        if node is None:
            return False
        if node.config.role == "prefill":
            node.verifies_pulls = blocks.guard_version is not None
        else:
            node.fingerprints = blocks.fingerprint is not None
            node.retains = blocks.guard_version is not None
            node.keeps_stock = blocks.retention == "stock"
            if blocks.block_size is not None and node.config.block_size is None:
                node.block_size = blocks.block_size
            return self.observe_engine(node_id, blocks.engine_id, (blocks.host, blocks.port))
        return self.observe_engine(node_id, blocks.engine_id)

    def observe_engine(self, node_id: str, engine_id: str,
                       side_channel: tuple[str, int] | None = None) -> bool:
        """Record the node's current engine id (and that engine's side channel, when
        known); True if it changed from a known one to another group (``core.engine_group``:
        another rank of a data-parallel D is not a restart)."""
        node = self._nodes.get(node_id)
        if node is None or not engine_id:
            return False
        node.engine_seen_s = self._clock()
        node.report_identity = None
        if side_channel is not None:
            node.side_channel = side_channel
        if node.engine_id is not None and same_group(node.engine_id, engine_id):
            node.engine_id = engine_id
            if side_channel is not None or engine_id not in node.ranks:
                node.ranks[engine_id] = side_channel
            return False
        old, node.engine_id = node.engine_id, engine_id
        node.ranks = {engine_id: side_channel}
        node.ranks_refused = False
        node.param_streams = frozenset()
        if old is not None:
            node.max_model_len = None  # the new engine's may differ: the next check reads it
            node.models_read = False
            log.warning("node %s restarted: engine %s -> %s", node_id, old, engine_id)
            return True
        return False

    def observe_entry(self, node_id: str, engine_id: str, created_at_s: float) -> bool:
        """An entry (maybe from another replica) says ``node_id`` ran ``engine_id`` at
        ``created_at_s``: adopt that id if it is newer than what this router saw last."""
        node = self._nodes.get(node_id)
        if node is None or engine_id in node.ranks or created_at_s <= node.engine_seen_s:
            return False
        return self.observe_engine(node_id, engine_id)

    async def request_failed(self, error: UpstreamError) -> None:
        """Count a failed call (not the client's 4xx); a node that cannot be connected to is
        marked down at once."""
        if error.client_fault:
            return
        self._metrics.upstream_error(error.node_id, error.kind, error.status)
        node = self._nodes.get(error.node_id)
        if node is not None:
            node.last_error = _describe(error)
        if error.kind == "connect":
            await self.mark_down(error.node_id, "unreachable")

    async def mark_down(self, node_id: str, reason: str) -> None:
        """Make the node unroutable and drop the entries it holds (no-op if already down)."""
        node = self._nodes[node_id]
        node.last_error = reason
        if not node.up:
            return
        node.up = False
        node.report_identity = None
        node.engine_id = None
        node.side_channel = None
        node.ranks = {}
        node.ranks_refused = False
        node.max_model_len = None
        node.models_read = False
        node.engine_asked = False
        node.verifies_pulls = False  # a P that comes back may run another connector
        self._publish(node)
        dropped = await self._index.drop_node(node_id)
        if dropped:
            self._metrics.dropped.labels("node_down").inc(dropped)
        log.warning("node %s down (%s); dropped %d entries", node_id, reason, dropped)

    def mark_up(self, node_id: str) -> None:
        node = self._nodes[node_id]
        node.failures = 0
        if node.up:
            return
        node.up = True
        self._publish(node)
        log.info("node %s up", node_id)

    # -- health -----------------------------------------------------------------------------

    async def check(self, node_id: str) -> bool:
        """One ``GET /health``; updates up/down; returns whether the node answered 200."""
        node = self._nodes[node_id]
        answered_before, node.answers_at_check = node.answers_at_check, node.answers
        busy = False
        try:
            answer = await self._upstream.get(
                node.config, "/health", timeout_s=self._config.health_timeout_s
            )
            ok, why = answer.status == 200, f"health answered HTTP {answer.status}"
        except UpstreamError as exc:
            ok, why = False, f"health check failed ({exc.kind})"
            busy = exc.kind == "timeout" and node.answers > answered_before
        if ok:
            self.mark_up(node_id)
            if node.config.role == "decode" and not node.models_read:
                await self._read_max_model_len(node)
            if node.engine_id is None and not node.engine_asked:
                await self._ask_engine(node)
            return True
        if busy:
            log.debug("node %s: health check timed out while it answers requests", node_id)
            return False
        node.failures += 1
        node.last_error = why
        if node.failures >= self._config.health_failures_to_down:
            await self.mark_down(node_id, why)
        return False

    async def _ask_engine(self, node: _Node) -> None:
        """Have a node, up with its engine unknown, asked its engine (``engine_unknown``; a
        P's answer also says whether it runs kvrelay's connector), and wait for the answer
        at most ``health_timeout_s`` (the check goes on beyond it). Asked once while the
        node stays up; again at the next check if it gave no answer."""
        if self.engine_unknown is None:
            return
        check = self.engine_unknown(node.config.node_id)
        if check is None:
            return
        node.engine_asked = True
        try:
            outcome = await asyncio.wait_for(asyncio.shield(check),
                                             self._config.health_timeout_s)
        except TimeoutError:
            return
        if outcome == "failed":
            node.engine_asked = False

    async def _read_max_model_len(self, node: _Node) -> None:
        """Learn D's ``max_model_len`` from its ``/v1/models`` (``core.engine_load``); a
        failed read leaves it unknown (the policy then does not check a turn's length)."""
        try:
            answer = await self._upstream.get(
                node.config, "/v1/models", timeout_s=self._config.health_timeout_s)
        except UpstreamError:
            return
        if answer.status == 200:
            node.max_model_len = max_model_len_from_models(answer.body)
            node.models_read = True

    async def check_all(self) -> dict[str, bool]:
        """Health-check every node concurrently."""
        results = await asyncio.gather(*(self.check(i) for i in self._order))
        return dict(zip(self._order, results, strict=True))

    async def run_health_loop(self) -> None:
        """``health_round`` every ``health_interval_s`` until cancelled."""
        while True:
            try:
                await self.health_round()
            except Exception:  # never let the loop die
                log.exception("health check round failed")
            await asyncio.sleep(self._config.health_interval_s)

    async def health_round(self) -> None:
        """Check every node, refresh what the index shares, adopt the replicas' drains."""
        await self.check_all()
        await self._index.refresh([n.node_id for n in self._config.decode])
        drained = await self._index.drained_nodes()
        if drained is not None:
            self.adopt_drained(drained)
        else:  # nothing shared, or the store lost it: this replica's own drains hold
            for node_id in sorted(self._drained):
                with contextlib.suppress(IndexUnavailable):
                    await self._index.set_drained(node_id, True)
        conflicts = await self._index.node_urls(
            {n.node_id: n.url for n in self._config.nodes})
        self._metrics.node_config_conflicts.set(len(conflicts))
        if conflicts:
            log.error("another router on the same shared state lists node(s) %s with other "
                      "URLs (%s): replicas must list the same nodes in the same order, or "
                      "give each node an id; until then each reads the other's entries for "
                      "other nodes", sorted(conflicts),
                      ", ".join(f"{k}={v}" for k, v in sorted(conflicts.items())))

    # -- room -------------------------------------------------------------------------------

    async def read_room(self, node_id: str) -> EngineRoom | None:
        """One ``GET /metrics`` of D: its room for a new request from vLLM's own gauges
        (``core.engine_load``), kept for ``metrics_room``; ``None`` (and nothing kept) when
        D did not answer them. Counted by outcome (``room_reads_total``: ``ok``,
        ``no_gauges``, ``failed``), so a D whose gauges cannot be read shows. A failed read
        changes nothing of D's health."""
        node = self._nodes[node_id]
        try:
            answer = await self._upstream.get(
                node.config, "/metrics", timeout_s=self._config.health_timeout_s)
        except UpstreamError:
            self._metrics.child(self._metrics.room_reads, node_id, "failed").inc()
            return None
        room = None
        if answer.status == 200:
            text = answer.body.decode("utf-8", "replace")
            room = room_from_metrics(text) if len(answer.body) <= METRICS_INLINE_BYTES \
                else await asyncio.to_thread(room_from_metrics, text)
        outcome = "ok" if room is not None else "no_gauges" if answer.status == 200 \
            else "failed"
        self._metrics.child(self._metrics.room_reads, node_id, outcome).inc()
        node.room = (room, self._clock()) if room is not None else None
        return room

    def metrics_room(self, node_id: str) -> tuple[EngineRoom, float] | None:
        """D's room as its ``/metrics`` said at most ``ROOM_STALE_READS`` reads ago, and
        when it was read; ``None`` without such a read."""
        node = self._nodes.get(node_id)
        if node is None or node.room is None or not node.up:
            return None
        room, read_at_s = node.room
        if self._clock() - read_at_s > ROOM_STALE_READS * self._config.room_interval_s:
            return None
        return room, read_at_s

    def rank_waiting(self, node_id: str, engine_id: str) -> int | None:
        """The requests waiting for capacity on a data-parallel D's rank ``engine_id`` by
        its last ``/metrics`` read (``metrics_room``; vLLM labels each rank's gauges with
        its index), ``None`` without one."""
        read = self.metrics_room(node_id)
        rank = dp_rank(engine_id)
        if read is None or rank is None:
            return None
        return read[0].waiting_on(str(rank))

    async def run_room_loop(self) -> None:
        """Read every D's room every ``room_interval_s`` until cancelled (never when 0),
        each D on its own, so a D slow to answer delays no other's reads."""
        if self._config.room_interval_s <= 0:
            return
        await asyncio.gather(*(self._room_loop(i) for i in self._decode_ids()))

    async def _room_loop(self, node_id: str) -> None:
        while True:
            if self.is_up(node_id):
                try:
                    await self.read_room(node_id)
                except Exception:  # never let the loop die
                    log.exception("room read of %s failed", node_id)
            await asyncio.sleep(self._config.room_interval_s)

    def _decode_ids(self) -> list[str]:
        return [i for i in self._order if self._nodes[i].config.role == "decode"]

    def available(self) -> tuple[bool, bool]:
        """Whether at least one P, and at least one D, is routable: up (last known state)
        and not drained. (Every D drained answered ``/health`` ok while every turn got a
        503: probe 14, K6.)"""
        up = [n for n in self._nodes.values()
              if n.up and n.config.node_id not in self._drained]
        return (any(n.config.role == "prefill" for n in up),
                any(n.config.role == "decode" for n in up))

    def drained(self) -> frozenset[str]:
        """The nodes an admin drained (``set_drained``)."""
        return frozenset(self._drained)

    def describe(self, *, admin: bool, load: bool = True) -> list[dict[str, object]]:
        """Nodes for ``/stats``, with ``load`` their load and learned costs (every tenant's
        traffic: the prompt tokens in flight tell one tenant how long another's prompt is,
        the sample counts how many requests others send; so not for a tenant's view), and
        with ``admin`` for ``/admin/nodes`` (engine ids, side channels, URLs, last error
        kind)."""
        out: list[dict[str, object]] = []
        for node_id in self._order:
            n = self._nodes[node_id]
            item: dict[str, object] = {
                "id": node_id,
                "role": n.config.role,
                "up": n.up,
                "drained": node_id in self._drained,
            }
            if load or admin:
                item.update({
                    "outstanding_requests": n.outstanding_requests,
                    "outstanding_prefill_tokens": n.outstanding_prefill_tokens,
                    "costs": _costs_json(n.costs) if n.config.role == "prefill" else None,
                })
                if n.room is not None:  # D's last read of its gauges (``read_room``)
                    room, read_at_s = n.room
                    item["room"] = {"free_tokens": room.free_tokens,
                                    "waiting": room.num_waiting,
                                    "read_s_ago": round(self._clock() - read_at_s, 3)}
            if admin:
                item.update({
                    "url": n.config.url,
                    "engine_id": n.engine_id,
                    "engines": sorted(n.ranks),  # one per rank of a data-parallel D
                    "side_channel": list(n.side_channel) if n.side_channel else None,
                    "verifies_pulls": n.verifies_pulls if n.config.role == "prefill" else None,
                    "fingerprints": n.fingerprints if n.config.role == "decode" else None,
                    "guard": self.guard_mode(node_id),
                    "max_model_len": n.max_model_len if n.config.role == "decode" else None,
                    "last_error": n.last_error,
                })
            out.append(item)
        return out

    def guard_mode(self, node_id: str) -> str:
        """Where turns through this node are checked: ``connector`` or ``tokenize``."""
        node = self._nodes[node_id]
        if node.config.role == "prefill":
            return "connector" if self.verifies_pulls(node_id) else "tokenize"
        return "connector" if self.fingerprints(node_id) else "tokenize"

    def _publish(self, node: _Node) -> None:
        self._metrics.node_up.labels(node.config.node_id, node.config.role).set(
            1.0 if node.up else 0.0
        )


class _Busy:
    """``NodeRegistry.busy``'s context (a class: a generator context costs twice as much on
    a path taken twice per turn)."""

    __slots__ = ("_node", "_tokens")

    def __init__(self, node: _Node, tokens: int) -> None:
        self._node = node
        self._tokens = tokens

    def __enter__(self) -> None:
        self._node.outstanding_requests += 1
        self._node.outstanding_prefill_tokens += self._tokens

    def __exit__(self, kind: object, *exc: object) -> None:
        self._node.outstanding_requests -= 1
        self._node.outstanding_prefill_tokens -= self._tokens
        if kind is None:
            self._node.answers += 1


def _describe(error: UpstreamError) -> str:
    """A node error for operators: its kind and status, never request content."""
    if error.kind == "status":
        return f"HTTP {error.status}"
    return error.kind


def _costs_json(costs: CostEstimates) -> dict[str, object]:
    return {
        "prefill_s_per_token": costs.prefill.fit.line.s_per_token,
        "prefill_fixed_s": costs.prefill.fit.line.fixed_s,
        "prefill_samples": costs.prefill.fit.num_samples,
        "transfer_s_per_token": costs.transfer.fit.line.s_per_token,
        "transfer_overhead_s": costs.transfer.fit.line.fixed_s,
        "transfer_samples": costs.transfer.fit.num_samples,
    }
