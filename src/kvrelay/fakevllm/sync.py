"""A fake D's retention sync with its routers, as kvrelay's connector does it.

``core.retention_sync`` is the contract: D POSTs a ``RetentionSync`` (JSON) to every
``kvrelay_retention_url`` its decode requests carried (the ``MAX_SYNC_URLS`` most recent),
every ``SYNC_INTERVAL_S`` on the engine's clock while it holds retained turns or has releases
to tell, and at once after a release or an ask (``releasing``); the router answers
``RetentionOrders`` and D frees what it orders released and what it answers ``dropped``
(``Retention.obey``). A turn whose router does not answer is asked of one that answers for
it (``core.retention_sync.ask_via``: the same router restarted, or a replica naming the same
shared state), as kvrelay's connector does. A URL outside ``report_hosts`` is never
contacted (as for reports); a failed post or an answer that is not the contract's keeps
the releases for the next sync.

The loop runs while there is something to tell and wakes every ``POLL_S`` event-loop seconds
to look at the engine's clock, so a ``ManualClock`` moved by a test drives it like real time.
Each round first runs the engine's ``tick`` (expiry of deadlines), so a turn is released at
its deadline even when no request comes. Each URL's sync is a task of its own (a lane, as
kvrelay's connector has a thread per router): a router that never answers holds up only its
own syncs, for ``POST_TIMEOUT_S``; a round while a URL's sync is in flight makes it sync
once more right after.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import Callable, Collection

import aiohttp

from kvrelay.core.report import ReportHosts
from kvrelay.core.retention_sync import (
    SYNC_INTERVAL_S,
    RetentionOrders,
    RetentionSyncError,
    decode_orders,
    encode,
)
from kvrelay.fakevllm.latency import Clock
from kvrelay.fakevllm.retention import Retention

POLL_S = 0.01
"""How often (event-loop seconds) the sync loop looks at the engine's clock."""
POST_TIMEOUT_S = 2.0


class SyncOutcome:
    """The last sync to one URL: HTTP status, the orders applied, or the error."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.status: int | None = None
        self.orders: RetentionOrders | None = None
        self.error: str | None = None
        self.count = 0


class Syncer:
    """Syncs one engine incarnation's ``Retention`` (module docstring)."""

    def __init__(self, retention: Retention, engine_id: str, *, clock: Clock,
                 tick: Callable[[], object], allowed_hosts: Collection[str]) -> None:
        self._retention = retention
        self._engine_id = engine_id
        self._clock = clock
        self._tick = tick
        self._allowed = ReportHosts(allowed_hosts)
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._lanes: dict[str, asyncio.Task[None]] = {}
        self._due: set[str] = set()
        self._next_s = float("-inf")
        self.outcomes: dict[str, SyncOutcome] = {}

    def wake(self) -> None:
        """Something to tell may have appeared (a turn retained, a release, a new URL)."""
        if not self._retention.urls:
            return
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        task, self._task = self._task, None
        tasks = [*([task] if task is not None else []), *self._lanes.values()]
        self._lanes = {}
        for each in tasks:
            each.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def sync_now(self) -> None:
        """One round to every URL, waited for (tests; the loop starts rounds when due)."""
        await asyncio.gather(*self._round())

    def _round(self) -> list[asyncio.Task[None]]:
        """Start a sync to every URL whose lane is idle; the lanes of this round."""
        self._next_s = self._clock() + SYNC_INTERVAL_S
        self._retention.urgent = False
        loop = asyncio.get_running_loop()
        lanes = []
        for url in self._retention.urls:
            self._due.add(url)
            lane = self._lanes.get(url)
            if lane is None or lane.done():
                lane = self._lanes[url] = loop.create_task(self._lane(url))
            lanes.append(lane)
        for gone in set(self._lanes) - set(self._retention.urls):
            if self._lanes[gone].done():
                del self._lanes[gone]
        return lanes

    async def _lane(self, url: str) -> None:
        """Sync ``url`` while a round has asked for it (a round while its sync was in flight
        asks once more, right after)."""
        while url in self._due and url in self._retention.urls:
            self._due.discard(url)
            await self._sync(url)

    async def _run(self) -> None:
        while self._retention.urls:
            self._tick()
            retention = self._retention
            if retention.urgent or (retention.has_news() and self._clock() >= self._next_s):
                self._round()
            elif not retention.has_news() and all(t.done() for t in self._lanes.values()):
                return
            await asyncio.sleep(POLL_S)

    async def _sync(self, url: str) -> None:
        outcome = self.outcomes.setdefault(url, SyncOutcome(url))
        host = urllib.parse.urlsplit(url).hostname or ""
        if not self._allowed.allows(host):
            outcome.error = f"host {host!r} not in report_hosts"
            return
        body = self._retention.sync_body(self._engine_id, url)
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=POST_TIMEOUT_S), trust_env=False)
        outcome.count += 1
        try:
            async with self._session.post(
                url, data=encode(body), headers={"Content-Type": "application/json"},
            ) as response:
                answer = await response.read()
                outcome.status = response.status
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
            self._retention.unanswered(url)
            return
        if not 200 <= outcome.status < 300:
            outcome.error = f"HTTP {outcome.status}"
            self._retention.unanswered(url)
            return
        self._retention.told(url, body.released)
        try:
            orders = decode_orders(answer) if answer.strip() else RetentionOrders()
        except RetentionSyncError as exc:
            outcome.error = str(exc)
            self._retention.unanswered(url)
            return
        outcome.error = None
        outcome.orders = orders
        self._retention.answered(url, orders.shared_state)
        self._retention.obey(url, orders, body.releasing)
