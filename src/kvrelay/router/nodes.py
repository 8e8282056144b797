"""The router's live view of its nodes: up/down, engine ids, load, cost estimates, health.

A node starts *up* (routable) and goes down after ``health_failures_to_down`` failed health
checks in a row, or at once when a request cannot connect to it. Going down drops every
conversation entry the node holds (``store.drop_node``): a node that was down may have lost
its blocks. A successful health check brings it back.

Engine ids are learned from ``remote_engine_id`` in the params a node returns. A new id for a
node means the engine restarted; entries retained by the old engine are not dropped here but
rejected by the policy (``engine_restarted``) when their conversation's next turn arrives.
With a shared store (several router replicas) an entry written by another replica is evidence
too: ``observe_entry`` adopts its engine id when the entry was created after this router last
saw the node's engine (router clock; the store converts times through the wall clock), so a
restart one replica noticed is not mistaken by another for a stale entry, nor the reverse.

Load (``outstanding_requests``, ``outstanding_prefill_tokens``) counts requests in flight,
via ``busy()``. ``CostEstimates`` are kept per P node: its prefill rate and the rate at which
it pulls KV from any D.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvrelay.core.costs import CostEstimates
from kvrelay.core.selection import NodeState, choose_decode, choose_prefill
from kvrelay.router.config import NodeConfig, RouterConfig
from kvrelay.router.metrics import RouterMetrics
from kvrelay.router.store import ConversationStore
from kvrelay.router.upstream import Upstream, UpstreamError

log = logging.getLogger("kvrelay.router")


@dataclass
class _Node:
    config: NodeConfig
    up: bool = True
    engine_id: str | None = None
    engine_seen_s: float = float("-inf")
    outstanding_requests: int = 0
    outstanding_prefill_tokens: int = 0
    failures: int = 0
    last_error: str | None = None
    costs: CostEstimates = field(default_factory=CostEstimates)

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
        )


class NodeRegistry:
    """Mutable per-node state, changed only from the event loop (no locks needed)."""

    def __init__(
        self,
        config: RouterConfig,
        upstream: Upstream,
        store: ConversationStore,
        metrics: RouterMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._clock = clock
        self._upstream = upstream
        self._store = store
        self._metrics = metrics
        self._nodes = {n.node_id: _Node(n) for n in config.nodes}
        self._order = [n.node_id for n in config.nodes]
        self._drained: set[str] = set()  # admin: no new turns, entries stay usable
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

    def choose_prefill(self, exclude: frozenset[str] = frozenset()) -> NodeConfig | None:
        """Least outstanding prefill work among up P nodes not in ``exclude``."""
        exclude = exclude | self._drained
        choice = choose_prefill([s for s in self.states() if s.node_id not in exclude])
        return self._nodes[choice.node_id].config if choice else None

    def choose_decode(
        self, affinity: str | None = None, exclude: frozenset[str] = frozenset()
    ) -> NodeConfig | None:
        """The affinity D unless down/overloaded/excluded, else the least loaded up D."""
        exclude = exclude | self._drained
        states = [s for s in self.states() if s.node_id not in exclude]
        choice = choose_decode(states, affinity, self._config.affinity)
        return self._nodes[choice.node_id].config if choice else None

    def set_drained(self, node_id: str, drained: bool) -> None:
        """Stop (or resume) choosing the node for new turns (``/admin/nodes/.../drain``)."""
        (self._drained.add if drained else self._drained.discard)(node_id)
        log.info("node %s %s", node_id, "drained" if drained else "undrained")

    def costs(self, node_id: str) -> CostEstimates:
        return self._nodes[node_id].costs

    def set_costs(self, node_id: str, costs: CostEstimates) -> None:
        self._nodes[node_id].costs = costs

    # -- load -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def busy(self, node_id: str, prefill_tokens: int = 0) -> Iterator[None]:
        """Count one request (and its prefill tokens) as outstanding on the node meanwhile."""
        node = self._nodes[node_id]
        node.outstanding_requests += 1
        node.outstanding_prefill_tokens += prefill_tokens
        try:
            yield
        finally:
            node.outstanding_requests -= 1
            node.outstanding_prefill_tokens -= prefill_tokens

    # -- engine ids and failures ------------------------------------------------------------

    def observe_engine(self, node_id: str, engine_id: str) -> bool:
        """Record the node's current engine id; True if it changed from a known one."""
        node = self._nodes.get(node_id)
        if node is None or not engine_id:
            return False
        node.engine_seen_s = self._clock()
        if node.engine_id == engine_id:
            return False
        old, node.engine_id = node.engine_id, engine_id
        if old is not None:
            log.warning("node %s restarted: engine %s -> %s", node_id, old, engine_id)
            return True
        return False

    def observe_entry(self, node_id: str, engine_id: str, created_at_s: float) -> bool:
        """An entry (maybe from another replica) says ``node_id`` ran ``engine_id`` at
        ``created_at_s``: adopt that id if it is newer than what this router saw last.
        True if the node's engine id changed from a known one."""
        node = self._nodes.get(node_id)
        if node is None or node.engine_id == engine_id or created_at_s <= node.engine_seen_s:
            return False
        return self.observe_engine(node_id, engine_id)

    async def request_failed(self, error: UpstreamError) -> None:
        """Count a failed call; a node that cannot be connected to is marked down at once."""
        self._metrics.upstream_errors.labels(error.node_id, error.kind).inc()
        node = self._nodes.get(error.node_id)
        if node is not None:
            node.last_error = error.message
        if error.kind == "connect":
            await self.mark_down(error.node_id, error.message)

    async def mark_down(self, node_id: str, reason: str) -> None:
        """Make the node unroutable and drop the entries it holds (no-op if already down)."""
        node = self._nodes[node_id]
        node.last_error = reason
        if not node.up:
            return
        node.up = False
        self._publish(node)
        dropped = await self._store.drop_node(node_id)
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
        try:
            resp = await self._upstream.get(
                node.config, "/health", timeout_s=self._config.health_timeout_s
            )
            ok, why = resp.status_code == 200, f"health answered HTTP {resp.status_code}"
        except UpstreamError as exc:
            ok, why = False, f"health check failed: {exc.message}"
        if ok:
            self.mark_up(node_id)
            return True
        node.failures += 1
        node.last_error = why
        if node.failures >= self._config.health_failures_to_down:
            await self.mark_down(node_id, why)
        return False

    async def check_all(self) -> dict[str, bool]:
        """Health-check every node concurrently."""
        results = await asyncio.gather(*(self.check(i) for i in self._order))
        return dict(zip(self._order, results, strict=True))

    async def run_health_loop(self) -> None:
        """Check every node every ``health_interval_s`` until cancelled."""
        while True:
            try:
                await self.check_all()
            except Exception:  # never let the loop die
                log.exception("health check round failed")
            await asyncio.sleep(self._config.health_interval_s)

    def describe(self) -> list[dict[str, object]]:
        """Nodes for ``/stats`` and ``/health``."""
        out: list[dict[str, object]] = []
        for node_id in self._order:
            n = self._nodes[node_id]
            out.append({
                "id": node_id,
                "role": n.config.role,
                "url": n.config.url,
                "up": n.up,
                "drained": node_id in self._drained,
                "engine_id": n.engine_id,
                "outstanding_requests": n.outstanding_requests,
                "outstanding_prefill_tokens": n.outstanding_prefill_tokens,
                "last_error": n.last_error,
                "costs": _costs_json(n.costs) if n.config.role == "prefill" else None,
            })
        return out

    def _publish(self, node: _Node) -> None:
        self._metrics.node_up.labels(node.config.node_id, node.config.role).set(
            1.0 if node.up else 0.0
        )


def _costs_json(costs: CostEstimates) -> dict[str, object]:
    return {
        "prefill_s_per_token": costs.prefill.seconds_per_token.value,
        "prefill_samples": costs.prefill.seconds_per_token.num_samples,
        "transfer_s_per_token": costs.transfer.seconds_per_token.value,
        "transfer_overhead_s": costs.transfer.overhead_s.value,
        "transfer_samples": costs.transfer.seconds_per_token.num_samples,
    }
