"""Committing a turn's entry: D's retained blocks plus the answer the next turn will carry.

An entry needs D's retained ``kv_transfer_params`` with the fingerprint of the tokens they
hold, and where to store it: the request's anchor and the continuation of D's answer
(``core.identity``). Non-streamed responses (and vLLM >= 0.33 final stream chunks) carry the
params; on vLLM 0.32 a stream carries only the answer and kvrelay's connector on D POSTs the
params to the internal listener (``/internal/kv-report``) about 100 ms after the last chunk
(sometimes before). ``ReportDesk`` holds a ``PendingTurn`` per D request, keyed by a turn
id bound to that D (``core.report.issue_turn_id``), until both halves are in (then the entry
is committed to the index) or it is settled without one: D retained nothing, the turn
failed, or no report came within ``report_timeout_s`` of the response's end.

Every report is checked against its turn (``core.report.check_report``); a report that
disagrees is refused and counted (``reports_total{outcome="mismatch_*"}``), never
committed, and never changes what the router believes about a node. One refused only for
naming another engine than D's known one (D may have restarted unseen, serving only
streams) makes the router ask D itself (``router.engine_check``), and is heard again once
that check has ended: committed if D's own answer named that engine.

A committed turn supersedes the entry it continued without pulling it (``supersedes``:
recompute, direct): the conversation has moved on, so that entry is dropped and D is
ordered to release it (``ConversationIndex`` release orders) instead of holding it to
its TTL; of a fork's branches, the first to commit wins and the others recompute.

How long the entry lives: D keeps the turn ``ttl_s`` (what it was told). With learned
retention (``PendingTurn.plan``) the answer shows how the turn ended
(``DecodeAnswer.waits_for``: a tool call or a reply); when that kind's time is shorter than
D's, the entry keeps only that and is flagged ``release_at_expiry``, so the index orders D
to release the blocks once the entry expires (a tool call's follow-up comes within the
tool's run time or not at all). A D whose connector says it keeps turns the stock way
(``RemoteBlocks.retention == "stock"``: one TTL, orders ignored) holds the turn its TTL
whatever it was told: the entry keeps that TTL and nothing is ordered.

The client's response never waits for the report. A later turn that continues this one
waits for it (``wait_for``), bounded by ``report_wait_s``; so that a later turn another
replica serves does too, a chat-family turn whose report is awaited is announced in a
shared index (``ConversationIndex.announce``, one write before the client gets the
response's end; withdrawn when it settles), and that replica looks again until the entry
is there (``plan``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec
from msgspec.structs import replace

from kvrelay.core.conversation import GapKind, new_entry, with_fingerprint
from kvrelay.core.fingerprint import held_fingerprint
from kvrelay.core.identity import (
    Continuation,
    RequestIdentity,
    text_end,
    text_entry,
    text_fines,
)
from kvrelay.core.params import RemoteBlocks
from kvrelay.core.report import (
    ReportError,
    ReportExpectation,
    check_report,
    issue_turn_id,
    parse_report,
    report_items,
    turn_id_for,
)
from kvrelay.core.retention_time import RetainPlan
from kvrelay.router.blocks import LayoutError, retained_layout
from kvrelay.router.engine_check import CheckOutcome, EngineChecks
from kvrelay.router.index import (
    ConversationIndex,
    EntryRef,
    Found,
    IndexUnavailable,
)
from kvrelay.router.metrics import RouterMetrics
from kvrelay.router.nodes import NodeRegistry

log = logging.getLogger("kvrelay.router")

_SETTLED_MEMORY = 4096
_DECODER = msgspec.json.Decoder()


class DecodeAnswer(msgspec.Struct, frozen=True):
    """What D answered, as the next turn will carry it: the continuation of the answer
    (``text`` for completions: UTF-8, or the packed output ids after a token-id prompt; else
    ``chat``), its size, and the token ids D returned when the router asked for them."""

    chat: Continuation | None
    text: bytes | None
    num_bytes: int
    prompt_token_ids: Sequence[int] | None = None
    output_token_ids: Sequence[int] = ()
    waits_for: GapKind = "user"
    """How the answer ended: with a tool call (``tool``) or a reply (``user``)."""


@dataclass(eq=False, slots=True)
class PendingTurn:
    """One D request whose entry is not settled yet (mutated only by ``ReportDesk``)."""

    turn_id: str
    identity: RequestIdentity
    tenant: str
    conversation: str
    number: int
    decode_node_id: str
    ttl_s: float
    num_prompt_tokens: int | None
    max_output_tokens: int | None
    plan: RetainPlan | None = None
    waits_for: GapKind = "user"
    slot: Continuation | None = None
    anchor: bytes | None = None
    num_bytes: int = 0
    token_ids: tuple[Sequence[int], Sequence[int]] | None = None
    supersedes: Found | None = None
    blocks: RemoteBlocks | None = None
    response_done_s: float | None = None
    report_received: bool = False
    awaits_report: bool = True
    announced: EntryRef | None = None
    flushed: bool = False
    """An admin dropped the turn's conversation while it was under way (``flush_scope``)."""
    opened_at_s: float = 0.0
    """When the router opened the turn (its clock): an admin's drop through another replica
    after it reaches the turn through the index (``ConversationIndex.put``)."""
    outcome: str | None = None
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    timer: asyncio.TimerHandle | None = None
    on_settle: list[Callable[[PendingTurn], None]] = field(default_factory=list)


