"""Block allocation as vLLM 0.32's scheduler does it: a FIFO waiting queue and preemption.

Read from ``vllm/v1/core/sched/scheduler.py`` and ``kv_cache_manager.py`` (0.32.0):

* **Admission.** A new request is admitted when the KV cache can hold its whole prompt
  (``scheduler_reserve_full_isl``: ``allocate_slots(full_sequence_must_fit=True)``), its
  prefix-cache hits included (a hit nobody references takes a free block, as
  ``get_num_blocks_to_allocate`` counts it). Output blocks are allocated step by step later.
  Otherwise it waits: the waiting queue is first come first served and its head blocks the
  rest (``schedule`` breaks out of the waiting loop when the head cannot be allocated).
  It is admitted as soon as blocks free up: a running request finishes, a P read of held
  blocks completes, a lease or TTL runs out (the step loop, ``watch``, checks expiry while
  anyone waits), or kvrelay's retention releases a turn.
* **Growth and preemption.** A running request needs a new block whenever its tokens cross
  a block boundary. If none is free, vLLM first asks the connector
  (``has_pending_block_frees``: stock NixlConnector says no), then preempts the running
  request scheduled last (``self.running[-1]``), which may be the request itself: its blocks
  are freed, it goes back to the *front* of the waiting queue and recomputes its prompt and
  output so far when readmitted (``_preempt_request``: ``num_computed_tokens = 0``).
  ``num_preemptions`` counts them (``vllm:num_preemptions_total``).
* **kvrelay's retention** (``relieve``, when the engine runs it): before a request waits or
  anyone is preempted, retained turns are asked for, least valuable first, enough for the
  allocation (``Retention.relieve``); while they are on their way (``pending``: vLLM's
  ``has_pending_block_frees``) a running request waits for them instead of preempting, and
  a waiting one is admitted once they are freed.

Where the fake is simpler: a request's prefill is one step, and a request still in it is not
preempted (the victim is the last *decoding* request); a recomputed request keeps the output
it was going to produce (the fake's output is fixed at admission).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvrelay.fakevllm.kv import BlockPool

STEP_S = 0.005
"""How often a waiting engine re-checks expiry (vLLM's engine core steps every ~1 ms while it
has work). Event-loop seconds: the fake's clock decides *whether* something expired."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(eq=False)
class Seat:
    """The scheduler's view of one request: the blocks it holds and where it stands.

    ``prefix_hashes``: the prompt's full-block hashes a prefix-cache hit may cover (at most
    ``num_prompt_tokens - 1`` tokens, as in vLLM). ``blocks``: its blocks, the first
    ``num_hit_blocks`` from the prefix cache. ``decoding``: past its prefill (preemptible).
    ``preempted``: its blocks were taken; it must be readmitted before its next token.
    """

    request_id: str
    prefix_hashes: Sequence[int] = ()
    blocks: list[int] = field(default_factory=list)
    num_hit_blocks: int = 0
    decoding: bool = False
    preempted: bool = False
    num_preemptions: int = 0


@dataclass(eq=False)
class _Waiter:
    seat: Seat
    num_tokens: int
    admitted: asyncio.Future[None]


