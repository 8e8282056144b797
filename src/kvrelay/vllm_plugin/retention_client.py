"""D's retention sync with the routers: daemon threads of the connector's scheduler process.

The scheduler thread (kvrelay's connector, ``kvrelay.vllm_plugin.connector``) never waits on
the network: each step it ``publish``es an immutable ``LedgerView`` and the releases it made,
and takes the routers' answers with ``take_orders``; this thread POSTs
``kvrelay.core.retention_sync.RetentionSync`` to each router D knows (the
``kvrelay_retention_url`` of recent decode requests, at most ``MAX_SYNC_URLS``, hosts allowed
as for reports: ``kvrelay_report_hosts``) every ``SYNC_INTERVAL_S`` while D holds retained
turns, waits on a router's answer or has releases to tell, and at once when the scheduler
thread asks (a release made or asked for), and once more when D has become idle (so a
router's gauges fall to zero). Each router gets the releases since its previous
successful sync (kept, up to ``MAX_RELEASED_PER_SYNC``, while it is unreachable) and only
the ``releasing`` ids of the turns it gave, or of turns it answers for when their own
router does not (``core.retention_sync.ask_via``: the same router restarted at another
token, or a replica naming the same shared state); its answer's ``dropped`` frees each
turn as its own router's would. vLLM-free.

**One lane per router**: each router D knows is synced from a thread of its own, over its own
keep-alive connection. A router that accepts connections and never answers (wedged, or a
replica being shut down whose socket still listens) then holds up only its own lane, for the
POST's timeout, while D's asks reach the other routers at once: synced one after another,
every ask waited behind it, its answer came after D's ``confirm_timeout_s``, and D kept
asking and falling back to waiting for the TTL, as stock vLLM does.
"""

from __future__ import annotations

import collections
import http.client
import logging
import queue
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Sequence

import msgspec

from kvrelay.core.report import ReportHosts
from kvrelay.core.retention_sync import (
    MAX_RELEASED_PER_SYNC,
    MAX_SHARED_MEMORY,
    MAX_SYNC_URLS,
    SYNC_INTERVAL_S,
    Lane,
    Released,
    RetentionOrders,
    RetentionSync,
    RetentionSyncError,
    ask_via,
    decode_orders,
    encode,
)
from kvrelay.vllm_plugin.retention import LedgerView

Post = Callable[[str, bytes], bytes]
"""POST a JSON body to a URL and return the answer's body; raises ``OSError`` or
``http.client.HTTPException`` (a non-2xx answer is an ``HTTPException``)."""


class Engine(msgspec.Struct, frozen=True):
    """What every sync says about D's engine (fixed for the process's life)."""

    engine_id: str
    block_size: int
    bytes_per_block: int
    num_blocks_total: int


class Orders(msgspec.Struct, frozen=True):
    """One router's answer, for the scheduler thread to apply."""

    url: str
    orders: RetentionOrders


class _Lane:
    """One router's sync thread: woken by ``wake``, ended by ``stop``."""

    def __init__(self, url: str, post: Post) -> None:
        self.url = url
        self.post = post
        self.wake = threading.Event()
        self.stopped = False
        self.lock = threading.Lock()
        """Held while this router's sync is made (its thread's, or a test's ``sync_once``)."""
        self.thread: threading.Thread | None = None

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()