class TextPending:
    """Whether a completions request carries pending turns' answers: each block's fine
    digests computed once, then one digest per end offset (at most one per byte of a
    block, however many turns are pending)."""

    def __init__(self, identity: RequestIdentity) -> None:
        self._identity = identity
        self._probes = {p.anchor: p for p in identity.probes if p.continuation is None}
        self._fines: dict[bytes, tuple[bytes, ...]] = {}
        self._ends: dict[tuple[bytes, int], Continuation | None] = {}

    def carries(self, anchor: bytes, continuation: Continuation) -> bool:
        probe = self._probes.get(anchor)
        if probe is None:
            return False
        place = (anchor, continuation.num_bytes)
        if place not in self._ends:
            fines = self._fines.get(anchor)
            if fines is None:
                fines = self._fines[anchor] = text_fines(self._identity, probe)
            self._ends[place] = text_end(self._identity, probe, fines, continuation.num_bytes)
        return self._ends[place] == continuation


class ReportDesk:
    """Pending turns by turn id and by anchor; see the module docstring."""

    def __init__(
        self,
        index: ConversationIndex,
        nodes: NodeRegistry,
        clock: Callable[[], float],
        metrics: RouterMetrics,
        *,
        safety_margin_s: float,
        report_timeout_s: float,
    ) -> None:
        self._index = index
        self._nodes = nodes
        self._clock = clock
        self._metrics = metrics
        self._margin = safety_margin_s
        self._timeout = report_timeout_s
        self._key = secrets.token_bytes(32)
        self._by_turn: dict[str, PendingTurn] = {}
        self._by_anchor: dict[tuple[bytes, bytes], set[PendingTurn]] = {}
        self._by_scope: dict[bytes, set[PendingTurn]] = {}
        self._settled: OrderedDict[str, None] = OrderedDict()
        self._withdrawals: set[asyncio.Task[None]] = set()
        self._rehearings: set[asyncio.Task[None]] = set()
        self._rehear: dict[str, object] = {}
        """Per turn id, the refused report to hear again once its engine check ends."""
        self.engine_checks: EngineChecks | None = None
        """Asks a D whose reports name another engine than the one known (set by the app;
        ``None``: never asks)."""
        self.unheld: Callable[[str, RemoteBlocks], None] | None = None
        """Told of a turn D retained that no entry will point at (``_commit``: no
        fingerprint, another prompt, a bad block layout, the index down), so a D that does
        not sync frees it now instead of at its TTL (``StockReleases.unheld``; set by the
        app)."""

    def __len__(self) -> int:
        return len(self._by_turn)

    def pending_of(self, tenant: str | None) -> int:
        """Turns of ``tenant`` (every tenant's with ``None``) still waiting for D's report."""
        if tenant is None:
            return len(self._by_turn)
        return sum(1 for p in self._by_turn.values() if p.tenant == tenant)

    def open(
        self,
        *,
        identity: RequestIdentity,
        tenant: str,
        conversation: str,
        number: int,
        decode_node_id: str,
        ttl_s: float,
        num_prompt_tokens: int | None,
        max_output_tokens: int | None,
        plan: RetainPlan | None = None,
    ) -> PendingTurn:
        """Register a D request about to be sent; its ``turn_id`` goes into the request.
        ``ttl_s`` is how long D keeps the turn; ``plan`` (learned retention) how long the
        entry keeps it once the answer shows how the turn ended."""
        p = PendingTurn(
            turn_id=issue_turn_id(self._key, secrets.token_bytes(12), decode_node_id),
            identity=identity,
            tenant=tenant,
            conversation=conversation,
            number=number,
            decode_node_id=decode_node_id,
            ttl_s=ttl_s,
            num_prompt_tokens=num_prompt_tokens,
            max_output_tokens=max_output_tokens,
            plan=plan,
            opened_at_s=self._clock(),
        )
        self._by_turn[p.turn_id] = p
        self._by_anchor.setdefault((identity.scope, identity.anchor), set()).add(p)
        if identity.explicit:
            self._by_scope.setdefault(identity.scope, set()).add(p)
        return p

    def flush_scope(self, scope: bytes) -> int:
        """An admin dropped the conversation ``scope`` names: its turns still under way here
        leave nothing to pull either (their entry is dropped as it commits, so D is ordered
        to release the turn). Returns how many. A turn another replica serves is dropped as
        it commits there, by the index's mark of the flush (``ConversationIndex.put``)."""
        flushed = [p for p in self._by_turn.values()
                   if p.identity.scope == scope and p.outcome is None]
        for p in flushed:
            p.flushed = True
        return len(flushed)

    def pending_for(self, identity: RequestIdentity) -> list[PendingTurn]:
        """Unsettled turns the request may continue: their answer is out and the request
        carries it, but D's params are not in yet. For an explicit id whose history matches
        none of them, every unsettled turn of that id (the request may continue the latest,
        ``index.lookup``)."""
        out: list[PendingTurn] = []
        seen: set[tuple[bytes, bytes]] = set()
        text = TextPending(identity) if identity.text is not None else None
        for probe in identity.probes:
            waiting = self._by_anchor.get((identity.scope, probe.anchor))
            if not waiting:
                continue
            for p in waiting:
                if p.slot is None:
                    continue
                place = (p.anchor or probe.anchor, p.slot.slot())
                if place in seen:
                    continue
                if probe.continuation is not None:
                    carried = p.slot == probe.continuation
                else:
                    carried = text is not None and p.anchor is not None \
                        and text.carries(p.anchor, p.slot)
                if carried:
                    seen.add(place)
                    out.append(p)
        if not out and identity.explicit:
            out = [p for p in self._by_scope.get(identity.scope, ()) if p.slot is not None]
        return out

    async def wait_for(self, pending: Sequence[PendingTurn], timeout_s: float) -> bool:
        """Wait until every turn in ``pending`` settled, at most ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                for p in pending:
                    if p.outcome is None:
                        await p.settled.wait()
        except TimeoutError:
            return False
        return True

    async def response_finished(
        self, p: PendingTurn, answer: DecodeAnswer, params: RemoteBlocks | None = None,
        *, retained: bool | None = None,
    ) -> None:
        """D's response ended normally. ``params`` are D's retained params when the response
        carried them (non-streamed, vLLM >= 0.33 final chunk); ``retained=False`` says it
        carried params and D retained nothing."""
        if p.outcome is not None:
            return
        p.response_done_s = self._clock()
        if answer.text is not None:
            p.anchor, p.slot = text_entry(p.identity, answer.text)
        else:
            p.slot = answer.chat
        p.num_bytes = p.identity.prompt_bytes + answer.num_bytes
        p.waits_for = answer.waits_for
        if answer.prompt_token_ids is not None:
            p.token_ids = (answer.prompt_token_ids, answer.output_token_ids)
        if retained is False:
            self.settle(p, "no_kv")
            return
        if params is not None and p.blocks is None:
            p.blocks = params
        if p.blocks is not None:
            await self._commit(p)
        elif not p.awaits_report:
            self.settle(p, "no_params")
        elif not p.report_received:
            p.timer = asyncio.get_running_loop().call_later(
                self._timeout, self.settle, p, "report_timeout"
            )
            await self._announce(p)

    async def _announce(self, p: PendingTurn) -> None:
        """Tell other replicas (a shared index) that ``p``'s entry is on its way, so that a
        follow-up one of them serves waits for it (``index.announce``; chat-family turns)."""
        if p.anchor is not None or p.slot is None:
            return
        ref = EntryRef(p.identity.scope, p.identity.anchor, p.slot.slot())
        await self._index.announce(ref, self._timeout)
        if p.outcome is None:
            p.announced = ref
        else:  # settled while the announcement was on its way
            await self._index.withdraw(ref)

    async def accept_reports(self, raw: bytes) -> list[str]:
        """Handle one ``/internal/kv-report`` body (one report or a batch); returns each
        report's outcome (also counted)."""
        try:
            items = report_items(_DECODER.decode(raw))
        except (msgspec.DecodeError, RecursionError, ReportError):
            items = [None]
        outcomes = [await self._accept(item) for item in items]
        for outcome in outcomes:
            self._metrics.child(self._metrics.reports, outcome).inc()
        return outcomes

    async def _accept(self, item: object) -> str:
        try:
            report = parse_report(item)
        except ReportError:
            return "invalid"
        p = self._by_turn.get(report.turn_id)
        if p is None:
            return "late" if report.turn_id in self._settled else "unknown_turn"
        if not turn_id_for(self._key, report.turn_id, p.decode_node_id):
            return "unknown_turn"
        engine, side_channel = self._nodes.trusted_identity(
            p.decode_node_id, report.blocks.engine_id if report.blocks is not None else None)
        expect = ReportExpectation(
            engine_id=engine, side_channel=side_channel,
            block_size=self._nodes.block_size(p.decode_node_id),
            num_prompt_tokens=p.num_prompt_tokens, max_output_tokens=p.max_output_tokens,
        )
        verdict = check_report(expect, report)
        if verdict != "ok":
            log.warning("report for a turn on %s refused: %s", p.decode_node_id, verdict)
            if verdict == "mismatch_engine" and report.blocks is not None \
                    and self.engine_checks is not None:
                check = self.engine_checks.doubt(p.decode_node_id, report.blocks.engine_id)
                if check is not None:
                    self._rehear_after(check, report.turn_id, item)
            return verdict
        p.report_received = True
        if report.blocks is None:
            self.settle(p, "no_kv")
            return "matched"
        self._nodes.accept_report_identity(p.decode_node_id, report.blocks)
        if p.blocks is None:
            p.blocks = report.blocks
        if p.response_done_s is not None:
            await self._commit(p)
        return "matched"

    def _rehear_after(self, check: asyncio.Task[CheckOutcome], turn_id: str,
                      item: object) -> None:
        """Hear ``item`` again once ``check`` has ended, if its turn is still waiting: the
        check may have taught the router D's new engine. One hearing per turn: a later
        refused report of the same turn replaces the item (forged ones cost no task each).
        Counted again only when the outcome is another."""
        if turn_id in self._rehear:
            self._rehear[turn_id] = item
            return
        self._rehear[turn_id] = item

        async def rehear() -> None:
            with contextlib.suppress(Exception):
                await asyncio.shield(check)
            outcome = await self._accept(self._rehear.pop(turn_id))
            if outcome not in ("mismatch_engine", "unknown_turn", "late"):
                self._metrics.child(self._metrics.reports, outcome).inc()

        task = asyncio.get_running_loop().create_task(rehear())
        self._rehearings.add(task)
        task.add_done_callback(self._rehearings.discard)

    def settle(self, p: PendingTurn, outcome: str) -> None:
        """Remove the pending turn and wake turns waiting on it (idempotent)."""
        if p.outcome is not None:
            return
        p.outcome = outcome
        if p.timer is not None:
            p.timer.cancel()
        self._by_turn.pop(p.turn_id, None)
        key = (p.identity.scope, p.identity.anchor)
        waiting = self._by_anchor.get(key)
        if waiting is not None:
            waiting.discard(p)
            if not waiting:
                del self._by_anchor[key]
        scoped = self._by_scope.get(p.identity.scope)
        if scoped is not None:
            scoped.discard(p)
            if not scoped:
                del self._by_scope[p.identity.scope]
        self._settled[p.turn_id] = None
        while len(self._settled) > _SETTLED_MEMORY:
            self._settled.popitem(last=False)
        self._metrics.child(self._metrics.turn_entries, outcome).inc()
        if p.announced is not None:
            task = asyncio.get_running_loop().create_task(self._index.withdraw(p.announced))
            self._withdrawals.add(task)
            task.add_done_callback(self._withdrawals.discard)
        p.settled.set()
        for callback in p.on_settle:
            callback(p)

    def _unheld(self, p: PendingTurn, blocks: RemoteBlocks, outcome: str) -> None:
        """Settle a turn D retained without an entry, and have its blocks freed."""
        self.settle(p, outcome)
        if self.unheld is not None and blocks.num_tokens > 0:
            self.unheld(p.decode_node_id, blocks)

    async def _commit(self, p: PendingTurn) -> None:
        blocks, slot = p.blocks, p.slot
        if p.outcome is not None or blocks is None or slot is None:
            return
        if p.token_ids is not None and blocks.fingerprint is None:
            prompt_ids, output_ids = p.token_ids
            expected = p.num_prompt_tokens
            if expected is not None and expected != len(prompt_ids):
                self._unheld(p, blocks, "token_ids_mismatch")
                return
            fingerprint = held_fingerprint(prompt_ids, output_ids, blocks.num_tokens)
            blocks = with_fingerprint(blocks, fingerprint)
        if blocks.fingerprint is None or blocks.fingerprint.num_tokens == 0:
            self._unheld(p, blocks, "no_fingerprint")
            return
        try:
            blocks, block_size = retained_layout(
                blocks, self._nodes.block_size(p.decode_node_id) or blocks.block_size
            )
            if block_size is not None:
                blocks = replace(blocks, block_size=block_size)
        except LayoutError as exc:
            log.warning("D %s: %s", p.decode_node_id, exc)
            self._unheld(p, blocks, "bad_block_layout")
            return
        done = p.response_done_s if p.response_done_s is not None else self._clock()
        if blocks.retention == "stock":  # D kept its TTL, whatever it was told
            shortened, kept_s = False, self._nodes.config(p.decode_node_id).ttl_s
        else:
            shortened = p.plan is not None and p.plan.shortened(p.waits_for)
            kept_s = p.plan.after(p.waits_for).retain_s if p.plan is not None and shortened \
                else p.ttl_s
        entry = new_entry(
            decode_node_id=p.decode_node_id,
            blocks=blocks,
            now_s=min(self._clock(), done),
            turn=p.number,
            conversation=p.conversation,
            num_bytes=p.num_bytes,
            ttl_s=kept_s,
            safety_margin_s=self._margin,
            block_size=block_size,
            waits_for=p.waits_for,
            release_at_expiry=shortened,
            context=p.identity.context,
        )
        ref = EntryRef(p.identity.scope, p.anchor or p.identity.anchor, slot.slot())
        try:
            kept = await self._index.put(ref, entry, tenant=p.tenant, opened_at_s=p.opened_at_s)
        except IndexUnavailable:
            self._unheld(p, blocks, "index_unavailable")
            return
        if p.flushed or not kept:  # an admin dropped it while under way: D releases it
            if kept:
                await self._index.drop(ref, entry)
            self._metrics.dropped.labels("admin").inc()
            self.settle(p, "flushed")
            return
        self.settle(p, "committed")
        old = p.supersedes
        if old is not None and await self._index.drop(old.ref, old.entry):
            self._metrics.dropped.labels("superseded").inc()