class Scheduler:
    """One engine's block scheduler (module docstring). ``tick`` runs before every retry
    while requests wait (the engine reaps expired holds there); ``relieve(num_blocks)``
    is kvrelay's retention asking for blocks and ``pending()`` whether blocks are on their
    way (``has_pending_block_frees``); ``None``: stock vLLM."""

    def __init__(self, pool: BlockPool, *, tick: Callable[[], object],
                 relieve: Callable[[int], object] | None = None,
                 pending: Callable[[], bool] | None = None) -> None:
        self._pool = pool
        self._tick = tick
        self._relieve = relieve
        self._pending = pending
        self._waiting: deque[_Waiter] = deque()
        self._running: list[Seat] = []
        self._serve_soon = False
        self._watch: asyncio.Task[None] | None = None
        self.num_preemptions = 0
        pool.on_free = self._kick

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def waiting_ids(self) -> list[str]:
        """Request ids in the waiting queue, head first."""
        return [w.seat.request_id for w in self._waiting]

    # -- admission --------------------------------------------------------------------------

    async def admit(self, seat: Seat, num_tokens: int) -> None:
        """Give ``seat`` blocks for ``num_tokens`` tokens: at once when nobody waits and they
        fit, else in FIFO order once they do. Cancelling the wait leaves no blocks taken."""
        if not self._waiting and self._try(seat, num_tokens):
            self._running.append(seat)
            return
        await self._wait(_Waiter(seat, num_tokens, _future()), front=False)

    async def grow(self, seat: Seat, num_tokens: int) -> bool:
        """Make ``seat``'s blocks cover ``num_tokens`` before its next token. True when it was
        preempted (by another request's growth or by its own) and readmitted: its caller
        recomputes. Running requests come before waiting ones, as in ``schedule``; while
        kvrelay's retention has blocks on their way the request waits for them instead of
        preempting anyone."""
        recomputed = False
        while True:
            if seat.preempted:
                await self._readmit(seat, num_tokens)
                recomputed = True
            needed = cdiv(num_tokens, self._pool.block_size) - len(seat.blocks)
            if needed <= 0:
                return recomputed
            if self._pool.num_free < needed and self._relieve is not None:
                self._relieve(needed)
            if self._pool.num_free >= needed:
                seat.blocks.extend(self._pool.allocate(needed))
                return recomputed
            if self._pending is not None and self._pending():
                await asyncio.sleep(STEP_S)  # the next engine step
                self._tick()
                continue
            self._preempt(self._victim(seat))

    def leave(self, seat: Seat) -> None:
        """``seat`` finished or was aborted; its blocks are its caller's to hold or free."""
        with contextlib.suppress(ValueError):
            self._running.remove(seat)
        for waiter in list(self._waiting):
            if waiter.seat is seat:
                self._waiting.remove(waiter)
                waiter.admitted.cancel()

    def close(self) -> None:
        """The engine died: nothing waits any more."""
        for waiter in self._waiting:
            waiter.admitted.cancel()
        self._waiting.clear()
        self._running.clear()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    # -- inside -----------------------------------------------------------------------------

    def _try(self, seat: Seat, num_tokens: int) -> bool:
        """Admit ``seat`` now if its blocks fit (after releasing retention if that helps)."""
        for attempt in range(2):
            hit = self._pool.match_prefix(seat.prefix_hashes)
            num_new = max(0, cdiv(num_tokens, self._pool.block_size) - len(hit))
            take = self._pool.num_to_allocate(hit, num_new)
            if take <= self._pool.num_free:
                self._pool.acquire(hit)
                seat.blocks = [*hit, *self._pool.allocate(num_new)]
                seat.num_hit_blocks = len(hit)
                seat.preempted = False
                return True
            if attempt or self._relieve is None:
                return False
            self._relieve(take)  # may free cached blocks the hit reads: look again
        return False

    def _victim(self, grower: Seat) -> Seat:
        """``self.running[-1]``: the last request scheduled that can be preempted."""
        for seat in reversed(self._running):
            if seat.decoding and not seat.preempted:
                return seat
        return grower

    def _preempt(self, seat: Seat) -> None:
        with contextlib.suppress(ValueError):
            self._running.remove(seat)
        blocks, seat.blocks = seat.blocks, []
        seat.num_hit_blocks = 0
        seat.preempted = True
        seat.num_preemptions += 1
        self.num_preemptions += 1
        self._pool.free(blocks)

    async def _readmit(self, seat: Seat, num_tokens: int) -> None:
        """A preempted request waits at the front of the queue for all its tokens' blocks."""
        if not self._waiting and self._try(seat, num_tokens):
            self._running.append(seat)
            return
        await self._wait(_Waiter(seat, num_tokens, _future()), front=True)

    async def _wait(self, waiter: _Waiter, *, front: bool) -> None:
        if front:
            self._waiting.appendleft(waiter)
        else:
            self._waiting.append(waiter)
        self._ensure_watch()
        self._kick()
        try:
            await waiter.admitted
        except asyncio.CancelledError:
            if waiter in self._waiting:
                self._waiting.remove(waiter)
            elif waiter.admitted.done() and not waiter.admitted.cancelled():
                # Admitted in the same loop turn the wait was cancelled: give them back.
                self.leave(waiter.seat)
                blocks, waiter.seat.blocks = waiter.seat.blocks, []
                self._pool.free(blocks)
            raise

    def _serve(self) -> None:
        """Admit waiting requests, head first, while the head fits."""
        self._serve_soon = False
        while self._waiting:
            head = self._waiting[0]
            if head.admitted.done():
                self._waiting.popleft()
                continue
            if not self._try(head.seat, head.num_tokens):
                return
            self._waiting.popleft()
            self._running.append(head.seat)
            head.admitted.set_result(None)

    def _kick(self) -> None:
        """Blocks were freed (or a request queued): serve the queue on the next loop turn."""
        if self._serve_soon or not self._waiting:
            return
        with contextlib.suppress(RuntimeError):  # no running loop: nothing can wait
            asyncio.get_running_loop().call_soon(self._serve)
            self._serve_soon = True

    def _ensure_watch(self) -> None:
        if self._watch is None or self._watch.done():
            self._watch = asyncio.get_running_loop().create_task(self._watch_expiry())

    async def _watch_expiry(self) -> None:
        """While anyone waits, step: reap what expired, then serve the queue."""
        while self._waiting:
            self._tick()
            self._serve()
            await asyncio.sleep(STEP_S)


def _future() -> asyncio.Future[None]:
    return asyncio.get_running_loop().create_future()
