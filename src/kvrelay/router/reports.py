"""Correlating a turn's D response with D's retained-KV report, and committing the entry.

An entry needs two things: D's retained ``kv_transfer_params`` and the exact token ids D holds
(the response's ``prompt_token_ids`` + generated ``token_ids``). Non-streamed responses (and
vLLM >= 0.33 final stream chunks) carry both; on vLLM 0.32 a stream carries only the ids and
kvrelay's D-side connector POSTs the params to ``/internal/kv-report`` about 100 ms after the
last chunk (sometimes before). ``ReportBook`` holds a ``PendingTurn`` per D request, keyed by
an unguessable turn id, until both halves are in (then the entry is committed to the store)
or it is settled without an entry: D retained nothing, the turn failed, or no report came
within ``report_timeout_s`` of the response's end.

The client's response never waits for any of this. Only the conversation's *next* turn does,
through ``wait_for(key, timeout)``, bounded by the router's ``report_wait_s``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvrelay.core.conversation import ConversationKey, entry_from_decode
from kvrelay.core.params import KVParamsError, RemoteBlocks, parse_optional_remote_blocks
from kvrelay.router.blocks import LayoutError, retained_layout
from kvrelay.router.metrics import RouterMetrics
from kvrelay.router.store import ConversationStore

log = logging.getLogger("kvrelay.router")


@dataclass
class PendingTurn:
    """One D request whose entry is not settled yet (mutated only by ``ReportBook``)."""

    turn_id: str
    key: ConversationKey
    decode_node_id: str
    turn: int
    ttl_s: float
    block_size: int | None
    fallback_prompt_ids: Sequence[int] | None
    prompt_token_ids: list[int] | None = None
    generated_token_ids: list[int] = field(default_factory=list)
    response_done_s: float | None = None
    blocks: RemoteBlocks | None = None
    report_num_prompt_tokens: int | None = None
    report_received: bool = False
    committing: bool = False
    outcome: str | None = None
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    timer: asyncio.TimerHandle | None = None


class ReportBook:
    """Pending turns by turn id and by conversation; see the module docstring."""

    def __init__(
        self,
        store: ConversationStore,
        clock: Callable[[], float],
        metrics: RouterMetrics,
        *,
        safety_margin_s: float,
        report_timeout_s: float,
        on_engine: Callable[[str, str], object] | None = None,
    ) -> None:
        self._store = store
        self._clock = clock
        self._metrics = metrics
        self._margin = safety_margin_s
        self._timeout = report_timeout_s
        self._on_engine = on_engine
        self._by_turn: dict[str, PendingTurn] = {}
        self._by_key: dict[ConversationKey, set[str]] = {}

    def __len__(self) -> int:
        return len(self._by_turn)

    def open(
        self,
        key: ConversationKey,
        decode_node_id: str,
        *,
        turn: int,
        ttl_s: float,
        block_size: int | None = None,
        fallback_prompt_ids: Sequence[int] | None,
    ) -> PendingTurn:
        """Register a D request about to be sent; its ``turn_id`` goes into the request."""
        p = PendingTurn(
            turn_id=secrets.token_urlsafe(18),
            key=key,
            decode_node_id=decode_node_id,
            turn=turn,
            ttl_s=ttl_s,
            block_size=block_size,
            fallback_prompt_ids=fallback_prompt_ids,
        )
        self._by_turn[p.turn_id] = p
        self._by_key.setdefault(key, set()).add(p.turn_id)
        return p

    def is_pending(self, key: ConversationKey) -> bool:
        return bool(self._by_key.get(key))

    async def wait_for(self, key: ConversationKey, timeout_s: float) -> bool:
        """Wait until no turn of ``key`` is pending, at most ``timeout_s``; True if none is."""
        ids = list(self._by_key.get(key, ()))
        events = [self._by_turn[i].settled.wait() for i in ids if i in self._by_turn]
        if not events:
            return True
        try:
            await asyncio.wait_for(asyncio.gather(*events), timeout_s)
        except TimeoutError:
            return False
        return True

    async def response_finished(
        self,
        p: PendingTurn,
        *,
        prompt_token_ids: Sequence[int] | None,
        generated_token_ids: Sequence[int],
        params: object = None,
    ) -> None:
        """D's response ended normally; ``params`` are D's retained params if it carried
        them (non-streamed, or vLLM >= 0.33 final chunk)."""
        if p.outcome is not None:
            return
        p.response_done_s = self._clock()
        p.prompt_token_ids = list(prompt_token_ids) if prompt_token_ids is not None else None
        p.generated_token_ids = list(generated_token_ids)
        if params is not None and p.blocks is None:
            try:
                p.blocks = parse_optional_remote_blocks(params)
            except KVParamsError as exc:
                log.warning("D %s returned invalid kv_transfer_params: %s", p.decode_node_id, exc)
                self.settle(p, "invalid_params")
                return
            if p.blocks is None:
                self.settle(p, "no_kv")
                return
        if p.blocks is not None:
            await self._commit(p)
        elif not p.report_received:
            p.timer = asyncio.get_running_loop().call_later(
                self._timeout, self.settle, p, "report_timeout"
            )

    async def accept_report(self, payload: Mapping[str, object]) -> str:
        """Handle one ``/internal/kv-report`` body; returns the outcome (for metrics/tests)."""
        turn_id = payload.get("turn_id")
        p = self._by_turn.get(turn_id) if isinstance(turn_id, str) else None
        if p is None:
            self._metrics.reports.labels("unknown_turn").inc()
            return "unknown_turn"
        self._metrics.reports.labels("matched").inc()
        p.report_received = True
        n_prompt = payload.get("num_prompt_tokens")
        if isinstance(n_prompt, int) and not isinstance(n_prompt, bool):
            p.report_num_prompt_tokens = n_prompt
        if p.blocks is None:
            try:
                p.blocks = parse_optional_remote_blocks(payload.get("kv_transfer_params"))
            except KVParamsError as exc:
                log.warning("invalid report from %s: %s", p.decode_node_id, exc)
                self.settle(p, "invalid_params")
                return "invalid_params"
        if p.blocks is None:
            self.settle(p, "no_kv")
            return "no_kv"
        if p.response_done_s is not None:
            await self._commit(p)
            return p.outcome or "committed"
        return "waiting_for_response"

    def fail(self, p: PendingTurn, reason: str) -> None:
        """The turn failed (error, client gone): settle without an entry."""
        self.settle(p, reason)

    def settle(self, p: PendingTurn, outcome: str) -> None:
        """Remove the pending turn and wake turns waiting on its conversation (idempotent)."""
        if p.outcome is not None:
            return
        p.outcome = outcome
        if p.timer is not None:
            p.timer.cancel()
        self._by_turn.pop(p.turn_id, None)
        ids = self._by_key.get(p.key)
        if ids is not None:
            ids.discard(p.turn_id)
            if not ids:
                del self._by_key[p.key]
        self._metrics.turn_entries.labels(outcome).inc()
        p.settled.set()

    async def _commit(self, p: PendingTurn) -> None:
        if p.committing or p.outcome is not None or p.blocks is None:
            return
        p.committing = True
        blocks = p.blocks
        prompt = p.prompt_token_ids
        if prompt is None:
            prompt = list(p.fallback_prompt_ids) if p.fallback_prompt_ids is not None else None
        expected = p.report_num_prompt_tokens
        if prompt is None or (expected is not None and expected != len(prompt)):
            self.settle(p, "token_ids_mismatch" if prompt is not None else "no_token_ids")
            return
        if blocks.direction != "decode_to_prefill":
            self.settle(p, "invalid_params")
            return
        try:
            blocks, block_size = retained_layout(blocks, p.block_size)
        except LayoutError as exc:
            log.warning("D %s: %s", p.decode_node_id, exc)
            self.settle(p, "bad_block_layout")
            return
        if self._on_engine is not None:
            self._on_engine(p.decode_node_id, blocks.engine_id)
        now = self._clock()
        entry = entry_from_decode(
            decode_node_id=p.decode_node_id,
            blocks=blocks,
            prompt_token_ids=prompt,
            generated_token_ids=p.generated_token_ids,
            now_s=min(now, p.response_done_s if p.response_done_s is not None else now),
            turn=p.turn,
            ttl_s=p.ttl_s,
            safety_margin_s=self._margin,
            block_size=block_size,
        )
        try:
            if entry.num_tokens > 0:
                await self._store.put(p.key, entry)
        finally:
            self.settle(p, "committed" if entry.num_tokens > 0 else "no_token_ids")
