"""D's retained turns as kvrelay's connector keeps them: accounting and the release handshake.

The scheduler side of kvrelay's connector on D (``kvrelay.vllm_plugin.connector``) owns one
``RetentionLedger`` and calls it from vLLM's scheduler thread only; the sync thread
(``kvrelay.vllm_plugin.retention_client``) sees it through the frozen ``LedgerView`` the
scheduler thread publishes. vLLM-free and clock-free (time is passed in, seconds on one
monotonic clock), so it is tested without an engine.

A turn is *held* from ``request_finished`` (vLLM delays freeing its blocks for a P to read)
until vLLM frees them: P read them, vLLM's TTL sweep ran, or kvrelay released them through
that same sweep. Which turns to release is ``kvrelay.core.retention``'s policy; how a release
is made safe is ``kvrelay.core.retention_sync``'s handshake:

* **pressure / headroom**: D picks turns (those least likely still to be pulled first, by
  their ``kvrelay_return_curve``; then least valuable, oldest first:
  ``core.retention.release_order``) and *asks* the router that
  gave the turn (its ``kvrelay_retention_url``) in its next sync (``releasing``); the turn
  stays held until the router answers it in ``dropped``; then it is *freeing*: the connector
  hands it to vLLM's expiry path and vLLM frees it within a step. A router that does not
  answer within ``confirm_timeout_s`` gets the turns back (held again) and is not asked
  again for ``ask_backoff_s``: D then waits or preempts as stock vLLM would, never frees a
  turn a router may still send a P to read. Turns without a retention URL are never asked.
* **router orders**: the router dropped the entry already, so the turn is freeing at once;
  a router's ``curves`` replace turns' return curves (it read how their answers ended).
* **deadline**: ``kvrelay_retain_s`` becomes the turn's own vLLM TTL (set by the connector);
  when vLLM's sweep frees it at or after its deadline the ledger records ``expired``.

In ``managed=False`` mode (``kvrelay up --retention stock``) the ledger only accounts: it
never asks, never frees, ignores orders.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

import msgspec
from msgspec.structs import replace

from kvrelay.core.retention import (
    NOTHING,
    BlockHolders,
    Release,
    RetainedTurn,
    blocks_freed,
    holders_after,
    release_over_headroom,
    release_under_pressure,
)
from kvrelay.core.retention_sync import (
    RELEASE_CAUSES,
    ReleaseCause,
    Released,
    TurnCurve,
)
from kvrelay.core.return_curve import ReturnCurve

CONFIRM_TIMEOUT_S = 2.0
"""How long D waits for a router to answer a ``releasing`` id before it keeps the turn."""
ASK_BACKOFF_S = 30.0
"""How long a router that let a release time out is not asked again."""
EXPIRY_SLACK_S = 0.05
"""A turn vLLM frees this close to (or after) its deadline was freed by the TTL sweep."""


class TurnState(Enum):
    HELD = "held"
    RELEASING = "releasing"
    """Asked of its router (``releasing``); still held."""
    FREEING = "freeing"
    """Confirmed or ordered: handed (or about to be handed) to vLLM's expiry path."""


@dataclass
class _Tracked:
    turn: RetainedTurn
    url: str | None
    state: TurnState = TurnState.HELD
    cause: ReleaseCause | None = None
    asked_at_s: float = 0.0


class LedgerView(msgspec.Struct, frozen=True):
    """What the sync thread sends, as of one scheduler step (immutable: safe to share)."""

    num_blocks_free: int
    retained_requests: int
    retained_blocks: int
    retained_tokens: int
    releases_total: dict[str, int]
    releasing: dict[str, tuple[str, ...]]
    """Per retention URL, the ids D asks that router to let it free."""

    @property
    def busy(self) -> bool:
        """Worth a sync: D holds turns or waits on a router's answer."""
        return self.retained_requests > 0 or bool(self.releasing)


