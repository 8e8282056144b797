"""D's retention, synced with the router: what D holds, what it released, what to release.

vLLM keeps every finished turn's blocks on D for one global TTL (``decoder_kv_blocks_ttl``)
and frees them only when P's read completes or the TTL sweep runs. kvrelay's connector on D
accounts each retained request and can release one early (under memory pressure, or because
the router knows its entry is dead). This module is the one home of the wire contract
between that connector (and the fake engine) and the router.

**Keys in a decode request's ``kv_transfer_params``** (router -> D; vLLM passes unknown
keys through untouched):

* ``kvrelay_retention_url``: where D's connector syncs its retention (``POST``, the router's
  internal listener, path ``RETENTION_PATH`` and a token of that D's: the connector posts to
  the URL's path as given). The connector remembers the most recent
  ``MAX_SYNC_URLS`` URLs it was given (several router replicas) and syncs with each.
* ``kvrelay_retain_s`` (float > 0): how long D keeps this turn's blocks; D clamps it to its
  configured TTL (``decoder_kv_blocks_ttl``), never above.
* ``kvrelay_retain_value`` (float): release order under pressure, lowest first; turns
  without one count as 0 and go oldest first.
* ``kvrelay_return_curve`` (``[return_p, log_mean, log_sigma]``,
  ``core.return_curve.ReturnCurve``): how the router saw turns like this one come back (the
  share that did, and a log-normal fit of their gaps). Under pressure or headroom D releases
  the turns least likely still to be pulled first (``core.retention.release_order``); absent
  or invalid, the turn ranks by value and age as without it.

**The sync** (D -> router, ``RetentionSync`` as JSON), sent every ``SYNC_INTERVAL_S`` while
D holds retained turns or has releases to tell, and at once after a release. The router
answers ``RetentionOrders``: D's request ids to release now, and the curves of turns whose
answer the router has read since, when they end another way than D was told (``curves``: a
turn that ended in a tool call comes back within the tools' run time or not at all, not
after a user's think time). A curve only orders releases; it never frees anything itself.
D never releases a request P is
reading; an order for an unknown or busy request is ignored (its next sync says what
happened). Routers that share their state (replicas on one Redis) say so in their answers
(``RetentionOrders.shared``), and D asks any of them for a turn another of them gave when
that one does not answer (``ask_via``). A released request's blocks are gone: the router
drops the entry and the next turn recomputes (reason ``released``).

**A release D decides itself is asked for first** (pressure, headroom). vLLM's pull mode gives
D no sign of a read in progress: P reads D's memory directly and only notifies D when done,
and the one check that declines a stale read is P's own, against the
``remote_blocks_expiry_time`` stamped in the params when the turn finished
(``NixlPullConnectorWorker._is_turn2_read_expired``), which an early release cannot change.
Blocks freed while a router still holds the entry, or has a P leg in flight for it, could be
read after they were reused. So D lists the turns it wants to free in ``releasing`` (to the
router whose ``kvrelay_retention_url`` came with the turn) and keeps them; the router drops
their entries, and answers in ``dropped`` the ids it holds no entry and runs no P leg for
(an id a P leg is reading is left out and asked for again later). D frees exactly the ids
in ``dropped``; a router that never answers them (down, or older than this field) only
costs D the release, never a stale read. Release orders need no such answer: the router
sends one only for an entry it has dropped. A turn's own deadline needs none either: D
stamps the shortened deadline in the params it returns, so P declines reads near it as for
vLLM's TTL.

Everything here is pure: bodies are decoded and checked, never sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec

from kvrelay.core.return_curve import ReturnCurve, valid

RETENTION_PATH = "/internal/kv-retention"
RETENTION_URL_KEY = "kvrelay_retention_url"
RETAIN_S_KEY = "kvrelay_retain_s"
RETAIN_VALUE_KEY = "kvrelay_retain_value"
RETURN_CURVE_KEY = "kvrelay_return_curve"

SYNC_INTERVAL_S = 0.25
"""How often D syncs while it holds retained turns (a router's order lands within ~0.5 s)."""
STALE_SYNC_S = 20 * SYNC_INTERVAL_S
"""A sync saying D holds turns stands for D's numbers this long: D syncs every
``SYNC_INTERVAL_S`` while it holds any, so a longer silence means it restarted (a new
engine posts nowhere until a decode request gives it a URL), went away, or cannot reach the
router, and its numbers are unknown. A sync saying D holds none stands until the next
(an idle D does not sync)."""
MAX_SYNC_URLS = 8
MAX_SHARED_MEMORY = 1024
"""Routers whose shared state (``RetentionOrders.shared``) D remembers, beyond the
``MAX_SYNC_URLS`` it syncs with: their turns are asked of another router naming it."""
MAX_SYNC_BYTES = 1024 * 1024
"""Sync bodies larger than this are refused unread."""
MAX_RELEASED_PER_SYNC = 4096
MAX_ORDERS = 4096

ReleaseCause = Literal["pressure", "router", "expired", "headroom"]
"""Why D freed a retained turn before P read it: D needed the blocks (``pressure``), the
router ordered it (``router``), its retention time ran out (``expired``), or retention held
more than the operator's headroom allows (``headroom``). A turn P read is not a release:
vLLM frees it after the read, as always."""
RELEASE_CAUSES: tuple[ReleaseCause, ...] = ("pressure", "router", "expired", "headroom")


class Released(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One retained turn D freed since its previous sync with this router."""

    request_id: str
    cause: ReleaseCause


class RetentionSync(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """D's retention as D's connector counts it, from D's own block pool.

    ``engine_id`` is D's vLLM engine id (a restart changes it); ``num_blocks_*`` count D's
    KV cache blocks (``block_size`` tokens, ``bytes_per_block`` bytes each across layers);
    ``retained_*`` are the finished turns D holds for a P to read; ``releases_total`` counts
    releases by cause since D started; ``released`` lists the releases since the previous
    sync to this router (at most ``MAX_RELEASED_PER_SYNC``, oldest dropped first).
    """

    engine_id: str
    block_size: int
    bytes_per_block: int
    num_blocks_total: int
    num_blocks_free: int
    retained_requests: int
    retained_blocks: int
    retained_tokens: int
    releases_total: dict[str, int] = {}
    released: tuple[Released, ...] = ()
    releasing: tuple[str, ...] = ()

    @property
    def retained_bytes(self) -> int:
        return self.retained_blocks * self.bytes_per_block


class TurnCurve(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """A retained turn's return curve, learned once the router read how its answer ended;
    it replaces the one D had (``kvrelay_return_curve``)."""

    request_id: str
    curve: ReturnCurve


class RetentionOrders(msgspec.Struct, frozen=True):
    """The router's answer to a sync: D's request ids to release now (``release``: entries
    the router dropped), of the sync's ``releasing`` ids those D may free now (``dropped``:
    no entry left and no P leg reading them), and turns' return curves (``curves``,
    ``turn_curves``).

    Versions: ``curves`` is left out of the JSON when there are none, so such an answer is
    what a connector that predates it reads; D ignores fields it does not know (a router
    newer than D's connector may send more) since the pull windows that ``curves``
    replaced. A connector older than that refuses an answer carrying ``curves`` (its sync
    fails; D keeps its turns, as stock vLLM would): upgrade D's connector before the
    router."""

    release: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    curves: tuple[TurnCurve, ...] | msgspec.UnsetType = msgspec.UNSET
    shared: str | msgspec.UnsetType = msgspec.UNSET
    """The shared state this router answers from (router replicas on one Redis): every
    router whose answers name the same ``shared`` answers D's asks for any turn any of them
    gave (``ask_via``). Left out by a router whose state is its own."""

    @property
    def turn_curves(self) -> tuple[TurnCurve, ...]:
        return () if isinstance(self.curves, msgspec.UnsetType) else self.curves

    @property
    def shared_state(self) -> str | None:
        return None if isinstance(self.shared, msgspec.UnsetType) else self.shared


class Lane(msgspec.Struct, frozen=True):
    """What D knows of one router it syncs with: whether its last sync was answered
    (``None``: not tried yet) and the shared state its answers named."""

    url: str
    answered: bool | None = None
    shared: str | None = None


def ask_via(url: str, lanes: Sequence[Lane], shared: str | None = None) -> str | None:
    """Where D asks for (``releasing``) the turns whose ``kvrelay_retention_url`` is
    ``url``. Their own router, while it answers; else a router that answers for it:

    1. one at the same origin (scheme, host, port): the same router, restarted, at another
       token (a restarted router answers D's asks whatever URL they come to);
    2. one whose answers name the shared state ``url``'s router named (``shared``, as D
       remembered it: replicas on one Redis, where the reads in progress and the entries
       are shared).

    Else ``url`` itself while D still syncs with it (it may come back), or ``None``: no
    router D syncs with can answer (the turn is freed by P's read, an order or its TTL).
    Without this, D asked only ``url``: a replica gone (scaled down, crashed), or more
    routers than ``MAX_SYNC_URLS``, left its turns unreleasable under pressure, and a live
    request waited for their TTL."""
    own = next((lane for lane in lanes if lane.url == url), None)
    if own is not None and own.answered is not False:
        return url
    origin = _origin(url)
    shared = shared if shared is not None else own.shared if own is not None else None
    for lane in lanes:
        if lane.answered and lane.url != url and _origin(lane.url) == origin:
            return lane.url
    if shared is not None:
        for lane in lanes:
            if lane.answered and lane.shared == shared:
                return lane.url
    return url if own is not None else None


def _origin(url: str) -> tuple[str, str]:
    """``(scheme, host[:port])`` of an absolute URL, lower-cased."""
    scheme, _, rest = url.partition("://")
    return scheme.lower(), rest.split("/", 1)[0].split("?", 1)[0].lower()


class RetentionSyncError(ValueError):
    """A sync body that is not the contract's format or breaks its limits."""


_decode_sync = msgspec.json.Decoder(RetentionSync)
_decode_orders = msgspec.json.Decoder(RetentionOrders)


def decode_sync(body: bytes) -> RetentionSync:
    """Parse and check a sync body; raises ``RetentionSyncError``."""
    if len(body) > MAX_SYNC_BYTES:
        raise RetentionSyncError(f"sync body over {MAX_SYNC_BYTES} bytes")
    try:
        sync = _decode_sync.decode(body)
    except msgspec.DecodeError as exc:
        raise RetentionSyncError(f"not a retention sync: {exc}") from None
    counts = (sync.block_size, sync.bytes_per_block, sync.num_blocks_total,
              sync.num_blocks_free, sync.retained_requests, sync.retained_blocks,
              sync.retained_tokens, *sync.releases_total.values())
    if any(value < 0 for value in counts):
        raise RetentionSyncError("negative count in a retention sync")
    if sync.block_size <= 0 or not sync.engine_id:
        raise RetentionSyncError("a retention sync needs a block size and an engine id")
    if sync.num_blocks_free > sync.num_blocks_total:
        raise RetentionSyncError("more free blocks than blocks")
    if sync.retained_blocks > sync.num_blocks_total:
        raise RetentionSyncError("more retained blocks than blocks")
    if unknown := set(sync.releases_total) - set(RELEASE_CAUSES):
        raise RetentionSyncError(f"unknown release causes {sorted(unknown)}")
    if len(sync.released) > MAX_RELEASED_PER_SYNC:
        raise RetentionSyncError(f"more than {MAX_RELEASED_PER_SYNC} releases in one sync")
    if len(sync.releasing) > MAX_RELEASED_PER_SYNC:
        raise RetentionSyncError(f"more than {MAX_RELEASED_PER_SYNC} releasing in one sync")
    return sync


def decode_orders(body: bytes) -> RetentionOrders:
    """Parse the router's answer (D's side); raises ``RetentionSyncError``."""
    try:
        orders = _decode_orders.decode(body)
    except msgspec.DecodeError as exc:
        raise RetentionSyncError(f"not retention orders: {exc}") from None
    curves = orders.turn_curves
    if max(len(orders.release), len(orders.dropped), len(curves)) > MAX_ORDERS:
        raise RetentionSyncError(f"more than {MAX_ORDERS} release orders")
    if not all(valid(c.curve) for c in curves):
        raise RetentionSyncError("a return curve needs finite numbers, a share in [0, 1] "
                                 "and a sigma >= 0")
    return orders


def encode(value: RetentionSync | RetentionOrders) -> bytes:
    return msgspec.json.encode(value)


def clamp_retain_s(requested_s: object, ttl_s: float) -> float:
    """How long D keeps a turn: the router's ``kvrelay_retain_s`` within (0, ttl_s], D's
    TTL when absent or not a positive number."""
    if isinstance(requested_s, bool) or not isinstance(requested_s, int | float):
        return ttl_s
    if not requested_s > 0:
        return ttl_s
    return min(float(requested_s), ttl_s)