class RetentionSyncClient:
    """Syncs D's retention with its routers, one daemon thread per router (started lazily;
    module docstring, "One lane per router")."""

    def __init__(self, allowed_hosts: Iterable[str], engine: Engine, *,
                 interval_s: float = SYNC_INTERVAL_S, post: Post | None = None,
                 logger: logging.Logger | None = None, background: bool = True) -> None:
        """``background=False``: no thread; the caller runs ``sync_once`` (tests). ``post``:
        the one POST every lane uses (tests); by default each lane has a connection of its
        own."""
        self._allowed = ReportHosts(allowed_hosts)
        self._engine = engine
        self._interval_s = interval_s
        self._post = post
        self._log = logger or logging.getLogger(__name__)
        self._lock = threading.Lock()
        self._background = background
        self._urls: collections.OrderedDict[str, collections.deque[Released]] = \
            collections.OrderedDict()
        self._lanes: dict[str, _Lane] = {}
        self._refused: set[str] = set()
        self._view: LedgerView | None = None
        self._orders: queue.SimpleQueue[Orders] = queue.SimpleQueue()
        self._failures = 0
        self._told_busy: set[str] = set()
        """Routers whose last answered sync said D was busy: they get one more when not."""
        self._answered: dict[str, bool] = {}
        """Whether each router's last sync was answered (``ask_via``)."""
        self._shared_of: collections.OrderedDict[str, str] = collections.OrderedDict()
        """The shared state each router's answers named, kept beyond ``MAX_SYNC_URLS``
        (at most ``MAX_SHARED_MEMORY``): its turns are asked of another router naming it."""

    def add_url(self, url: str) -> bool:
        """Remember a router's retention URL (most recent ``MAX_SYNC_URLS``); ``False`` for a
        host not allowed (never contacted)."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not self._allowed.allows(parts.hostname or ""):
            if url not in self._refused and len(self._refused) < 64:
                self._refused.add(url)
                self._log.warning("kvrelay: not syncing retention with %s: host not allowed "
                                  "(kvrelay_report_hosts)", parts.hostname)
            return False
        with self._lock:
            if url in self._urls:
                self._urls.move_to_end(url)
            else:
                self._urls[url] = collections.deque(maxlen=MAX_RELEASED_PER_SYNC)
                self._lanes[url] = _Lane(url, self._post or _HttpPost().post)
                while len(self._urls) > MAX_SYNC_URLS:
                    gone, _ = self._urls.popitem(last=False)
                    self._lanes.pop(gone).stop()
        return True

    def urls(self) -> list[str]:
        with self._lock:
            return list(self._urls)

    def publish(self, view: LedgerView, released: Sequence[Released], *,
                urgent: bool = False) -> None:
        """The scheduler thread's latest state; ``urgent`` syncs now instead of at the next
        interval. Starts the thread on the first call once a URL is known."""
        with self._lock:
            self._view = view
            for pending in self._urls.values():
                pending.extend(released)
            lanes = list(self._lanes.values())
        for lane in lanes:
            if self._background and lane.thread is None:
                lane.thread = threading.Thread(target=self._run, args=(lane,),
                                               name="kvrelay-retention", daemon=True)
                lane.thread.start()
            if urgent or released:
                lane.wake.set()

    def take_orders(self) -> list[Orders]:
        """The answers received since the previous call (scheduler thread)."""
        got: list[Orders] = []
        while True:
            try:
                got.append(self._orders.get_nowait())
            except queue.Empty:
                return got

    def _run(self, lane: _Lane) -> None:
        while not lane.stopped:
            lane.wake.wait(self._interval_s)
            lane.wake.clear()
            if not lane.stopped:
                self._sync_lane(lane)

    def sync_once(self) -> int:
        """One round: a sync to each router that has something to hear, one after another
        (tests; the lanes' threads sync on their own). Returns how many were answered."""
        with self._lock:
            lanes = list(self._lanes.values())
        return sum(self._sync_lane(lane) for lane in lanes)

    def _sync_lane(self, lane: _Lane) -> bool:
        """Sync with ``lane``'s router if it has something to hear; whether it answered."""
        with lane.lock:
            return self._sync(lane)

    def _sync(self, lane: _Lane) -> bool:
        url = lane.url
        with self._lock:
            view = self._view
            pending = self._urls.get(url)
            released = list(pending) if pending is not None else []
            told_busy = url in self._told_busy
        if view is None or pending is None:
            return False
        asked = self._asked_via(url, view)
        releasing = tuple(i for ids in asked.values() for i in ids)
        if not (view.busy or released or told_busy):
            return False
        sync = RetentionSync(
            engine_id=self._engine.engine_id, block_size=self._engine.block_size,
            bytes_per_block=self._engine.bytes_per_block,
            num_blocks_total=self._engine.num_blocks_total,
            num_blocks_free=min(view.num_blocks_free, self._engine.num_blocks_total),
            retained_requests=view.retained_requests,
            retained_blocks=min(view.retained_blocks, self._engine.num_blocks_total),
            retained_tokens=view.retained_tokens,
            releases_total=view.releases_total, released=tuple(released),
            releasing=releasing)
        try:
            answer = lane.post(url, encode(sync))
            orders = decode_orders(answer) if answer.strip() else RetentionOrders()
        except (OSError, http.client.HTTPException, RetentionSyncError) as exc:
            with self._lock:
                self._failures += 1
                failures = self._failures
                newly = self._answered.get(url) is not False
                self._answered[url] = False
                others = [other for other in self._lanes.values() if other is not lane]
            if failures in (1, 10, 100) or failures % 1000 == 0:
                self._log.warning("kvrelay: retention sync to %s failed (%d so far): %s",
                                  url, failures, exc)
            if newly and asked:  # its turns are asked of another router now
                for other in others:
                    other.wake.set()
            return False
        with self._lock:
            self._answered[url] = True
            shared = orders.shared_state
            if shared is not None:
                self._shared_of[url] = shared
                self._shared_of.move_to_end(url)
                while len(self._shared_of) > MAX_SHARED_MEMORY:
                    self._shared_of.popitem(last=False)
            if view.busy:
                self._told_busy.add(url)
            else:
                self._told_busy.discard(url)
            pending = self._urls.get(url)
            for _ in range(min(len(released), len(pending or ()))):
                assert pending is not None
                pending.popleft()
        own = frozenset(asked.get(url, ()))
        if orders.release or orders.turn_curves or own.intersection(orders.dropped):
            self._orders.put(Orders(url=url, orders=msgspec.structs.replace(
                orders, dropped=tuple(i for i in orders.dropped if i in own))))
        for turn_url, ids in asked.items():  # asked here for another router's turns
            mine = frozenset(ids)
            dropped = tuple(i for i in orders.dropped if i in mine)
            if turn_url != url and dropped:
                self._orders.put(Orders(url=turn_url, orders=RetentionOrders(dropped=dropped)))
        return True

    def _asked_via(self, url: str, view: LedgerView) -> dict[str, tuple[str, ...]]:
        """The ``releasing`` ids this router is asked for, by the router that gave each
        turn: its own, and those of routers it answers for (``ask_via``)."""
        with self._lock:
            lanes = [Lane(u, self._answered.get(u), self._shared_of.get(u)) for u in self._urls]
            shared_of = dict(self._shared_of)
        out: dict[str, tuple[str, ...]] = {}
        room = MAX_RELEASED_PER_SYNC
        for turn_url, ids in view.releasing.items():
            if room > 0 and ask_via(turn_url, lanes, shared_of.get(turn_url)) == url:
                out[turn_url] = ids[:room]
                room -= len(out[turn_url])
        return out


class _HttpPost:
    """POSTs over one keep-alive connection per router address (this thread only)."""

    def __init__(self, timeout_s: float = 2.0) -> None:
        self._timeout_s = timeout_s
        self._connections: dict[tuple[str, str], http.client.HTTPConnection] = {}

    def post(self, url: str, body: bytes) -> bytes:
        try:
            return self._post_once(url, body)
        except (BrokenPipeError, ConnectionResetError):
            # The router closed an idle keep-alive connection (RemoteDisconnected is a
            # ConnectionResetError): once more on a new one.
            return self._post_once(url, body)

    def _post_once(self, url: str, body: bytes) -> bytes:
        parts = urllib.parse.urlsplit(url)
        key = (parts.scheme, parts.netloc)
        conn = self._connections.get(key)
        if conn is None:
            kind = (http.client.HTTPSConnection if parts.scheme == "https"
                    else http.client.HTTPConnection)
            conn = self._connections[key] = kind(parts.netloc, timeout=self._timeout_s)
        try:
            conn.request("POST", parts.path or "/", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            answer = resp.read()
        except (OSError, http.client.HTTPException):
            conn.close()
            self._connections.pop(key, None)
            raise
        if not 200 <= resp.status < 300:
            raise http.client.HTTPException(f"HTTP {resp.status}: {answer[:200]!r}")
        return answer