@dataclass
class RetentionLedger:
    """The retained turns of one D engine (scheduler thread only)."""

    managed: bool = True
    headroom: float = 0.0
    confirm_timeout_s: float = CONFIRM_TIMEOUT_S
    ask_backoff_s: float = ASK_BACKOFF_S
    _turns: dict[str, _Tracked] = field(default_factory=dict)
    _to_free: list[str] = field(default_factory=list)
    _released: list[Released] = field(default_factory=list)
    _releases_total: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(RELEASE_CAUSES, 0))
    _backoff_until_s: dict[str, float] = field(default_factory=dict)
    _blocks: int = 0
    _tokens: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.headroom <= 1.0:
            raise ValueError(f"retention headroom is a fraction in [0, 1], got {self.headroom}")

    # -- accounting -------------------------------------------------------------------------

    def retain(self, request_id: str, *, num_blocks: int, num_tokens: int, now_s: float,
               retain_s: float, value: float = 0.0, url: str | None = None,
               curve: ReturnCurve | None = None,
               block_ids: tuple[int, ...] = ()) -> RetainedTurn:
        """A finished request whose blocks vLLM now holds for a P to read, and how such
        turns come back (``kvrelay_return_curve``; ``None``: unknown). ``block_ids``: its
        blocks, when known (shared blocks are counted once they are freed,
        ``core.retention``)."""
        self._pop(request_id)
        turn = RetainedTurn(request_id=request_id, num_blocks=num_blocks, num_tokens=num_tokens,
                            retained_at_s=now_s, deadline_s=now_s + retain_s, value=value,
                            curve=curve, block_ids=block_ids)
        self._turns[request_id] = _Tracked(turn, url)
        self._blocks += num_blocks
        self._tokens += num_tokens
        return turn

    def _pop(self, request_id: str) -> _Tracked | None:
        tracked = self._turns.pop(request_id, None)
        if tracked is not None:
            self._blocks -= tracked.turn.num_blocks
            self._tokens -= tracked.turn.num_tokens
        return tracked

    def freed(self, request_id: str, now_s: float) -> Released | None:
        """vLLM freed the request's blocks (``finished_sending``): the release this was, or
        ``None`` when P read the turn (or it was not retained here)."""
        tracked = self._pop(request_id)
        if tracked is None:
            return None
        cause = tracked.cause if tracked.state is TurnState.FREEING else None
        if cause is None and now_s + EXPIRY_SLACK_S >= tracked.turn.deadline_s:
            cause = "expired"
        if cause is None:
            return None
        released = Released(request_id=request_id, cause=cause)
        self._releases_total[cause] += 1
        self._released.append(released)
        return released

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._turns

    def state(self, request_id: str) -> TurnState | None:
        tracked = self._turns.get(request_id)
        return tracked.state if tracked is not None else None

    @property
    def retained_blocks(self) -> int:
        return self._blocks

    @property
    def retained_tokens(self) -> int:
        return self._tokens

    @property
    def releases_total(self) -> dict[str, int]:
        return dict(self._releases_total)

    def turns(self) -> list[RetainedTurn]:
        return [tracked.turn for tracked in self._turns.values()]

    def describe(self, request_ids: Iterable[str], now_s: float) -> str:
        """``request_ids`` for D's log, each with its chance of a pull at ``now_s``
        (``RetainedTurn.pull_chance``; "no curve" without one): why D chose them."""
        parts = []
        for request_id in request_ids:
            tracked = self._turns.get(request_id)
            if tracked is None or tracked.turn.curve is None:
                parts.append(f"{request_id} (no curve)")
            else:
                parts.append(f"{request_id} (pull chance {tracked.turn.pull_chance(now_s):.3f})")
        return ", ".join(parts)

    # -- deciding releases ------------------------------------------------------------------

    def _askable(self, now_s: float) -> list[RetainedTurn]:
        return [t.turn for t in self._turns.values()
                if t.state is TurnState.HELD and t.url is not None
                and self._backoff_until_s.get(t.url, 0.0) <= now_s]

    def _on_the_way(self) -> list[RetainedTurn]:
        """Turns on their way to being freed (asked or confirmed)."""
        return [t.turn for t in self._turns.values() if t.state is not TurnState.HELD]

    def has_pending(self) -> bool:
        """A release is under way: vLLM will get blocks back without preempting anyone."""
        return any(t.state is not TurnState.HELD for t in self._turns.values())

    def ask_under_pressure(self, *, num_blocks_free: int, num_blocks_needed: int,
                           now_s: float, holders: BlockHolders | None = None) -> Release:
        """Ask for enough turns to free ``num_blocks_needed`` blocks (blocks already on their
        way count as free). ``short_blocks`` is what even that leaves missing. ``holders``:
        D's holder counts, so that a release counts only the blocks it frees."""
        if not self.managed:
            return NOTHING
        on_the_way = self._on_the_way()
        release = release_under_pressure(
            self._askable(now_s),
            num_blocks_free=num_blocks_free + blocks_freed(on_the_way, holders),
            num_blocks_needed=num_blocks_needed, now_s=now_s,
            holders=holders_after(holders, on_the_way) if holders is not None else None)
        self._ask(release, "pressure", now_s)
        return release

    def ask_over_headroom(self, *, num_blocks_total: int, now_s: float,
                          holders: BlockHolders | None = None) -> Release:
        """Ask for what retention holds above ``(1 - headroom)`` of the cache."""
        if not self.managed or self.headroom <= 0.0:
            return NOTHING
        held = [t.turn for t in self._turns.values() if t.state is TurnState.HELD]
        left = holders_after(holders, self._on_the_way()) if holders is not None else None
        over = release_over_headroom(held, num_blocks_total=num_blocks_total,
                                     headroom=self.headroom, now_s=now_s, holders=left)
        askable = {turn.request_id for turn in self._askable(now_s)}
        release = Release(request_ids=tuple(i for i in over.request_ids if i in askable),
                          num_blocks=over.num_blocks, reason=over.reason)
        self._ask(release, "headroom", now_s)
        return release

    def _ask(self, release: Release, cause: ReleaseCause, now_s: float) -> None:
        for request_id in release.request_ids:
            tracked = self._turns[request_id]
            tracked.state, tracked.cause, tracked.asked_at_s = TurnState.RELEASING, cause, now_s

    def confirmed(self, url: str, dropped: Iterable[str]) -> None:
        """``url``'s router dropped these entries: free what D asked that router for."""
        for request_id in dropped:
            tracked = self._turns.get(request_id)
            if tracked is not None and tracked.state is TurnState.RELEASING \
                    and tracked.url == url:
                self._free(request_id, tracked, tracked.cause or "pressure")
        self._backoff_until_s.pop(url, None)

    def ordered(self, release: Iterable[str]) -> None:
        """The router orders these released (it dropped their entries)."""
        if not self.managed:
            return
        for request_id in release:
            tracked = self._turns.get(request_id)
            if tracked is not None and tracked.state is not TurnState.FREEING:
                self._free(request_id, tracked, "router")

    def take_curves(self, curves: Iterable[TurnCurve]) -> None:
        """The router read how these turns' answers ended: their return curves are the
        kind's (a tool call's follow-up comes within the tools' run time or not at all)."""
        for told in curves:
            tracked = self._turns.get(told.request_id)
            if tracked is not None:
                tracked.turn = replace(tracked.turn, curve=told.curve)

    def _free(self, request_id: str, tracked: _Tracked, cause: ReleaseCause) -> None:
        tracked.state, tracked.cause = TurnState.FREEING, cause
        self._to_free.append(request_id)

    def time_out(self, now_s: float) -> list[str]:
        """Turns asked more than ``confirm_timeout_s`` ago go back to held; their routers
        are not asked again for ``ask_backoff_s``. Returns the ids given back."""
        late = [(request_id, t) for request_id, t in self._turns.items()
                if t.state is TurnState.RELEASING
                and now_s - t.asked_at_s >= self.confirm_timeout_s]
        for _, tracked in late:
            tracked.state, tracked.cause = TurnState.HELD, None
            if tracked.url is not None:
                self._backoff_until_s[tracked.url] = now_s + self.ask_backoff_s
        return [request_id for request_id, _ in late]

    def take_to_free(self) -> list[str]:
        """Ids to hand to vLLM's expiry path now (each once)."""
        due, self._to_free = self._to_free, []
        return [request_id for request_id in due
                if self.state(request_id) is TurnState.FREEING]

    def take_released(self) -> list[Released]:
        """Releases made since the previous call (for the routers)."""
        done, self._released = self._released, []
        return done

    def view(self, num_blocks_free: int) -> LedgerView:
        releasing: dict[str, list[str]] = {}
        for request_id, tracked in self._turns.items():
            if tracked.state is TurnState.RELEASING and tracked.url is not None:
                releasing.setdefault(tracked.url, []).append(request_id)
        return LedgerView(
            num_blocks_free=num_blocks_free, retained_requests=len(self._turns),
            retained_blocks=self._blocks, retained_tokens=self._tokens,
            releases_total=dict(self._releases_total),
            releasing={url: tuple(ids) for url, ids in releasing.items()})


def blocks_needed(num_tokens: int, block_size: int, watermark_blocks: int = 0, *,
                  num_hit_blocks: int = 0, num_free_hit_blocks: int | None = None) -> int:
    """Blocks a waiting request of ``num_tokens`` tokens takes from D's free blocks to be
    admitted with its first decode token, counted as vLLM counts them
    (``get_num_blocks_to_allocate``): the blocks beyond its local prefix-cache hit
    (``num_hit_blocks``, its first blocks), the hit blocks that sit in the free queue
    (``num_free_hit_blocks``: reference count 0; using one takes it off the free queue;
    ``None``: all of them), and the watermark.

    A hit block another request holds costs nothing: a system prompt and tools every
    conversation of an agent shares, held by the retained turns of other conversations, is
    most of a new conversation's prompt, and asking for it again would release retained
    turns that admitting the request never needed."""
    total = math.ceil((num_tokens + 1) / block_size)
    hit = min(max(0, num_hit_blocks), total)
    free_hits = hit if num_free_hit_blocks is None else min(max(0, num_free_hit_blocks), hit)
    return total - hit + free_hits + watermark_blocks
