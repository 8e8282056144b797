"""D's retention sync with the routers: one daemon thread of the connector's scheduler process.

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
the ``releasing`` ids of the turns it gave. vLLM-free.
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
    MAX_SYNC_URLS,
    SYNC_INTERVAL_S,
    Released,
    RetentionOrders,
    RetentionSync,
    RetentionSyncError,
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


class RetentionSyncClient:
    """Syncs D's retention with its routers from one daemon thread (started lazily)."""

    def __init__(self, allowed_hosts: Iterable[str], engine: Engine, *,
                 interval_s: float = SYNC_INTERVAL_S, post: Post | None = None,
                 logger: logging.Logger | None = None, background: bool = True) -> None:
        """``background=False``: no thread; the caller runs ``sync_once`` (tests)."""
        self._allowed = ReportHosts(allowed_hosts)
        self._engine = engine
        self._interval_s = interval_s
        self._post = post or _HttpPost().post
        self._log = logger or logging.getLogger(__name__)
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._background = background
        self._urls: collections.OrderedDict[str, collections.deque[Released]] = \
            collections.OrderedDict()
        self._refused: set[str] = set()
        self._view: LedgerView | None = None
        self._wake = threading.Event()
        self._orders: queue.SimpleQueue[Orders] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._failures = 0
        self._told_busy: set[str] = set()
        """Routers whose last answered sync said D was busy: they get one more when not."""

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
                while len(self._urls) > MAX_SYNC_URLS:
                    self._urls.popitem(last=False)
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
            have_urls = bool(self._urls)
        if have_urls and self._background and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvrelay-retention",
                                            daemon=True)
            self._thread.start()
        if urgent or released:
            self._wake.set()

    def take_orders(self) -> list[Orders]:
        """The answers received since the previous call (scheduler thread)."""
        got: list[Orders] = []
        while True:
            try:
                got.append(self._orders.get_nowait())
            except queue.Empty:
                return got

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval_s)
            self._wake.clear()
            self.sync_once()

    def sync_once(self) -> int:
        """One round: a sync to each router that has something to hear. Returns how many
        syncs were answered."""
        with self._sync_lock:
            return self._sync_round()

    def _sync_round(self) -> int:
        with self._lock:
            view = self._view
            due = [(url, list(pending)) for url, pending in self._urls.items()]
        if view is None:
            return 0
        answered = 0
        for url, released in due:
            releasing = view.releasing.get(url, ())
            if not (view.busy or released or url in self._told_busy):
                continue
            sync = RetentionSync(
                engine_id=self._engine.engine_id, block_size=self._engine.block_size,
                bytes_per_block=self._engine.bytes_per_block,
                num_blocks_total=self._engine.num_blocks_total,
                num_blocks_free=min(view.num_blocks_free, self._engine.num_blocks_total),
                retained_requests=view.retained_requests,
                retained_blocks=min(view.retained_blocks, self._engine.num_blocks_total),
                retained_tokens=view.retained_tokens,
                releases_total=view.releases_total, released=tuple(released),
                releasing=releasing[:MAX_RELEASED_PER_SYNC])
            try:
                answer = self._post(url, encode(sync))
                orders = decode_orders(answer) if answer.strip() else RetentionOrders()
            except (OSError, http.client.HTTPException, RetentionSyncError) as exc:
                self._failures += 1
                if self._failures in (1, 10, 100) or self._failures % 1000 == 0:
                    self._log.warning("kvrelay: retention sync to %s failed (%d so far): %s",
                                      url, self._failures, exc)
                continue
            answered += 1
            if view.busy:
                self._told_busy.add(url)
            else:
                self._told_busy.discard(url)
            with self._lock:
                pending = self._urls.get(url)
                for _ in range(min(len(released), len(pending or ()))):
                    assert pending is not None
                    pending.popleft()
            if orders.release or orders.dropped or orders.turn_curves:
                self._orders.put(Orders(url=url, orders=orders))
        return answered


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
